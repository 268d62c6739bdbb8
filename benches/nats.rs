//! Delivery throughput to NATS JetStream: kubecast's delivery path vs a raw async-nats
//! JetStream publisher with async acks, same payloads, same server, same run. Prints figures;
//! asserts nothing about time.
//!
//!     cargo bench --bench nats                   # 20000 events over 5000 objects, 5 rounds
//!     cargo bench --bench nats -- --events 50000
//!     cargo bench --bench nats -- --side kubecast --mode structured   # one run kind only
//!
//! The recorded stream is the one of the Kafka benchmark (~10 KB Pods). The raw side publishes
//! each object's JSON with `Nats-Msg-Id` and awaits the PubAcks, 1000 in flight. kubecast runs
//! its own path for each change (identity decoding, CloudEvent, outbound queue with per-object
//! order and `max_in_flight` 1000, the NATS sink, the acknowledgement watermark) in binary mode
//! (payload = the same object JSON, `ce-*` headers: the like-for-like comparison) and in
//! structured mode (the default: payload = the event JSON). Each run has its own file-backed
//! stream (so no run's messages are duplicates of another's), deleted afterwards. Needs the test NATS: it runs `tests/env/up nats`.

mod common;

use std::time::{Duration, Instant};

use std::future::IntoFuture;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use common::{OBJECTS, cpu_seconds, record};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kubecast::sink::nats::{Mode, NatsConfig};
use kubecast::sink::{NatsSink, Sink};
use std::future::Future;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let events = common::events_arg(20_000);
    let env = common::env_up("nats");
    let url = common::env_value(&env, "NATS_URL");
    let recording = record(events);
    let bytes: usize = recording.iter().map(bytes::Bytes::len).sum();
    println!(
        "recorded stream: {events} events over {OBJECTS} Pods, {:.1} KB per object on average",
        bytes as f64 / events as f64 / 1024.0
    );
    let client = async_nats::connect(&url).await.expect("connect");
    let js = jetstream::new(client);
    let run = std::process::id();

    // Warm up (connections, stream files) outside the measurements.
    let warmup = format!("bench{run}w");
    with_stream(&js, &warmup, 1000.min(events), raw(&js, &format!("{warmup}.x"), &recording[..1000.min(events)])).await;
    let rounds = common::rounds_arg();
    println!("{rounds} rounds, the raw publisher first in odd ones, kubecast in even ones");
    let nan = (f64::NAN, f64::NAN);
    let mut results = Vec::new();
    for r in 0..rounds {
        println!("round {}/{rounds}", r + 1);
        let raw_side = async {
            if !common::side("raw") {
                return nan;
            }
            let s = format!("bench{run}r{r}");
            with_stream(&js, &s, events, raw(&js, &format!("{s}.x"), &recording)).await
        };
        let kubecast_side = async {
            if !common::side("kubecast") {
                return (nan, nan);
            }
            let binary = if common::arg("--mode").is_none_or(|m| m == "binary") {
                let s = format!("bench{run}b{r}");
                with_stream(&js, &s, events, kubecast_run(&url, &format!("{s}.x"), Mode::Binary, &recording)).await
            } else {
                nan
            };
            let structured = if common::arg("--mode").is_none_or(|m| m == "structured") {
                let s = format!("bench{run}s{r}");
                with_stream(&js, &s, events, kubecast_run(&url, &format!("{s}.x"), Mode::Structured, &recording)).await
            } else {
                nan
            };
            (binary, structured)
        };
        let (raw_figures, (binary, structured)) = common::in_turn(r, raw_side, kubecast_side).await;
        results.push(common::Round {
            raw: raw_figures,
            runs: vec![("kubecast (binary mode)", binary), ("kubecast (structured mode)", structured)],
        });
    }
    common::report(events, "raw async-nats JetStream", &results);
}

/// Runs `work` with a fresh file-backed stream `name` (subjects `name.>`), checks that it
/// stored `expected` messages, deletes it.
async fn with_stream<T>(js: &jetstream::Context, name: &str, expected: usize, work: impl Future<Output = T>) -> T {
    let stream_name = name.to_uppercase();
    js.create_stream(stream::Config {
        name: stream_name.clone(),
        subjects: vec![format!("{name}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .expect("stream");
    let out = work.await;
    let mut s = js.get_stream(&stream_name).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages as usize, expected, "every event stored once");
    js.delete_stream(&stream_name).await.unwrap();
    out
}

/// Publishes each object's JSON with its id as `Nats-Msg-Id`, awaiting the PubAcks, 1000 in
/// flight.
async fn raw(js: &jetstream::Context, subject: &str, recording: &[bytes::Bytes]) -> (f64, f64) {
    let payloads: Vec<(String, bytes::Bytes)> = common::payloads(recording)
        .into_iter()
        .enumerate()
        .map(|(i, (k, b))| (format!("{k}:{i}"), bytes::Bytes::from(b)))
        .collect();
    let (threads0, cpu0, t0) = (common::thread_cpu(), cpu_seconds(), Instant::now());
    let mut acks: FuturesUnordered<<jetstream::context::PublishAckFuture as IntoFuture>::IntoFuture> =
        FuturesUnordered::new();
    let mut done = 0usize;
    for (id, payload) in payloads {
        while acks.len() >= 1000 {
            acks.next().await.unwrap().expect("PubAck");
            done += 1;
        }
        let ack = js
            .send_publish(subject.to_string(), PublishMessage::build().payload(payload).message_id(id))
            .await
            .expect("publish");
        acks.push(ack.into_future());
    }
    while let Some(a) = acks.next().await {
        a.expect("PubAck");
        done += 1;
    }
    assert_eq!(done, recording.len());
    let figures = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    println!("raw {}", common::cpu_split(&threads0, recording.len()));
    figures
}

async fn kubecast_run(
    url: &str,
    subject: &str,
    mode: Mode,
    recording: &std::sync::Arc<Vec<bytes::Bytes>>,
) -> (f64, f64) {
    let cfg: NatsConfig = serde_json::from_value(serde_json::json!({
        "url": url,
        "subject": subject,
        "mode": if mode == Mode::Binary { "binary" } else { "structured" },
    }))
    .unwrap();
    let sink = NatsSink::open(&cfg, 1000, Duration::from_secs(10)).await.expect("NATS sink");
    common::kubecast(Sink::Nats(sink), recording, &common::pods()).await
}
