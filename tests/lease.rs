//! `[coordination]`: two processes on one Lease, exactly one publishes; the standby takes over
//! when the leader dies or is paused past the lease, and a paused leader that wakes up stops.

use kubecast_kit as common;

use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, about, client, create_cm};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);
const GRACE: Duration = Duration::from_secs(2);

fn has(kc: &Kubecast, subject: &str) -> bool {
    !about(&kc.events(), subject).is_empty()
}

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
    assert!(!has(&a, &y), "the dead leader published nothing more");
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
