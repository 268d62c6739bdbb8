//! Delivery throughput: kubecast's delivery path vs a raw rdkafka producer, same payloads, same
//! broker, same run. Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench kafka                   # 50000 events over 5000 objects
//!     cargo bench --bench kafka -- --events 20000
//!
//! The stream is "recorded" deterministically: ~10 KB Pods (labels, annotations,
//! managedFields, five containers with env, status), each object modified several times.
//! kubecast's side runs the library's own path for each change: decoding the object's identity
//! from the watch's JSON (the rest is passed through untouched), CloudEvent building, the
//! outbound queue (per-object order, `max_in_flight` 1000), the Kafka sink (binary mode: `ce_*`
//! headers, value = the object) with delivery reports, and the acknowledgement watermark. The
//! raw side sends the same object JSON with the same key, 1000 in flight. Needs the test
//! Kafka: it runs `tests/env/up kafka` (idempotent; left running).

mod common;

use std::time::{Duration, Instant};

use common::{OBJECTS, cpu_seconds, record};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kubecast::sink::Sink;
use kubecast::sink::kafka::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

/// The allocator of the kubecast binary (src/main.rs), so both sides run as they would there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let events = common::events_arg(50_000);
    let env = common::env_up("kafka");
    let brokers = common::env_value(&env, "KAFKA_BROKERS");
    let ar = common::pods();
    let recording = record(events);
    let bytes: usize = recording.iter().map(Vec::len).sum();
    println!(
        "recorded stream: {events} events over {OBJECTS} Pods, {:.1} KB per object on average",
        bytes as f64 / events as f64 / 1024.0
    );

    let run = std::process::id();
    // Warm the broker (topic creation, connections) outside the measurements.
    raw(&brokers, &format!("bench.warmup.{run}"), &recording[..1000.min(events)]).await;

    let raw_figures = raw(&brokers, &format!("bench.raw.{run}"), &recording).await;
    let sink = Sink::Kafka(
        kubecast::sink::KafkaSink::new(&KafkaConfig {
            brokers: brokers.to_string(),
            topic: format!("bench.kubecast.{run}"),
            mode: Default::default(),
            tombstones: false,
            properties: Default::default(),
        })
        .unwrap(),
    );
    let kc = common::kubecast(sink, &recording, &ar).await;
    common::report(events, "raw rdkafka producer", raw_figures, &[("kubecast delivery", kc)]);
}

type Delivery<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), rdkafka::error::KafkaError>> + 'a>>;

/// A raw idempotent producer sending each object's JSON with its uid as key, 1000 in flight.
async fn raw(brokers: &str, topic: &str, recording: &[Vec<u8>]) -> (f64, f64) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap();
    // The key (uid) is known to a raw producer in advance; kubecast must read it from the JSON.
    let payloads: Vec<(String, &[u8])> =
        common::keys(recording).into_iter().zip(recording.iter().map(Vec::as_slice)).collect();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let mut in_flight: FuturesUnordered<Delivery<'_>> = FuturesUnordered::new();
    for (key, payload) in &payloads {
        if in_flight.len() >= 1000 {
            in_flight.next().await.unwrap().expect("delivered");
        }
        let producer = producer.clone();
        in_flight.push(Box::pin(async move {
            producer
                .send(FutureRecord::to(topic).key(key).payload(*payload), Timeout::Never)
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        }));
    }
    while let Some(r) = in_flight.next().await {
        r.expect("delivered");
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0)
}
