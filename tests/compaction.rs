//! 410 Gone: resource versions that expired. Against the compacting apiserver (watch cache off,
//! etcd compacted every 5 s) for relist-diff after a restart and while running, and against
//! the default apiserver (watch cache on: it sends bookmarks) for quiet filtered streams.

use kubecast_kit as common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, about, cm_config, create_cms, hundred_changes, names, verb, wait_until_expired};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

fn checkpoint_rv(kc: &Kubecast) -> Option<String> {
    let cps = kc.checkpoints();
    cps.first().and_then(|c| c["resource_version"].as_str().map(String::from))
}

/// Asserts that `after` holds exactly the expected changes (repeats only with the same id),
/// nothing for `untouched`, and returns them.
fn assert_exact_changes(
    after: &[Value],
    expected: &BTreeSet<String>,
    deleted: &BTreeSet<String>,
    ns: &str,
    untouched: &[String],
) {
    let got: BTreeSet<String> =
        after.iter().filter(|e| verb(e) != "deleted").map(|e| e["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(&got, expected, "added/modified after the gap:\n{}", common::pretty(after));
    let got_deleted: BTreeSet<String> = after
        .iter()
        .filter(|e| verb(e) == "deleted")
        .map(|e| e["partitionkey"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(&got_deleted, deleted, "deletes made during the gap");
    for name in untouched {
        assert!(about(after, &format!("{ns}/{name}")).is_empty(), "unchanged {name} was emitted again");
    }
}

#[tokio::test]
async fn resume_after_compaction_relists_and_diffs_every_create_update_and_delete() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "gone").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let existing = create_cms(&client, &ns.name, &names("c", 0..60)).await;

    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let mut kc = Kubecast::start_with_checkpoint(&cm_config(&ns.name, ""), "flush_interval_ms = 100", &env);
    kc.wait_for("snapshot", WAIT, |e| e.len() == 60).await;
    common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let rv = checkpoint_rv(&kc).unwrap();
    let n_before = kc.events().len();
    kc.kill9();

    let (expected, deleted) = hundred_changes(&client, &ns.name, &existing).await;
    wait_until_expired(&api, &rv).await;

    kc.restart(&env);
    kc.wait_for("the resync", WAIT, |e| e.len() >= n_before + 100).await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let all = kc.events();
    let after = &common::without(&all[n_before..], &barrier);
    assert_eq!(after.len(), 100, "exactly the 100 changes:\n{}", common::pretty(after));
    assert!(after.iter().all(|e| e["origin"] == "resync"), "{}", common::pretty(after));
    assert_exact_changes(after, &expected, &deleted, &ns.name, &names("c", 50..60));
    // A resync delete carries the last known identity.
    let d = after.iter().find(|e| verb(e) == "deleted").unwrap();
    assert!(d["subject"].as_str().unwrap().starts_with(&format!("{}/c", ns.name)));
    assert_eq!(d["data"]["metadata"]["uid"], d["partitionkey"]);
    let log = kc.log();
    assert!(log.contains("410 Gone"), "{log}");
    assert!(
        log.contains("streaming lists not available") && log.contains("mode=\"paginated\""),
        "WatchList is off on this apiserver: fallback to paginated lists\n{log}"
    );
    assert!(kc.stop().success());

    // And the checkpoint now resumes cleanly: a restart emits nothing.
    let n = kc.events().len();
    kc.restart(&env);
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let again = common::without(&kc.events()[n..], &barrier);
    assert!(again.is_empty(), "nothing re-emitted after the resync was checkpointed:\n{}", common::pretty(&again));
    assert!(kc.stop().success());
}

#[tokio::test]
async fn a_410_while_running_relists_and_diffs_without_duplicating_unchanged_objects() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "gone-live").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let existing = create_cms(&client, &ns.name, &names("c", 0..60)).await;

    let env = [("KUBECONFIG", kubeconfig.as_str())];
    // Short server-side watch timeout: the watch ends while kubecast is frozen.
    let mut kc = Kubecast::start_with(&cm_config(&ns.name, "watch_timeout_seconds = 2"), &env);
    kc.wait_for("snapshot", WAIT, |e| e.len() == 60).await;
    let last = api.patch("c59", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "seen"}}))).await.unwrap();
    let last_rv = last.metadata.resource_version.unwrap();
    kc.wait_for("c59 modified", WAIT, |e| e.len() == 61).await;

    kc.signal("STOP");
    tokio::time::sleep(Duration::from_secs(4)).await; // the frozen watch times out server-side
    let (expected, deleted) = hundred_changes(&client, &ns.name, &existing).await;
    wait_until_expired(&api, &last_rv).await;
    kc.signal("CONT");

    kc.wait_for("the resync", WAIT, |e| e.len() >= 161).await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let all = kc.events();
    let after = &common::without(&all[61..], &barrier);
    assert_eq!(after.len(), 100, "exactly the 100 changes:\n{}", common::pretty(after));
    assert!(after.iter().all(|e| e["origin"] == "resync"), "{}", common::pretty(after));
    let mut untouched = names("c", 50..59);
    untouched.push("c59".into());
    assert_exact_changes(after, &expected, &deleted, &ns.name, &untouched);
    assert!(kc.log().contains("410 Gone"), "{}", kc.log());
    assert!(kc.stop().success());
}

/// A stream whose selector matches nothing, on a resource that keeps changing elsewhere, lives
/// longer than the apiserver's history of its list's resourceVersion; bookmarks keep moving its
/// checkpoint, so a restart resumes without a relist. (Default apiserver: with its watch cache
/// on, it sends a bookmark about every minute; the cache keeps ~75 s of history.)
#[tokio::test]
async fn a_quiet_filtered_stream_keeps_its_checkpoint_fresh_through_bookmarks() {
    let client = common::client().await;
    let quiet = TestNamespace::new(&client, "quiet").await;
    let busy = TestNamespace::new(&client, "busy").await;
    let mut kc = Kubecast::start_with_checkpoint(
        &format!(
            "[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\nlabel_selector = \"never=matches\"\n",
            quiet.name
        ),
        "flush_interval_ms = 100",
        &[],
    );
    let deadline = Instant::now() + WAIT;
    while checkpoint_rv(&kc).is_none() {
        assert!(Instant::now() < deadline, "no checkpoint\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let list_rv = checkpoint_rv(&kc).unwrap();

    // Churn on the same resource elsewhere until the list's resourceVersion is out of the
    // watch cache's history (and the stream has had time for bookmarks).
    let busy_api = Api::<ConfigMap>::namespaced(client.clone(), &busy.name);
    create_cms(&client, &busy.name, &names("b", 0..20)).await;
    let quiet_api = Api::<ConfigMap>::namespaced(client.clone(), &quiet.name);
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut round = 0u64;
    loop {
        for name in names("b", 0..20) {
            busy_api
                .patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"r": round.to_string()}})))
                .await
                .unwrap();
        }
        round += 1;
        let expired = {
            match quiet_api.watch(&WatchParams::default().timeout(1), &list_rv).await {
                Err(kube::Error::Api(s)) => s.code == 410,
                Err(e) => panic!("{e}"),
                Ok(s) => {
                    let mut s = std::pin::pin!(s);
                    matches!(s.try_next().await, Ok(Some(WatchEvent::Error(st))) if st.code == 410)
                }
            }
        };
        if expired && checkpoint_rv(&kc).as_deref() != Some(list_rv.as_str()) {
            break;
        }
        assert!(Instant::now() < deadline, "list rv never expired or no bookmark arrived\n{}", kc.log());
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    assert!(kc.events().is_empty(), "the filter drops everything");
    let bookmark_rv = checkpoint_rv(&kc).unwrap();
    assert_ne!(bookmark_rv, list_rv, "bookmarks moved the checkpoint");
    kc.kill9();
    kc.restart(&[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !kc.log().contains("resuming from checkpoint") {
        assert!(Instant::now() < deadline, "{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The barrier passes the selector: its event is the only one.
    let barrier = common::settle(&mut kc, &client, &quiet.name, json!({"never": "matches"})).await;
    let log = kc.log();
    assert!(!log.contains("relisting"), "resumed from the bookmark without a relist:\n{log}");
    let evs = kc.events();
    assert_eq!(evs.len(), 1, "{}", common::pretty(&evs));
    assert_eq!(evs[0]["subject"], barrier.as_str());
    assert!(kc.stop().success());
}

/// A stream resumed from a checkpoint whose resourceVersion expired is not ready before its
/// relist-diff is done, although its watch is accepted: on this apiserver (watch cache off)
/// the 410 comes as the first event of the watch. One apiserver request per second makes the
/// relist wait about a second for its turn: the window in which `/readyz` must stay 503.
#[tokio::test]
async fn a_resumed_stream_is_not_ready_until_its_relist_after_410_is_done() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "ready").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    create_cms(&client, &ns.name, &names("c", 0..5)).await;

    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let config = cm_config(&ns.name, "qps = 1\nburst = 1");
    let mut kc = Kubecast::start_with_checkpoint(&config, "flush_interval_ms = 100", &env);
    kc.wait_for("snapshot", WAIT, |e| e.len() == 5).await;
    kc.wait_ready(200).await;
    assert!(kc.stop().success());
    let rv = checkpoint_rv(&kc).expect("a checkpoint");
    let n_before = kc.events().len();
    let created = create_cms(&client, &ns.name, &names("n", 0..1)).await;
    wait_until_expired(&api, &rv).await;

    let lists_before = kc.log().matches("list complete").count();
    kc.restart(&env);
    let deadline = Instant::now() + WAIT;
    let mut not_ready_seen = 0;
    loop {
        let (status, body) = kc.admin_get("/readyz").await;
        let listed = kc.log().matches("list complete").count() > lists_before;
        if status == 200 {
            assert!(listed, "ready before the relist after 410 was done:\n{}", kc.log());
            break;
        }
        assert_eq!(status, 503, "{body}");
        not_ready_seen += 1;
        assert!(Instant::now() < deadline, "never ready again\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(not_ready_seen > 0, "not ready while resyncing");
    let log = kc.log();
    assert!(log.contains("410 Gone"), "the relist was caused by the expired resourceVersion\n{log}");
    let events = kc.wait_for("the resync", WAIT, |e| e.len() > n_before).await;
    let (uid, rv) = &created["n00"];
    assert!(
        events[n_before..].iter().any(|e| e["id"] == format!("{uid}:{rv}:added").as_str() && e["origin"] == "resync"),
        "{}",
        common::pretty(&events[n_before..])
    );
    assert!(kc.stop().success());
}

/// A delete delivered by the watch, then a crash before the checkpoint was written, then the
/// history compacted: the restart's relist-diff finds the object gone and emits its delete
/// again, from the last resourceVersion it knew. Consumers that drop duplicates by id must see
/// one delete: both carry the id `{uid}:deleted`.
#[tokio::test]
async fn a_delete_seen_by_the_watch_and_again_by_a_relist_has_one_id() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "delid").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let existing = create_cms(&client, &ns.name, &names("d", 0..2)).await;
    let env = [("KUBECONFIG", kubeconfig.as_str())];
    // No periodic write: only the one at shutdown.
    let mut kc = Kubecast::start_with_checkpoint(&cm_config(&ns.name, ""), "flush_interval_ms = 3600000", &env);
    kc.wait_for("snapshot", WAIT, |e| e.len() == 2).await;
    assert!(kc.stop().success(), "{}", kc.log());
    let rv = checkpoint_rv(&kc).expect("the final checkpoint");
    kc.restart(&env);
    kc.wait_log("resuming from checkpoint", 1).await;
    // Ready once the resumed watch is confirmed: the delete then comes as a watch event.
    kc.wait_ready(200).await;

    api.delete("d00", &DeleteParams::default()).await.unwrap();
    let subject = format!("{}/d00", ns.name);
    let evs =
        kc.wait_for("the watched delete", WAIT, |e| about(e, &subject).iter().any(|e| verb(e) == "deleted")).await;
    let watched = about(&evs, &subject).into_iter().find(|e| verb(e) == "deleted").unwrap().clone();
    assert_eq!(watched["origin"], "watch");
    kc.kill9(); // before any checkpoint write: the checkpoint still has d00
    assert_eq!(checkpoint_rv(&kc).as_deref(), Some(rv.as_str()));
    wait_until_expired(&api, &rv).await;

    let n_before = kc.events().len();
    kc.restart(&env);
    let evs = kc.wait_for("the resync delete", WAIT, |e| e[n_before..].iter().any(|e| verb(e) == "deleted")).await;
    let resynced = evs[n_before..].iter().find(|e| verb(e) == "deleted").unwrap();
    assert_eq!(resynced["origin"], "resync", "{}", common::pretty(&evs));
    let uid = &existing["d00"].0;
    assert_ne!(
        resynced["resourceversion"], watched["resourceversion"],
        "the two paths knew different resourceVersions (the test would prove nothing otherwise)"
    );
    assert_eq!(resynced["id"], watched["id"], "one delete, one id");
    assert_eq!(watched["id"], format!("{uid}:deleted").as_str());
    assert!(kc.stop().success(), "{}", kc.log());
}

/// A resync delete carries only the object's identity: a `filter` reading the object's data
/// must not drop it (it would be lost for good). Only `events` can exclude deletes.
#[tokio::test]
async fn a_resync_delete_is_not_dropped_by_a_filter_it_cannot_be_judged_by() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "rsfilter").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    common::create_cm(&client, &ns.name, "kept", json!({}), json!({"keep": "yes"})).await;
    common::create_cm(&client, &ns.name, "other", json!({}), json!({"keep": "no"})).await;
    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let config = format!("{}filter = \"has(object.data) && object.data.keep == 'yes'\"\n", cm_config(&ns.name, ""));
    let mut kc = Kubecast::start_with_checkpoint(&config, "", &env);
    kc.wait_for("the snapshot of kept", WAIT, |e| !e.is_empty()).await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let evs = common::without(&kc.events(), &barrier);
    assert_eq!(evs.len(), 1, "the filter passes only kept: {}", common::pretty(&evs));
    assert!(kc.stop().success(), "{}", kc.log());
    let rv = checkpoint_rv(&kc).expect("the final checkpoint");

    api.delete("kept", &DeleteParams::default()).await.unwrap();
    wait_until_expired(&api, &rv).await;
    kc.restart(&env);
    kc.wait_log("list complete", 2).await;
    let evs = kc.wait_for("the resync delete of kept", WAIT, |e| common::without(e, &barrier).len() >= 2).await;
    let evs = common::without(&evs, &barrier);
    let d = &evs[1];
    assert_eq!((verb(d), d["origin"].as_str()), ("deleted", Some("resync")), "{}", common::pretty(&evs));
    assert_eq!(d["subject"], format!("{}/kept", ns.name).as_str());
    assert!(d["data"].get("data").is_none(), "a tombstone: identity only");
    assert!(kc.stop().success(), "{}", kc.log());
}

/// A paginated list slower than the apiserver's compaction (40 objects, one per page, 2
/// requests per second: 20 s; etcd compacted every 5 s while another namespace's ConfigMap is
/// written, so the list's resourceVersion is compacted before its last page). Its continue
/// token expires; kubecast then lists once without pages, as client-go's pager does, and the
/// list finishes with every object once. Before, it started over from the first page, which
/// expired again: the stream never synced.
#[tokio::test]
async fn a_list_that_outlives_its_continue_token_finishes_as_one_unpaginated_list() {
    let kubeconfig = common::compacting_kubeconfig();
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "pager").await;
    let busy = TestNamespace::new(&client, "pager-writes").await;
    let listed = create_cms(&client, &ns.name, &names("p", 0..40)).await;
    // Writes elsewhere move etcd's revision on (compaction keeps the newest revision).
    let writes = Api::<ConfigMap>::namespaced(client.clone(), &busy.name);
    create_cms(&client, &busy.name, &names("w", 0..1)).await;
    let writer = tokio::spawn(async move {
        // At most two minutes (the test ends it sooner).
        for n in 0..600u32 {
            let patch = json!({"data": {"n": n.to_string()}});
            let _ = writes.patch("w00", &PatchParams::default(), &Patch::Merge(&patch)).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });

    let config = cm_config(&ns.name, "qps = 2\nburst = 1\nstreaming_lists = false") + "page_size = 1\n";
    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let mut kc = Kubecast::start_with(&config, &env);
    kc.wait_log("continue token expired", 1).await;
    let deadline = Instant::now() + WAIT;
    while !kc.log().contains("list complete") {
        assert!(Instant::now() < deadline, "the list never finished:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    writer.abort();
    kc.wait_for("the snapshot", WAIT, |e| e.len() >= listed.len()).await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let events = common::without(&kc.events(), &barrier);
    let ids: BTreeSet<String> = events.iter().map(|e| e["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), events.len(), "each object once:\n{}", common::pretty(&events));
    let want: BTreeSet<String> = listed.values().map(|(uid, rv)| format!("{uid}:{rv}:added")).collect();
    assert_eq!(ids, want, "every listed object once, as listed");
    let (_, metrics) = kc.admin_get("/metrics").await;
    let full = metrics
        .lines()
        .find(|l| l.starts_with("kubecast_full_lists_total{"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(full, Some(1.0), "one unpaginated list:\n{metrics}");
    assert!(kc.stop().success(), "{}", kc.log());
}
