//! Delivery throughput to NATS JetStream: kubecast's delivery path vs a raw async-nats
//! JetStream publisher with async acks, same payloads, same server, same run. Prints figures;
//! asserts nothing about time.
//!
//!     cargo bench --bench nats                   # 20000 events over 5000 objects, 5 rounds
//!     cargo bench --bench nats -- --events 50000
//!     cargo bench --bench nats -- --side kubecast --mode structured   # one run kind only
//!     cargo bench --bench nats -- --broker-cpu 1    # the server on CPU 1, the benchmark on the others
//!
//! The recorded stream is the one of the Kafka benchmark (~10 KB Pods). The raw side publishes
//! each object's JSON with `Nats-Msg-Id` and awaits the PubAcks, 1000 in flight. kubecast runs
//! its own wiring for each change (`Pipeline::start_downstream`: identity decoding, shaping and
//! CloudEvent, outbound queue with per-object order and `max_in_flight` 1000, the NATS sink, the
//! acknowledgement watermark, the persister) in binary mode
//! (payload = the same object JSON, `ce-*` headers: the like-for-like comparison) and in
//! structured mode (the default: payload = the event JSON). Each run has its own file-backed
//! stream (so no run's messages are duplicates of another's), deleted afterwards. Needs the test NATS: it runs `tests/env/up nats`.

mod common;

use std::time::{Duration, Instant};

use std::future::IntoFuture;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, message::PublishMessage, stream};
use common::{OBJECTS, cpu_seconds, record};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kubecast::sink::nats::Mode;
use std::future::Future;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    common::run_like_the_binary(run());
}

async fn run() {
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

    // What the raw publisher sends, made before anything is measured: each object's JSON with
    // its id, and kubecast's own messages (payload and headers) in each mode.
    // (Only when the raw side runs: `--side kubecast` under a profiler shows kubecast alone.)
    let n = 1000.min(events);
    let raw_runs = common::side("raw");
    let plain = plain_messages(if raw_runs { &recording } else { &recording[..n] });
    let like_kubecast = |mode| if raw_runs { kubecast_messages(&recording, mode) } else { Vec::new() };
    let (binary_messages, structured_messages) = (like_kubecast(Mode::Binary), like_kubecast(Mode::Structured));
    // Warm up (connections, stream files) outside the measurements.
    let warmup = format!("bench{run}w");
    with_stream(&js, &warmup, n, raw(&js, &format!("{warmup}.x"), &plain[..n])).await;
    // kubecast's side too, with the whole stream: its first run in a process measured up to
    // 1.7x the CPU per event of the later ones.
    if common::side("kubecast") {
        let warmup = format!("bench{run}kw");
        with_stream(&js, &warmup, events, kubecast_run(&url, &format!("{warmup}.x"), Mode::Structured, &recording))
            .await;
    }
    let rounds = common::rounds_arg();
    let _pinned = common::pin_broker("nats");
    println!("{rounds} rounds, the raw publisher first in odd ones, kubecast in even ones");
    let nan = (f64::NAN, f64::NAN);
    let mode = |m: &str| common::arg("--mode").is_none_or(|x| x == m);
    let mut results = Vec::new();
    for r in 0..rounds {
        println!("round {}/{rounds}", r + 1);
        let raw_side = async {
            if !common::side("raw") {
                return (nan, nan, nan);
            }
            let s = format!("bench{run}r{r}");
            let plain = with_stream(&js, &s, events, raw(&js, &format!("{s}.x"), &plain)).await;
            let s = format!("bench{run}rb{r}");
            let binary = if mode("binary") {
                with_stream(&js, &s, events, raw(&js, &format!("{s}.x"), &binary_messages)).await
            } else {
                nan
            };
            let s = format!("bench{run}rs{r}");
            let structured = if mode("structured") {
                with_stream(&js, &s, events, raw(&js, &format!("{s}.x"), &structured_messages)).await
            } else {
                nan
            };
            (plain, binary, structured)
        };
        let kubecast_side = async {
            if !common::side("kubecast") {
                return (nan, nan);
            }
            let binary = if mode("binary") {
                let s = format!("bench{run}b{r}");
                with_stream(&js, &s, events, kubecast_run(&url, &format!("{s}.x"), Mode::Binary, &recording)).await
            } else {
                nan
            };
            let structured = if mode("structured") {
                let s = format!("bench{run}s{r}");
                with_stream(&js, &s, events, kubecast_run(&url, &format!("{s}.x"), Mode::Structured, &recording)).await
            } else {
                nan
            };
            (binary, structured)
        };
        let ((raw_figures, raw_binary, raw_structured), (binary, structured)) =
            common::in_turn(r, raw_side, kubecast_side).await;
        results.push(common::Round {
            raw: raw_figures,
            runs: vec![
                (RAW_BINARY, raw_binary),
                (RAW_STRUCTURED, raw_structured),
                (KUBECAST_BINARY, binary),
                (KUBECAST_STRUCTURED, structured),
            ],
        });
    }
    common::report(events, "raw async-nats JetStream", &results);
    common::report_like_for_like(&results, &[(KUBECAST_BINARY, RAW_BINARY), (KUBECAST_STRUCTURED, RAW_STRUCTURED)]);
}

const RAW_BINARY: &str = "raw, kubecast's binary-mode messages";
const RAW_STRUCTURED: &str = "raw, kubecast's structured-mode messages";
const KUBECAST_BINARY: &str = "kubecast (binary mode)";
const KUBECAST_STRUCTURED: &str = "kubecast (structured mode)";

/// One message as the raw publisher sends it: `Nats-Msg-Id`, payload, other headers.
type Message = (String, bytes::Bytes, Option<HeaderMap>);

/// Each object's JSON, with `<uid>:<index>` as its id.
fn plain_messages(recording: &[bytes::Bytes]) -> Vec<Message> {
    common::payloads(recording)
        .into_iter()
        .enumerate()
        .map(|(i, (k, b))| (format!("{k}:{i}"), bytes::Bytes::from(b), None))
        .collect()
}

/// The messages kubecast sends for the recording in `mode` (its payloads, headers and ids).
fn kubecast_messages(recording: &[bytes::Bytes], mode: Mode) -> Vec<Message> {
    let source = std::sync::Arc::new(kubecast::model::EventSource::new("bench", &common::pods()));
    recording
        .iter()
        .map(|line| {
            let event = &common::event(line, &source);
            let (payload, headers) = kubecast::sink::nats::encode(event, mode);
            (event.id().to_string(), payload, Some(headers))
        })
        .collect()
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

/// Publishes `messages` with their ids as `Nats-Msg-Id`, awaiting the PubAcks, 1000 in flight.
async fn raw(js: &jetstream::Context, subject: &str, messages: &[Message]) -> (f64, f64) {
    // Cloned before the clock starts (a reference count each, and the headers' maps).
    let messages: Vec<Message> = messages.to_vec();
    let count = messages.len();
    common::settle();
    let (threads0, cpu0, t0) = (common::thread_cpu(), cpu_seconds(), Instant::now());
    let mut acks: FuturesUnordered<<jetstream::context::PublishAckFuture as IntoFuture>::IntoFuture> =
        FuturesUnordered::new();
    let mut done = 0usize;
    for (id, payload, headers) in messages {
        while acks.len() >= 1000 {
            acks.next().await.unwrap().expect("PubAck");
            done += 1;
        }
        // The headers first: `headers` replaces the map that `message_id` adds to.
        let mut message = PublishMessage::build().payload(payload);
        if let Some(headers) = headers {
            message = message.headers(headers);
        }
        let message = message.message_id(id);
        let ack = js.send_publish(subject.to_string(), message).await.expect("publish");
        acks.push(ack.into_future());
    }
    while let Some(a) = acks.next().await {
        a.expect("PubAck");
        done += 1;
    }
    assert_eq!(done, count);
    let figures = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    println!("raw {}", common::cpu_split(&threads0, count));
    figures
}

async fn kubecast_run(
    url: &str,
    subject: &str,
    mode: Mode,
    recording: &std::sync::Arc<Vec<bytes::Bytes>>,
) -> (f64, f64) {
    let mode = if mode == Mode::Binary { "binary" } else { "structured" };
    let sink = format!(
        "[sink]\ntype = \"nats\"\n\n[sink.nats]\nurl = \"{url}\"\nsubject = \"{subject}\"\nmode = \"{mode}\"\n"
    );
    common::kubecast(&sink, recording).await
}
