//! Exactly-once into Kafka when the delivery stops half way, against the real Kafka broker and
//! apiserver of `tests/env`: an event sent into the open transaction but never acknowledged
//! (here: the shutdown deadline while the broker does not answer, with `tombstones = true`,
//! so one of an event's two records is in the transaction and the other waits for room) must
//! never be committed; a `read_committed` consumer sees every change once after the restart.
//!
//! And a SIGTERM while the broker does not answer still ends within the shutdown deadline
//! (a state write waits for the store up to its own timeout otherwise), losing nothing.
//!
//! The tests pause the shared broker (SIGSTOP, bounded, always resumed), one at a time.

use kubecast_kit as common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams};
use rdkafka::ClientConfig;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::Message;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(120);

/// One pause of the shared broker at a time.
static PAUSE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One record as a `read_committed` consumer sees it: an event (its id, verb and object uid)
/// or a tombstone (`id` empty, the key: the object's uid).
#[derive(Debug, Clone)]
struct Rec {
    id: String,
    verb: String,
    uid: String,
}

/// Reads every partition of `topic` from the beginning, `read_committed`, into `out` until
/// `stop` is set.
fn committed_records(topic: String, out: Arc<Mutex<Vec<Rec>>>, stop: Arc<std::sync::atomic::AtomicBool>) {
    tokio::spawn(async move {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
            .set("group.id", common::unique("eos-faults-verify"))
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        if !common::traffic::assign_from_beginning(&consumer, &topic, &stop).await {
            return;
        }
        let mut stream = consumer.stream();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(500), stream.next()).await else {
                continue;
            };
            let key = String::from_utf8_lossy(m.key().unwrap_or_default()).to_string();
            let rec = match m.payload() {
                None => Rec { id: String::new(), verb: "tombstone".into(), uid: key },
                Some(p) => {
                    let e: Value = serde_json::from_slice(p).expect("a structured event");
                    Rec {
                        id: e["id"].as_str().unwrap().to_string(),
                        verb: e["type"].as_str().unwrap().rsplit('.').next().unwrap().to_string(),
                        uid: e["data"]["metadata"]["uid"].as_str().unwrap().to_string(),
                    }
                }
            };
            out.lock().unwrap().push(rec);
        }
    });
}

async fn wait_until(what: &str, kc: &mut Kubecast, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn metric(kc: &mut Kubecast, name: &str) -> Option<f64> {
    let (_, metrics) = kc.admin_get("/metrics").await;
    metrics.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Thirty objects deleted while the broker is paused: librdkafka's queue (21 records here)
/// fills with ten deletes and their tombstones and the eleventh delete's event; its tombstone
/// waits for room, so that event is in the open transaction, not acknowledged. SIGTERM: the
/// shutdown deadline stops the queue there; the broker is back before the final write. That
/// transaction is aborted, not committed with half of an event that no state covers: after
/// the restart each delete is seen once, followed by its tombstone.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_sent_but_not_acknowledged_at_the_shutdown_deadline_is_never_committed() {
    let _one = PAUSE.lock().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-abandon").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let created = common::create_cms(&client, &ns.name, &common::names("d", 0..30)).await;
    let config = format!(
        "[cluster]\nname = \"{}\"\n[delivery]\nshutdown_timeout_seconds = 2\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n",
        common::unique("eos"),
        ns.name
    );
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"structured\"\nexactly_once = true\ntombstones = true\n[sink.kafka.properties]\n\"queue.buffering.max.messages\" = \"21\"\n",
        common::env_var("KAFKA_BROKERS")
    );
    // Commits every 5 s: none starts in the middle of the deletes below.
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 5000\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let (stop, seen) = (Arc::new(std::sync::atomic::AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
    committed_records(topic.clone(), seen.clone(), stop.clone());
    let mut kc = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    let count = |verb: &str| seen.lock().unwrap().iter().filter(|r| r.verb == verb).count();
    wait_until("the thirty creates committed", &mut kc, || count("added") >= 30).await;

    {
        let paused = common::Paused::now("kafka", Duration::from_secs(90));
        api.delete_collection(&DeleteParams::default(), &ListParams::default()).await.expect("delete all");
        // Ten deletes with their tombstones and one delete without: the queue is full.
        let deadline = Instant::now() + WAIT;
        while metric(&mut kc, "kubecast_kafka_transaction_events").await != Some(21.0) {
            assert!(Instant::now() < deadline, "librdkafka's queue did not fill:\n{}", kc.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        kc.signal("TERM");
        kc.wait_log("shutdown deadline", 1).await;
        drop(paused);
    }
    let status = kc.wait_exit(WAIT).await;
    assert!(status.success(), "a shutdown, not a failure: {status}\n{}", kc.log());

    kc.restart(&[]);
    wait_until("thirty deletes and tombstones committed after the restart", &mut kc, || {
        count("deleted") >= 30 && count("tombstone") >= 30
    })
    .await;
    // Anything committed twice would be committed by now (commits every 5 s): one more.
    let committed = metric(&mut kc, "kubecast_kafka_transactions_total{outcome=\"committed\"}").await.unwrap_or(0.0);
    let deadline = Instant::now() + WAIT;
    while metric(&mut kc, "kubecast_kafka_transactions_total{outcome=\"committed\"}").await.unwrap_or(0.0) <= committed
    {
        assert!(Instant::now() < deadline, "no commit after the deletes:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = seen.lock().unwrap().clone();

    let mut ids: BTreeMap<&str, usize> = BTreeMap::new();
    for r in seen.iter().filter(|r| !r.id.is_empty()) {
        *ids.entry(&r.id).or_default() += 1;
    }
    let twice: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "events committed more than once: {twice:?}\n{}", kc.log());
    for (name, (uid, _)) in &created {
        let of: Vec<&str> = seen.iter().filter(|r| &r.uid == uid).map(|r| r.verb.as_str()).collect();
        assert_eq!(of, ["added", "deleted", "tombstone"], "{name} ({uid}): each record once, in order");
    }
    let log = kc.log();
    assert!(log.contains("transaction abandoned"), "the open transaction was abandoned, not committed:\n{log}");
    assert!(kc.stop().success(), "{}", kc.log());
}

/// The sum of a counter family's samples.
async fn counter_sum(kc: &mut Kubecast, family: &str) -> f64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    metrics
        .lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// SIGTERM while the broker does not answer (paused): a commit waits up to 30 s for it, and
/// the final write as long again; kubecast still exits within `shutdown_timeout_seconds` (3)
/// plus the final write's grace (2 s) and a margin. Nothing is lost: after the broker is back,
/// the restart sends what was not committed, each change once.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_while_the_broker_does_not_answer_exits_by_the_deadline_and_loses_nothing() {
    let _one = PAUSE.lock().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-term").await;
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let mut created = common::create_cms(&client, &ns.name, &common::names("a", 0..5)).await;
    let config = format!(
        "[cluster]\nname = \"{}\"\n[delivery]\nshutdown_timeout_seconds = 3\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n",
        common::unique("eos"),
        ns.name
    );
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"structured\"\nexactly_once = true\n",
        common::env_var("KAFKA_BROKERS")
    );
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let (stop, seen) = (Arc::new(std::sync::atomic::AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
    committed_records(topic.clone(), seen.clone(), stop.clone());
    let mut kc = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    let added = |seen: &Arc<Mutex<Vec<Rec>>>| seen.lock().unwrap().iter().filter(|r| r.verb == "added").count();
    wait_until("the first five changes committed", &mut kc, || added(&seen) >= 5).await;
    let observed = counter_sum(&mut kc, "kubecast_events_observed").await;

    let took = {
        let _paused = common::Paused::now("kafka", Duration::from_secs(90));
        created.extend(common::create_cms(&client, &ns.name, &common::names("b", 0..5)).await);
        let deadline = Instant::now() + WAIT;
        while counter_sum(&mut kc, "kubecast_events_observed").await < observed + 5.0 {
            assert!(Instant::now() < deadline, "the five changes made during the pause not read:\n{}", kc.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A commit (every 200 ms) now waits for the broker.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let term = Instant::now();
        kc.signal("TERM");
        kc.wait_exit(Duration::from_secs(90)).await;
        term.elapsed()
    };
    assert!(
        took <= Duration::from_secs(3 + 2 + 3),
        "SIGTERM to exit took {took:?}: more than shutdown_timeout_seconds (3) + the final write's grace (2) + 3 s\n{}",
        kc.log()
    );

    kc.restart(&[]);
    wait_until("the ten changes committed after the restart", &mut kc, || added(&seen) >= 10).await;
    let committed = metric(&mut kc, "kubecast_kafka_transactions_total{outcome=\"committed\"}").await.unwrap_or(0.0);
    let deadline = Instant::now() + WAIT;
    while metric(&mut kc, "kubecast_kafka_transactions_total{outcome=\"committed\"}").await.unwrap_or(0.0) <= committed
    {
        assert!(Instant::now() < deadline, "no commit after the restart:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = seen.lock().unwrap().clone();
    for (name, (uid, _)) in &created {
        let of: Vec<&str> = seen.iter().filter(|r| &r.uid == uid).map(|r| r.verb.as_str()).collect();
        assert_eq!(of, ["added"], "{name} ({uid}): committed once\n{}", kc.log());
    }
    assert!(kc.stop().success(), "{}", kc.log());
}
