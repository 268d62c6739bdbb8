//! The gap-free reflector against the real apiserver (watch cache on, the default): resume
//! from persisted checkpoints after kill -9, corrupt checkpoints, selector changes,
//! `initial = "now"`, kinds served late, and a CRD deleted and re-created while watched.

use kubecast_kit as common;

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use common::{Kubecast, TestNamespace, about, client, cm_config, create_cms, names, verb};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

async fn update_cm(api: &Api<ConfigMap>, name: &str, v: &str) -> (String, String) {
    let c = api.patch(name, &PatchParams::default(), &Patch::Merge(json!({"data": {"v": v}}))).await.expect("patch");
    (c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap())
}

fn ids(evs: &[Value]) -> Vec<String> {
    evs.iter().map(|e| e["id"].as_str().unwrap().to_string()).collect()
}

/// The committed resume point and object count of the only checkpoint of `kc`.
fn checkpoint_of(kc: &Kubecast) -> (Option<String>, Vec<Value>) {
    let cps = kc.checkpoints();
    assert_eq!(cps.len(), 1, "one stream, one checkpoint file");
    (cps[0]["resource_version"].as_str().map(String::from), cps[0]["objects"].as_array().unwrap().clone())
}

async fn wait_checkpoint(kc: &Kubecast, what: &str, done: impl Fn(&[Value]) -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if !kc.checkpoints().is_empty() && done(&checkpoint_of(kc).1) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "checkpoint never reached: {what}\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn kill_9_then_100_changes_while_down_are_emitted_exactly_and_nothing_else() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "resume").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let existing = create_cms(&client, &ns.name, &names("c", 0..60)).await;

    let mut kc = Kubecast::start_with_checkpoint(&cm_config(&ns.name, ""), "flush_interval_ms = 100", &[]);
    kc.wait_for("60 snapshot events", WAIT, |e| e.len() >= 60).await;
    // One live change, then wait until the checkpoint has it.
    let (uid0, rv0) = update_cm(&api, "c00", "live").await;
    kc.wait_for("live change", WAIT, |e| e.iter().any(|e| e["id"] == format!("{uid0}:{rv0}:modified").as_str())).await;
    wait_checkpoint(&kc, "the live change", |objs| objs.iter().any(|o| o[0] == uid0.as_str() && o[3] == rv0.as_str()))
        .await;
    let before = kc.events();
    kc.kill9();

    // 100 changes while kubecast is down: 30 updates, 20 deletes, 50 creates.
    let mut expected: BTreeSet<String> = BTreeSet::new();
    for name in names("c", 0..30) {
        let (uid, rv) = update_cm(&api, &name, "down").await;
        expected.insert(format!("{uid}:{rv}:modified"));
    }
    let mut deleted_uids = HashSet::new();
    for name in names("c", 30..50) {
        api.delete(&name, &DeleteParams::default()).await.unwrap();
        deleted_uids.insert(existing[&name].0.clone());
    }
    for (_, (uid, rv)) in create_cms(&client, &ns.name, &names("n", 0..50)).await {
        expected.insert(format!("{uid}:{rv}:added"));
    }

    kc.restart(&[]);
    let n_before = before.len();
    kc.wait_for("the 100 changes", WAIT, |e| {
        let after: HashSet<String> = ids(&e[n_before.min(e.len())..]).into_iter().collect();
        let deletes = e[n_before.min(e.len())..].iter().filter(|e| verb(e) == "deleted").count();
        expected.iter().all(|id| after.contains(id)) && deletes >= 20
    })
    .await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let all = common::without(&kc.events(), &barrier);
    let after = &all[n_before..];
    let before_ids: HashSet<String> = ids(&before).into_iter().collect();

    let mut distinct_deleted = HashSet::new();
    for e in after {
        let id = e["id"].as_str().unwrap();
        if verb(e) == "deleted" {
            let uid = e["partitionkey"].as_str().unwrap();
            assert!(deleted_uids.contains(uid), "delete of an object that was not deleted: {id}");
            distinct_deleted.insert(id.to_string());
            continue;
        }
        assert!(
            expected.contains(id) || before_ids.contains(id),
            "event after restart is neither one of the changes nor a repeat (same id) of an earlier event: {id}\n{}",
            common::pretty(after)
        );
        assert!(!before_ids.contains(id) || e["origin"] == "watch");
    }
    assert_eq!(distinct_deleted.len(), 20, "one delete per deleted object:\n{}", common::pretty(after));
    for name in names("c", 50..60) {
        assert!(about(after, &format!("{}/{name}", ns.name)).is_empty(), "untouched {name} was emitted again");
    }
    assert!(after.iter().all(|e| e["origin"] == "watch"), "resumed inside the watch window: no relist");
    assert!(!kc.log().contains("relisting"), "no relist:\n{}", kc.log());
    assert!(kc.stop().success());
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_a_clear_error_never_a_silent_replay() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "corrupt").await;
    create_cms(&client, &ns.name, &names("c", 0..3)).await;
    let mut kc = Kubecast::start(&cm_config(&ns.name, ""));
    kc.wait_for("snapshot", WAIT, |e| e.len() == 3).await;
    assert!(kc.stop().success());
    let state = kc.dir.path().join("state");
    // The stream's checkpoint file (the directory also holds the lock and the dead letter).
    let file = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .expect("a checkpoint file");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&file, &bytes).unwrap();

    kc.restart(&[]);
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = kc.log();
    assert!(
        log.contains("is corrupt") && log.contains(file.file_name().unwrap().to_str().unwrap()) && log.contains("fix:"),
        "{log}"
    );
    assert_eq!(kc.events().len(), 3, "nothing replayed");

    std::fs::write(&file, br#"{"version": 99}"#).unwrap();
    kc.restart(&[]);
    assert!(!kc.wait_exit(WAIT).await.success());
    assert!(kc.log().contains("format version 99"), "{}", kc.log());
}

#[tokio::test]
async fn a_changed_selector_gets_its_own_checkpoint_and_initial_now_emits_only_new_changes() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "query").await;
    create_cms(&client, &ns.name, &names("c", 0..5)).await;

    let mut kc = Kubecast::start(&cm_config(&ns.name, ""));
    kc.wait_for("snapshot", WAIT, |e| e.len() == 5).await;
    assert!(kc.stop().success());

    // Same directory, another query: a new checkpoint file, the old one untouched and unused.
    let old = checkpoint_of(&kc);
    let cfg = format!("{}field_selector = \"metadata.name!=c00\"\ninitial = \"now\"\n", cm_config(&ns.name, ""));
    std::fs::write(
        kc.dir.path().join("kubecast.toml"),
        std::fs::read_to_string(kc.dir.path().join("kubecast.toml")).unwrap().replace(&cm_config(&ns.name, ""), &cfg),
    )
    .unwrap();
    kc.restart(&[]);
    let deadline = std::time::Instant::now() + WAIT;
    while kc.checkpoints().len() < 2 {
        assert!(std::time::Instant::now() < deadline, "no second checkpoint\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    update_cm(&api, "c00", "x").await; // filtered out by the field selector
    let (uid, rv) = update_cm(&api, "c01", "x").await;
    kc.wait_for("c01 modified", WAIT, |e| e.len() > 5).await;
    let barrier = common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let evs = common::without(&kc.events(), &barrier);
    assert_eq!(ids(&evs[5..]), [format!("{uid}:{rv}:modified")], "initial = now: no snapshot, only the new change");
    assert!(kc.stop().success());
    let cps = kc.checkpoints();
    assert_eq!(cps.len(), 2);
    assert!(cps.iter().any(|c| c["resource_version"].as_str() == old.0.as_deref()), "old checkpoint untouched");
    let new = cps.iter().find(|c| c["stream"]["field_selector"] == "metadata.name!=c00").unwrap();
    // c01..c04 and the barrier.
    assert_eq!(new["objects"].as_array().unwrap().len(), 5, "initial = now still indexes existing objects");
}

const GROUP: &str = "e2e.kubecast.io";

async fn create_crd(client: &Client, plural: &str, kind: &str) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("{plural}.{GROUP}")},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural.trim_end_matches('s'), "kind": kind},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    }))
    .unwrap();
    crds.create(&PostParams::default(), &crd).await.expect("create CRD");
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), plural);
    for _ in 0..150 {
        if Api::<DynamicObject>::all_with(client.clone(), &ar).list(&Default::default()).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("CRD {plural} not served");
}

async fn delete_crd(client: &Client, plural: &str, kind: &str) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    crds.delete(&format!("{plural}.{GROUP}"), &DeleteParams::default()).await.unwrap();
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), plural);
    for _ in 0..300 {
        let gone = crds.get_opt(&format!("{plural}.{GROUP}")).await.unwrap().is_none();
        if gone && Api::<DynamicObject>::all_with(client.clone(), &ar).list(&Default::default()).await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("CRD {plural} not deleted");
}

async fn create_cr(client: &Client, ns: &str, plural: &str, kind: &str, name: &str) -> (String, String) {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", kind), plural);
    let mut o = DynamicObject::new(name, &ar).within(ns);
    o.data = json!({"spec": {"n": 1}});
    let o = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar)
        .create(&PostParams::default(), &o)
        .await
        .unwrap();
    (o.metadata.uid.unwrap(), o.metadata.resource_version.unwrap())
}

/// A unique CRD (plural, Kind) per test run: CRDs are cluster-wide.
fn unique_kind(prefix: &str) -> (String, String) {
    let suffix: String =
        common::unique("x").chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>().to_lowercase();
    let kind = format!("{prefix}{suffix}");
    (format!("{}s", kind.to_lowercase()), kind)
}

#[tokio::test]
async fn a_kind_served_later_starts_its_stream_when_the_crd_appears() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "late").await;
    let (plural, kind) = unique_kind("Late");
    let mut kc = Kubecast::start(&format!(
        "[[resources]]\napi_version = \"{GROUP}/v1\"\nkind = \"{kind}\"\nnamespaces = [\"{}\"]\n",
        ns.name
    ));
    let deadline = std::time::Instant::now() + WAIT;
    while !kc.log().contains("waiting for it to be served") {
        assert!(std::time::Instant::now() < deadline, "{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = kc.wait_ready(503).await;
    assert!(body.contains("waiting for its kind"), "readiness names the waiting stream: {body}");
    assert_eq!(kc.admin_get("/livez").await.0, 200, "alive while waiting");
    create_crd(&client, &plural, &kind).await;
    kc.wait_ready(200).await;
    let (uid, rv) = create_cr(&client, &ns.name, &plural, &kind, "first").await;
    let evs = kc.wait_for("the first custom resource", WAIT, |e| !e.is_empty()).await;
    assert_eq!(evs[0]["id"], format!("{uid}:{rv}:added").as_str());
    assert_eq!(evs[0]["type"], format!("io.kubecast.{GROUP}.{kind}.added").as_str());
    assert!(kc.stop().success());
    delete_crd(&client, &plural, &kind).await;
}

/// Documented behaviour: deleting a CRD deletes its objects, and kubecast emits a `deleted`
/// for each (from the watch, or from the relist-diff once the kind is back); while the kind
/// is gone the stream waits; when the CRD is re-created the stream relists and diffs, so the
/// new objects come as `added` and nothing is lost or duplicated.
#[tokio::test]
async fn a_crd_deleted_and_recreated_while_watched() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "recrd").await;
    let (plural, kind) = unique_kind("Gadget");
    create_crd(&client, &plural, &kind).await;
    let (u1, _) = create_cr(&client, &ns.name, &plural, &kind, "g1").await;
    let (u2, _) = create_cr(&client, &ns.name, &plural, &kind, "g2").await;
    let mut kc = Kubecast::start(&format!(
        "[[resources]]\napi_version = \"{GROUP}/v1\"\nkind = \"{kind}\"\nnamespaces = [\"{}\"]\n",
        ns.name
    ));
    kc.wait_for("snapshot of g1, g2", WAIT, |e| e.len() == 2).await;

    delete_crd(&client, &plural, &kind).await;
    kc.wait_for("g1 and g2 deleted", WAIT, |e| e.iter().filter(|e| verb(e) == "deleted").count() >= 2).await;
    create_crd(&client, &plural, &kind).await;
    let (u3, rv3) = create_cr(&client, &ns.name, &plural, &kind, "g3").await;
    kc.wait_for("g3 added", WAIT, |e| e.iter().any(|e| e["partitionkey"] == u3.as_str())).await;
    // A last change, to wait for everything before it (see `common::settle`).
    let (barrier, barrier_rv) = create_cr(&client, &ns.name, &plural, &kind, "barrier").await;
    common::settle_at(&mut kc, barrier_rv.parse().unwrap(), "the barrier").await;
    let evs: Vec<Value> = kc.events().into_iter().filter(|e| e["partitionkey"] != barrier.as_str()).collect();
    let mut got: Vec<(String, String)> =
        evs.iter().map(|e| (e["partitionkey"].as_str().unwrap().to_string(), verb(e).to_string())).collect();
    got.sort();
    got.dedup(); // a repeat with the same id is allowed; distinct changes must be exact
    let mut want = vec![
        (u1.clone(), "added".to_string()),
        (u1, "deleted".to_string()),
        (u2.clone(), "added".to_string()),
        (u2, "deleted".to_string()),
        (u3.clone(), "added".to_string()),
    ];
    want.sort();
    assert_eq!(got, want, "\n{}", common::pretty(&evs));
    let g3 = evs.iter().find(|e| e["partitionkey"] == u3.as_str()).unwrap();
    assert_eq!(g3["id"], format!("{u3}:{rv3}:added").as_str());
    assert!(kc.stop().success());
    delete_crd(&client, &plural, &kind).await;
}
