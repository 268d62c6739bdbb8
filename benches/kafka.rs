//! Delivery throughput: kubecast's delivery path vs a raw rdkafka producer, same payloads, same
//! broker, same run. Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench kafka                   # 50000 events over 5000 objects, 5 rounds
//!     cargo bench --bench kafka -- --events 20000 --rounds 5
//!     cargo bench --bench kafka -- --broker-cpu 1   # the broker on CPU 1, the benchmark on the others
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
    let _pinned = common::pin_broker("kafka");
    let partitions = common::arg("--partitions").map_or(6, |p| p.parse().expect("--partitions N"));
    // Fresh topics for each run, all created before anything is measured.
    let topic = |side: &str, round: usize| format!("bench.{side}.{run}.{round}");
    let mut topics = vec![format!("bench.warmup.{run}")];
    for r in 0..rounds {
        topics.extend(SIDES.map(|side| topic(side, r)));
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
                return vec![nan; 1 + COMMIT_INTERVALS.len()];
            }
            let mut out = vec![common::kubecast(&kafka_sink(&brokers, &topic("kubecast", r), false), &recording).await];
            for ms in COMMIT_INTERVALS {
                let sink = kafka_sink(&brokers, &topic(&format!("eos{ms}"), r), true);
                out.push(common::kubecast_paced(&sink, &recording, None, &eos_checkpoint(ms)).await);
            }
            out
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
        delete_topics(&brokers, &SIDES.map(|side| topic(side, r))).await;
        let mut runs =
            vec![("raw producer + kubecast's CloudEvents headers", raw_headers), ("kubecast delivery", kc[0])];
        for (i, name) in [
            "kubecast exactly once, commit 200 ms",
            "kubecast exactly once, commit 1000 ms (default)",
            "kubecast exactly once, commit 5000 ms",
        ]
        .into_iter()
        .enumerate()
        {
            runs.push((name, kc[1 + i]));
        }
        results.push(common::Round { raw: raw_figures, runs });
    }
    common::report(events, "raw rdkafka producer", &results);
    common::report_like_for_like(
        &results,
        &COMMIT_INTERVALS.map(|ms| match ms {
            200 => ("kubecast exactly once, commit 200 ms", "kubecast delivery"),
            1000 => ("kubecast exactly once, commit 1000 ms (default)", "kubecast delivery"),
            _ => ("kubecast exactly once, commit 5000 ms", "kubecast delivery"),
        }),
    );
    if common::side("kubecast") {
        latency(&brokers, &recording).await;
    }
}

/// The topic sides of a round: the raw producer, with headers, kubecast, and kubecast with
/// exactly once at each commit interval.
const SIDES: [&str; 6] = ["raw", "rawh", "kubecast", "eos200", "eos1000", "eos5000"];
/// `[checkpoint] flush_interval_ms` (the commit interval with exactly once) of the runs.
const COMMIT_INTERVALS: [u64; 3] = [200, 1000, 5000];
/// Events per second of the latency runs.
const PACE: u32 = 2000;

/// The `[checkpoint]` lines of an exactly-once run.
fn eos_checkpoint(ms: u64) -> String {
    format!("store = \"kafka\"\nflush_interval_ms = {ms}")
}

/// End-to-end latency at a steady `PACE` events per second: from the event's making
/// (`ce_time`, kubecast's shaping stage; the recorded stream has no apiserver) to the record
/// read by a `read_committed` consumer, for kubecast without and with exactly once.
async fn latency(brokers: &str, recording: &std::sync::Arc<Vec<bytes::Bytes>>) {
    let n = (PACE as usize * 8).min(recording.len());
    let recording = std::sync::Arc::new(recording[..n].to_vec());
    println!("\nend-to-end latency at {PACE} events/s, {n} events (event made -> read by a read_committed consumer):");
    println!("{:<44} {:>10} {:>10} {:>10}", "", "p50 ms", "p99 ms", "max ms");
    let run = std::process::id();
    let mut cases: Vec<(String, Option<u64>)> = vec![("kubecast delivery".into(), None)];
    cases.extend(COMMIT_INTERVALS.map(|ms| (format!("kubecast exactly once, commit {ms} ms"), Some(ms))));
    for (name, eos) in cases {
        let topic = format!("bench.latency.{run}.{}", eos.unwrap_or(0));
        create_topics(brokers, std::slice::from_ref(&topic), 6).await;
        let reader = tokio::spawn(read_latencies(brokers.to_string(), topic.clone(), n));
        let sink = kafka_sink(brokers, &topic, eos.is_some());
        let checkpoint = eos.map(eos_checkpoint).unwrap_or_default();
        common::kubecast_paced(&sink, &recording, Some(PACE), &checkpoint).await;
        let mut ms = reader.await.unwrap();
        ms.sort_by(f64::total_cmp);
        let q = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
        println!("{name:<44} {:>10.1} {:>10.1} {:>10.1}", q(0.5), q(0.99), q(1.0));
        delete_topics(brokers, &[topic]).await;
    }
}

/// Reads `n` records of `topic` with `read_committed`; per record, the milliseconds from its
/// `ce_time` header to its arrival.
async fn read_latencies(brokers: String, topic: String, n: usize) -> Vec<f64> {
    use rdkafka::Message;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::Headers;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("bench-latency-{}", std::process::id()))
        .set("isolation.level", "read_committed")
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", "10")
        .create()
        .expect("consumer");
    consumer.subscribe(&[&topic]).expect("subscribe");
    let mut out = Vec::with_capacity(n);
    let mut stream = consumer.stream();
    let deadline = Instant::now() + Duration::from_secs(300);
    while out.len() < n && Instant::now() < deadline {
        let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(1), stream.next()).await else { continue };
        let now = chrono::Utc::now();
        let time =
            m.headers().and_then(|h| h.iter().find(|h| h.key == "ce_time").and_then(|h| h.value.map(<[u8]>::to_vec)));
        if let Some(t) = time.and_then(|t| chrono::DateTime::parse_from_rfc3339(std::str::from_utf8(&t).ok()?).ok()) {
            out.push((now - t.with_timezone(&chrono::Utc)).num_microseconds().unwrap_or(0) as f64 / 1000.0);
        }
    }
    assert!(!out.is_empty(), "no record of {topic} read");
    out
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

/// kubecast's `[sink]` table: Kafka in binary mode (the default), `exactly_once` as given,
/// `extra_properties` passed on.
fn kafka_sink(brokers: &str, topic: &str, exactly_once: bool) -> String {
    let properties: String = extra_properties().iter().map(|(k, v)| format!("{k:?} = {v:?}\n")).collect();
    format!(
        "[sink]\ntype = \"kafka\"\n\n[sink.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\nexactly_once = {exactly_once}\n\n[sink.kafka.properties]\n{properties}"
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
