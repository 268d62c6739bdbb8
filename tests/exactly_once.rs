//! Exactly-once into Kafka (`[sink.kafka] exactly_once = true`), against the real Kafka broker
//! and apiserver of `tests/env`: a `read_committed` consumer that drops nothing sees every
//! change once, per object in apiserver order, across SIGKILLs, a broker restart and a fenced
//! old leader.

// The broker-restart test holds the write side of a lock across awaits; the others the read side.
#![allow(clippy::await_holding_lock)]

use kubecast_kit as common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

/// The broker restart test stops the shared broker: it runs alone.
static BROKER: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    BROKER.read().unwrap_or_else(|e| e.into_inner())
}

/// One event as a `read_committed` consumer sees it.
#[derive(Debug, Clone)]
struct Seen {
    id: String,
    uid: String,
    verb: String,
    name: String,
    rv: u64,
}

/// Reads `topic` (every partition, from the beginning) with `isolation.level =
/// read_committed` into `out`, until `stop` is set.
fn committed_reader(topic: String, out: Arc<Mutex<Vec<Seen>>>, stop: Arc<std::sync::atomic::AtomicBool>) {
    tokio::spawn(async move {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
            .set("group.id", common::unique("eos-verify"))
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false")
            .set("topic.metadata.refresh.interval.ms", "500")
            .create()
            .expect("consumer");
        let partitions = loop {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            if let Ok(md) = consumer.fetch_metadata(Some(&topic), Duration::from_secs(2))
                && let Some(t) =
                    md.topics().iter().find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
            {
                break t.partitions().len() as i32;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(&topic, p, Offset::Beginning).unwrap();
        }
        consumer.assign(&tpl).unwrap();
        let mut stream = consumer.stream();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(500), stream.next()).await else {
                continue;
            };
            let e: Value = serde_json::from_slice(m.payload().expect("payload")).expect("a structured event");
            let verb = e["type"].as_str().unwrap().rsplit('.').next().unwrap().to_string();
            let meta = &e["data"]["metadata"];
            out.lock().unwrap().push(Seen {
                id: e["id"].as_str().unwrap().to_string(),
                uid: meta["uid"].as_str().unwrap().to_string(),
                verb,
                name: meta["name"].as_str().unwrap().to_string(),
                rv: meta["resourceVersion"].as_str().unwrap().parse().unwrap(),
            });
        }
    });
}

/// The config, the `[sink]` section and the `[checkpoint]` lines of an exactly-once run.
struct Setup {
    config: String,
    sink: String,
    checkpoint: String,
}

fn setup(ns: &str, topic: &str, state: &str, extra: &str) -> Setup {
    Setup {
        config: format!(
            "[cluster]\nname = \"{}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n{extra}\n",
            common::unique("eos")
        ),
        sink: format!(
            "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"structured\"\nexactly_once = true\n",
            common::env_var("KAFKA_BROKERS")
        ),
        checkpoint: format!("store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\n"),
    }
}

/// What the load wrote: per uid, the resourceVersions of its creates and updates, and
/// whether it was deleted.
#[derive(Default, Debug)]
struct Written {
    changes: BTreeMap<String, Vec<u64>>,
    deleted: Vec<String>,
}

/// Creates, updates and deletes ConfigMaps among `names` at about `per_second`, until `stop`.
async fn load(
    api: Api<ConfigMap>,
    names: usize,
    per_second: u64,
    written: Arc<Mutex<Written>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut live: HashMap<String, String> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / per_second));
    let mut n = 0u64;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        tick.tick().await;
        n += 1;
        let name = format!("cm-{}", rnd() % names as u64);
        match live.get(&name).cloned() {
            None => {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": name}, "data": {"n": n.to_string()}
                }))
                .unwrap();
                if let Ok(c) = api.create(&PostParams::default(), &cm).await {
                    let uid = c.metadata.uid.unwrap();
                    let rv = c.metadata.resource_version.unwrap().parse().unwrap();
                    written.lock().unwrap().changes.entry(uid.clone()).or_default().push(rv);
                    live.insert(name, uid);
                }
            }
            Some(uid) if rnd() % 10 < 7 => {
                let patch = json!({"data": {"n": n.to_string()}});
                if let Ok(c) =
                    api.patch(&name, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await
                {
                    let rv = c.metadata.resource_version.unwrap().parse().unwrap();
                    written.lock().unwrap().changes.entry(uid).or_default().push(rv);
                }
            }
            Some(uid) => {
                if api.delete(&name, &DeleteParams::default()).await.is_ok() {
                    written.lock().unwrap().deleted.push(uid);
                    live.remove(&name);
                }
            }
        }
    }
}

/// Every change exactly once, per object in apiserver order, and the view equals the
/// apiserver's list.
fn check_exactly_once(seen: &[Seen], written: &Written, now: &BTreeMap<String, u64>) {
    let mut ids: HashMap<&str, usize> = HashMap::new();
    for s in seen {
        *ids.entry(&s.id).or_default() += 1;
    }
    let dups: Vec<_> = ids.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        dups.is_empty(),
        "{} ids seen more than once (of {} events): {:?}",
        dups.len(),
        seen.len(),
        &dups[..dups.len().min(10)]
    );
    // Per object: its creates and updates, in the order written, then its delete.
    let mut per_uid: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
    for s in seen {
        per_uid.entry(&s.uid).or_default().push(s);
    }
    for (uid, rvs) in &written.changes {
        let got: Vec<u64> =
            per_uid.get(uid.as_str()).into_iter().flatten().filter(|s| s.verb != "deleted").map(|s| s.rv).collect();
        assert_eq!(&got, rvs, "object {uid}: the changes written, each once, in order");
        let deletes = per_uid.get(uid.as_str()).into_iter().flatten().filter(|s| s.verb == "deleted").count();
        let deleted = written.deleted.contains(uid);
        assert_eq!(deletes, usize::from(deleted), "object {uid}: deleted {deleted}, delete events {deletes}");
        if deleted {
            assert_eq!(per_uid[uid.as_str()].last().unwrap().verb, "deleted", "object {uid}: the delete comes last");
        }
    }
    // (A namespace may get other ConfigMaps, e.g. kube-root-ca.crt when a controller manager
    // runs: only the load's own objects, named cm-*, are counted.)
    let own = per_uid.values().filter(|evs| evs.iter().all(|s| s.name.starts_with("cm-"))).count();
    assert_eq!(own, written.changes.len(), "events only of objects the test wrote");
    // The view a consumer builds equals the apiserver's list. Kept per uid: only an object's
    // own events are in order (one partition); a name deleted and created again has two uids,
    // whose events may sit in two partitions.
    let mut last: HashMap<&str, &Seen> = HashMap::new();
    for s in seen {
        last.insert(&s.uid, s);
    }
    let view: BTreeMap<String, u64> =
        last.values().filter(|s| s.verb != "deleted").map(|s| (s.name.clone(), s.rv)).collect();
    assert_eq!(&view, now, "the view rebuilt from the committed events is the apiserver's list");
}

async fn listed(api: &Api<ConfigMap>) -> BTreeMap<String, u64> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| (c.metadata.name.unwrap(), c.metadata.resource_version.unwrap().parse().unwrap()))
        .collect()
}

/// Waits until the consumer saw every change written (or `WAIT`), then a little longer for
/// anything beyond them.
async fn settle(seen: &Arc<Mutex<Vec<Seen>>>, written: &Arc<Mutex<Written>>) {
    let want = {
        let w = written.lock().unwrap();
        w.changes.values().map(Vec::len).sum::<usize>() + w.deleted.len()
    };
    let deadline = Instant::now() + WAIT;
    while seen.lock().unwrap().len() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
}

/// A `read_committed` reader of `topic` and a load on `api`'s ConfigMaps, running until
/// [`Traffic::finish`], which checks exactly-once.
struct Traffic {
    api: Api<ConfigMap>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    load_stop: Arc<std::sync::atomic::AtomicBool>,
    written: Arc<Mutex<Written>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    loader: tokio::task::JoinHandle<()>,
}

impl Traffic {
    /// ~50 changes per second on `names` ConfigMaps.
    fn start(api: &Api<ConfigMap>, topic: &str, names: usize) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let load_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let written = Arc::new(Mutex::new(Written::default()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        committed_reader(topic.to_string(), seen.clone(), stop.clone());
        let loader = tokio::spawn(load(api.clone(), names, 50, written.clone(), load_stop.clone()));
        Self { api: api.clone(), stop, load_stop, written, seen, loader }
    }

    fn seen(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// Stops the load, waits for the reader to see every change, checks exactly-once; the
    /// changes written.
    async fn finish(self) -> Written {
        self.load_stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.loader.await.unwrap();
        settle(&self.seen, &self.written).await;
        let now = listed(&self.api).await;
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let seen = self.seen.lock().unwrap().clone();
        let written = std::mem::take(&mut *self.written.lock().unwrap());
        check_exactly_once(&seen, &written, &now);
        written
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_sigkills_under_load_a_read_committed_consumer_sees_every_change_once() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-kills").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let s = setup(&ns.name, &topic, &state, "");
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;

    let traffic = Traffic::start(&api, &topic, 200);

    // SIGKILL at pseudo-random moments (0.3 to 2.3 s after the restart's first commit could
    // have happened), restarting each time.
    let mut seed = 7u64;
    for round in 0..20 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let after = Duration::from_millis(300 + (seed >> 33) % 2000);
        tokio::time::sleep(after).await;
        assert!(kc.exited().is_none(), "round {round}: kubecast exited by itself:\n{}", kc.log());
        kc.kill9();
        kc.restart(&[]);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let written = traffic.finish().await;
    assert!(
        written.changes.len() > 100 && !written.deleted.is_empty(),
        "the load made creates, updates and deletes: {written:?}"
    );
    assert!(kc.stop().success(), "{}", kc.log());
}

/// Two processes on one Lease: the leader paused past its lease (the standby takes over, the
/// old one wakes up fenced), then the new leader SIGKILLed (the first one, restarted, takes
/// over again). A `read_committed` consumer sees every change once, none of what the paused
/// leader sent after losing the Lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_old_leader_and_a_failover_stay_exactly_once() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-failover").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let s = setup(&ns.name, &topic, &state, "");
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let mut a = Kubecast::start_with_sink(&config, &s.sink, &s.checkpoint, &[]);
    a.wait_log("holding the lease", 1).await;
    a.wait_log("list complete", 1).await;
    let mut b = Kubecast::start_with_sink(&config, &s.sink, &s.checkpoint, &[]);
    b.wait_log("standby: another process holds the lease", 1).await;

    let traffic = Traffic::start(&api, &topic, 50);

    tokio::time::sleep(Duration::from_secs(3)).await;
    a.signal("STOP");
    b.wait_log("holding the lease", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    a.signal("CONT");
    let status = a.wait_exit(Duration::from_secs(15)).await;
    assert!(!status.success(), "the old leader stops once it wakes up: {status}\n{}", a.log());
    a.restart(&[]);
    a.wait_log("standby: another process holds the lease", 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    b.kill9();
    a.wait_log("holding the lease", 1).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    traffic.finish().await;
    assert!(a.stop().success(), "{}", a.log());
}

/// The broker stopped and started again while a transaction is open (one always is under
/// load): what was not committed is aborted and sent again; still exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_broker_restart_in_the_middle_of_a_transaction_stays_exactly_once() {
    let _exclusive = BROKER.write().unwrap_or_else(|e| e.into_inner());
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-broker").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let s = setup(&ns.name, &topic, &state, "");
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;

    let traffic = Traffic::start(&api, &topic, 100);
    // Some transactions committed before the outage.
    let deadline = Instant::now() + WAIT;
    while traffic.seen() < 50 {
        assert!(Instant::now() < deadline, "no committed event before the outage:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let back = common::Stopped::now("kafka");
    tokio::time::sleep(Duration::from_secs(8)).await;
    drop(back);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(kc.exited().is_none(), "kubecast rode the outage out:\n{}", kc.log());
    traffic.finish().await;
    assert!(kc.stop().success(), "{}", kc.log());
}

/// The broker paused (SIGSTOP: connections stay open, nothing answers) longer than a commit
/// may take (30 s), while commits go on under load: the commit in progress times out, which
/// librdkafka says is retriable (call it again), not a reason to abort. It is finished once
/// the broker answers again, neither aborted nor sent again; kubecast goes on committing and
/// stays exactly once.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_that_times_out_is_finished_when_the_broker_answers_again() {
    let _exclusive = BROKER.write().unwrap_or_else(|e| e.into_inner());
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-pause").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let s = setup(&ns.name, &topic, &state, "");
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;

    let traffic = Traffic::start(&api, &topic, 50);
    let deadline = Instant::now() + WAIT;
    while traffic.seen() < 50 {
        assert!(
            Instant::now() < deadline,
            "no committed event before the pause:
{}",
            kc.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    {
        // Bounded (below the transaction timeout of 60 s, after which the broker aborts it).
        let _paused = common::Paused::now("kafka", Duration::from_secs(50));
        kc.wait_log("checkpoints not written", 1).await;
    }
    // Commits go on after the pause.
    let deadline = Instant::now() + WAIT;
    let before = traffic.seen();
    while traffic.seen() < before + 50 {
        assert!(Instant::now() < deadline, "no commit after the pause:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(kc.exited().is_none(), "kubecast rode the pause out:\n{}", kc.log());
    traffic.finish().await;
    let (_, metrics) = kc.admin_get("/metrics").await;
    assert!(
        metrics.contains("kubecast_kafka_transactions_total{outcome=\"commit_pending\"} "),
        "the commit timed out and was finished later:\n{metrics}\n{}",
        kc.log()
    );
    assert!(kc.stop().success(), "{}", kc.log());
}

/// A record that no retry delivers (its topic does not exist and is not created) cannot be
/// skipped: kubecast stops naming the topic, nothing is committed; once the topic exists, a
/// restart delivers every change once.
#[tokio::test(flavor = "multi_thread")]
async fn a_record_no_retry_delivers_stops_kubecast_and_is_sent_after_the_fix() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-poison").await;
    let (topic, state) = (common::unique("eos-missing"), common::unique("eos-state"));
    let mut s = setup(&ns.name, &topic, &state, "");
    // The broker auto-creates topics; this producer asks it not to, so the topic stays missing.
    s.sink.push_str(
        "[sink.kafka.properties]\n\"allow.auto.create.topics\" = \"false\"\n\"topic.metadata.propagation.max.ms\" = \"1000\"\n",
    );
    common::create_cms(&client, &ns.name, &common::names("p", 0..3)).await;
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success(), "{status}");
    let log = kc.log();
    assert!(log.contains(&topic) && log.contains("no retry can deliver it"), "names the topic and why:\n{log}");

    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let new = rdkafka::admin::NewTopic::new(&topic, 3, rdkafka::admin::TopicReplication::Fixed(1));
    admin.create_topics(&[new], &rdkafka::admin::AdminOptions::new()).await.unwrap().remove(0).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    committed_reader(topic.clone(), seen.clone(), stop.clone());
    kc.restart(&[]);
    let deadline = Instant::now() + WAIT;
    while seen.lock().unwrap().len() < 3 {
        assert!(Instant::now() < deadline, "the three changes after the fix:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = seen.lock().unwrap().clone();
    // (Only the test's own ConfigMaps: a controller manager adds kube-root-ca.crt.)
    let mut names: Vec<&str> = seen.iter().map(|s| s.name.as_str()).filter(|n| n.starts_with('p')).collect();
    names.sort();
    assert_eq!(names, ["p00", "p01", "p02"], "each once: {seen:?}");
    let (_, metrics) = kc.admin_get("/metrics").await;
    let committed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kubecast_kafka_transactions_total{outcome=\"committed\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(committed.is_some_and(|n| n >= 1.0), "committed transactions counted:\n{metrics}");
    assert!(metrics.contains("kubecast_kafka_transaction_events "), "{metrics}");
    assert!(kc.stop().success(), "{}", kc.log());
}
