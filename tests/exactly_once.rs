//! Exactly-once into Kafka (`[sink.kafka] exactly_once = true`), against the real Kafka broker
//! and apiserver of `tests/env`: a `read_committed` consumer that drops nothing sees every
//! change once, per object in apiserver order, across SIGKILLs, a broker restart and a fenced
//! old leader.

// The broker-restart test holds the write side of a lock across awaits; the others the read side.
#![allow(clippy::await_holding_lock)]

use kubecast_kit as common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::traffic::{Delivery, Source, Traffic, Written};
use common::{Kubecast, TestNamespace, client};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use rdkafka::ClientConfig;

const WAIT: Duration = Duration::from_secs(120);

/// The broker restart test stops the shared broker: it runs alone.
static BROKER: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    BROKER.read().unwrap_or_else(|e| e.into_inner())
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

/// A `read_committed` consumer of `topic` (a read of the committed transactions only).
fn committed(topic: &str) -> Source {
    Source::Kafka { brokers: common::env_var("KAFKA_BROKERS"), topic: topic.to_string(), read_committed: true }
}

/// How many events a new `read_committed` reader of kubecast's topic sees within 10 s (when the
/// test's own reader seems stuck: is it the reader, or the commits? A read to the end would
/// wait for the open transaction).
async fn fresh_read(topic: &str) -> usize {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    common::traffic::reader(committed(topic), seen.clone(), stop.clone());
    tokio::time::sleep(Duration::from_secs(10)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    seen.lock().unwrap().len()
}

/// The subjects of the committed events of `topic` (structured mode), every partition read to
/// its end.
fn committed_subjects(topic: &str) -> Vec<String> {
    use rdkafka::message::Message;
    common::topic::read_to_end(topic, true)
        .iter()
        .filter_map(|m| m.payload())
        .map(|p| {
            serde_json::from_slice::<serde_json::Value>(p).expect("a structured event")["subject"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// A `read_committed` reader of `topic` and ~50 changes per second on `names` ConfigMaps of
/// `api`'s namespace, until [`Eos::finish`], which checks exactly-once.
struct Eos(Traffic, String);

impl Eos {
    fn start(api: &Api<ConfigMap>, topic: &str, names: usize) -> Self {
        Self(Traffic::start(api, committed(topic), names, 50), topic.to_string())
    }

    fn seen(&self) -> usize {
        self.0.seen()
    }

    /// Stops the load, waits for the reader to see every change, checks exactly-once; what
    /// the load wrote.
    async fn finish(self) -> Written {
        self.0.finish(Delivery::ExactlyOnce, WAIT).await.written
    }
}

/// Exactly-once kubecast on a fresh namespace (`prefix`) under ~50 changes/s, once its
/// first 50 events are committed (read by a `read_committed` reader).
async fn committing_under_load(prefix: &str) -> (TestNamespace, Kubecast, Eos) {
    let client = client().await;
    let ns = TestNamespace::new(&client, prefix).await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    let mut s = setup(&ns.name, &topic, &state, "");
    // librdkafka's view of the transactions in the log, for a failure's diagnosis.
    s.sink.push_str("[sink.kafka.properties]\n\"debug\" = \"eos\"\n");
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;
    let traffic = Eos::start(&api, &topic, 50);
    let deadline = Instant::now() + WAIT;
    while traffic.seen() < 50 {
        assert!(Instant::now() < deadline, "no committed event before the pause:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (ns, kc, traffic)
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

    let traffic = Eos::start(&api, &topic, 200);

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

    let traffic = Eos::start(&api, &topic, 50);

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

    let traffic = Eos::start(&api, &topic, 100);
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
    let (_ns, mut kc, traffic) = committing_under_load("eos-pause").await;
    {
        // Bounded (below the transaction timeout of 60 s, after which the broker aborts it).
        let _paused = common::Paused::now("kafka", Duration::from_secs(50));
        kc.wait_log("checkpoints not written", 1).await;
    }
    // Commits go on after the pause.
    let deadline = Instant::now() + WAIT;
    let before = traffic.seen();
    while traffic.seen() < before + 50 {
        if Instant::now() > deadline {
            let fresh = fresh_read(&traffic.1).await;
            panic!(
                "no commit after the pause: the test's reader saw {} events, {before} before the pause; a new read_committed reader sees {fresh}:\n{}",
                traffic.seen(),
                kc.log()
            );
        }
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

/// The broker paused (SIGSTOP: connections stay open, nothing answers) for longer than the
/// transaction timeout (60 s) in the middle of a transaction: the broker aborts that
/// transaction itself once it runs again. kubecast sends its events again in a new one and
/// stays exactly once, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_pause_longer_than_the_transaction_timeout_is_ridden_out_exactly_once() {
    let _exclusive = BROKER.write().unwrap_or_else(|e| e.into_inner());
    let (_ns, mut kc, traffic) = committing_under_load("eos-long-pause").await;
    {
        let _paused = common::Paused::now("kafka", Duration::from_secs(70));
        // The whole pause: 70 s, past transaction.timeout.ms.
        tokio::time::sleep(Duration::from_secs(70)).await;
    }
    let deadline = Instant::now() + WAIT;
    let before = traffic.seen();
    while traffic.seen() < before + 50 {
        if let Some(status) = kc.exited() {
            panic!("kubecast exited after the pause: {status:?}\n{}", kc.log());
        }
        if Instant::now() > deadline {
            let (_, m) = kc.admin_get("/metrics").await;
            let m: Vec<&str> = m
                .lines()
                .filter(|l| {
                    l.starts_with("kubecast_in_flight")
                        || l.starts_with("kubecast_queue_depth")
                        || l.starts_with("kubecast_kafka_transaction")
                        || l.starts_with("kubecast_checkpoint_lag")
                })
                .collect();
            panic!("no commit after the pause: {m:#?}\n{}", kc.log());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(kc.exited().is_none(), "kubecast rode the pause out:\n{}", kc.log());
    traffic.finish().await;
    let (_, metrics) = kc.admin_get("/metrics").await;
    let outcomes: Vec<&str> = metrics.lines().filter(|l| l.starts_with("kubecast_kafka_transactions_total{")).collect();
    eprintln!("[exactly-once] transactions through a 70 s pause: {outcomes:?}");
    assert!(
        outcomes.iter().any(|l| !l.contains("\"committed\"")),
        "the pause met a transaction (a commit that did not finish): {outcomes:?}\n{}",
        kc.log()
    );
    assert!(kc.stop().success(), "{}", kc.log());
}

/// A record whose topic does not exist (and is not created) is a set-up mistake, not the
/// event's, and exactly-once cannot skip it: nothing is committed while it lasts, the process
/// stays up, not ready once no commit succeeded for the documented threshold (30 s here),
/// naming the topic and the fix. Once the topic exists, a later commit delivers every change
/// once, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_topic_holds_the_commits_and_every_change_goes_once_after_it_is_created() {
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
    kc.wait_ready_reason("no exactly-once commit succeeded for").await;
    let (status, body) = kc.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&topic) && body.contains("fix: create the topic"), "names the topic and the fix: {body}");
    assert!(kc.exited().is_none(), "kubecast stays up:\n{}", kc.log());
    assert!(kc.log().contains("a record's destination refuses every record"), "{}", kc.log());
    // The transaction's events are held like any refused event: counted, and named with the cause.
    assert!(body.contains("refuses every event: the topic does not exist"), "{body}");
    assert!(refused_events(&mut kc).await > 0, "kubecast_sink_refused counts the transaction's events");

    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let new = rdkafka::admin::NewTopic::new(&topic, 3, rdkafka::admin::TopicReplication::Fixed(1));
    admin.create_topics(&[new], &rdkafka::admin::AdminOptions::new()).await.unwrap().remove(0).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    common::traffic::reader(committed(&topic), seen.clone(), stop.clone());
    let deadline = Instant::now() + WAIT;
    while seen.lock().unwrap().len() < 3 {
        assert!(kc.exited().is_none(), "kubecast stopped:\n{}", kc.log());
        assert!(Instant::now() < deadline, "the three changes after the fix:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    // Once a stored position has reached a later change, everything before it is committed.
    common::settle(&mut kc, &client, &ns.name, serde_json::json!({})).await;
    let subjects = committed_subjects(&topic);
    // (Only the test's own ConfigMaps: a controller manager adds kube-root-ca.crt.)
    let mut names: Vec<&str> =
        subjects.iter().filter_map(|s| s.rsplit('/').next()).filter(|n| n.starts_with('p')).collect();
    names.sort();
    assert_eq!(names, ["p00", "p01", "p02"], "each once: {subjects:?}");
    let (_, metrics) = kc.admin_get("/metrics").await;
    let committed = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kubecast_kafka_transactions_total{outcome=\"committed\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(committed.is_some_and(|n| n >= 1.0), "committed transactions counted:\n{metrics}");
    assert!(metrics.contains("kubecast_kafka_transaction_events "), "{metrics}");
    assert_eq!(refused_events(&mut kc).await, 0, "nothing held once committed");
    assert!(kc.stop().success(), "{}", kc.log());
}

/// `kubecast_sink_refused{reason="missing_topic"}`.
async fn refused_events(kc: &mut Kubecast) -> i64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    let line = metrics.lines().find_map(|l| l.strip_prefix("kubecast_sink_refused{reason=\"missing_topic\"} "));
    line.and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no kubecast_sink_refused:\n{metrics}"))
}

/// `kubecast_kafka_transactions_total{outcome}` from `/metrics` (0 when not counted yet).
fn transactions(metrics: &str, outcome: &str) -> f64 {
    let prefix = format!("kubecast_kafka_transactions_total{{outcome=\"{outcome}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

/// Names of the test's ConfigMaps that exist before kubecast starts.
const LISTED: &str = "listed-";

/// A rate limit of 5 events per second with up to 1000 events in flight, and 350 objects
/// listed at once plus a load on top: sending the list alone takes 70 s, longer than the
/// transaction timeout (60 s). Commits go on every 200 ms meanwhile (a commit waits only for
/// sends in progress, never for the rate limit): each one commits, the broker aborts none, and
/// a `read_committed` consumer sees every change once.
#[tokio::test(flavor = "multi_thread")]
async fn a_low_rate_limit_with_many_events_in_flight_never_pushes_a_commit_past_its_timeout() {
    const OBJECTS: usize = 350;
    const RATE: usize = 5;
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-rate").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("eos-events"), common::unique("eos-state"));
    common::create_cms(&client, &ns.name, &common::names(LISTED, 0..OBJECTS)).await;
    let limits = format!("[delivery]\nrate_per_second = {RATE}\nmax_in_flight = 1000\n");
    let s = setup(&ns.name, &topic, &state, &limits);
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;

    let traffic = Traffic::start(&api, committed(&topic), 20, 2);
    // Every listed object read back (at the rate limit, with a margin).
    let deadline = Instant::now() + Duration::from_secs((OBJECTS / RATE) as u64) + WAIT;
    loop {
        let listed: std::collections::HashSet<String> =
            traffic.events().into_iter().filter(|e| e.name.starts_with(LISTED)).map(|e| e.name).collect();
        if listed.len() == OBJECTS {
            break;
        }
        assert!(Instant::now() < deadline, "{} of {OBJECTS} listed objects read back:\n{}", listed.len(), kc.log());
        assert!(kc.exited().is_none(), "kubecast exited:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let verdict = traffic.finish(Delivery::ExactlyOnce, WAIT).await;
    assert!(verdict.written.count() > 20, "the load went on meanwhile: {:?}", verdict.written);
    let (_, metrics) = kc.admin_get("/metrics").await;
    let (committed, aborted, pending) = (
        transactions(&metrics, "committed"),
        transactions(&metrics, "aborted"),
        transactions(&metrics, "commit_pending"),
    );
    assert!(committed > 100.0, "commits went on while the list was sent: {committed}");
    assert!(
        aborted == 0.0 && pending == 0.0,
        "every commit committed: {aborted} aborted, {pending} pending (unless the shared broker was stopped or paused meanwhile)\n{}",
        kc.log()
    );
    assert!(kc.stop().success(), "{}", kc.log());
}

/// One record of the dead-letter topic as a `read_committed` consumer sees it.
#[derive(Debug, Clone)]
struct DeadLetter {
    id: String,
    verb: String,
    reason: String,
    data_dropped: bool,
}

/// Reads every partition of the dead-letter topic from the beginning, `read_committed`, into
/// `out` until `stop`.
fn read_dead_letters(topic: String, out: Arc<Mutex<Vec<DeadLetter>>>, stop: Arc<std::sync::atomic::AtomicBool>) {
    use futures::StreamExt;
    use rdkafka::message::{Headers, Message};
    tokio::spawn(async move {
        let consumer: rdkafka::consumer::StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
            .set("group.id", common::unique("eos-dead-letters"))
            .set("isolation.level", "read_committed")
            .set("enable.auto.commit", "false")
            .set("topic.metadata.refresh.interval.ms", "500")
            .create()
            .expect("a Kafka consumer");
        if !common::traffic::assign_from_beginning(&consumer, &topic, &stop).await {
            return;
        }
        let mut stream = consumer.stream();
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(500), stream.next()).await else {
                continue;
            };
            let header = |k: &str| {
                m.headers()
                    .and_then(|h| h.iter().find(|h| h.key == k).and_then(|h| h.value))
                    .map(|v| String::from_utf8_lossy(v).to_string())
                    .unwrap_or_default()
            };
            let e: serde_json::Value = serde_json::from_slice(m.payload().expect("a dead letter")).expect("JSON");
            out.lock().unwrap().push(DeadLetter {
                id: e["id"].as_str().expect("an event id").to_string(),
                verb: e["type"].as_str().expect("a type").rsplit('.').next().unwrap().to_string(),
                reason: header("kubecast_dead_letter_reason"),
                data_dropped: header("kubecast_data_dropped") == "true",
            });
        }
    });
}

/// Dead letters inside the transaction (`[delivery.dead_letter] type = "broker"`): an object
/// larger than the producer's `message.max.bytes` (1 MB) is refused by the producer for good,
/// so each of its events goes to the dead-letter topic in the same transaction as the state
/// that moves past it. Under load, across SIGKILLs (one right after a change of the object, so
/// its dead letter is likely in a transaction that never commits): a `read_committed`
/// consumer of the dead-letter topic sees each of the object's events once, and one of the
/// events' topic every other change once.
#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_go_into_the_transaction_and_are_seen_once() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "eos-dead").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state, dead) = (common::unique("eos-events"), common::unique("eos-state"), common::unique("eos-dead"));
    let mut s = setup(
        &ns.name,
        &topic,
        &state,
        &format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n"),
    );
    // Commits 2 s apart: a SIGKILL right after a dead letter's write is most likely before
    // the commit of its transaction.
    s.checkpoint = s.checkpoint.replace("flush_interval_ms = 200", "flush_interval_ms = 2000");
    let mut kc = Kubecast::start_with_sink(&s.config, &s.sink, &s.checkpoint, &[]);
    kc.wait_log("list complete", 1).await;
    let traffic = Eos::start(&api, &topic, 50);
    let (letters, stop) = (Arc::new(Mutex::new(Vec::new())), Arc::new(std::sync::atomic::AtomicBool::new(false)));
    read_dead_letters(dead.clone(), letters.clone(), stop.clone());
    let wait_letters = |n: usize| {
        let letters = letters.clone();
        async move {
            let deadline = Instant::now() + WAIT;
            while letters.lock().unwrap().len() < n {
                assert!(Instant::now() < deadline, "{n} dead letters: {:?}", letters.lock().unwrap());
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let big = |c: char| serde_json::json!({"big": c.to_string().repeat(1_000_000)});

    common::create_cm(&client, &ns.name, "big", serde_json::json!({}), big('a')).await;
    wait_letters(1).await;
    kc.kill9();
    kc.restart(&[]);
    assert!(traffic.0.flowing(50, WAIT).await, "commits after the restart:\n{}", kc.log());
    let dead_lettered = |kc: &Kubecast| kc.log().matches("writing it to the dead letter").count();
    let before = dead_lettered(&kc);
    let patch = serde_json::json!({"data": big('b')});
    api.patch("big", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&patch)).await.unwrap();
    kc.wait_log("writing it to the dead letter", before + 1).await;
    kc.kill9();
    kc.restart(&[]);
    wait_letters(2).await;
    api.delete("big", &Default::default()).await.unwrap();
    wait_letters(3).await;
    traffic.finish().await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let letters = letters.lock().unwrap().clone();
    // More writes than dead letters: a transaction holding one was aborted and sent again.
    eprintln!("{} dead-letter writes for {} dead letters", dead_lettered(&kc), letters.len());
    let verbs: Vec<&str> = letters.iter().map(|l| l.verb.as_str()).collect();
    assert_eq!(verbs, ["added", "modified", "deleted"], "each of the object's events once, in order: {letters:?}");
    let mut ids: Vec<&str> = letters.iter().map(|l| l.id.as_str()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3, "{letters:?}");
    for l in &letters {
        assert!(l.reason.to_lowercase().contains("too large"), "the reason: {l:?}");
        assert!(l.data_dropped, "the dead-letter topic has the same limit: the event without its data: {l:?}");
    }
    assert!(kc.stop().success(), "{}", kc.log());
}
