//! `[coordination] shards`: replicas spread the shards of every stream among themselves, each
//! shard one Lease, one set of positions and its own lists and watches (the apiserver's
//! `shardSelector`, or kubecast's own filter by the same hash where the apiserver does not
//! apply it). Against the real apiserver and Kafka of `tests/env`; server-side filtering against
//! the apiserver of `tests/env/sharded` (its `ShardedListAndWatch` gate on).

use kubecast_kit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::traffic::{Delivery, Source, Traffic};
use common::{Kubecast, TestNamespace, client, create_cm};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use rdkafka::message::Message;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

/// A config of `shards` shards over the ConfigMaps of `ns` (short lease timings: 4 s lease,
/// 2 s renew deadline, 1 s retry), the state in the Kafka topic `state`.
fn sharded(ns: &str, lease: &str, shards: u32, state: &str) -> (String, String) {
    let config =
        common::lease_cm_config(ns, lease).replace("enabled = true\n", &format!("enabled = true\nshards = {shards}\n"));
    let checkpoint = format!(
        "store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\nbrokers = \"{}\"\ntopic = \"{state}\"\n",
        common::env_var("KAFKA_BROKERS")
    );
    (config, checkpoint)
}

fn kafka_sink(topic: &str, exactly_once: bool) -> String {
    format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"structured\"\nexactly_once = {exactly_once}\n",
        common::env_var("KAFKA_BROKERS")
    )
}

/// The shards a running replica says it holds (`kubecast_shard_held`).
async fn held(kc: &mut Kubecast) -> BTreeSet<String> {
    let (_, metrics) = kc.admin_get("/metrics").await;
    metrics
        .lines()
        .filter(|l| l.starts_with("kubecast_shard_held{") && l.ends_with(" 1"))
        .filter_map(|l| Some(l.split('"').nth(1)?.to_string()))
        .collect()
}

/// Waits until the running replicas `kcs` hold every one of `count` shards between them, each
/// once, in the spread `want` (sorted counts); the shards of each.
async fn wait_spread(kcs: &mut [&mut Kubecast], count: usize, want: &[usize], what: &str) -> Vec<BTreeSet<String>> {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut per = Vec::new();
        for kc in kcs.iter_mut() {
            per.push(held(kc).await);
        }
        let mut sizes: Vec<usize> = per.iter().map(BTreeSet::len).collect();
        sizes.sort();
        let all: BTreeSet<&String> = per.iter().flatten().collect();
        if sizes == want && all.len() == count {
            return per;
        }
        if Instant::now() > deadline {
            let logs: Vec<String> = kcs.iter().map(|k| k.log()).collect();
            panic!("{what}: the shards never spread {want:?} (last {per:?})\n{}", logs.join("\n-----\n"));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// This replica's identity, as its log says it.
fn identity(kc: &Kubecast) -> String {
    let log = kc.log();
    let line = log.lines().find(|l| l.contains("sharded: taking a share")).expect("the start line");
    line.split("identity=").nth(1).unwrap().split_whitespace().next().unwrap().trim_matches('"').to_string()
}

/// Every position record of the state topic (one partition), in the order written: (key,
/// writer, epoch). Committed records only, up to the end the topic had when called.
fn positions(topic: &str) -> Vec<(String, String, i64)> {
    let mut out = Vec::new();
    for m in common::topic::read_to_end(topic, true) {
        let (Some(key), Some(value)) = (m.key(), m.payload()) else { continue };
        let key = String::from_utf8_lossy(key).to_string();
        if key.ends_with(".p") {
            let v: Value = serde_json::from_slice(value).unwrap();
            out.push((key, v["writer"].as_str().unwrap().to_string(), v["epoch"].as_i64().unwrap()));
        }
    }
    out
}

/// 3 replicas, 4 shards, ~50 changes/s over 200 ConfigMaps into Kafka: the shards spread
/// 2/1/1; one replica SIGKILLed and another paused past its lease (SIGSTOP) lose their shards
/// to the others within about a lease duration; the paused one, woken up, never writes state
/// again and gets shards back by a clean handover. Every change arrives, per object in
/// apiserver order (after dropping duplicates by id), and the final view is the apiserver's.
#[tokio::test(flavor = "multi_thread")]
async fn three_replicas_share_four_shards_through_a_kill_and_a_pause() {
    kill_and_pause(Delivery::AtLeastOnce).await;
}

/// The same with `exactly_once`: each shard's events and positions commit in its own Kafka
/// transaction (`transactional.id` per shard), and a `read_committed` consumer sees every
/// change once, none of what the paused replica sent after losing its shards.
#[tokio::test(flavor = "multi_thread")]
async fn exactly_once_holds_per_shard_through_a_kill_and_a_pause() {
    kill_and_pause(Delivery::ExactlyOnce).await;
}

async fn kill_and_pause(delivery: Delivery) {
    let exactly_once = delivery == Delivery::ExactlyOnce;
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state) = (common::unique("shards-events"), common::unique("shards-state"));
    let (config, checkpoint) = sharded(&ns.name, &common::unique("lease"), 4, &state);
    let sink = kafka_sink(&topic, exactly_once);
    let mut a = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    let mut b = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    let mut c = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    wait_spread(&mut [&mut a, &mut b, &mut c], 4, &[1, 1, 2], "3 replicas").await;
    // Every shard listed (an empty namespace) before the load: no change precedes a list.
    let deadline = Instant::now() + WAIT;
    while [&a, &b, &c].iter().map(|k| k.log().matches("list complete").count()).sum::<usize>() < 4 {
        assert!(Instant::now() < deadline, "not every shard listed:\n{}\n{}\n{}", a.log(), b.log(), c.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for kc in [&mut a, &mut b, &mut c] {
        let body = kc.wait_ready(200).await;
        assert!(body.contains("shards held: "), "{body}");
    }
    let source =
        Source::Kafka { brokers: common::env_var("KAFKA_BROKERS"), topic: topic.clone(), read_committed: exactly_once };
    let traffic = Traffic::start(&api, source, 200, 50);
    assert!(traffic.flowing(200, WAIT).await, "events flow");

    // SIGKILL one: its shards move to the two others within about a lease duration.
    let killed = Instant::now();
    a.kill9();
    wait_spread(&mut [&mut b, &mut c], 4, &[2, 2], "after a SIGKILL").await;
    assert!(killed.elapsed() < Duration::from_secs(4 + 2 + 6), "shards moved after {:?}", killed.elapsed());
    assert!(traffic.flowing(100, WAIT).await, "events flow after the kill");

    // SIGSTOP another past its lease: the last one takes every shard.
    let zombie = identity(&b);
    b.signal("STOP");
    wait_spread(&mut [&mut c], 4, &[4], "after a SIGSTOP").await;
    // Until the new holder wrote every shard's position: what the paused one wrote before is
    // behind that.
    let survivor = identity(&c);
    let deadline = Instant::now() + WAIT;
    let taken_over = loop {
        let records = positions(&state);
        let mut last: BTreeMap<&str, &str> = BTreeMap::new();
        for (key, writer, _) in &records {
            last.insert(key, writer);
        }
        if last.len() == 4 && last.values().all(|w| *w == survivor) {
            break records.len();
        }
        assert!(Instant::now() < deadline, "the survivor never wrote every shard's position: {last:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(traffic.flowing(100, WAIT).await, "events flow after the pause");

    // Woken up, the paused one finds its Leases lost: it stops those shards without writing,
    // stays in the group, and gets two shards back by a clean handover from the busiest.
    b.signal("CONT");
    b.wait_log("shard lost", 2).await;
    wait_spread(&mut [&mut b, &mut c], 4, &[2, 2], "after the wake-up").await;
    assert!(c.log().contains("giving this shard up"), "a clean handover:\n{}", c.log());
    assert!(traffic.flowing(100, WAIT).await, "events flow after the handover");

    let verdict = traffic.finish(delivery, WAIT).await;
    assert!(verdict.written.count() > 500, "a steady load: {} changes", verdict.written.count());

    // The paused replica wrote no position between losing its Leases and getting shards back
    // by a handover: every record it wrote after the takeover is of a later epoch it held anew.
    let records = positions(&state);
    let mut epoch_of: BTreeMap<&str, i64> = BTreeMap::new();
    for (key, writer, epoch) in &records[..taken_over] {
        if writer != &zombie {
            epoch_of.insert(key, *epoch);
        }
    }
    for (key, writer, epoch) in &records[taken_over..] {
        if writer == &zombie {
            let taken = epoch_of.get(key.as_str()).copied().unwrap_or(-1);
            assert!(
                *epoch > taken,
                "{key}: the paused replica wrote under epoch {epoch} after epoch {taken} took over"
            );
        }
    }
    for kc in [&mut b, &mut c] {
        assert!(kc.stop().success(), "{}", kc.log());
    }

    // `kubecast state list` reads the sharded store: each shard listed as a stream of its own.
    let out = std::process::Command::new(common::bin())
        .args(["state", "list", "-o", "json", "--config"])
        .arg(c.dir.path().join("kubecast.toml"))
        .env("KUBECONFIG", common::kubeconfig())
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "state list failed: {}\n{stdout}", String::from_utf8_lossy(&out.stderr));
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let mut ids: Vec<&str> = listed.as_array().unwrap().iter().map(|s| s["stream"].as_str().unwrap()).collect();
    ids.sort();
    assert_eq!(ids.len(), 4, "{listed:#}");
    for (i, id) in ids.iter().enumerate() {
        assert!(id.ends_with(&format!(".shard-{i}-of-4")), "{ids:?}");
    }
}

/// A lone replica paused past its renew deadline: woken up, it finds its shards' Leases lost
/// and stops them without writing. Nobody else took them, so the Leases still name it: it takes
/// them back (they are free to it) and delivers the changes made meanwhile, in both shards.
#[tokio::test(flavor = "multi_thread")]
async fn a_lone_replica_takes_back_the_shards_it_lost_at_a_missed_renew_deadline() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards-back").await;
    let (config, checkpoint) = sharded(&ns.name, &common::unique("lease"), 2, &common::unique("shards-state"));
    let mut kc = Kubecast::start_with_checkpoint(&config, &checkpoint, &[]);
    wait_spread(&mut [&mut kc], 2, &[2], "one replica").await;
    kc.wait_log("list complete", 2).await;
    // Past the renew deadline (2 s): the pause is the fault, not a wait.
    kc.signal("STOP");
    tokio::time::sleep(Duration::from_secs(3)).await;
    kc.signal("CONT");
    kc.wait_log("shard lost", 2).await;
    wait_spread(&mut [&mut kc], 2, &[2], "after the wake-up").await;
    let names: BTreeSet<String> = (0..20).map(|i| format!("{}/back-{i}", ns.name)).collect();
    for i in 0..20 {
        create_cm(&client, &ns.name, &format!("back-{i}"), json!({}), json!({"v": "1"})).await;
    }
    let seen = |evs: &[Value]| -> BTreeSet<String> {
        evs.iter().filter_map(|e| e["subject"].as_str()).filter(|s| names.contains(*s)).map(String::from).collect()
    };
    kc.wait_for("every ConfigMap made after the wake-up", WAIT, |e| seen(e) == names).await;
    assert!(kc.stop().success(), "{}", kc.log());
}

/// Two replicas of 4 shards started together (an install, a scale-up) take two shards each
/// in their second round, each shard once: none takes every shard in its first round only to
/// list them and hand two over, and they do not race for the same shards (each takes its own
/// first). A retry period of 5 s: the replicas start well within it of each other.
#[tokio::test(flavor = "multi_thread")]
async fn replicas_started_together_take_their_share_without_a_handover() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards-join").await;
    for i in 0..20 {
        create_cm(&client, &ns.name, &format!("join-{i}"), json!({}), json!({"v": "1"})).await;
    }
    let (config, checkpoint) = sharded(&ns.name, &common::unique("lease"), 4, &common::unique("shards-state"));
    let config = config
        .replace("lease_duration_seconds = 4\n", "lease_duration_seconds = 20\n")
        .replace("renew_deadline_seconds = 2\n", "renew_deadline_seconds = 10\n")
        .replace("retry_period_seconds = 1\n", "retry_period_seconds = 5\n");
    assert!(config.contains("retry_period_seconds = 5"), "{config}");
    let mut a = Kubecast::start_with_checkpoint(&config, &checkpoint, &[]);
    let mut b = Kubecast::start_with_checkpoint(&config, &checkpoint, &[]);
    let per = wait_spread(&mut [&mut a, &mut b], 4, &[2, 2], "2 replicas").await;
    // Every object once, from the two lists of each replica's shards.
    let names: BTreeSet<String> = (0..20).map(|i| format!("{}/join-{i}", ns.name)).collect();
    let subjects = |kc: &Kubecast| -> Vec<String> {
        kc.events()
            .iter()
            .filter_map(|e| e["subject"].as_str())
            .filter(|s| names.contains(*s))
            .map(String::from)
            .collect()
    };
    let deadline = Instant::now() + WAIT;
    while subjects(&a).len() + subjects(&b).len() < names.len() {
        assert!(Instant::now() < deadline, "not every object listed:\n{}\n-----\n{}", a.log(), b.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (kc, shards) in [(&a, &per[0]), (&b, &per[1])] {
        let log = kc.log();
        assert!(log.contains("joined the group: taking shards from the next round on"), "{log}");
        assert_eq!(log.matches("holding the shard's lease").count(), 2, "took only its own {shards:?}:\n{log}");
        assert!(!log.contains("giving this shard up"), "handed a shard over:\n{log}");
        assert_eq!(log.matches("list complete").count(), 2, "listed its two shards only:\n{log}");
    }
    let mut all = subjects(&a);
    all.extend(subjects(&b));
    all.sort();
    assert_eq!(all, names.into_iter().collect::<Vec<_>>(), "each object once, by one replica");
    assert!(a.stop().success() && b.stop().success());
}

/// One replica running 4 shards and an unsharded kubecast on the same ConfigMaps emit the
/// same events (ids, in the same order per object), whether the apiserver applies the shard
/// selector or kubecast filters by the same hash itself; `kubecast_shard_skipped_total` says
/// which happened. Where the apiserver applies the selector, this also checks kubecast's hash
/// against the apiserver's: an object the apiserver sent to a shard that kubecast's hash puts
/// elsewhere would be skipped (counted), and one it put elsewhere would be missing.
/// The tests that use the apiserver of `tests/env/sharded`: one restarts it.
static SHARDED_APISERVER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The sum of `family`'s samples (every label set) in a `/metrics` text.
fn metric_sum(metrics: &str, family: &str) -> f64 {
    let prefix = format!("{family}{{");
    metrics.lines().filter(|l| l.starts_with(&prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

async fn same_events_as_unsharded(expect_server_side: bool) {
    let _one = if expect_server_side { Some(SHARDED_APISERVER.lock().await) } else { None };
    // The gate on: the apiserver of `tests/env/sharded`; off: the shared one.
    let kubeconfig = expect_server_side.then(common::sharded_kubeconfig);
    let client = match &kubeconfig {
        Some(k) => common::client_for(k).await,
        None => client().await,
    };
    let env: Vec<(&str, &str)> = kubeconfig.iter().map(|k| ("KUBECONFIG", k.as_str())).collect();
    let ns = TestNamespace::new(&client, "shards-same").await;
    let state = common::unique("shards-state");
    let (config, checkpoint) = sharded(&ns.name, &common::unique("lease"), 4, &state);
    let mut sharded = Kubecast::start_with_checkpoint(&config, &checkpoint, &env);
    let mut whole = Kubecast::start_with(&common::cm_config(&ns.name, ""), &env);
    sharded.wait_log("list complete", 4).await;
    whole.wait_log("list complete", 1).await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    for i in 0..40 {
        create_cm(&client, &ns.name, &format!("cm-{i}"), json!({}), json!({"v": "1"})).await;
    }
    for i in (0..40).step_by(3) {
        api.patch(&format!("cm-{i}"), &PatchParams::default(), &Patch::Merge(&json!({"data": {"v": "2"}})))
            .await
            .unwrap();
    }
    for i in (0..40).step_by(7) {
        api.delete(&format!("cm-{i}"), &DeleteParams::default()).await.unwrap();
    }
    let want = 40 + 14 + 6;
    let ids = |evs: &[Value]| -> Vec<String> { evs.iter().map(|e| e["id"].as_str().unwrap().to_string()).collect() };
    whole.wait_for("every change, unsharded", WAIT, |e| e.len() >= want).await;
    sharded.wait_for("every change, sharded", WAIT, |e| e.len() >= want).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (w, s) = (whole.events(), sharded.events());
    let set = |v: Vec<String>| v.into_iter().collect::<BTreeSet<_>>();
    assert_eq!(set(ids(&s)), set(ids(&w)), "the same events");
    assert_eq!(s.len(), w.len(), "no event twice");
    // Per object, the same order.
    let per_object = |evs: &[Value]| {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for e in evs {
            m.entry(e["subject"].as_str().unwrap().to_string())
                .or_default()
                .push(e["id"].as_str().unwrap().to_string());
        }
        m
    };
    assert_eq!(per_object(&s), per_object(&w), "the same order per object");
    let (_, metrics) = sharded.admin_get("/metrics").await;
    let skipped = metric_sum(&metrics, "kubecast_shard_skipped_total");
    if expect_server_side {
        assert_eq!(skipped, 0.0, "the apiserver applied the selector: no other shard's object arrived\n{metrics}");
    } else {
        assert!(skipped >= 30.0, "the apiserver ignored the selector: kubecast skipped the others' objects\n{metrics}");
    }
    assert!(sharded.stop().success(), "{}", sharded.log());
    assert!(whole.stop().success(), "{}", whole.log());
}

/// The shared test apiserver runs without the `ShardedListAndWatch` gate: kubecast filters.
#[tokio::test(flavor = "multi_thread")]
async fn client_side_filtering_gives_the_unsharded_events() {
    same_events_as_unsharded(false).await;
}

/// The apiserver of `tests/env/sharded` runs with `--feature-gates=ShardedListAndWatch=true`
/// (alpha in 1.36): it applies the selector, and kubecast skips nothing.
#[tokio::test(flavor = "multi_thread")]
async fn server_side_filtering_gives_the_unsharded_events() {
    same_events_as_unsharded(true).await;
}

/// The stored positions of one shard count do not resume under another: a replica started with
/// another count, or without shards, on the same state stops with an error naming both counts.
/// Waits until `kc` emitted an event about `ns/name` whose verb is `verb` (and, for a
/// modification, whose object has `data.v == v`).
async fn wait_change(kc: &mut Kubecast, ns: &str, name: &str, verb: &str, v: Option<&str>) {
    let subject = format!("{ns}/{name}");
    kc.wait_for(&format!("{verb} {subject}"), WAIT, |evs| {
        common::about(evs, &subject)
            .iter()
            .any(|e| common::verb(e) == verb && v.is_none_or(|v| e["data"]["data"]["v"] == v))
    })
    .await;
}

/// The count changes while replicas run, as a `helm upgrade` of `coordination.shards` (or a
/// rollback) does when the pods roll: 2 shards, then a replica of 3 joins (the 2-shard one
/// gives every shard up and takes none; the new one waits for them, then resumes from their
/// positions), then 1 (no shards) the same way while the replica of 3 runs, then 2 again
/// while the unsharded one runs. Each count after the first resumes by a relist-diff against the positions the
/// last count wrote: the changes made during the handover arrive, deletes included, and the
/// objects that did not change are not sent again (no snapshot).
#[tokio::test(flavor = "multi_thread")]
async fn changing_the_shard_count_resumes_from_the_old_positions_without_a_snapshot() {
    change_the_count(Store::Kafka).await;
}

/// The same with the positions in a NATS key-value bucket (read by key, not in one pass).
#[tokio::test(flavor = "multi_thread")]
async fn changing_the_shard_count_resumes_from_the_nats_bucket() {
    change_the_count(Store::Nats).await;
}

#[derive(Clone, Copy)]
enum Store {
    Kafka,
    Nats,
}

async fn change_the_count(store: Store) {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards-count").await;
    let state = common::unique("shards-state");
    let lease = common::unique("lease");
    // The positions in Kafka (as `sharded` says) or NATS.
    let sharded = |ns: &str, lease: &str, n: u32, state: &str| {
        let (config, kafka) = sharded(ns, lease, n, state);
        let checkpoint = match store {
            Store::Kafka => kafka,
            Store::Nats => format!(
                "store = \"nats\"\nflush_interval_ms = 200\n[checkpoint.nats]\nurl = \"{}\"\nbucket = \"{state}\"\n",
                common::env_var("NATS_URL")
            ),
        };
        (config, checkpoint)
    };
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    for i in 0..6 {
        create_cm(&client, &ns.name, &format!("static-{i}"), json!({}), json!({"v": "1"})).await;
    }
    let (two, checkpoint) = sharded(&ns.name, &lease, 2, &state);
    let mut a = Kubecast::start_with_checkpoint(&two, &checkpoint, &[]);
    a.wait_log("list complete", 2).await;
    create_cm(&client, &ns.name, "x", json!({}), json!({"v": "1"})).await;
    wait_change(&mut a, &ns.name, "x", "added", None).await;
    let deadline = Instant::now() + WAIT;
    while a.state_list().as_array().map_or(0, Vec::len) < 2 {
        assert!(Instant::now() < deadline, "both shards' positions written:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A replica of 3 joins while the one of 2 runs.
    let (three, _) = sharded(&ns.name, &lease, 3, &state);
    let mut b = Kubecast::start_with_checkpoint(&three, &checkpoint, &[]);
    a.wait_log("giving every shard up: another shard count takes over", 1).await;
    a.wait_ready_reason("the shard count is changing").await;
    // Changes during the handover.
    api.patch("x", &PatchParams::default(), &Patch::Merge(&json!({"data": {"v": "2"}}))).await.unwrap();
    create_cm(&client, &ns.name, "y", json!({}), json!({"v": "1"})).await;
    api.delete("static-0", &DeleteParams::default()).await.unwrap();
    let spread = wait_spread(&mut [&mut a, &mut b], 3, &[0, 3], "3 shards on the new replica").await;
    assert!(spread[0].is_empty(), "the 2-shard replica holds nothing: {spread:?}");
    wait_change(&mut b, &ns.name, "x", "modified", Some("2")).await;
    wait_change(&mut b, &ns.name, "y", "added", None).await;
    wait_change(&mut b, &ns.name, "static-0", "deleted", None).await;
    assert!(b.log().contains("resuming from its positions"), "{}", b.log());
    for i in 1..6 {
        let s = format!("{}/static-{i}", ns.name);
        assert!(
            common::about(&b.events(), &s).is_empty(),
            "static-{i} did not change: not sent again\n{}",
            common::pretty(&b.events())
        );
    }
    assert!(a.stop().success(), "{}", a.log());

    // Back to no shards, from the 3 shards' positions, while the replica of 3 runs (pods
    // rolled without the chart's `Recreate`): the unsharded replica takes part in the group
    // too. It waits for the 3 shards' Leases; the replica of 3 gives them up.
    let unsharded = common::lease_cm_config(&ns.name, &lease);
    let mut c = Kubecast::start_with_checkpoint(&unsharded, &checkpoint, &[]);
    c.wait_log("not taking the lease: the shard count is changing", 1).await;
    b.wait_log("giving every shard up: another shard count takes over", 1).await;
    api.patch("static-1", &PatchParams::default(), &Patch::Merge(&json!({"data": {"v": "2"}}))).await.unwrap();
    wait_change(&mut c, &ns.name, "static-1", "modified", Some("2")).await;
    assert!(held(&mut b).await.is_empty(), "the replica of 3 holds nothing once the unsharded one runs");
    b.wait_ready_reason("the shard count is changing").await;
    create_cm(&client, &ns.name, "z", json!({}), json!({"v": "1"})).await;
    wait_change(&mut c, &ns.name, "z", "added", None).await;
    for name in ["x", "y", "static-2", "static-3"] {
        let s = format!("{}/{name}", ns.name);
        assert!(
            common::about(&c.events(), &s).is_empty(),
            "{name} did not change: not sent again\n{}",
            common::pretty(&c.events())
        );
    }
    assert!(b.stop().success(), "{}", b.log());

    // And from no shards to 2, the unsharded replica running: it gives its Lease up (drained,
    // its positions written) and stands aside, not ready; the new one resumes from there.
    let (two, _) = sharded(&ns.name, &lease, 2, &state);
    let mut d = Kubecast::start_with_checkpoint(&two, &checkpoint, &[]);
    c.wait_log("giving the lease up: another shard count takes over", 1).await;
    api.patch("static-2", &PatchParams::default(), &Patch::Merge(&json!({"data": {"v": "2"}}))).await.unwrap();
    wait_spread(&mut [&mut d], 2, &[2], "2 shards on the new replica").await;
    wait_change(&mut d, &ns.name, "static-2", "modified", Some("2")).await;
    c.wait_ready_reason("the shard count is changing").await;
    assert!(c.exited().is_none(), "the replica without shards stands aside until stopped:\n{}", c.log());
    assert!(d.log().contains("resuming from its positions"), "{}", d.log());
    for name in ["z", "static-3", "static-4"] {
        let s = format!("{}/{name}", ns.name);
        assert!(
            common::about(&d.events(), &s).is_empty(),
            "{name} did not change: not sent again\n{}",
            common::pretty(&d.events())
        );
    }
    assert!(c.stop().success(), "{}", c.log());
    assert!(d.stop().success(), "{}", d.log());
}

/// `kubecast state reset` and `import` keep unsharded state: with shards they refuse, naming
/// the procedure (no server needed: refused before connecting).
#[test]
fn state_reset_and_import_refuse_sharded_configs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubecast.toml");
    let (config, checkpoint) = (
        "[coordination]\nenabled = true\nshards = 4\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n",
        "[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"127.0.0.1:1\"\n",
    );
    std::fs::write(&path, format!("{config}{checkpoint}")).unwrap();
    for args in [&["reset", "x", "--to", "now"][..], &["import", "/nonexistent.json"][..]] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kubecast"))
            .args(["state", "--config"])
            .arg(&path)
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("[coordination] shards = 4") && err.contains("docs/sharding.md"), "{args:?}: {err}");
    }
}

/// The shard count changed twice under load, 2 replicas each time, exactly-once: every change
/// once for a read_committed consumer, and no object listed twice.
#[tokio::test(flavor = "multi_thread")]
async fn changing_the_shard_count_under_load_exactly_once() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards-load").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let (topic, state, lease) =
        (common::unique("shards-events"), common::unique("shards-state"), common::unique("lease"));
    let sink = kafka_sink(&topic, true);
    let source =
        Source::Kafka { brokers: common::env_var("KAFKA_BROKERS"), topic: topic.clone(), read_committed: true };
    let mut traffic = None;
    for count in [2u32, 4, 3] {
        let (config, checkpoint) = sharded(&ns.name, &lease, count, &state);
        let mut a = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
        let mut b = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
        let half = count as usize / 2;
        wait_spread(&mut [&mut a, &mut b], count as usize, &[half, count as usize - half], "2 replicas").await;
        for kc in [&mut a, &mut b] {
            kc.wait_ready(200).await;
        }
        let t = match traffic.take() {
            None => Traffic::start(&api, source.clone(), 20, 50),
            Some(t) => t,
        };
        assert!(t.flowing(100, WAIT).await, "events flow with {count} shards\n{}\n{}", a.log(), b.log());
        traffic = Some(t);
        assert!(a.stop().success(), "{}", a.log());
        assert!(b.stop().success(), "{}", b.log());
    }
    // The last count again, to deliver what changed after the last stop.
    let (config, checkpoint) = sharded(&ns.name, &lease, 3, &state);
    let mut a = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    wait_spread(&mut [&mut a], 3, &[3], "1 replica").await;
    let verdict = traffic.unwrap().finish(Delivery::ExactlyOnce, WAIT).await;
    println!(
        "shards 2 -> 4 -> 3: {} changes, {} events, {} duplicates",
        verdict.written.count(),
        verdict.seen,
        verdict.duplicates
    );
    assert!(a.stop().success(), "{}", a.log());
}

/// Restarts the sharded apiserver with the gate on when dropped.
struct GateBack;

impl Drop for GateBack {
    fn drop(&mut self) {
        restart_sharded_apiserver(true);
    }
}

/// Restarts the apiserver of `tests/env/sharded` (etcd kept), with the `ShardedListAndWatch`
/// gate on or off.
fn restart_sharded_apiserver(gate: bool) {
    let script = common::env::repo_root().join("tests/env/sharded");
    let out = std::process::Command::new(&script)
        .arg("restart")
        .env("KUBECAST_ENV_SHARDED_GATE", gate.to_string())
        // Without the gate, watches are served from etcd (no watch cache): a watch resumed on
        // the restarted apiserver goes on from where it was, as on another apiserver of a
        // control plane, instead of a 410 Gone and a new list.
        .env("KUBECAST_ENV_WATCH_CACHE", gate.to_string())
        .output()
        .expect("run tests/env/sharded restart");
    assert!(out.status.success(), "tests/env/sharded restart: {}", String::from_utf8_lossy(&out.stderr));
}

/// Skew: a shard's list was filtered by the apiserver (it echoed the selector), then the
/// apiserver comes back without the `ShardedListAndWatch` gate (a control plane rolling the
/// gate back, or a watch that lands on an apiserver without it), so the watch sends every
/// object. Each stream sees an object of another shard after a filtered list: it stops
/// sending the selector, lists again (diffed: no object taken for deleted, none sent twice),
/// and filters on its own side. Every change arrives once, before and after; a warning, no
/// error, and the metric counts it.
#[tokio::test(flavor = "multi_thread")]
async fn a_watch_on_an_apiserver_without_the_gate_after_a_filtered_list_loses_nothing() {
    let _one = SHARDED_APISERVER.lock().await;
    let kubeconfig = common::sharded_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "shards-skew").await;
    for i in 0..12 {
        create_cm(&client, &ns.name, &format!("before-{i}"), json!({}), json!({"v": "1"})).await;
    }
    let (config, checkpoint) = sharded(&ns.name, &common::unique("lease"), 2, &common::unique("shards-state"));
    // Leases that outlast the apiserver's restart: the streams go on through it. The restart
    // takes 5 s on an idle machine and has taken 40 s beside the other tests of this file;
    // a shard whose renew deadline passed would start again from its position, on the
    // apiserver without the gate, and never see the skew this test is about.
    let config = config.replace(
        "lease_duration_seconds = 4\nrenew_deadline_seconds = 2\n",
        "lease_duration_seconds = 600\nrenew_deadline_seconds = 400\n",
    );
    assert!(config.contains("renew_deadline_seconds = 400"), "{config}");
    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let mut kc = Kubecast::start_with_checkpoint(&config, &checkpoint, &env);
    kc.wait_log("the apiserver applies the shard selector", 2).await;
    kc.wait_for("the objects listed", WAIT, |e| e.len() >= 12).await;

    restart_sharded_apiserver(false);
    // The gate on again when the test ends, whatever its outcome: the other tests need it.
    let _gate_back = GateBack;
    // The watches come back on the apiserver without the gate; new objects of both shards.
    let client = common::client_for(&kubeconfig).await;
    for i in 0..12 {
        create_cm(&client, &ns.name, &format!("after-{i}"), json!({}), json!({"v": "1"})).await;
    }
    kc.wait_log("sent an object of another shard", 2).await;
    kc.wait_for("every object once", WAIT, |e| e.len() >= 24).await;
    // Settled: the relists are done and diffed.
    kc.wait_log("list complete", 4).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let events = kc.events();
    let mut added: Vec<String> = events
        .iter()
        .filter(|e| common::verb(e) == "added")
        .map(|e| e["subject"].as_str().unwrap().to_string())
        .collect();
    added.sort();
    let mut want: Vec<String> =
        (0..12).flat_map(|i| [format!("{}/before-{i}", ns.name), format!("{}/after-{i}", ns.name)]).collect();
    want.sort();
    let ours: Vec<&String> = added.iter().filter(|s| s.contains("/before-") || s.contains("/after-")).collect();
    assert_eq!(ours, want.iter().collect::<Vec<_>>(), "each object added once:\n{}", kc.log());
    assert!(!events.iter().any(|e| common::verb(e) == "deleted"), "no live object taken for deleted: {events:?}");
    let (_, metrics) = kc.admin_get("/metrics").await;
    let dropped = metric_sum(&metrics, "kubecast_shard_selector_dropped_total");
    assert!(dropped >= 2.0, "each shard's stream counted it:\n{metrics}");
    assert!(!kc.log().lines().any(|l| l.contains(" ERROR ")), "a warning, not an error:\n{}", kc.log());
    assert!(kc.stop().success(), "{}", kc.log());
}

/// A memory limit on one process: a cgroup (v1 memory controller, as on this machine) of its
/// own; removed when dropped (its process gone by then, or moved back to the root first).
struct MemoryLimit {
    dir: std::path::PathBuf,
}

impl MemoryLimit {
    const ROOT: &'static str = "/sys/fs/cgroup/memory";

    fn on(pid: u32, bytes: u64) -> Self {
        let root = std::path::Path::new(Self::ROOT);
        assert!(
            root.join("memory.limit_in_bytes").exists(),
            "{}: no cgroup v1 memory controller here (this test runs as root on a machine with one)",
            Self::ROOT
        );
        let dir = root.join(common::unique("kubecast-test"));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        std::fs::write(dir.join("memory.limit_in_bytes"), bytes.to_string()).unwrap();
        std::fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        Self { dir }
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap_or_default()
    }

    /// The most the group ever used, in bytes.
    fn peak(&self) -> u64 {
        self.read("memory.max_usage_in_bytes").trim().parse().unwrap_or(0)
    }

    /// Processes of the group the kernel killed for its limit.
    fn oom_kills(&self) -> u64 {
        self.read("memory.oom_control")
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryLimit {
    fn drop(&mut self) {
        for pid in self.read("cgroup.procs").lines() {
            let _ = std::fs::write(std::path::Path::new(Self::ROOT).join("cgroup.procs"), pid);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `kubecast_queue_depth` of a replica: the events its shards' queues hold together.
async fn queue_depth(kc: &mut Kubecast) -> f64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    let line = metrics.lines().find(|l| l.starts_with("kubecast_queue_depth ")).expect("kubecast_queue_depth");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Four shards land on one replica while the sink is away (the HTTP receiver stopped), under a
/// steady load of ~100 KiB ConfigMaps. The queue and in-flight bounds are the process's,
/// shared by its shards: the replica's queues together hold at most `queue_capacity` (200)
/// events (one more per shard that arrived while the others held it all), as one unsharded
/// process would; before, each shard held that much, four times one shard's worth. The
/// replica runs under a memory limit that one shard's worth fits and four shards' worth would
/// not, and is never killed for it. Once the receiver is back, every change arrives, in order
/// per object.
#[tokio::test(flavor = "multi_thread")]
async fn four_shards_on_one_replica_during_an_outage_hold_one_replicas_worth() {
    const CAPACITY: usize = 200;
    const PAD: usize = 128 * 1024;
    // Measured: 72 MiB at the peak with 100 KiB objects (the process's base, four shards'
    // state clients, the HTTP sink, and ~(200 + 4 x 2 x 16) held events); four shards'
    // worth of queues and stages, what the load below writes meanwhile (1000 x 128 KiB),
    // would not fit.
    const LIMIT: u64 = 128 * 1024 * 1024;
    let client = client().await;
    let ns = TestNamespace::new(&client, "shards-bounds").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    // The positions in NATS: nothing of this test waits on Kafka.
    let (config, _) = sharded(&ns.name, &common::unique("lease"), 4, "unused");
    let checkpoint = format!(
        "store = \"nats\"\nflush_interval_ms = 200\n[checkpoint.nats]\nurl = \"{}\"\nbucket = \"{}\"\n",
        common::env_var("NATS_URL"),
        common::unique("bounds-state")
    );
    let config =
        format!("{config}[delivery]\nqueue_capacity = {CAPACITY}\nmax_in_flight = 20\nbackoff_max_ms = 1000\n");
    let mut receiver = common::receiver::Receiver::start(&[]);
    let sink = format!("[sink]\ntype = \"http\"\n[sink.http]\nurl = \"{}\"\n", receiver.url());
    let mut a = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    let limit = MemoryLimit::on(a.pid().expect("running"), LIMIT);
    let mut b = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    wait_spread(&mut [&mut a, &mut b], 4, &[2, 2], "2 replicas").await;
    let deadline = Instant::now() + WAIT;
    while [&a, &b].iter().map(|k| k.log().matches("list complete").count()).sum::<usize>() < 4 {
        assert!(Instant::now() < deadline, "not every shard listed:\n{}\n{}", a.log(), b.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let source = Source::HttpLog { path: receiver.log.clone() };
    let traffic = Traffic::start_padded(&api, source, 300, 50, PAD);
    assert!(traffic.flowing(50, WAIT).await, "events flow");

    // The outage; then one replica is gone and the other takes every shard.
    receiver.stop();
    b.kill9();
    wait_spread(&mut [&mut a], 4, &[4], "after the kill").await;
    // Until the load wrote one shard's worth (a queue of 200 and its stages) for each of the
    // four: what the replica holds is sampled meanwhile.
    let (start, mut deepest) = (traffic.written().count(), 0.0f64);
    let deadline = Instant::now() + WAIT;
    while traffic.written().count() < start + 4 * (CAPACITY + 2 * CAPACITY / 8) {
        assert!(
            a.exited().is_none(),
            "the replica exited (memory limit: {} OOM kills)\n{}",
            limit.oom_kills(),
            a.log()
        );
        assert!(Instant::now() < deadline, "the load wrote {} changes", traffic.written().count() - start);
        deepest = deepest.max(queue_depth(&mut a).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "during the outage: at most {deepest} events held in the queues of 4 shards (queue_capacity {CAPACITY}); memory peak {} MiB of {} MiB",
        limit.peak() / (1 << 20),
        LIMIT / (1 << 20)
    );
    assert!(deepest <= (CAPACITY + 4) as f64, "the shards' queues together held {deepest} events");
    assert!(deepest >= (CAPACITY * 9 / 10) as f64, "the queues never filled ({deepest} held): nothing was tested");

    receiver.restart();
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    assert!(verdict.written.count() > 1000, "a steady load: {} changes", verdict.written.count());
    println!("{} changes, {} events read, {} duplicates", verdict.written.count(), verdict.seen, verdict.duplicates);
    assert_eq!(limit.oom_kills(), 0, "killed for the memory limit");
    assert!(a.stop().success(), "{}", a.log());
}
