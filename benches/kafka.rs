//! Delivery throughput: kubecast's delivery path vs a raw rdkafka producer, same payloads, same
//! broker, same run. Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench kafka                   # 50000 events over 5000 objects, 5 rounds
//!     cargo bench --bench kafka -- --events 20000 --rounds 5
//!
//! The stream is "recorded" deterministically: ~10 KB Pods (labels, annotations,
//! managedFields, five containers with env, status), each object modified several times.
//! kubecast's side runs its own wiring (`Pipeline::start_downstream`, as `kubecast run`) for
//! each change: decoding the object's identity from the watch's JSON (the rest is passed
//! through untouched), the shaping stage and CloudEvent, the outbound queue (per-object order,
//! `max_in_flight` 1000), the Kafka sink (binary mode: `ce_*` headers, value = the object) with
//! delivery reports, the acknowledgement watermark and the persister. The
//! raw side sends the same object JSON with the same key, 1000 in flight. Needs the test
//! Kafka: it runs `tests/env/up kafka` (idempotent; left running).

mod common;

use std::time::{Duration, Instant};

use common::{OBJECTS, cpu_seconds, record};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

/// The allocator of the kubecast binary (src/main.rs), so both sides run as they would there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    common::run_like_the_binary(run());
}

async fn run() {
    let events = common::events_arg(50_000);
    let env = common::env_up("kafka");
    let brokers = common::env_value(&env, "KAFKA_BROKERS");
    let recording = record(events);
    let bytes: usize = recording.iter().map(bytes::Bytes::len).sum();
    println!(
        "recorded stream: {events} events over {OBJECTS} Pods, {:.1} KB per object on average",
        bytes as f64 / events as f64 / 1024.0
    );

    let run = std::process::id();
    let rounds = common::rounds_arg();
    let partitions = common::arg("--partitions").map_or(6, |p| p.parse().expect("--partitions N"));
    // Fresh topics for each run, all created before anything is measured.
    let topic = |side: &str, round: usize| format!("bench.{side}.{run}.{round}");
    let mut topics = vec![format!("bench.warmup.{run}")];
    for r in 0..rounds {
        topics.extend(["raw", "rawh", "kubecast"].map(|side| topic(side, r)));
    }
    create_topics(&brokers, &topics, partitions).await;
    println!(
        "topics with {partitions} partitions; {rounds} rounds, the raw producer first in odd ones, kubecast in even ones"
    );
    // Warm the broker (connections, log segments) outside the measurements.
    raw(&brokers, &topics[0], &recording[..1000.min(events)], false).await;
    delete_topics(&brokers, &topics[..1]).await;

    let nan = (f64::NAN, f64::NAN);
    let mut results = Vec::new();
    for r in 0..rounds {
        println!("round {}/{rounds}", r + 1);
        let kubecast_side = async {
            if !common::side("kubecast") {
                return nan;
            }
            common::kubecast(&kafka_sink(&brokers, &topic("kubecast", r)), &recording).await
        };
        let raw_side = async {
            if !common::side("raw") {
                return (nan, nan);
            }
            (
                raw(&brokers, &topic("raw", r), &recording, false).await,
                raw(&brokers, &topic("rawh", r), &recording, true).await,
            )
        };
        let ((raw_figures, raw_headers), kc) = common::in_turn(r, raw_side, kubecast_side).await;
        // Each round writes ~1 GB per 50k events: freed at once.
        delete_topics(&brokers, &["raw", "rawh", "kubecast"].map(|side| topic(side, r))).await;
        results.push(common::Round {
            raw: raw_figures,
            runs: vec![("raw producer + kubecast's CloudEvents headers", raw_headers), ("kubecast delivery", kc)],
        });
    }
    common::report(events, "raw rdkafka producer", &results);
}

/// Creates `topics` with `partitions` partitions each, before anything is measured.
async fn create_topics(brokers: &str, topics: &[String], partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    let new: Vec<NewTopic<'_>> =
        topics.iter().map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1))).collect();
    for result in admin.create_topics(&new, &AdminOptions::new()).await.expect("create topics") {
        result.expect("topic created");
    }
}

/// Deletes `topics` (their data: the broker frees the disk space).
async fn delete_topics(brokers: &str, topics: &[String]) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    for result in admin.delete_topics(&names, &AdminOptions::new()).await.expect("delete topics") {
        result.expect("topic deleted");
    }
}

/// kubecast's `[sink]` table: Kafka in binary mode (the default), `extra_properties` passed on.
fn kafka_sink(brokers: &str, topic: &str) -> String {
    let properties: String = extra_properties().iter().map(|(k, v)| format!("{k:?} = {v:?}\n")).collect();
    format!(
        "[sink]\ntype = \"kafka\"\n\n[sink.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\n\n[sink.kafka.properties]\n{properties}"
    )
}

/// `KUBECAST_BENCH_KAFKA_PROPERTIES="linger.ms=20,batch.size=2000000"`: librdkafka properties
/// for both sides (to compare settings).
fn extra_properties() -> Vec<(String, String)> {
    std::env::var("KUBECAST_BENCH_KAFKA_PROPERTIES")
        .unwrap_or_default()
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').expect("KUBECAST_BENCH_KAFKA_PROPERTIES: key=value,...");
            (k.trim().to_string(), v.trim().to_string())
        })
        .collect()
}

type Delivery<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), rdkafka::error::KafkaError>> + 'a>>;

/// A raw idempotent producer sending each object's JSON with its uid as key, 1000 in flight;
/// with `headers`, also the CloudEvents headers kubecast sends with it (made in advance).
async fn raw(brokers: &str, topic: &str, recording: &[bytes::Bytes], headers: bool) -> (f64, f64) {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", brokers).set("enable.idempotence", "true").set("acks", "all");
    for (k, v) in extra_properties() {
        cc.set(k, v);
    }
    let producer: FutureProducer = cc.create().unwrap();
    // The key (uid) is known to a raw producer in advance; kubecast must read it from the JSON.
    let payloads = common::payloads(recording);
    let source = std::sync::Arc::new(kubecast::model::EventSource::new("bench", &common::pods()));
    let headers: Vec<Option<rdkafka::message::OwnedHeaders>> = recording
        .iter()
        .map(|line| {
            headers.then(|| {
                kubecast::sink::kafka::encode(&common::event(line, &source), kubecast::sink::kafka::Mode::Binary).1
            })
        })
        .collect();
    common::settle();
    let (threads0, cpu0, t0) = (common::thread_cpu(), cpu_seconds(), Instant::now());
    let mut in_flight: FuturesUnordered<Delivery<'_>> = FuturesUnordered::new();
    for ((key, payload), headers) in payloads.iter().zip(headers) {
        if in_flight.len() >= 1000 {
            in_flight.next().await.unwrap().expect("delivered");
        }
        let producer = producer.clone();
        in_flight.push(Box::pin(async move {
            let record = FutureRecord::to(topic).key(key).payload(payload);
            let record = match headers {
                Some(h) => record.headers(h),
                None => record,
            };
            producer.send(record, Timeout::Never).await.map(|_| ()).map_err(|(e, _)| e)
        }));
    }
    while let Some(r) = in_flight.next().await {
        r.expect("delivered");
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    let figures = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    println!("raw {}", common::cpu_split(&threads0, recording.len()));
    figures
}
