//! `[coordination]`: two processes on one Lease, exactly one publishes; the standby takes over
//! when the leader dies or is paused past the lease, and a paused leader that wakes up stops;
//! a clean stop hands over at once (the standby watches the Lease).

use kubecast_kit as common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, about, client, create_cm};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use rdkafka::message::Message;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const GRACE: Duration = Duration::from_secs(2);

#[tokio::test]
async fn one_of_two_publishes_and_the_standby_takes_over_when_the_leader_dies() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "lease").await;
    let cfg = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let mut a = Kubecast::start(&cfg);
    a.wait_log("holding the lease", 1).await;
    let mut b = Kubecast::start(&cfg);
    // A standby is ready (it must not hold up rollouts) and says it stands by.
    b.wait_log("standby: another process holds the lease", 1).await;
    let (status, body) = b.admin_get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("standby: lease") && body.contains(&format!("{}/", ns.name)) && body.contains("held by"),
        "{body}"
    );
    let (_, metrics) = b.admin_get("/metrics").await;
    assert!(metrics.lines().any(|l| l == "kubecast_leader 0"), "{metrics}");

    create_cm(&client, &ns.name, "x", json!({}), json!({"v": "1"})).await;
    let x = format!("{}/x", ns.name);
    a.wait_for("x from the leader", WAIT, |e| !about(e, &x).is_empty()).await;
    tokio::time::sleep(GRACE).await;
    assert!(b.events().is_empty(), "the standby published:\n{}", common::pretty(&b.events()));

    let killed = Instant::now();
    a.kill9();
    b.wait_log("holding the lease", 1).await;
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(4 + 2 + 2), "takeover after {took:?}: about one lease duration");
    // No checkpoint of its own: its first list emits x; then it watches.
    b.wait_for("x from the new leader", WAIT, |e| !about(e, &x).is_empty()).await;
    create_cm(&client, &ns.name, "y", json!({}), json!({"v": "1"})).await;
    let y = format!("{}/y", ns.name);
    b.wait_for("y from the new leader", WAIT, |e| !about(e, &y).is_empty()).await;
    b.wait_ready(200).await;
    let (_, metrics) = b.admin_get("/metrics").await;
    assert!(metrics.lines().any(|l| l == "kubecast_leader 1"), "{metrics}");
    assert!(metrics.lines().any(|l| l == "kubecast_lease_epoch 1"), "one takeover: {metrics}");
    assert!(b.stop().success(), "{}", b.log());
    // The new leader sent x once, from its first list, and y once, from its watch.
    let evs = b.events();
    let (xs, ys) = (about(&evs, &x), about(&evs, &y));
    assert_eq!((xs.len(), ys.len()), (1, 1), "{}", common::pretty(&evs));
    assert_eq!((&xs[0]["origin"], &ys[0]["origin"]), (&json!("snapshot"), &json!("watch")), "{}", common::pretty(&evs));
}

/// A leader paused past its lease (SIGSTOP) is replaced; when it wakes up (SIGCONT) it finds
/// the lease held by the other and stops at once, having published at most the changes it
/// read before it noticed (as the README says: what it had read from its watch within one
/// retry period, with their usual ids).
#[tokio::test]
async fn a_paused_leader_that_wakes_up_stops_and_publishes_at_most_what_it_read_meanwhile() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "lease-pause").await;
    let cfg = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let mut a = Kubecast::start(&cfg);
    a.wait_log("holding the lease", 1).await;
    a.wait_ready(200).await;
    let mut b = Kubecast::start(&cfg);
    b.wait_log("standby: another process holds the lease", 1).await;

    a.signal("STOP");
    b.wait_log("holding the lease", 1).await;
    create_cm(&client, &ns.name, "z", json!({}), json!({"v": "1"})).await;
    let z = format!("{}/z", ns.name);
    b.wait_for("z from the new leader", WAIT, |e| !about(e, &z).is_empty()).await;
    let before = a.events().len();

    a.signal("CONT");
    let status = a.wait_exit(Duration::from_secs(3 + 5)).await;
    assert!(!status.success(), "a leader that lost its lease exits with an error");
    let log = a.log();
    assert!(log.contains("lost the lease"), "{log}");
    let after: Vec<_> = a.events()[before..].to_vec();
    assert!(
        after.iter().all(|e| e["subject"] == z.as_str()),
        "after losing the lease it published only what it had read meanwhile:\n{}",
        common::pretty(&after)
    );
    assert!(b.stop().success(), "{}", b.log());
}

/// A record of the handover test: its Kafka timestamp (set by the producer when kubecast
/// handed it over) and the ConfigMap's `data.v`.
#[derive(Debug, Clone, Copy)]
struct Published {
    at_ms: i64,
    v: u64,
}

/// Every record about the ConfigMap `steady` in `topic` up to its end when called (none while
/// the topic does not exist): read up to the high watermarks, since records keep arriving.
fn read_topic(topic: &str) -> Vec<Published> {
    let mut out = Vec::new();
    for m in common::topic::read_if_any(topic, false) {
        let cm: Value = serde_json::from_slice(m.payload().expect("a payload")).expect("JSON");
        if cm["metadata"]["name"] != "steady" {
            continue; // kube-root-ca.crt
        }
        let v = cm["data"]["v"].as_str().unwrap_or_else(|| panic!("no data.v in {cm}")).parse().unwrap();
        out.push(Published { at_ms: m.timestamp().to_millis().expect("a timestamp"), v });
    }
    out
}

/// The records of `topic` once `done` holds for them (read again every 200 ms, bounded).
async fn wait_records(topic: &str, what: &str, done: impl Fn(&[Published]) -> bool) -> Vec<Published> {
    let deadline = Instant::now() + WAIT;
    loop {
        let t = topic.to_string();
        let got = tokio::task::spawn_blocking(move || read_topic(&t)).await.unwrap();
        if done(&got) {
            return got;
        }
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The time (ms since the epoch) of the first log line containing `needle`.
fn log_time(log: &str, needle: &str) -> Option<i64> {
    let line = log.lines().find(|l| l.contains(needle))?;
    let stamp = line.split_whitespace().next()?;
    Some(chrono::DateTime::parse_from_rfc3339(stamp).ok()?.timestamp_millis())
}

/// A clean handover under a steady stream of changes (one every 50 ms), with the Kafka sink
/// and the Kafka store and the default timings (retry period 2 s): the leader gets SIGTERM,
/// drains, writes its final checkpoint and gives the Lease up; the standby, watching the
/// Lease, takes it and resumes from that checkpoint. To tell the two publishers apart, each
/// writes its own topic (the state, the Lease and the transactional.id are shared). Nothing is
/// lost, and the old leader's last record comes before the new one's first. The gap between
/// them is printed (a figure for the README, not asserted).
#[tokio::test(flavor = "multi_thread")]
async fn a_clean_stop_hands_the_lease_over_at_once_losing_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "lease-handover").await;
    let id = common::unique("handover").replace('_', "-");
    let config = common::cm_config(
        &ns.name,
        &format!("[coordination]\nenabled = true\nlease_name = \"{id}\"\nlease_namespace = \"{}\"\n", ns.name),
    );
    let checkpoint =
        format!("store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{id}.state\"\n");
    let sink = |who: &str| {
        format!(
            "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{id}.{who}\"\n[delivery]\nshutdown_timeout_seconds = 10\n",
            common::env_var("KAFKA_BROKERS")
        )
    };
    let (topic_a, topic_b) = (format!("{id}.a"), format!("{id}.b"));
    create_cm(&client, &ns.name, "steady", json!({}), json!({"v": "0"})).await;
    let mut a = Kubecast::start_with_sink(&config, &sink("a"), &checkpoint, &[]);
    a.wait_log("holding the lease", 1).await;
    a.wait_ready(200).await;
    let mut b = Kubecast::start_with_sink(&config, &sink("b"), &checkpoint, &[]);
    b.wait_log("standby: another process holds the lease", 1).await;

    // The steady stream: v = 1, 2, ... every 50 ms until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let writer = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut v = 0u64;
            while !stop.load(Ordering::Relaxed) && v < 2000 {
                v += 1;
                let patch = json!({"data": {"v": v.to_string()}});
                api.patch("steady", &PatchParams::default(), &Patch::Merge(&patch)).await.expect("patch");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            v
        }
    });
    wait_records(&topic_a, "20 changes from the leader", |r| r.len() >= 20).await;

    let term = Instant::now();
    let status = a.stop_within(WAIT).await.expect("the leader stops");
    let stopped = term.elapsed();
    assert!(status.success(), "a clean stop:\n{}", a.log());
    wait_records(&topic_b, "changes from the new leader", |r| r.len() >= 20).await;
    stop.store(true, Ordering::Relaxed);
    let last = writer.await.unwrap();
    let from_b = wait_records(&topic_b, "the last change", |r| r.iter().any(|p| p.v == last)).await;
    let from_a = tokio::task::spawn_blocking(move || read_topic(&topic_a)).await.unwrap();

    let seen: BTreeSet<u64> = from_a.iter().chain(&from_b).map(|p| p.v).collect();
    let lost: Vec<u64> = (0..=last).filter(|v| !seen.contains(v)).collect();
    assert!(lost.is_empty(), "changes lost in the handover: {lost:?}");
    let a_last = from_a.iter().map(|p| p.at_ms).max().unwrap();
    let b_first = from_b.iter().map(|p| p.at_ms).min().unwrap();
    assert!(
        a_last <= b_first,
        "two publishers at once: the old leader's last record at {a_last}, the new one's first at {b_first}"
    );
    let a_vs: BTreeSet<u64> = from_a.iter().map(|p| p.v).collect();
    let again = from_b.iter().filter(|p| a_vs.contains(&p.v)).count();
    // Where the time goes, from the logs' timestamps (ms after the old leader's last record).
    let after =
        |log: &str, needle: &str| log_time(log, needle).map_or_else(|| "?".to_string(), |t| format!("{}", t - a_last));
    let (a_log, b_log) = (a.log(), b.log());
    eprintln!(
        "handover: {} ms between the old leader's last record and the new leader's first (SIGTERM to exit of the old leader: {} ms; {} changes, {} sent again by the new leader); after the last record: final checkpoint {} ms, lease taken {} ms, state read {} ms, streams started {} ms",
        b_first - a_last,
        stopped.as_millis(),
        last,
        again,
        after(&a_log, "final checkpoints written"),
        after(&b_log, "holding the lease"),
        after(&b_log, "Kafka state topic read"),
        after(&b_log, "kubecast running"),
    );
    assert!(b.stop().success(), "{}", b.log());

    // The Lease made anew (its namespace deleted, the release moved or renamed) while the state
    // stays: written under epoch 1 by the second holder. The next process creates the Lease
    // above that epoch and runs, instead of being refused by the store and restarting.
    let leases = Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), &ns.name);
    leases.delete(&id, &Default::default()).await.expect("delete the Lease");
    let mut c = Kubecast::start_with_sink(&config, &sink("c"), &checkpoint, &[]);
    c.wait_log("created the Lease above the highest epoch in the state store", 1).await;
    c.wait_ready(200).await;
    let transitions = leases.get(&id).await.unwrap().spec.unwrap().lease_transitions;
    assert_eq!(transitions, Some(2), "one above the stored epoch 1");
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let patch = json!({"data": {"v": (last + 1).to_string()}});
    api.patch("steady", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    let topic_c = format!("{id}.c");
    wait_records(&topic_c, "a change after the Lease was made anew", |r| r.iter().any(|p| p.v == last + 1)).await;
    assert!(c.exited().is_none(), "{}", c.log());
    assert!(c.stop().success(), "{}", c.log());
}

/// The Lease's renewTime as the apiserver has it, in milliseconds.
async fn renewed_ms(client: &kube::Client, ns: &str, name: &str) -> i64 {
    let lease =
        Api::<k8s_openapi::api::coordination::v1::Lease>::namespaced(client.clone(), ns).get(name).await.unwrap();
    lease.spec.and_then(|s| s.renew_time).expect("renewTime").0.as_millisecond()
}

/// The runtime's only worker blocked for twice the renew deadline (as a long synchronous
/// computation or a blocking call would hold it): the Lease is renewed all along, because its
/// keeper runs on a thread of its own with a client of its own, and the process still holds
/// it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn a_blocked_runtime_worker_does_not_hold_up_the_lease_renewals() {
    use kubecast::app::leadership::{Keepers, Tenure};
    use kubecast::coordination::lease::{Attempt, CoordinationConfig, Elector};
    use kubecast::source::client::ClusterConfig;
    use tokio_util::sync::CancellationToken;

    let client = client().await;
    let ns = TestNamespace::new(&client, "lease-thread").await;
    let cfg = CoordinationConfig {
        enabled: true,
        lease_name: "busy".into(),
        lease_namespace: Some(ns.name.clone()),
        identity: Some("busy-worker".into()),
        lease_duration_seconds: 4,
        renew_deadline_seconds: 3,
        retry_period_seconds: 1,
        ..Default::default()
    };
    let mut elector = Elector::new(client.clone(), &cfg);
    let Attempt::Held { epoch } = elector.try_acquire_or_renew().await.expect("lease taken") else {
        panic!("the new Lease is not held");
    };
    let cluster = ClusterConfig { kubeconfig: Some(common::kubeconfig().into()), ..Default::default() };
    let keepers = Keepers::start(&cluster).await.expect("the keepers' thread and client");
    let (stop, lost) = (CancellationToken::new(), CancellationToken::new());
    let tenure = Tenure::new(&cfg, lost.clone());
    let keeper = keepers.keep(elector, cfg.clone(), epoch, stop.clone(), tenure.clone());
    let before = renewed_ms(&client, &ns.name, "busy").await;
    // The test's own body runs beside the worker (`block_on`); a task runs on it.
    tokio::spawn(async { std::thread::sleep(Duration::from_secs(6)) }).await.unwrap();
    assert!(tenure.held(), "the Lease counts as held after the worker was blocked");
    assert!(!lost.is_cancelled() && !keeper.is_finished(), "the keeper reported the Lease lost");
    let after = renewed_ms(&client, &ns.name, "busy").await;
    assert!(after - before >= 4000, "renewTime moved {} ms while the worker was blocked 6 s", after - before);
    stop.cancel();
    keeper.await.expect("keeper task").expect("given up cleanly");
}

/// A Lease namespace that does not exist: not ready, the cause and the fix named (not the
/// permission's), nothing published; the Lease is taken once the namespace exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_lease_namespace_is_named_and_then_taken() {
    let client = common::client().await;
    let ns = common::TestNamespace::new(&client, "lease-nons").await;
    let lease_ns = common::unique("lease-later");
    let config = common::lease_cm_config(&ns.name, "kubecast")
        .replace(&format!("lease_namespace = \"{}\"", ns.name), &format!("lease_namespace = \"{lease_ns}\""));
    let mut kc = common::Kubecast::start(&config);
    kc.wait_ready_reason(&format!("create the namespace {lease_ns}")).await;
    let (_, body) = kc.admin_get("/readyz").await;
    assert!(!body.contains("grant get"), "not a permission: {body}");
    let later = common::create_namespace(&client, &lease_ns, &[]).await.expect("create the Lease's namespace");
    kc.wait_ready(200).await;
    kc.kill9();
    let _ = kube::Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .delete(&lease_ns, &Default::default())
        .await;
    drop(later);
}

/// A client for the test apiserver that counts its requests by method.
async fn counting_client() -> (kube::Client, Arc<std::sync::Mutex<std::collections::BTreeMap<String, usize>>>) {
    let counts = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::new()));
    let kc = kube::config::Kubeconfig::read_from(common::kubeconfig()).expect("read kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.expect("kubeconfig");
    let seen = counts.clone();
    let count = tower::util::MapRequestLayer::new(move |req: http::Request<kube::client::Body>| {
        *seen.lock().unwrap().entry(req.method().to_string()).or_insert(0) += 1;
        req
    });
    let client = kube::client::ClientBuilder::try_from(cfg).expect("client").with_layer(&count).build();
    (client, counts)
}

/// A holder renews its Lease, and a replica its member Lease, with one request each (no read
/// first); a Lease written by another holder meanwhile is never written over (the renewal is
/// conditional on the holder's own last write), and a Lease deleted meanwhile is made again.
#[tokio::test]
async fn a_holder_renews_in_one_request_and_never_over_another_holders_write() {
    use k8s_openapi::api::coordination::v1::Lease;
    use kubecast::coordination::lease::{Attempt, CoordinationConfig, Elector};
    use kubecast::coordination::members::Members;

    let admin = client().await;
    let ns = TestNamespace::new(&admin, "lease-renew").await;
    let (counted, counts) = counting_client().await;
    let cfg = CoordinationConfig {
        enabled: true,
        lease_name: "renew".into(),
        lease_namespace: Some(ns.name.clone()),
        identity: Some("holder-a".into()),
        lease_duration_seconds: 4,
        renew_deadline_seconds: 3,
        retry_period_seconds: 1,
        shards: 2,
    };
    let leases: Api<Lease> = Api::namespaced(admin.clone(), &ns.name);
    let renew_time = |l: &Lease| l.spec.as_ref().and_then(|s| s.renew_time.clone()).expect("renewTime").0;
    let holder = |l: &Lease| l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default();

    let mut a = Elector::new(counted.clone(), &cfg);
    assert_eq!(a.try_acquire_or_renew().await.expect("taken"), Attempt::Held { epoch: 0 });
    let mut last = renew_time(&leases.get("renew").await.unwrap());
    counts.lock().unwrap().clear();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(a.try_acquire_or_renew().await.expect("renewed"), Attempt::Held { epoch: 0 });
        let now = renew_time(&leases.get("renew").await.unwrap());
        assert!(now > last, "renewTime moved on");
        last = now;
    }
    assert_eq!(counts.lock().unwrap().clone(), [("PUT".to_string(), 3)].into(), "one write per renewal, no read");

    // Another process took the Lease over (as after an expiry): the holder's conditional write
    // fails, it reads the Lease and sees the other holder; the Lease stays the other's.
    let patch = json!({"spec": {"holderIdentity": "holder-b", "leaseTransitions": 1}});
    leases.patch("renew", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    assert_eq!(a.try_acquire_or_renew().await.expect("attempt"), Attempt::Other { holder: "holder-b".into() });
    let lease = leases.get("renew").await.unwrap();
    assert_eq!((holder(&lease), lease.spec.unwrap().lease_transitions), ("holder-b".into(), Some(1)));

    // A Lease deleted under its holder is made again by its next renewal.
    let mut c = Elector::new(counted.clone(), &CoordinationConfig { lease_name: "again".into(), ..cfg.clone() });
    assert_eq!(c.try_acquire_or_renew().await.expect("taken"), Attempt::Held { epoch: 0 });
    leases.delete("again", &Default::default()).await.unwrap();
    assert_eq!(c.try_acquire_or_renew().await.expect("made again"), Attempt::Held { epoch: 0 });
    assert_eq!(holder(&leases.get("again").await.unwrap()), c.identity());

    // A replica's member Lease: created once, then one write per heartbeat.
    let mut members = Members::new(counted.clone(), &cfg, cfg.identity());
    members.heartbeat().await.expect("member lease created");
    counts.lock().unwrap().clear();
    for _ in 0..3 {
        members.heartbeat().await.expect("member lease renewed");
    }
    assert_eq!(counts.lock().unwrap().clone(), [("PUT".to_string(), 3)].into(), "one write per heartbeat, no read");
    let group = members.list().await.expect("the group");
    assert!(group.members.contains(&cfg.identity()), "the renewed member is live: {:?}", group.members);
}
