//! The Kafka sink and the outbound queue against the real Kafka broker and apiserver from
//! tests/env, read back by an independent consumer.

// Each #[tokio::test] runs on its own thread and runtime: holding the std lock across awaits
// only serializes the tests, it cannot deadlock a runtime.
#![allow(clippy::await_holding_lock)]

use kubecast_kit as common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, create_cm};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

/// The outage test stops the shared broker: it runs alone.
static BROKER: RwLock<()> = RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    BROKER.read().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone)]
struct Record {
    key: Option<String>,
    payload: Option<Vec<u8>>,
    headers: BTreeMap<String, String>,
    partition: i32,
    timestamp_ms: i64,
}

impl Record {
    fn json(&self) -> Value {
        serde_json::from_slice(self.payload.as_deref().expect("payload")).expect("JSON payload")
    }
    fn header(&self, k: &str) -> &str {
        self.headers.get(k).map(String::as_str).unwrap_or_else(|| panic!("no header {k}: {:?}", self.headers))
    }
}

/// Waits until kubecast's `kubecast_checkpoint_lag` (items read but not acknowledged, set after
/// each checkpoint cycle) adds up to at least `n`.
async fn wait_lag_at_least(kc: &mut Kubecast, n: f64) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (_, metrics) = kc.admin_get("/metrics").await;
        let lag: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("kubecast_checkpoint_lag{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        if lag >= n {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "checkpoint lag {lag} never reached {n}:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Reads `topic` from the beginning until `done` holds for everything read so far.
async fn consume_until(topic: &str, what: &str, done: impl Fn(&[Record]) -> bool) -> Vec<Record> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
        .set("group.id", common::unique("verify"))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "false")
        .set("topic.metadata.refresh.interval.ms", "500")
        .create()
        .expect("consumer");
    // Wait for the topic (kubecast's first record creates it), then read all its partitions
    // from the beginning: no consumer-group rebalancing involved.
    let deadline = Instant::now() + WAIT;
    let partitions = loop {
        let md = consumer.fetch_metadata(Some(topic), Duration::from_secs(2));
        if let Ok(md) = md
            && let Some(t) =
                md.topics().iter().find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
        {
            break t.partitions().len() as i32;
        }
        assert!(Instant::now() < deadline, "topic {topic} never appeared (waiting for {what})");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let mut stream = consumer.stream();
    while !done(&out) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out reading {topic} for {what}; got {} records", out.len());
        match tokio::time::timeout(left.min(Duration::from_secs(2)), stream.next()).await {
            Ok(Some(Ok(m))) => out.push(Record {
                key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                payload: m.payload().map(<[u8]>::to_vec),
                headers: m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                (
                                    h.key.to_string(),
                                    h.value.map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                partition: m.partition(),
                timestamp_ms: m.timestamp().to_millis().unwrap_or_default(),
            }),
            Ok(Some(Err(e))) => eprintln!("consumer: {e}"),
            _ => {}
        }
    }
    out
}

fn kafka_config(cluster: &str, ns: &str, extra: &str) -> String {
    format!(
        r#"[cluster]
name = "{cluster}"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
namespaces = ["{ns}"]
{extra}
"#
    )
}

/// Starts kubecast with the Kafka sink and waits until its initial list is done, so that every
/// later change arrives as its own watch event.
async fn start_kafka(config: &str, sink: &str, checkpoint: &str) -> Kubecast {
    let mut kc = Kubecast::start_with_sink(config, sink, checkpoint, &[]);
    kc.wait_log("list complete", 1).await;
    kc
}

fn sink_toml(topic: &str, more: &str) -> String {
    format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n{more}\n",
        common::env_var("KAFKA_BROKERS")
    )
}

fn cluster_name() -> String {
    common::unique("k").replace('_', "-")
}

/// Per key, the `data.v` values in topic order must never go back (repeats are allowed).
fn assert_per_key_order(records: &[Record]) -> HashMap<String, Vec<i64>> {
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    let mut partitions: HashMap<String, HashSet<i32>> = HashMap::new();
    for r in records {
        let key = r.key.clone().expect("every record has a key");
        partitions.entry(key.clone()).or_default().insert(r.partition);
        if r.payload.is_none() || r.headers.get("ce_type").is_some_and(|t| t.ends_with(".deleted")) {
            continue;
        }
        let data = r.json();
        let v = data["data"]["v"].as_str().map(|v| v.parse::<i64>().unwrap());
        if let Some(v) = v {
            let seq = per_key.entry(key.clone()).or_default();
            if let Some(last) = seq.last() {
                assert!(*last <= v, "key {key}: v went from {last} to {v}: out of order");
            }
            seq.push(v);
        }
    }
    assert!(partitions.values().all(|p| p.len() == 1), "one partition per key");
    per_key
}

#[tokio::test]
async fn binary_mode_headers_key_and_per_object_order() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka").await;
    let cluster = cluster_name();
    let topic = format!("kubecast.{cluster}.core.configmaps");
    let mut kc = start_kafka(
        &kafka_config(&cluster, &ns.name, ""),
        &sink_toml("kubecast.{cluster}.{group}.{resource}", ""),
        "flush_interval_ms = 100",
    )
    .await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let mut uids = Vec::new();
    for i in 0..5 {
        uids.push(
            create_cm(&client, &ns.name, &format!("o{i}"), json!({}), json!({"v": "0"})).await.metadata.uid.unwrap(),
        );
    }
    for v in 1..=5 {
        for i in 0..5 {
            api.patch(&format!("o{i}"), &PatchParams::default(), &Patch::Merge(json!({"data": {"v": v.to_string()}})))
                .await
                .unwrap();
        }
    }
    api.delete("o0", &DeleteParams::default()).await.unwrap();
    let records = consume_until(&topic, "31 events", |r| r.len() >= 31).await;
    assert_eq!(records.len(), 31, "5 added + 25 modified + 1 deleted");

    let per_key = assert_per_key_order(&records);
    for uid in &uids {
        assert_eq!(per_key[uid], [0, 1, 2, 3, 4, 5], "every change of {uid}, in order");
    }
    for r in &records {
        let uid = r.key.as_deref().unwrap();
        assert_eq!(r.header("ce_specversion"), "1.0");
        assert_eq!(r.header("ce_partitionkey"), uid);
        assert_eq!(r.header("content-type"), "application/json");
        assert_eq!(r.header("ce_source"), format!("k8s://{cluster}/api/v1/configmaps"));
        assert!(r.header("ce_type").starts_with("io.kubecast.core.ConfigMap."));
        let verb = r.header("ce_type").rsplit('.').next().unwrap().to_string();
        let id = if verb == "deleted" {
            format!("{uid}:deleted")
        } else {
            format!("{uid}:{}:{verb}", r.header("ce_resourceversion"))
        };
        assert_eq!(r.header("ce_id"), id);
        assert!(r.header("ce_subject").starts_with(&format!("{}/o", ns.name)));
        assert!(chrono::DateTime::parse_from_rfc3339(r.header("ce_time")).is_ok());
        assert_eq!(r.header("ce_origin"), "watch");
        let data = r.json();
        assert_eq!(data["kind"], "ConfigMap", "value = data, the object");
        assert_eq!(data["metadata"]["uid"], uid);
    }
    let last = records.iter().rfind(|r| r.key.as_deref() == Some(uids[0].as_str())).unwrap();
    assert!(last.header("ce_type").ends_with(".deleted"));
    assert_eq!(last.json()["data"]["v"], "5", "a deleted event carries the last state");
    assert!(kc.stop().success(), "{}", kc.log());
}

#[tokio::test]
async fn structured_mode_per_resource_topic_and_tombstones() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-s").await;
    let cluster = cluster_name();
    let topic = format!("custom.{cluster}.{}.added-and-more", ns.name);
    let mut kc = start_kafka(
        &kafka_config(&cluster, &ns.name, "topic = \"custom.{cluster}.{namespace}.added-and-more\""),
        &sink_toml("unused.{cluster}", "mode = \"structured\"\ntombstones = true"),
        "",
    )
    .await;
    let cm = create_cm(&client, &ns.name, "s", json!({}), json!({"v": "1"})).await;
    let uid = cm.metadata.uid.unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name).delete("s", &DeleteParams::default()).await.unwrap();
    let records = consume_until(&topic, "added, deleted and a tombstone", |r| r.len() >= 3).await;
    assert_eq!(records.len(), 3);
    assert_eq!(records[0].header("content-type"), "application/cloudevents+json; charset=UTF-8");
    let ev = records[0].json();
    assert_eq!(ev["specversion"], "1.0");
    assert_eq!(ev["type"], "io.kubecast.core.ConfigMap.added");
    assert_eq!(ev["partitionkey"], uid.as_str());
    assert_eq!(ev["data"]["data"]["v"], "1");
    assert_eq!(records[1].json()["type"], "io.kubecast.core.ConfigMap.deleted");
    assert_eq!(records[2].key.as_deref(), Some(uid.as_str()));
    assert!(records[2].payload.is_none(), "null value: a tombstone for compacted topics");
    assert!(kc.stop().success(), "{}", kc.log());
}

async fn create_topic(name: &str, config: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let mut t = NewTopic::new(name, 1, TopicReplication::Fixed(1));
    for (k, v) in config {
        t = t.set(k, v);
    }
    let r = admin.create_topics(&[t], &AdminOptions::new()).await.unwrap();
    r[0].as_ref().expect("topic created");
}

#[tokio::test]
async fn a_record_over_the_broker_limit_goes_to_the_dead_letter_and_the_stream_goes_on() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-dl").await;
    let cluster = cluster_name();
    let topic = format!("small.{cluster}");
    let dead = format!("dead.{cluster}");
    create_topic(&topic, &[("max.message.bytes", "20000")]).await;
    let mut kc = start_kafka(
        &kafka_config(&cluster, &ns.name, ""),
        &(sink_toml(&topic, "") + &format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n")),
        "flush_interval_ms = 100",
    )
    .await;
    let big = create_cm(&client, &ns.name, "big", json!({}), json!({"v": "1", "blob": "x".repeat(50_000)})).await;
    let small = create_cm(&client, &ns.name, "small", json!({}), json!({"v": "1"})).await;
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
        .patch("big", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "2", "blob": "y"}})))
        .await
        .unwrap();

    let records = consume_until(&topic, "the small events", |r| r.len() >= 2).await;
    let big_uid = big.metadata.uid.unwrap();
    let small_uid = small.metadata.uid.unwrap();
    assert_eq!(records.len(), 2, "the too-large event is not in the topic");
    let of = |uid: &str| {
        records.iter().find(|r| r.key.as_deref() == Some(uid)).unwrap_or_else(|| panic!("no record for {uid}"))
    };
    assert_eq!(of(&small_uid).json()["data"]["v"], "1");
    assert_eq!(of(&big_uid).json()["data"]["v"], "2", "the stream went on past the big event");

    let dl = consume_until(&dead, "the dead letter", |r| !r.is_empty()).await;
    assert_eq!(dl.len(), 1);
    assert_eq!(dl[0].key.as_deref(), Some(big_uid.as_str()));
    let reason = dl[0].header("kubecast_dead_letter_reason");
    assert!(reason.contains("too large"), "reason: {reason}");
    assert_eq!(dl[0].header("kubecast_original_destination"), topic);
    assert_eq!(dl[0].json()["type"], "io.kubecast.core.ConfigMap.added");
    assert!(kc.log().contains("writing it to the dead letter"), "{}", kc.log());

    // The operator lets the topic take larger records and replays the dead letter, while
    // kubecast runs: the event reaches the topic it was meant for, under its original id and
    // key, in the sink's mode; replay remembers how far it got.
    let big_id = format!("{big_uid}:{}:added", big.metadata.resource_version.unwrap());
    let config = kc.dir.path().join("kubecast.toml");
    let out = common::dead_letter_ok(&config, &["list"]);
    assert!(out.contains(&big_id) && out.contains(&topic) && out.contains("too large"), "{out}");
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let alter = rdkafka::admin::AlterConfig::new(rdkafka::admin::ResourceSpecifier::Topic(&topic))
        .set("max.message.bytes", "1000000");
    admin.alter_configs(&[alter], &AdminOptions::new()).await.unwrap()[0].as_ref().expect("topic config altered");
    let out = common::dead_letter_ok(&config, &["replay"]);
    assert!(out.contains(&format!("replayed: {big_id} to {topic}")), "{out}");
    let records = consume_until(&topic, "the replayed event", |r| r.len() >= 3).await;
    let replayed = records.iter().find(|r| r.headers.get("ce_id") == Some(&big_id)).expect("the replayed event");
    assert_eq!(replayed.key.as_deref(), Some(big_uid.as_str()));
    assert_eq!(replayed.json()["data"]["v"], "1");
    assert_eq!(replayed.json()["data"]["blob"].as_str().map(str::len), Some(50_000));
    assert_eq!(replayed.header("content-type"), "application/json", "binary mode, as the sink");
    // Again: nothing left to replay.
    let out = common::dead_letter_ok(&config, &["replay"]);
    assert!(!out.contains("replayed:"), "replayed twice: {out}");
    assert_eq!(common::dead_letter_ok(&config, &["list"]), "");
    assert!(kc.stop().success(), "{}", kc.log());
}

#[tokio::test]
async fn the_rate_limit_is_observed() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-rate").await;
    let cluster = cluster_name();
    let topic = format!("rate.{cluster}");
    for i in 0..60 {
        create_cm(&client, &ns.name, &format!("r{i:02}"), json!({}), json!({"v": "0"})).await;
    }
    let mut kc = start_kafka(
        &kafka_config(&cluster, &ns.name, ""),
        &(sink_toml(&topic, "") + "[delivery]\nrate_per_second = 20\nburst = 1\n"),
        "",
    )
    .await;
    let records = consume_until(&topic, "60 snapshot events", |r| r.len() >= 60).await;
    let first = records.iter().map(|r| r.timestamp_ms).min().unwrap();
    let last = records.iter().map(|r| r.timestamp_ms).max().unwrap();
    let secs = (last - first) as f64 / 1000.0;
    let rate = 59.0 / secs.max(0.001);
    eprintln!("60 events in {secs:.2} s: {rate:.1} events/s (configured 20/s)");
    assert!(rate <= 20.0 * 1.15, "rate {rate:.1}/s exceeds the configured 20/s");
    assert!(kc.stop().success(), "{}", kc.log());
}

#[tokio::test]
async fn an_unreachable_broker_is_a_clear_error_and_loses_nothing() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-down").await;
    let cluster = cluster_name();
    create_cm(&client, &ns.name, "kept", json!({}), json!({"v": "1"})).await;
    // Nothing listens on port 1.
    let bad = "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"127.0.0.1:1\"\ntopic = \"down.{cluster}\"\n[sink.kafka.properties]\n\"message.timeout.ms\" = \"3000\"\n[delivery]\nshutdown_timeout_seconds = 2\n";
    let mut kc = start_kafka(&kafka_config(&cluster, &ns.name, ""), bad, "flush_interval_ms = 100").await;
    let deadline = Instant::now() + WAIT;
    while !(kc.log().contains("Kafka client error") && kc.log().contains("send failed; retrying")) {
        assert!(Instant::now() < deadline, "no clear error:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = kc.log();
    assert!(log.contains("127.0.0.1:1"), "the error names the broker:\n{log}");
    kc.wait_ready_reason("sink: broker not reachable").await;
    // The sends failed (logged above): nothing acknowledged, so no checkpoint either.
    let (_, metrics) = kc.admin_get("/metrics").await;
    let acked: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kubecast_events_acked_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(acked, 0.0, "nothing acknowledged:\n{metrics}");
    assert!(kc.checkpoints().iter().all(|c| c["resource_version"].is_null()), "nothing acknowledged, no checkpoint");
    assert!(kc.stop().success(), "a clean stop even with undelivered events\n{}", kc.log());

    // With the real broker, the snapshot that was never acknowledged is delivered now.
    let topic = format!("down.{cluster}");
    kc.set_sink(&sink_toml("down.{cluster}", ""));
    kc.restart(&[]);
    let records = consume_until(&topic, "the kept object", |r| !r.is_empty()).await;
    assert_eq!(records[0].header("ce_subject"), format!("{}/kept", ns.name));
    assert!(kc.stop().success());
}

/// Kafka stopped for 60 s while 1000 changes happen; kubecast is killed with -9 during the
/// outage and restarted. Afterwards every change arrives, in order per object, and no
/// checkpoint ever passed an unacknowledged event.
#[tokio::test]
async fn a_60_s_broker_outage_with_a_kill_9_loses_nothing() {
    let _exclusive = BROKER.write().unwrap_or_else(|e| e.into_inner());
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-outage").await;
    let cluster = cluster_name();
    let topic = format!("outage.{cluster}");
    create_cm(&client, &ns.name, "before", json!({}), json!({"v": "0"})).await;
    let mut kc =
        start_kafka(&kafka_config(&cluster, &ns.name, ""), &sink_toml(&topic, ""), "flush_interval_ms = 100").await;
    consume_until(&topic, "the snapshot", |r| !r.is_empty()).await;
    let deadline = Instant::now() + WAIT;
    while kc.checkpoints().iter().all(|c| c["resource_version"].is_null()) {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let acked_before = kc.checkpoints()[0].clone();

    let outage = Instant::now();
    let broker_back = common::Stopped::now("kafka");
    // 1000 changes: 100 objects created, then 9 updates each.
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let first_rvs = std::sync::Mutex::new(Vec::new());
    futures::stream::iter(0..100)
        .for_each_concurrent(8, |i| {
            let client = client.clone();
            let ns = ns.name.clone();
            let first_rvs = &first_rvs;
            async move {
                let cm = create_cm(&client, &ns, &format!("c{i:03}"), json!({}), json!({"v": "0"})).await;
                let rv: u64 = cm.metadata.resource_version.unwrap().parse().unwrap();
                first_rvs.lock().unwrap().push(rv);
            }
        })
        .await;
    let first_change = *first_rvs.lock().unwrap().iter().min().unwrap();
    for v in 1..=9 {
        futures::stream::iter(0..100)
            .for_each_concurrent(8, |i| {
                let api = api.clone();
                async move {
                    api.patch(
                        &format!("c{i:03}"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"data": {"v": v.to_string()}})),
                    )
                    .await
                    .unwrap();
                }
            })
            .await;
    }
    // kubecast read the 1000 changes and a checkpoint cycle ran after it did.
    wait_lag_at_least(&mut kc, 1000.0).await;
    // Nothing of the outage is acknowledged, so the checkpoint has not moved.
    let during = kc.checkpoints()[0].clone();
    let during_rv: u64 = during["resource_version"].as_str().unwrap().parse().unwrap();
    assert!(during_rv < first_change, "checkpoint passed unacknowledged events: {during_rv} >= {first_change}");
    eprintln!(
        "checkpoint before the outage {}, during it {during_rv}, first change of the outage {first_change}",
        acked_before["resource_version"]
    );
    assert_eq!(during["objects"], acked_before["objects"]);
    kc.kill9();
    kc.restart(&[]);
    // The new process read the changes again from the checkpoint, and still acknowledged none.
    kc.wait_ready_reason("sink: broker not reachable").await;
    wait_lag_at_least(&mut kc, 1000.0).await;
    assert_eq!(kc.checkpoints()[0]["resource_version"], during["resource_version"]);
    let left = Duration::from_secs(60).saturating_sub(outage.elapsed());
    tokio::time::sleep(left).await;
    drop(broker_back);
    kc.wait_ready(200).await;

    let records = consume_until(&topic, "1000 changes", |r| {
        r.iter().filter_map(|r| r.headers.get("ce_id")).collect::<HashSet<_>>().len() >= 1001
    })
    .await;
    let per_key = assert_per_key_order(&records);
    let complete = per_key.values().filter(|v| v.ends_with(&[9]) && (0..=9).all(|x| v.contains(&x))).count();
    assert_eq!(complete, 100, "every one of the 1000 changes arrived, per object in order");
    let deadline = Instant::now() + WAIT;
    loop {
        let cp = &kc.checkpoints()[0];
        if cp["objects"].as_array().unwrap().len() == 101 {
            break;
        }
        assert!(Instant::now() < deadline, "checkpoint did not catch up:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(kc.stop().success(), "{}", kc.log());
}

/// The state in Kafka too (`[checkpoint] store = "kafka"`): while the broker is down nothing
/// is acknowledged and kubecast keeps running (its store is not fenced by the outage), the
/// changes made meanwhile all arrive once it is back, and the state topic catches up: a fresh
/// process with no disk then resumes without sending anything again.
#[tokio::test]
async fn a_broker_outage_with_the_state_in_kafka_loses_nothing() {
    let _exclusive = BROKER.write().unwrap_or_else(|e| e.into_inner());
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-state-outage").await;
    let cluster = cluster_name();
    let topic = format!("state-outage.{cluster}");
    let state = format!("state-outage-state.{cluster}");
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 100\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let config = kafka_config(&cluster, &ns.name, "");
    create_cm(&client, &ns.name, "before", json!({}), json!({"v": "0"})).await;
    let mut kc = start_kafka(&config, &sink_toml(&topic, ""), &checkpoint).await;
    consume_until(&topic, "the snapshot", |r| !r.is_empty()).await;

    let broker_back = common::Stopped::now("kafka");
    futures::stream::iter(0..20)
        .for_each_concurrent(8, |i| {
            let client = client.clone();
            let ns = ns.name.clone();
            async move {
                create_cm(&client, &ns, &format!("c{i:02}"), json!({}), json!({"v": "0"})).await;
            }
        })
        .await;
    // A state write fails once its commit times out (30 s into the outage): logged and retried
    // at the next interval, not fatal (`wait_log` fails if the process exits).
    kc.wait_log("checkpoints not written; retrying at the next interval", 1).await;
    assert!(kc.exited().is_none(), "a failing state write is retried, not fatal:\n{}", kc.log());
    drop(broker_back);
    let consumed = consume_until(&topic, "21 objects", |r| {
        r.iter().filter_map(|r| r.key.clone()).collect::<HashSet<_>>().len() >= 21
    });
    let records = tokio::select! {
        records = tokio::time::timeout(WAIT - Duration::from_secs(10), consumed) => match records {
            Ok(records) => records,
            Err(_) => panic!("the changes made during the outage did not arrive:\n{}", kc.log()),
        },
        status = kc.wait_exit(WAIT) => panic!("kubecast exited ({status}) after the outage:\n{}", kc.log()),
    };
    // Every change made during the outage, each under its own object's key.
    let names: HashSet<String> =
        records.iter().map(|r| r.header("ce_subject").rsplit('/').next().unwrap().to_string()).collect();
    for i in 0..20 {
        assert!(names.contains(&format!("c{i:02}")), "c{i:02} missing: {names:?}");
    }
    // The state topic catches up: a new process with no disk sends nothing again (nothing but
    // the barrier made after it started, to know it has sent all it would).
    common::settle(&mut kc, &client, &ns.name, json!({})).await;
    assert!(kc.stop().success(), "{}", kc.log());
    let fresh_start = chrono::Utc::now().timestamp_millis();
    let mut fresh = Kubecast::start_with_sink(&config, &sink_toml(&topic, ""), &checkpoint, &[]);
    fresh.wait_ready(200).await;
    let barrier = common::settle(&mut fresh, &client, &ns.name, json!({})).await;
    let records = consume_until(&topic, "the 21 objects and 2 barriers", |r| {
        r.iter().filter_map(|r| r.key.clone()).collect::<HashSet<_>>().len() >= 23
    })
    .await;
    let again: Vec<_> =
        records.iter().filter(|r| r.timestamp_ms >= fresh_start && r.header("ce_subject") != barrier).collect();
    assert!(again.is_empty(), "sent again after resuming from the state topic: {again:?}\n{}", fresh.log());
    assert!(!fresh.log().contains("list complete"), "resumed, no snapshot:\n{}", fresh.log());
    assert!(fresh.stop().success(), "{}", fresh.log());
}

/// A broker that refuses the credentials: a clear error, not ready, no crash, nothing
/// acknowledged; with the right password (read from the environment, never logged) the
/// events that waited are delivered.
#[tokio::test]
async fn refused_credentials_are_a_clear_error_and_the_secret_is_never_logged() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-auth").await;
    let cluster = cluster_name();
    let topic = format!("auth.{cluster}");
    create_cm(&client, &ns.name, "waiting", json!({}), json!({"v": "1"})).await;
    let sasl = |password_var: &str| {
        format!(
            "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n[sink.kafka.properties]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"{}\"\n\"sasl.password\" = \"${{env:{password_var}}}\"\n[delivery]\nshutdown_timeout_seconds = 2\n",
            common::env_var("KAFKA_SASL_BROKERS"),
            common::env_var("KAFKA_SASL_USER"),
        )
    };
    let wrong = "wrong-password-0123";
    let right = common::env_var("KAFKA_SASL_PASSWORD");
    let env = [("TEST_KAFKA_WRONG", wrong), ("TEST_KAFKA_RIGHT", right.as_str())];
    let mut kc = Kubecast::start_with_sink(
        &kafka_config(&cluster, &ns.name, ""),
        &sasl("TEST_KAFKA_WRONG"),
        "flush_interval_ms = 100",
        &env,
    );
    kc.wait_ready_reason("sink: broker not reachable").await;
    let deadline = Instant::now() + WAIT;
    while !kc.log().contains("Authentication failed") {
        assert!(Instant::now() < deadline, "no clear authentication error:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(kc.checkpoints().iter().all(|c| c["resource_version"].is_null()), "nothing acknowledged");
    assert!(kc.stop().success(), "no crash: a clean stop\n{}", kc.log());

    kc.set_sink(&sasl("TEST_KAFKA_RIGHT"));
    kc.restart(&env);
    let records = consume_until(&topic, "the waiting object", |r| !r.is_empty()).await;
    assert_eq!(records[0].header("ce_subject"), format!("{}/waiting", ns.name));
    kc.wait_ready(200).await;
    assert!(kc.stop().success());
    let log = kc.log();
    assert!(!log.contains(wrong) && !log.contains(&right), "a password appeared in the log:\n{log}");
}

/// The lines of a kubecast log at level ERROR, and those with a librdkafka configuration
/// warning (`CONFWARN`: a property of the other role, ignored).
fn errors_and_confwarns(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains(" ERROR ") || l.contains("\"level\":\"ERROR\"") || l.contains("CONFWARN"))
        .collect()
}

/// A fresh, empty state topic (created by the Kafka store) and producer properties in
/// `[sink.kafka] properties`: the store's consumers get only consumer properties (librdkafka
/// warns `CONFWARN` for each producer property it ignores), and the end of the empty
/// partition, how the store knows it has read the topic, is no ERROR line. Started again on the
/// now written topic: the same.
#[tokio::test]
async fn the_kafka_store_starts_on_an_empty_state_topic_without_warnings_or_errors() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "kafka-store-quiet").await;
    let cluster = cluster_name();
    let topic = format!("quiet.{cluster}");
    let state = format!("quiet-state.{cluster}");
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 100\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let sink = sink_toml(&topic, "[sink.kafka.properties]\n\"linger.ms\" = \"5\"\n\"compression.type\" = \"zstd\"\n");
    let config = kafka_config(&cluster, &ns.name, "");
    let mut kc = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    kc.wait_ready(200).await;
    let log = kc.log();
    assert!(log.contains("Kafka state topic created"), "a fresh state topic:\n{log}");
    assert!(log.contains("Kafka state topic read"), "{log}");
    create_cm(&client, &ns.name, "one", json!({}), json!({"v": "1"})).await;
    consume_until(&topic, "the change", |r| !r.is_empty()).await;
    assert!(kc.stop().success(), "{}", kc.log());
    let log = kc.log();
    assert!(
        errors_and_confwarns(&log).is_empty(),
        "a fresh state topic:\n{}\n\nthe whole log:\n{log}",
        errors_and_confwarns(&log).join("\n")
    );

    kc.restart(&[]);
    kc.wait_ready(200).await;
    assert!(kc.stop().success(), "{}", kc.log());
    let log = kc.run_log();
    assert!(log.contains("Kafka state topic read"), "{log}");
    assert!(
        errors_and_confwarns(&log).is_empty(),
        "the written state topic:\n{}\n\nthe whole log:\n{log}",
        errors_and_confwarns(&log).join("\n")
    );
}
