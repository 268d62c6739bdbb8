//! Event shaping against the real apiserver: safe payloads, redaction, CEL filters, change
//! detection, payload modes, exact events read from the file sink (and NATS for Secrets).

use kubecast_kit as common;

use std::time::Duration;

use common::{Kubecast, TestNamespace, about, client, create_cm, verb};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
const GROUP: &str = "shaping.kubecast.io";

fn config(ns: &str, kind_lines: &str, extra: &str) -> String {
    format!("[cluster]\nname = \"e2e\"\n[[resources]]\n{kind_lines}\nnamespaces = [\"{ns}\"]\n{extra}\n")
}

fn cms(ns: &str, extra: &str) -> String {
    config(ns, "api_version = \"v1\"\nkind = \"ConfigMap\"", extra)
}

async fn patch_cm(client: &Client, ns: &str, name: &str, patch: Value) {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .unwrap();
}

/// managedFields and the last-applied annotation are dropped by default (other annotations
/// stay); `keep_managed_fields = true` keeps both.
#[tokio::test]
async fn managed_fields_and_last_applied_are_dropped_by_default() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shape-safe").await;
    let mut dropped = Kubecast::start(&cms(&ns.name, ""));
    let mut kept = Kubecast::start(&cms(&ns.name, "keep_managed_fields = true"));
    dropped.wait_log("list complete", 1).await;
    kept.wait_log("list complete", 1).await;
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "applied", "annotations": {LAST_APPLIED: "{\"data\":{\"k\":\"v\"}}", "team": "a"}},
        "data": {"k": "v"}
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), &ns.name).create(&PostParams::default(), &cm).await.unwrap();

    let evs = dropped.wait_for("the added event", WAIT, |e| !e.is_empty()).await;
    let meta = &evs[0]["data"]["metadata"];
    assert!(meta.get("managedFields").is_none(), "{meta}");
    assert_eq!(meta["annotations"], json!({"team": "a"}), "only last-applied is dropped");
    assert_eq!(evs[0]["data"]["data"], json!({"k": "v"}));
    assert_eq!(meta["name"], "applied");

    let evs = kept.wait_for("the added event", WAIT, |e| !e.is_empty()).await;
    let meta = &evs[0]["data"]["metadata"];
    assert!(meta["managedFields"].as_array().is_some_and(|m| !m.is_empty()), "{meta}");
    assert!(meta["annotations"].get(LAST_APPLIED).is_some());
}

/// Secret values never leave the cluster: not in `data` / `stringData`, not in the
/// last-applied annotation, not in a patch, for every payload mode, in the file sink and in
/// NATS; keys stay.
#[tokio::test]
async fn secret_values_never_appear_in_any_payload_mode() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shape-secret").await;
    let secrets = "api_version = \"v1\"\nkind = \"Secret\"";
    let stream = nats_stream().await;
    let subject = format!("{}.{{cluster}}.{{resource}}", stream.1);
    let nats_sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{subject}\"\n",
        common::env_var("NATS_URL")
    );
    let mut runs = [
        Kubecast::start(&config(&ns.name, secrets, "")),
        Kubecast::start(&config(&ns.name, secrets, "payload = \"metadata\"")),
        Kubecast::start(&config(&ns.name, secrets, "payload = \"patch\"\nkeep_previous = true")),
        Kubecast::start(&config(&ns.name, secrets, "keep_managed_fields = true\nfilter = \"verb != 'deleted'\"")),
    ];
    let mut nats = Kubecast::start_with_sink(&config(&ns.name, secrets, ""), &nats_sink, "", &[]);
    for k in runs.iter_mut().chain(std::iter::once(&mut nats)) {
        k.wait_ready(200).await;
    }
    let plain = "hunter2-plain-value";
    let encoded = "c3VwZXItc2VjcmV0LWJhc2U2NA=="; // "super-secret-base64"
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "creds", "annotations": {LAST_APPLIED: format!("{{\"stringData\":{{\"password\":\"{plain}\"}}}}")}},
        "data": {"token": encoded},
        "stringData": {"password": plain}
    }))
    .unwrap();
    let api = Api::<Secret>::namespaced(client.clone(), &ns.name);
    api.create(&PostParams::default(), &secret).await.unwrap();
    api.patch("creds", &PatchParams::default(), &Patch::Merge(json!({"stringData": {"password": "second-secret-zz"}})))
        .await
        .unwrap();
    api.delete("creds", &DeleteParams::default()).await.unwrap();
    let base64_of = |s: &str| {
        use std::io::Write;
        let mut out = Vec::new();
        let mut child = std::process::Command::new("base64")
            .arg("-w0")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
        out.extend(child.wait_with_output().unwrap().stdout);
        String::from_utf8(out).unwrap()
    };
    let forbidden = [
        plain.to_string(),
        encoded.to_string(),
        base64_of(plain),
        "second-secret-zz".into(),
        base64_of("second-secret-zz"),
    ];
    for (i, k) in runs.iter_mut().enumerate() {
        let want = if i == 3 { 2 } else { 3 };
        let evs = k.wait_for("the secret's events", WAIT, |e| e.len() >= want).await;
        assert_eq!(evs.len(), want, "run {i}");
        let text = std::fs::read_to_string(&k.events_path).unwrap();
        for f in &forbidden {
            assert!(!text.contains(f.as_str()), "run {i}: a secret value leaked ({f}):\n{text}");
        }
        match i {
            0 => {
                assert_eq!(evs[0]["data"]["data"], json!({"token": "<redacted>", "password": "<redacted>"}));
                assert!(evs[0]["data"]["metadata"].get("annotations").is_none());
            }
            1 => {
                assert_eq!(evs[0]["payload"], "metadata");
                assert!(evs[0]["data"].get("data").is_none());
                assert_eq!(evs[0]["data"]["metadata"]["name"], "creds");
            }
            2 => {
                assert_eq!(evs[1]["payload"], "patch");
                assert_eq!(evs[1]["datacontenttype"], "application/json-patch+json");
                assert!(evs[1]["data"].is_array(), "{}", evs[1]["data"]);
                // Both versions are redacted, yet the consumer learns which key changed.
                let ops = evs[1]["data"].as_array().unwrap();
                assert!(
                    ops.contains(&json!({"op": "replace", "path": "/data/password", "value": "<redacted>"})),
                    "the changed key is named, its value redacted: {}",
                    evs[1]["data"]
                );
                assert!(
                    !ops.iter().any(|op| op["path"] == "/data/token"),
                    "an unchanged key is not: {}",
                    evs[1]["data"]
                );
            }
            _ => {
                let meta = &evs[0]["data"]["metadata"];
                assert!(meta["managedFields"].is_array(), "kept on request");
                assert!(
                    meta.get("annotations").is_none(),
                    "a Secret's last-applied annotation holds its data: always dropped"
                );
            }
        }
    }
    let msgs = nats_read(&stream.0, 3).await;
    for m in &msgs {
        for f in &forbidden {
            assert!(!m.contains(f.as_str()), "NATS: a secret value leaked ({f}): {m}");
        }
    }
}

async fn nats_stream() -> (String, String) {
    let js = async_nats::jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("shape").replace('-', "_");
    let name = prefix.to_uppercase();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    (name, prefix)
}

async fn nats_read(stream: &str, n: usize) -> Vec<String> {
    use futures::StreamExt;
    let js = async_nats::jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let s = js.get_stream(stream).await.unwrap();
    let consumer = s
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while out.len() < n {
        assert!(std::time::Instant::now() < deadline, "only {} of {n} NATS messages", out.len());
        let mut batch =
            consumer.fetch().max_messages(100).expires(Duration::from_millis(500)).messages().await.unwrap();
        while let Some(m) = batch.next().await {
            out.push(String::from_utf8_lossy(&m.unwrap().payload).into_owned());
        }
    }
    js.delete_stream(stream).await.unwrap();
    out
}

/// `redact` paths on a custom resource, and `max_event_bytes`: a large object falls back to
/// its metadata with `truncated = true`, a small one is sent whole.
#[tokio::test]
async fn redact_paths_and_max_event_bytes() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shape-redact").await;
    ensure_rollout_crd(&client).await;
    let rollouts = format!("api_version = \"{GROUP}/v1\"\nkind = \"Rollout\"");
    let mut k = Kubecast::start(&config(
        &ns.name,
        &rollouts,
        "redact = [\"spec.password\", \"spec.env.*.value\"]\nmax_event_bytes = 4096",
    ));
    k.wait_ready(200).await;
    let api = rollouts_api(&client, &ns.name);
    let mut small = DynamicObject::new("small", &rollout_resource()).within(&ns.name);
    small.data = json!({"spec": {"password": "pw-1", "env": [{"name": "A", "value": "va"}, {"name": "B", "value": "vb"}], "replicas": 2}});
    api.create(&PostParams::default(), &small).await.unwrap();
    let mut big = DynamicObject::new("big", &rollout_resource()).within(&ns.name);
    big.data = json!({"spec": {"replicas": 1, "blob": "x".repeat(10_000)}});
    api.create(&PostParams::default(), &big).await.unwrap();

    let evs = k.wait_for("two added events", WAIT, |e| e.len() >= 2).await;
    let small = about(&evs, &format!("{}/small", ns.name))[0];
    assert_eq!(
        small["data"]["spec"],
        json!({"password": "<redacted>", "env": [{"name": "A", "value": "<redacted>"}, {"name": "B", "value": "<redacted>"}], "replicas": 2})
    );
    assert!(small.get("truncated").is_none());
    let big = about(&evs, &format!("{}/big", ns.name))[0];
    assert_eq!(big["truncated"], true, "{big}");
    assert!(big["data"].get("spec").is_none());
    assert_eq!(big["data"]["metadata"]["name"], "big");
    assert_eq!(big["data"]["kind"], "Rollout");
}

/// CEL filters with exact results: labels, `has()`, phase transitions with `oldObject`;
/// filtered-out events still advance the checkpoint; a run-time error delivers the event (the
/// default rule) and is logged.
#[tokio::test]
async fn cel_filters_select_exactly() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shape-cel").await;
    ensure_rollout_crd(&client).await;
    let rollouts = format!("api_version = \"{GROUP}/v1\"\nkind = \"Rollout\"");
    let transition = "keep_previous = true\nfilter = \"verb == 'modified' && oldObject.spec.phase != object.spec.phase && object.spec.phase == 'Ready'\"";
    let mut phase = Kubecast::start(&config(&ns.name, &rollouts, transition));
    let mut labels = Kubecast::start(&cms(
        &ns.name,
        "filter = \"has(object.metadata.labels) && object.metadata.labels.team == 'a'\"",
    ));
    let mut erroring = Kubecast::start(&cms(&ns.name, "filter = \"object.data.size > 3\""));
    for k in [&mut phase, &mut labels, &mut erroring] {
        k.wait_ready(200).await;
    }
    create_cm(&client, &ns.name, "team-a", json!({"team": "a"}), json!({"size": "5"})).await;
    create_cm(&client, &ns.name, "team-b", json!({"team": "b"}), json!({})).await;
    create_cm(&client, &ns.name, "nolabels", json!({}), json!({"size": "1"})).await;
    patch_cm(&client, &ns.name, "team-b", json!({"metadata": {"labels": {"team": "a"}}})).await;

    let api = rollouts_api(&client, &ns.name);
    let mut r = DynamicObject::new("r1", &rollout_resource()).within(&ns.name);
    r.data = json!({"spec": {"phase": "Pending"}});
    api.create(&PostParams::default(), &r).await.unwrap();
    for p in ["Progressing", "Ready", "Ready", "Degraded", "Ready"] {
        let patch = json!({"spec": {"phase": p, "note": common::unique("n")}});
        api.patch("r1", &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    }

    let evs = phase.wait_for("two transitions to Ready", WAIT, |e| e.len() >= 2).await;
    // Filtered out (an `added`), it still moves the checkpoint.
    rollout_barrier(&client, &ns.name, &mut [&mut phase]).await;
    let evs_now = phase.events();
    assert_eq!(evs_now.len(), 2, "only transitions into Ready:\n{}", common::pretty(&evs_now));
    assert!(evs.iter().all(|e| verb(e) == "modified" && e["data"]["spec"]["phase"] == "Ready"));

    labels.wait_for("team a", WAIT, |e| e.len() >= 2).await;
    // Without labels, filtered out: it still moves the checkpoint.
    common::settle(&mut labels, &client, &ns.name, json!({})).await;
    let got: Vec<(String, String)> = labels
        .events()
        .iter()
        .map(|e| (e["subject"].as_str().unwrap().rsplit('/').next().unwrap().to_string(), verb(e).to_string()))
        .collect();
    assert_eq!(got, [("team-a".to_string(), "added".to_string()), ("team-b".to_string(), "modified".to_string())]);

    // `object.data.size` is a string: `> 3` fails at run time on every object -> delivered.
    erroring.wait_for("every event, delivered by the default rule", WAIT, |e| e.len() >= 4).await;
    erroring.wait_log("filter failed on this object", 1).await;

    // The checkpoint of the label-filtered stream covers the objects it never sent.
    assert_eq!(labels.stop().code(), Some(0));
    let cp = labels.checkpoints();
    let names: Vec<&str> = cp[0]["objects"].as_array().unwrap().iter().map(|o| o[2].as_str().unwrap()).collect();
    assert!(names.contains(&"nolabels"), "filtered-out events advance the checkpoint: {names:?}");
}

/// `ignore_status_only` on a Deployment-like custom resource with a status subresource:
/// status updates (and changes of `ignore_fields`) are dropped, spec changes are sent; the
/// `patch` payload gives the exact change.
#[tokio::test]
async fn status_only_updates_are_dropped_and_patches_are_exact() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "shape-status").await;
    ensure_rollout_crd(&client).await;
    let rollouts = format!("api_version = \"{GROUP}/v1\"\nkind = \"Rollout\"");
    let mut k = Kubecast::start(&config(
        &ns.name,
        &rollouts,
        "ignore_status_only = true\nignore_fields = [\"metadata.annotations.heartbeat\"]\nkeep_previous = true\npayload = \"patch\"",
    ));
    let mut all = Kubecast::start(&config(&ns.name, &rollouts, ""));
    k.wait_ready(200).await;
    all.wait_ready(200).await;
    let api = rollouts_api(&client, &ns.name);
    let mut r = DynamicObject::new("web", &rollout_resource()).within(&ns.name);
    r.data = json!({"spec": {"replicas": 1, "image": "app:1"}});
    api.create(&PostParams::default(), &r).await.unwrap();
    for i in 0..3 {
        api.patch_status("web", &PatchParams::default(), &Patch::Merge(json!({"status": {"readyReplicas": i}})))
            .await
            .unwrap();
    }
    api.patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"annotations": {"heartbeat": "1"}}})))
        .await
        .unwrap();
    api.patch("web", &PatchParams::default(), &Patch::Merge(json!({"spec": {"image": "app:2"}}))).await.unwrap();
    api.patch_status("web", &PatchParams::default(), &Patch::Merge(json!({"status": {"readyReplicas": 9}})))
        .await
        .unwrap();
    api.delete("web", &DeleteParams::default()).await.unwrap();

    all.wait_for("all 8 changes", WAIT, |e| e.len() >= 8).await;
    let evs = k.wait_for("added, the spec change, deleted", WAIT, |e| e.len() >= 3).await;
    let barrier = rollout_barrier(&client, &ns.name, &mut [&mut k]).await;
    let evs_now = common::without(&k.events(), &barrier);
    assert_eq!(evs_now.len(), 3, "{}", common::pretty(&evs_now));
    let verbs: Vec<&str> = evs.iter().map(verb).collect();
    assert_eq!(verbs, ["added", "modified", "deleted"]);
    assert_eq!(evs[0]["payload"], "full");
    assert_eq!(evs[1]["payload"], "patch");
    let ops: Vec<(String, String)> = evs[1]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|op| (op["op"].as_str().unwrap().to_string(), op["path"].as_str().unwrap().to_string()))
        .collect();
    // From the object just before this change (the previous version, not the previous event).
    let mut ops = ops;
    ops.sort();
    let want: Vec<(String, String)> =
        [("replace", "/metadata/generation"), ("replace", "/metadata/resourceVersion"), ("replace", "/spec/image")]
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
    assert_eq!(ops, want, "{}", evs[1]["data"]);
    let image = evs[1]["data"].as_array().unwrap().iter().find(|o| o["path"] == "/spec/image").unwrap();
    assert_eq!(image["value"], "app:2");
    assert_eq!(evs[2]["payload"], "full");
}

/// Invalid shaping options are check-config errors naming the key, with the CEL position.
#[test]
fn invalid_shaping_options_are_rejected_by_check_config() {
    let cases: &[(&str, &[&str])] = &[
        ("filter = \"object.metadata.name ==\"", &["resources[0].filter", "CEL syntax error", "1:"]),
        ("filter = \"object.metadata.name\"", &["resources[0].filter", "must evaluate to a bool"]),
        ("filter = \"nosuch(object)\"", &["resources[0].filter", "Undeclared reference to 'nosuch'"]),
        ("filter = \"oldObject.spec != object.spec\"", &["resources[0].filter", "keep_previous = true"]),
        ("payload = \"patch\"", &["resources[0].payload", "keep_previous = true"]),
        ("payload = \"diff\"", &["resources[0].payload", "full, metadata, patch"]),
        ("redact = [\"spec..password\"]", &["resources[0].redact[0]", "not a field path"]),
        ("ignore_fields = [\"metadata.labels\"]", &["resources[0].ignore_fields", "ignore_status_only"]),
        ("max_event_bytes = 10", &["resources[0].max_event_bytes", "at least 1024"]),
        ("filter_error = \"explode\"", &["resources[0].filter_error", "deliver, drop"]),
    ];
    for (line, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.toml");
        std::fs::write(&path, format!("[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n{line}\n")).unwrap();
        let out =
            std::process::Command::new(common::bin()).args(["check-config", "--config"]).arg(&path).output().unwrap();
        assert!(!out.status.success(), "{line}: accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        for w in *want {
            assert!(err.contains(w), "{line}: {w:?} not in:\n{err}");
        }
    }
}

/// Creates Rollout `barrier-<unique>` and waits until each of `instances` has a checkpoint at
/// its resourceVersion: every event of an earlier change is delivered then (see
/// `common::settle`). Returns its subject.
async fn rollout_barrier(client: &Client, ns: &str, instances: &mut [&mut Kubecast]) -> String {
    let name = common::unique("barrier");
    let mut r = DynamicObject::new(&name, &rollout_resource()).within(ns);
    r.data = json!({"spec": {"phase": "Barrier"}});
    let r = rollouts_api(client, ns).create(&PostParams::default(), &r).await.unwrap();
    let rv = r.metadata.resource_version.unwrap().parse().unwrap();
    let subject = format!("{ns}/{name}");
    for k in instances {
        common::settle_at(k, rv, &subject).await;
    }
    subject
}

fn rollout_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, "v1", "Rollout"), "rollouts")
}

fn rollouts_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &rollout_resource())
}

/// A Deployment-like CRD with a status subresource (created once, shared by the tests).
async fn ensure_rollout_crd(client: &Client) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("rollouts.{GROUP}")},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"plural": "rollouts", "singular": "rollout", "kind": "Rollout"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}
                }}}}]
        }
    }))
    .unwrap();
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create CRD: {e}"),
    }
    for _ in 0..150 {
        if Api::<DynamicObject>::all_with(client.clone(), &rollout_resource()).list(&Default::default()).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("CRD rollouts not served");
}
