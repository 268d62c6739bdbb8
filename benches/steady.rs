//! CPU and wake-ups per event at steady rates: kubecast's delivery path into Kafka fed at a
//! fixed number of changes per second, as a watch delivers them, rather than as fast as it can.
//! Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench steady                              # 200, 1500 and 10000 changes/s, 10 s each
//!     cargo bench --bench steady -- --rates 1500 --seconds 20 --partitions 1 --rounds 3
//!
//! Per rate, in a fresh topic whose records carry the broker's append time
//! (`message.timestamp.type = LogAppendTime`):
//! - a thread of its own stands for the apiserver: it answers a watch request with each recorded
//!   watch line (~8 KB Pods, see `common::record`) written at its due time as a chunk of its
//!   own, as the apiserver flushes each event; a task reads that watch through kubecast's
//!   apiserver client (its connections gather events that come fast: `--gather-ms`, default
//!   `cluster.watch_gather_ms`'s), decodes each line as the reflector does and sends the item on;
//! - kubecast's real wiring takes it from there (shaping, the queue, the Kafka sink with
//!   delivery reports, acknowledgements, the persister), as `kubecast run` starts them;
//! - measured from the first line to the last acknowledgement: the process's CPU time and
//!   context switches (voluntary + involuntary, every thread, `getrusage`), less the feeding
//!   thread's own, per event; per thread kind (`rdk:broker`, `tokio-runtime-worker`, ...) too;
//! - afterwards the topic is read back: per record, the broker's append time (the broker
//!   acknowledges right after it) minus the time its line was due to be written (so the time
//!   it waited on the connection counts), p50 / p99 / max.
//!
//! Needs the test Kafka: it runs `tests/env/up kafka` (idempotent; left running). Under
//! `perf record -g -p <pid>` it shows where the CPU of one rate goes (`--rates 1500`).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kubecast::app::wiring::Pipeline;
use kubecast::model::{Effect, EventSource, IndexOp, ObjectIndex};
use kubecast::sink::Sink;
use kubecast::source::gather::Gather;
use kubecast::source::reflector::Item;
use kubecast::state::store::file::FileStore;
use kubecast::state::store::{Delta, Owner, Store};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use std::io::{Read as _, Write as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The allocator of the kubecast binary (src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Distinct recorded lines; longer runs cycle through them (each line is copied as it is fed).
const RECORDED: usize = 10_000;

fn main() {
    common::run_like_the_binary(run());
}

async fn run() {
    let rates: Vec<u32> = common::arg("--rates")
        .unwrap_or_else(|| "200,1500,10000".into())
        .split(',')
        .map(|r| r.trim().parse().expect("--rates N,M,..."))
        .collect();
    let seconds: f64 = common::arg("--seconds").map_or(10.0, |s| s.parse().expect("--seconds S"));
    let partitions: i32 = common::arg("--partitions").map_or(6, |p| p.parse().expect("--partitions N"));
    let rounds = common::arg("--rounds").map_or(1, |r| r.parse::<usize>().expect("--rounds N")).max(1);
    // `--gather-ms N`: the watch connection's gathering window (`cluster.watch_gather_ms`).
    let gather_ms: u32 = common::arg("--gather-ms")
        .map_or(kubecast::source::client::ClusterConfig::default().watch_gather_ms, |g| {
            g.parse().expect("--gather-ms N")
        });
    let env = common::env_up("kafka");
    let brokers = common::env_value(&env, "KAFKA_BROKERS");
    let most = rates.iter().map(|&r| (f64::from(r) * seconds) as usize).max().unwrap_or(0);
    let recording = common::record(most.min(RECORDED));
    println!(
        "{} recorded Pods (~{:.1} KB each), {seconds} s per rate, topics of {partitions} partitions, {rounds} round(s), watch gathered for {gather_ms} ms",
        recording.len(),
        recording.iter().map(bytes::Bytes::len).sum::<usize>() as f64 / recording.len() as f64 / 1024.0
    );
    // Warms the broker and the allocator outside the measurements.
    steady(&brokers, &recording, 500, 500, partitions, gather_ms).await;
    let mut figures: Vec<(u32, Vec<Figures>)> = rates.iter().map(|&r| (r, Vec::new())).collect();
    for round in 0..rounds {
        for (rate, out) in &mut figures {
            let events = (f64::from(*rate) * seconds) as usize;
            let f = steady(&brokers, &recording, *rate, events, partitions, gather_ms).await;
            println!("round {} at {rate}/s: {}", round + 1, f.threads);
            out.push(f);
        }
    }
    println!();
    println!(
        "{:>10} {:>8} {:>14} {:>18} {:>12} {:>10} {:>10} {:>10}",
        "changes/s", "events", "CPU µs/event", "switches/event", "(voluntary)", "p50 ms", "p99 ms", "max ms"
    );
    for (rate, runs) in &figures {
        let m = |f: fn(&Figures) -> f64| common::median(runs.iter().map(f).collect());
        println!(
            "{rate:>10} {:>8} {:>14.1} {:>18.2} {:>12.2} {:>10.1} {:>10.1} {:>10.1}",
            runs[0].events,
            m(|f| f.cpu_us),
            m(|f| f.switches),
            m(|f| f.voluntary),
            m(|f| f.p50),
            m(|f| f.p99),
            m(|f| f.max)
        );
    }
    if rounds > 1 {
        println!("(medians over {rounds} rounds)");
    }
}

/// One rate's figures, per event.
struct Figures {
    events: usize,
    cpu_us: f64,
    switches: f64,
    voluntary: f64,
    p50: f64,
    p99: f64,
    max: f64,
    /// CPU and switches per thread kind.
    threads: String,
}

/// `events` changes at `rate` per second through kubecast into a fresh topic.
async fn steady(
    brokers: &str,
    recording: &Arc<Vec<bytes::Bytes>>,
    rate: u32,
    events: usize,
    partitions: i32,
    gather_ms: u32,
) -> Figures {
    let topic = format!("bench.steady.{}.{}", std::process::id(), kubecast_kit::unique("r"));
    create_topic(brokers, &topic, partitions).await;
    let dir = tempfile::tempdir().unwrap();
    // `KUBECAST_BENCH_KAFKA_PROPERTIES="linger.ms=20,..."`: librdkafka properties to compare.
    let properties: String = std::env::var("KUBECAST_BENCH_KAFKA_PROPERTIES")
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| format!("{:?} = {:?}\n", k.trim(), v.trim()))
        .collect();
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n\n[sink.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\n\n[sink.kafka.properties]\n{properties}"
    );
    let mut pipeline = Pipeline::new(common::config(dir.path(), &sink));
    let config = pipeline.config.clone();
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await.expect("sink"));
    let store = Store::File(FileStore::open(&config.checkpoint.dir, Owner::default()).expect("checkpoint store"));
    // A process in its steady state: it synced the objects before these changes (every object
    // the run changes is in its checkpoint's index), so the changes modify known objects
    // rather than grow the index from nothing.
    let source = Arc::new(EventSource::new(&config.cluster.name, &common::pods()));
    let synced = synced(&recording[..events.min(recording.len())], &source);
    store.write(&[(pipeline.streams[0].key.clone(), synced)]).await.expect("synced checkpoint");
    pipeline.load(store).await.expect("positions");
    // As `kubecast run` checks the topic before it starts: the producer knows its partitions
    // and their leaders before the first event (a topic just created has none for a moment).
    let kafka = sink.kafka().expect("a Kafka sink");
    assert!(kafka.topic_exists(&topic).await.expect("the brokers answer"), "topic {topic} created");
    let cancel = CancellationToken::new();
    common::settle();

    let (threads0, usage0) = (per_thread(), usage());
    let (items_tx, items_rx) = mpsc::channel::<Item>(pipeline.bounds().channel_capacity());
    let mut downstream =
        pipeline.start_downstream(sink.clone(), items_rx, &kubecast::observe::health::Health::new(Vec::new()), &cancel);
    // The apiserver's connection: a watch response whose every line is written at its due
    // time (as its own chunk, as the apiserver flushes each event), from a thread of its own.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a local port");
    let url = format!("http://{}", listener.local_addr().unwrap());
    let feeder = {
        let recording = recording.clone();
        std::thread::Builder::new()
            .name("feed".into())
            .spawn(move || {
                let own0 = own_usage();
                let (mut conn, _) = listener.accept().expect("the watch connects");
                conn.set_nodelay(true).unwrap();
                request_read(&mut conn);
                conn.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                )
                .unwrap();
                let start = Instant::now();
                let started_ms =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64() * 1000.0;
                let every = Duration::from_secs(1).as_secs_f64() / f64::from(rate.max(1));
                for i in 0..events {
                    let due = start + Duration::from_secs_f64(every * i as f64);
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let line = &recording[i % recording.len()];
                    let chunk = [format!("{:x}\r\n", line.len() + 1).as_bytes(), line, b"\n\r\n"].concat();
                    if conn.write_all(&chunk).is_err() {
                        break;
                    }
                }
                let _ = conn.write_all(b"0\r\n\r\n");
                let own1 = own_usage();
                (own1.cpu - own0.cpu, own1.voluntary - own0.voluntary, own1.involuntary - own0.involuntary, started_ms)
            })
            .unwrap()
    };
    // The reflector: reads the watch through kubecast's apiserver client, decodes each line as
    // it arrives and emits its item.
    let reflector = tokio::spawn(async move {
        let config = kube::Config::new(url.parse().unwrap());
        let client = kubecast::source::connect::client(config, Gather::from_millis(gather_ms)).expect("client");
        let request = http::Request::get("/api/v1/pods?watch=true").body(Vec::new()).unwrap();
        let response = client.send(request.map(kube::client::Body::from)).await.expect("the watch answers");
        let mut lines = std::pin::pin!(kubecast::source::watch::lines(response.into_body()));
        let mut seq = 0u64;
        while let Some(line) = lines.next().await {
            if items_tx.send(common::item(seq, &line.expect("a line"), &source)).await.is_err() {
                return;
            }
            seq += 1;
        }
    });
    downstream.queue.await.unwrap().expect("delivered");
    let usage1 = usage();
    let threads = per_thread_split(&threads0, events);
    let (feed_cpu, feed_voluntary, feed_involuntary, started_ms) = feeder.join().unwrap();
    reflector.await.unwrap();
    downstream.shaper.await.unwrap();
    cancel.cancel();
    if let Some(p) = downstream.persister.take() {
        p.await.unwrap().expect("persisted");
    }
    drop(sink);
    let n = events as f64;
    let cpu = usage1.cpu - usage0.cpu - feed_cpu;
    let voluntary = usage1.voluntary - usage0.voluntary - feed_voluntary;
    let switches = voluntary + usage1.involuntary - usage0.involuntary - feed_involuntary;
    let every_ms = 1000.0 / f64::from(rate.max(1));
    let mut ms = append_latencies(brokers, &topic, events, |i| started_ms + every_ms * i as f64).await;
    delete_topic(brokers, &topic).await;
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms[((ms.len() as f64 - 1.0) * p).round() as usize];
    Figures {
        events,
        cpu_us: cpu / n * 1e6,
        switches: switches / n,
        voluntary: voluntary / n,
        p50: q(0.5),
        p99: q(0.99),
        max: q(1.0),
        threads,
    }
}

/// Reads an HTTP request's head (the watch request) off `conn`.
fn request_read(conn: &mut std::net::TcpStream) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(conn.read(&mut byte).expect("the request"), 1, "the request ended early");
        head.push(byte[0]);
    }
}

/// The checkpoint of a stream that listed `lines`' objects: each in its index, the list's
/// resourceVersion the highest of theirs.
fn synced(lines: &[bytes::Bytes], source: &Arc<EventSource>) -> Delta {
    let mut upserts = ObjectIndex::default();
    let mut highest = 0u64;
    for line in lines {
        let item = common::item(0, line, source);
        if let Effect::Watched { op: IndexOp::Upsert(uid, entry), rv } = &item.effect {
            upserts.insert(uid, entry);
            highest = highest.max(rv.parse().unwrap_or(0));
        }
    }
    Delta { upserts, full: true, resource_version: Some(highest.to_string()), ..Delta::default() }
}

/// CPU seconds and context switches (voluntary, involuntary) of every thread of this process,
/// those that ended included.
struct Usage {
    cpu: f64,
    voluntary: f64,
    involuntary: f64,
}

fn usage() -> Usage {
    rusage(libc::RUSAGE_SELF)
}

/// The calling thread's own.
fn own_usage() -> Usage {
    rusage(libc::RUSAGE_THREAD)
}

fn rusage(who: libc::c_int) -> Usage {
    // SAFETY: getrusage fills the struct it is given; a zeroed rusage is a valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `who` is RUSAGE_SELF or RUSAGE_THREAD.
    assert_eq!(unsafe { libc::getrusage(who, &mut u) }, 0, "getrusage");
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Usage { cpu: secs(u.ru_utime) + secs(u.ru_stime), voluntary: u.ru_nvcsw as f64, involuntary: u.ru_nivcsw as f64 }
}

/// Per live thread, by name without trailing digits: (CPU seconds, context switches).
fn per_thread() -> std::collections::BTreeMap<String, (f64, f64)> {
    let mut out = std::collections::BTreeMap::new();
    for t in common::threads() {
        let e = out.entry(t.name).or_insert((0.0, 0.0));
        e.0 += t.cpu;
        e.1 += t.voluntary + t.involuntary;
    }
    out
}

/// What each thread kind took per event since `before`: "name µs / switches".
fn per_thread_split(before: &std::collections::BTreeMap<String, (f64, f64)>, events: usize) -> String {
    let n = events as f64;
    let parts: Vec<String> = per_thread()
        .into_iter()
        .filter(|(name, _)| name != "feed")
        .map(|(name, (cpu, sw))| {
            let (c0, s0) = before.get(&name).copied().unwrap_or((0.0, 0.0));
            (name, cpu - c0, sw - s0)
        })
        .filter(|(_, cpu, sw)| *cpu > 0.0 || *sw > 0.0)
        .map(|(name, cpu, sw)| format!("{name} {:.1} µs / {:.2}", cpu / n * 1e6, sw / n))
        .collect();
    format!("per event (thread: CPU / switches): {}", parts.join(", "))
}

/// A topic whose records carry the broker's append time.
async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    let new =
        NewTopic::new(topic, partitions, TopicReplication::Fixed(1)).set("message.timestamp.type", "LogAppendTime");
    for result in admin.create_topics(&[new], &AdminOptions::new()).await.expect("create topic") {
        result.expect("topic created");
    }
}

async fn delete_topic(brokers: &str, topic: &str) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", brokers).create().expect("admin client");
    for result in admin.delete_topics(&[topic], &AdminOptions::new()).await.expect("delete topic") {
        result.expect("topic deleted");
    }
}

/// Reads the `n` records of `topic`; per record, the milliseconds from its `ce_time` header
/// (the event made) to its timestamp (the broker's append time).
async fn append_latencies(brokers: &str, topic: &str, n: usize, written_ms: impl Fn(usize) -> f64) -> Vec<f64> {
    use futures::StreamExt;
    use rdkafka::Message;
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::Headers;
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("bench-steady-{}", std::process::id()))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    consumer.subscribe(&[topic]).expect("subscribe");
    let mut out = Vec::with_capacity(n);
    // Per partition, the feed position of the last record read: records of a partition are in
    // feed order, so a record's position is the first after it with the record's
    // resourceVersion (recorded lines repeat every RECORDED).
    let mut last: std::collections::HashMap<i32, usize> = std::collections::HashMap::new();
    let mut stream = consumer.stream();
    let deadline = Instant::now() + Duration::from_secs(120);
    while out.len() < n && Instant::now() < deadline {
        let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_secs(1), stream.next()).await else { continue };
        let appended = m.timestamp().to_millis().expect("LogAppendTime") as f64;
        let header = |key: &str| {
            m.headers()
                .and_then(|h| h.iter().find(|h| h.key == key).and_then(|h| h.value.map(<[u8]>::to_vec)))
                .and_then(|v| String::from_utf8(v).ok())
        };
        let rv: usize = header("ce_resourceversion").and_then(|v| v.parse().ok()).expect("ce_resourceversion");
        let first = rv - common::FIRST_RESOURCE_VERSION;
        let after = last.get(&m.partition()).map_or(0, |&p| p + 1);
        let position = if first >= after { first } else { first + (after - first).div_ceil(RECORDED) * RECORDED };
        last.insert(m.partition(), position);
        out.push(appended - written_ms(position));
    }
    assert_eq!(out.len(), n, "every record of {topic} read back");
    out
}
