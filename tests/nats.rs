//! The NATS sink against the real nats-server (JetStream) and apiserver from tests/env, read
//! back by an independent JetStream consumer.

// Each #[tokio::test] runs on its own thread and runtime: holding the std lock across awaits
// only serializes the tests, it cannot deadlock a runtime.
#![allow(clippy::await_holding_lock)]

use kubecast_kit as common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use common::{Kubecast, TestNamespace, client, create_cm};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

/// The restart test stops the shared server: it runs alone.
static SERVER: RwLock<()> = RwLock::new(());

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    SERVER.read().unwrap_or_else(|e| e.into_inner())
}

#[derive(Debug, Clone)]
struct Msg {
    subject: String,
    headers: BTreeMap<String, String>,
    payload: Vec<u8>,
}

impl Msg {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.payload).expect("JSON payload")
    }
    fn header(&self, k: &str) -> &str {
        self.headers.get(k).map(String::as_str).unwrap_or_else(|| panic!("no header {k}: {:?}", self.headers))
    }
}

/// A JetStream stream of the test's own (unique subjects), deleted when dropped.
struct TestStream {
    js: jetstream::Context,
    name: String,
    /// The literal first token of every subject of this stream.
    prefix: String,
}

impl TestStream {
    async fn new() -> Self {
        let js = js().await;
        let prefix = common::unique("t").replace('-', "_");
        let name = prefix.to_uppercase();
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("create stream");
        Self { js, name, prefix }
    }

    async fn messages(&self) -> u64 {
        let mut s = self.js.get_stream(&self.name).await.unwrap();
        s.info().await.unwrap().state.messages
    }

    /// Reads the stream from its start with a new consumer until `done` holds.
    async fn read_until(&self, what: &str, done: impl Fn(&[Msg]) -> bool) -> Vec<Msg> {
        read_stream(&self.js, &self.name, what, done).await
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let (js, name) = (self.js.clone(), self.name.clone());
        // Best effort, in the background: the test's runtime may be shutting down.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let _ = tokio::time::timeout(Duration::from_secs(5), js.delete_stream(&name)).await;
            });
        })
        .join()
        .ok();
    }
}

async fn js() -> jetstream::Context {
    let client = async_nats::connect(common::env_var("NATS_URL")).await.expect("connect to nats");
    jetstream::new(client)
}

async fn read_stream(js: &jetstream::Context, name: &str, what: &str, done: impl Fn(&[Msg]) -> bool) -> Vec<Msg> {
    let deadline = Instant::now() + WAIT;
    let s = js.get_stream(name).await.expect("stream exists");
    let consumer = s
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut out = Vec::new();
    while !done(&out) {
        assert!(Instant::now() < deadline, "timed out reading stream {name} for {what}; got {} messages", out.len());
        let mut batch =
            consumer.fetch().max_messages(500).expires(Duration::from_millis(500)).messages().await.expect("fetch");
        while let Some(m) = batch.next().await {
            let m = m.expect("message");
            out.push(Msg {
                subject: m.subject.to_string(),
                headers: m
                    .headers
                    .iter()
                    .flat_map(|h| h.iter())
                    .map(|(k, v)| (k.to_string(), v.first().map(|v| v.to_string()).unwrap_or_default()))
                    .collect(),
                payload: m.payload.to_vec(),
            });
        }
    }
    out
}

fn nats_sink(subject: &str, extra: &str) -> String {
    format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{subject}\"\n{extra}\n[delivery]\nshutdown_timeout_seconds = 5\n",
        common::env_var("NATS_URL")
    )
}

fn cm_resource(ns: &str, extra: &str) -> String {
    format!("[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n{extra}\n")
}

fn cluster_name() -> String {
    common::unique("nats").replace('_', "-")
}

/// Per object (uid): the (resourceVersion, verb) sequence as read, in stream order.
fn per_object(msgs: &[Value]) -> HashMap<String, Vec<(u64, String)>> {
    let mut out: HashMap<String, Vec<(u64, String)>> = HashMap::new();
    for e in msgs {
        let rv: u64 = e["resourceversion"].as_str().unwrap().parse().unwrap();
        let verb = e["type"].as_str().unwrap().rsplit('.').next().unwrap().to_string();
        out.entry(e["partitionkey"].as_str().unwrap().to_string()).or_default().push((rv, verb));
    }
    out
}

/// Structured mode (the default): each change is one JetStream message on the templated
/// subject, with `Nats-Msg-Id` = the event id and the CloudEvents content type; per object in
/// order. A cluster-scoped kind of a dotted API group shows the subject token rules.
#[tokio::test]
async fn structured_events_arrive_in_order_with_their_headers() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-order").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let label = common::unique("nr");
    let config = format!(
        "[cluster]\nname = \"{cluster}\"\n{}\n[[resources]]\napi_version = \"rbac.authorization.k8s.io/v1\"\nkind = \"ClusterRole\"\nlabel_selector = \"kubecast-test={label}\"\n",
        cm_resource(&ns.name, "")
    );
    let subject = format!("{}.{{cluster}}.{{group}}.{{resource}}.{{namespace}}", stream.prefix);
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, ""), "", &[]);
    k.wait_ready(200).await;

    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    for i in 0..5 {
        create_cm(&client, &ns.name, &format!("o{i}"), json!({}), json!({"v": "0"})).await;
    }
    for v in 1..=3 {
        for i in 0..5 {
            api.patch(&format!("o{i}"), &PatchParams::default(), &Patch::Merge(json!({"data": {"v": v.to_string()}})))
                .await
                .unwrap();
        }
    }
    for i in 0..5 {
        api.delete(&format!("o{i}"), &DeleteParams::default()).await.unwrap();
    }
    let roles = Api::<k8s_openapi::api::rbac::v1::ClusterRole>::all(client.clone());
    let role_name = common::unique("kubecast-test-role");
    roles
        .create(
            &Default::default(),
            &serde_json::from_value(json!({"metadata": {"name": role_name, "labels": {"kubecast-test": label}}}))
                .unwrap(),
        )
        .await
        .unwrap();

    let msgs = stream.read_until("25 ConfigMap changes and 1 ClusterRole", |m| m.len() >= 26).await;
    assert_eq!(msgs.len(), 26, "exactly the changes, nothing else");
    let cm_subject = format!("{}.{cluster}.core.configmaps.{}", stream.prefix, ns.name);
    let role_subject = format!("{}.{cluster}.rbac_authorization_k8s_io.clusterroles._", stream.prefix);
    let mut events = Vec::new();
    for m in &msgs {
        let e = m.json();
        let dedupe = format!("{}@{}", e["id"].as_str().unwrap(), m.subject);
        assert_eq!(m.header("Nats-Msg-Id"), dedupe, "dedupe id = CloudEvent id on its subject");
        assert_eq!(m.header("Content-Type"), "application/cloudevents+json; charset=UTF-8");
        assert_eq!(e["specversion"], "1.0");
        assert_eq!(e["datacontenttype"], "application/json");
        if e["type"].as_str().unwrap().contains("ClusterRole") {
            assert_eq!(m.subject, role_subject, "dots in the group and the empty namespace become _");
            assert_eq!(e["type"], "io.kubecast.rbac.authorization.k8s.io.ClusterRole.added");
            assert_eq!(e["data"]["metadata"]["name"], role_name);
        } else {
            assert_eq!(m.subject, cm_subject);
            assert_eq!(e["source"], format!("k8s://{cluster}/api/v1/configmaps"));
            events.push(e);
        }
    }
    let objects = per_object(&events);
    assert_eq!(objects.len(), 5);
    for (uid, seq) in &objects {
        let verbs: Vec<&str> = seq.iter().map(|(_, v)| v.as_str()).collect();
        assert_eq!(verbs, ["added", "modified", "modified", "modified", "deleted"], "object {uid}");
        assert!(seq.windows(2).all(|w| w[0].0 < w[1].0), "resourceVersions increase for {uid}: {seq:?}");
    }
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    roles.delete(&role_name, &DeleteParams::default()).await.unwrap();
}

/// Two `[[resources]]` entries that both see an object, each with its own subject in one
/// stream: each subject gets the change (JetStream's duplicate window spans the stream's
/// subjects; the same event id on another subject is not a repeat).
#[tokio::test]
async fn two_entries_that_see_one_object_each_get_the_change_on_their_subject() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-overlap").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let (a, b) = (format!("{}.a.{{verb}}", stream.prefix), format!("{}.b.{{verb}}", stream.prefix));
    let config = format!(
        "[cluster]\nname = \"{cluster}\"\n{}{}",
        cm_resource(&ns.name, &format!("label_selector = \"app=x\"\nsubject = \"{a}\"")),
        cm_resource(&ns.name, &format!("label_selector = \"tier=y\"\nsubject = \"{b}\""))
    );
    let mut k = Kubecast::start_with_sink(&config, &nats_sink("unused.{cluster}", ""), "", &[]);
    k.wait_ready(200).await;
    let cm = create_cm(&client, &ns.name, "both", json!({"app": "x", "tier": "y"}), json!({})).await;
    let id = format!("{}:{}:added", cm.metadata.uid.unwrap(), cm.metadata.resource_version.unwrap());
    let msgs = stream.read_until("the change on both subjects", |m| m.len() >= 2).await;
    let mut got: Vec<(String, String)> =
        msgs.iter().map(|m| (m.subject.clone(), m.json()["id"].as_str().unwrap().to_string())).collect();
    got.sort();
    let want = vec![(format!("{}.a.added", stream.prefix), id.clone()), (format!("{}.b.added", stream.prefix), id)];
    assert_eq!(got, want);
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    assert_eq!(stream.messages().await, 2, "once on each subject");
}

/// Binary mode and a per-resource subject: the payload is the object, every attribute a
/// `ce-` header.
#[tokio::test]
async fn binary_mode_and_per_resource_subject() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-binary").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let route = format!("{}.custom.{{kind}}.{{verb}}", stream.prefix);
    let config =
        format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, &format!("subject = \"{route}\"")));
    let mut k = Kubecast::start_with_sink(&config, &nats_sink("unused.{cluster}", "mode = \"binary\""), "", &[]);
    k.wait_ready(200).await;
    let cm = create_cm(&client, &ns.name, "b1", json!({"app": "x"}), json!({"k": "v w"})).await;

    let msgs = stream.read_until("the added event", |m| !m.is_empty()).await;
    let m = &msgs[0];
    assert_eq!(m.subject, format!("{}.custom.ConfigMap.added", stream.prefix));
    let uid = cm.metadata.uid.unwrap();
    let rv = cm.metadata.resource_version.unwrap();
    let id = format!("{uid}:{rv}:added");
    assert_eq!(m.header("Nats-Msg-Id"), format!("{id}@{}", m.subject));
    assert_eq!(m.header("ce-id"), id);
    assert_eq!(m.header("ce-specversion"), "1.0");
    assert_eq!(m.header("ce-type"), "io.kubecast.core.ConfigMap.added");
    assert_eq!(m.header("ce-source"), format!("k8s://{cluster}/api/v1/configmaps"));
    assert_eq!(m.header("ce-subject"), format!("{}/b1", ns.name));
    assert_eq!(m.header("ce-datacontenttype"), "application/json");
    assert_eq!(m.header("ce-partitionkey"), uid);
    assert_eq!(m.header("ce-resourceversion"), rv);
    assert!(!m.header("ce-time").is_empty());
    assert!(!m.headers.contains_key("Content-Type"), "binary mode: no structured content type");
    let obj = m.json();
    assert_eq!(obj["kind"], "ConfigMap");
    assert_eq!(obj["data"]["k"], "v w");
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
}

/// kill -9 after the PubAcks but before the checkpoint covers them: the restarted kubecast
/// publishes the same events again with the same ids, JetStream reports them as duplicates,
/// and the stream (and so any consumer) holds each change once.
#[tokio::test]
async fn replays_after_kill9_are_dropped_as_duplicates() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-dedupe").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{}.{{cluster}}.{{resource}}", stream.prefix);
    // Checkpoints only at shutdown: whatever is published after the start is not in one.
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, ""), "flush_interval_ms = 3600000", &[]);
    k.wait_ready(200).await;
    let names = common::names("d", 0..20);
    common::create_cms(&client, &ns.name, &names).await;
    let first = stream.read_until("20 added events", |m| m.len() >= 20).await;
    let uids: HashSet<String> = first.iter().map(|m| m.json()["partitionkey"].as_str().unwrap().to_string()).collect();
    assert_eq!(uids.len(), 20);
    let covered: HashSet<String> = k
        .checkpoints()
        .iter()
        .flat_map(|c| c["objects"].as_array().cloned().unwrap_or_default())
        .map(|o| o[0].as_str().unwrap().to_string())
        .collect();
    assert!(covered.is_disjoint(&uids), "no checkpoint covers the published events yet");
    k.kill9();

    k.restart(&[]);
    k.wait_log("JetStream dropped a duplicate", 20).await;
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    let covered: HashSet<String> = k
        .checkpoints()
        .iter()
        .flat_map(|c| c["objects"].as_array().cloned().unwrap_or_default())
        .map(|o| o[0].as_str().unwrap().to_string())
        .collect();
    assert!(uids.is_subset(&covered), "after the replays were acknowledged, the checkpoint covers them");
    assert_eq!(stream.messages().await, 20, "the stream kept each change once");
    let all = stream.read_until("all messages", |m| m.len() >= 20).await;
    let ids: HashSet<&str> = all.iter().map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!((all.len(), ids.len()), (20, 20), "a consumer sees each change once");
}

/// nats-server stopped and started again while changes happen: every change arrives, per
/// object in order, none twice.
#[tokio::test]
async fn server_restart_mid_stream_loses_nothing() {
    let _exclusive = SERVER.write().unwrap_or_else(|e| e.into_inner());
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-restart").await;
    let stream = TestStream::new().await;
    let stream_name = stream.name.clone();
    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{}.{{cluster}}.{{resource}}", stream.prefix);
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, "ack_timeout_ms = 2000"), "", &[]);
    k.wait_ready(200).await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let names = common::names("r", 0..30);
    common::create_cms(&client, &ns.name, &names).await;
    let server_back = ServerBack;
    for v in 1..=6 {
        if v == 3 {
            common::env_script(&["down", "nats"]);
            k.wait_ready_reason("sink").await;
            // kubecast saw the server go away, not only the probe.
            k.wait_log("disconnected from NATS", 1).await;
        }
        for n in &names {
            api.patch(n, &PatchParams::default(), &Patch::Merge(json!({"data": {"v": v.to_string()}}))).await.unwrap();
        }
        if v == 4 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            common::env_script(&["up", "nats"]);
            // Connected again: the first connection and this one.
            k.wait_log("connected to NATS", 2).await;
        }
    }
    drop(server_back);
    k.wait_ready(200).await;
    let js = js().await;
    let msgs = read_stream(&js, &stream_name, "30 objects x 7 changes", |m| m.len() >= 210).await;
    let events: Vec<Value> = msgs.iter().map(Msg::json).collect();
    let ids: HashSet<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), events.len(), "no change twice");
    let objects = per_object(&events);
    assert_eq!(objects.len(), 30);
    for (uid, seq) in &objects {
        assert_eq!(seq.len(), 7, "created + 6 updates of {uid}: {seq:?}");
        assert!(seq.windows(2).all(|w| w[0].0 < w[1].0), "in order for {uid}: {seq:?}");
    }
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
}

/// Restarts nats-server even when the test fails half-way.
struct ServerBack;

impl Drop for ServerBack {
    fn drop(&mut self) {
        common::env_script(&["up", "nats"]);
    }
}

/// Wrong password: a clear error, not ready, nothing acknowledged, the secret never logged.
/// Then the nkey user and the right password both deliver.
#[tokio::test]
async fn credentials_refused_then_accepted() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-auth").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{}.{{cluster}}.{{resource}}", stream.prefix);
    create_cm(&client, &ns.name, "waiting", json!({}), json!({"v": "1"})).await;
    let wrong = "not-the-password-4711";
    let auth = format!("user = \"{}\"\npassword = \"${{env:TEST_NATS_PASSWORD}}\"", common::env_var("NATS_USER"));
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, &auth), "", &[("TEST_NATS_PASSWORD", wrong)]);
    k.wait_log("NATS refused the credentials", 1).await;
    k.wait_ready_reason("sink").await;
    assert_eq!(stream.messages().await, 0);
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    assert!(k.checkpoints().iter().all(|c| c["objects"].as_array().is_none_or(|o| o.is_empty())));

    let nkey = format!("nkey_seed = \"${{file:{}}}\"", common::env_var("NATS_NKEY_SEED_FILE"));
    k.set_sink(&nats_sink(&subject, &nkey));
    k.restart(&[]);
    let msgs = stream.read_until("the waiting event, via the nkey user", |m| !m.is_empty()).await;
    assert_eq!(msgs[0].json()["subject"], format!("{}/waiting", ns.name));
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());

    k.set_sink(&nats_sink(&subject, &auth));
    k.restart(&[("TEST_NATS_PASSWORD", &common::env_var("NATS_PASSWORD"))]);
    k.wait_ready(200).await;
    create_cm(&client, &ns.name, "second", json!({}), json!({})).await;
    stream.read_until("the second event, via user/password", |m| m.len() >= 2).await;
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    let log = k.log();
    assert!(!log.contains(wrong) && !log.contains(&common::env_var("NATS_PASSWORD")), "a secret leaked:\n{log}");
    let seed = std::fs::read_to_string(common::env_var("NATS_NKEY_SEED_FILE")).unwrap();
    assert!(!log.contains(seed.trim()), "the nkey seed leaked");
}

/// No stream covers the subjects: a set-up mistake, not a reason to stop. kubecast stays up,
/// not ready, with `/readyz` and the log naming the subject and the fix. With
/// `create_stream = true` it creates the stream and delivers.
#[tokio::test]
async fn missing_stream_is_a_clear_error_or_created_on_request() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-nostream").await;
    let cluster = cluster_name();
    let prefix = common::unique("nostream").replace('-', "_");
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{prefix}.{{cluster}}.{{resource}}.{{namespace}}");
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, ""), "", &[]);
    let want = format!("{prefix}.{cluster}.configmaps.{}", ns.name);
    k.wait_ready_reason("destination: NATS event subject").await;
    let (status, body) = k.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&want) && body.contains("no JetStream stream covers") && body.contains("fix:"), "{body}");
    let log = k.log();
    let said = format!("no JetStream stream covers subject \"{want}\"");
    assert!(log.contains(&said), "want {said:?} in:\n{log}");
    assert!(log.contains("create_stream = true"), "the fix is named:\n{log}");
    assert!(k.exited().is_none(), "kubecast stays up:\n{log}");
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());

    let name = prefix.to_uppercase();
    k.set_sink(&nats_sink(&subject, &format!("create_stream = true\n[sink.nats.stream]\nname = \"{name}\"")));
    k.restart(&[]);
    k.wait_ready(200).await;
    create_cm(&client, &ns.name, "c1", json!({}), json!({})).await;
    let js = js().await;
    let msgs = read_stream(&js, &name, "the event in the created stream", |m| !m.is_empty()).await;
    assert_eq!(msgs[0].subject, format!("{prefix}.{cluster}.configmaps.{}", ns.name));
    let mut s = js.get_stream(&name).await.unwrap();
    let info = s.info().await.unwrap();
    assert_eq!(info.config.subjects, vec![format!("{prefix}.>")], "derived from the template");
    assert_eq!(info.config.duplicate_window, Duration::from_secs(600));
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    js.delete_stream(&name).await.unwrap();
}

/// Core NATS (`jetstream = false`): events reach a plain subscriber.
#[tokio::test]
async fn core_nats_mode_publishes_to_subscribers() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-core").await;
    let cluster = cluster_name();
    let prefix = common::unique("core").replace('-', "_");
    let nc = async_nats::connect(common::env_var("NATS_URL")).await.unwrap();
    let mut sub = nc.subscribe(format!("{prefix}.>")).await.unwrap();
    nc.flush().await.unwrap();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{prefix}.{{cluster}}.{{resource}}");
    let mut k = Kubecast::start_with_sink(&config, &nats_sink(&subject, "jetstream = false"), "", &[]);
    k.wait_ready(200).await;
    create_cm(&client, &ns.name, "c1", json!({}), json!({})).await;
    let m = tokio::time::timeout(WAIT, sub.next()).await.expect("a message").unwrap();
    assert_eq!(m.subject.as_str(), format!("{prefix}.{cluster}.configmaps"));
    let e: Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(e["subject"], format!("{}/c1", ns.name));
    assert!(m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).is_none(), "no JetStream id in core mode");
    // An event over the server's max_payload: refused by the client at every attempt, so it
    // goes to the dead letter (the default file), and the next change follows.
    create_cm(&client, &ns.name, "big", json!({}), json!({"big": "x".repeat(1_048_000)})).await;
    create_cm(&client, &ns.name, "after", json!({}), json!({})).await;
    let m = tokio::time::timeout(WAIT, sub.next()).await.expect("the change after the big one").unwrap();
    let e: Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(e["subject"], format!("{}/after", ns.name));
    // (Another object: its event may be published before the dead letter is written.)
    let file = k.dir.path().join("state").join("dead-letter.jsonl");
    let deadline = Instant::now() + WAIT;
    let dead = loop {
        let dead = std::fs::read_to_string(&file).unwrap_or_default();
        if dead.contains(&format!("{}/big", ns.name)) || Instant::now() > deadline {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        dead.contains(&format!("{}/big", ns.name)) && dead.contains("max payload"),
        "dead letter:\n{dead}\n{}",
        k.log()
    );
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    assert!(k.log().contains("at-most-once"), "the guarantee is stated at start");
}

/// An event over the server's max_payload (1 MiB) cannot be published: it goes to the
/// dead-letter subject (the attributes only, as it is too large there as well), with the
/// reason in headers, and the stream goes on.
#[tokio::test]
async fn oversized_event_goes_to_the_dead_letter_subject() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-dl").await;
    let stream = TestStream::new().await;
    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let subject = format!("{}.{{cluster}}.{{resource}}", stream.prefix);
    let dl = format!("{}.dead-letter", stream.prefix);
    let sink =
        format!("{}[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dl}\"\n", nats_sink(&subject, ""));
    let mut k = Kubecast::start_with_sink(&config, &sink, "", &[]);
    k.wait_ready(200).await;
    let big = "x".repeat(1_048_000);
    create_cm(&client, &ns.name, "big", json!({}), json!({"big": big})).await;
    create_cm(&client, &ns.name, "after", json!({}), json!({})).await;
    let msgs = stream.read_until("the dead letter and the next event", |m| m.len() >= 2).await;
    let dead = msgs.iter().find(|m| m.subject == dl).expect("a dead letter");
    assert!(dead.header("Kubecast-Dead-Letter-Reason").contains("max payload"), "{:?}", dead.headers);
    assert_eq!(dead.header("Kubecast-Original-Destination"), format!("{}.{cluster}.configmaps", stream.prefix));
    assert_eq!(dead.header("Kubecast-Data-Dropped"), "true");
    assert_eq!(dead.json()["subject"], format!("{}/big", ns.name));
    let next = msgs.iter().find(|m| m.subject != dl).expect("the next event");
    assert_eq!(next.json()["subject"], format!("{}/after", ns.name));
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
}

/// A nats-server of this test's own with mutual TLS and token auth: kubecast delivers with the
/// CA, its client certificate and the token; without a client certificate the server refuses
/// it (not ready, nothing lost: the event arrives once the certificate is configured).
#[tokio::test]
async fn mutual_tls_and_token() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-tls").await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let certs = format!(
        r#"set -e; cd '{d}'
openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=kubecast-test-ca 2>/dev/null
for who in server client; do
  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who 2>/dev/null
  usage=serverAuth; [ $who = client ] && usage=clientAuth
  printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=%s\n' $usage >$who.ext
  openssl x509 -req -in $who.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out $who.crt -days 1 -extfile $who.ext 2>/dev/null
done"#
    );
    let ok = std::process::Command::new("bash").args(["-c", &certs]).status().unwrap().success();
    assert!(ok, "test certificates");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token = "tls-test-token-31337";
    std::fs::write(
        dir.path().join("server.conf"),
        format!(
            "listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{d}/js\" }}\ntls {{ cert_file: \"{d}/server.crt\"\n key_file: \"{d}/server.key\"\n ca_file: \"{d}/ca.crt\"\n verify: true }}\nauthorization {{ token: \"{token}\" }}\n"
        ),
    )
    .unwrap();
    let url = format!("tls://127.0.0.1:{port}");
    let (server, js) = own_server(dir.path(), &url, "tls", || async {
        async_nats::ConnectOptions::with_token(token.into())
            .add_root_certificates(dir.path().join("ca.crt"))
            .add_client_certificate(dir.path().join("client.crt"), dir.path().join("client.key"))
    })
    .await;

    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let sink = |client_cert: bool| {
        let mut s = format!(
            "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{url}\"\nsubject = \"tls.{{cluster}}.{{resource}}\"\ntoken = \"${{env:TEST_NATS_TOKEN}}\"\n[sink.nats.tls]\nrequired = true\nca_file = \"{d}/ca.crt\"\n"
        );
        if client_cert {
            s.push_str(&format!("cert_file = \"{d}/client.crt\"\nkey_file = \"{d}/client.key\"\n"));
        }
        s + "[delivery]\nshutdown_timeout_seconds = 5\n"
    };
    create_cm(&client, &ns.name, "secured", json!({}), json!({})).await;
    let env = [("TEST_NATS_TOKEN", token)];
    let mut k = Kubecast::start_with_sink(&config, &sink(false), "", &env);
    k.wait_ready_reason("sink").await;
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    let mut s = js.get_stream("TLS").await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 0, "refused without a client certificate");

    k.set_sink(&sink(true));
    k.restart(&env);
    let msgs = read_stream(&js, "TLS", "the event over mutual TLS", |m| !m.is_empty()).await;
    assert_eq!(msgs[0].subject, format!("tls.{cluster}.configmaps"));
    assert_eq!(msgs[0].json()["subject"], format!("{}/secured", ns.name));
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    assert!(!k.log().contains(token), "the token leaked");
    drop(server);
}

/// A credentials file (NATS operator mode: the user's JWT and nkey seed in one file, as `nsc`
/// writes it). A user of an account the server does not know is refused: a clear error, not
/// ready, nothing sent. The right file delivers. No seed or JWT of either file is logged.
#[tokio::test]
async fn credentials_file_refused_then_accepted() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-creds").await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let made = std::process::Command::new(common::env_var("NATS_CREDS_TOOL")).arg(&d).status().unwrap().success();
    assert!(made, "nats-creds (tests/env/nats/creds)");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::write(
        dir.path().join("server.conf"),
        format!("listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{d}/js\" }}\ninclude ./operator.conf\n"),
    )
    .unwrap();
    let url = format!("nats://127.0.0.1:{port}");
    let user = dir.path().join("user.creds");
    let (server, js) = own_server(dir.path(), &url, "creds", || {
        let user = user.clone();
        async move { async_nats::ConnectOptions::with_credentials_file(user).await.expect("user.creds") }
    })
    .await;

    let cluster = cluster_name();
    let config = format!("[cluster]\nname = \"{cluster}\"\n{}", cm_resource(&ns.name, ""));
    let sink = |file: &str| {
        format!(
            "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{url}\"\nsubject = \"creds.{{cluster}}.{{resource}}\"\ncredentials_file = \"{d}/{file}\"\n[delivery]\nshutdown_timeout_seconds = 5\n"
        )
    };
    create_cm(&client, &ns.name, "signed", json!({}), json!({})).await;
    let mut k = Kubecast::start_with_sink(&config, &sink("stranger.creds"), "", &[]);
    k.wait_log("NATS refused the credentials", 1).await;
    k.wait_ready_reason("sink").await;
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    let mut s = js.get_stream("CREDS").await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 0, "nothing sent as the unknown account's user");
    assert!(k.checkpoints().iter().all(|c| c["objects"].as_array().is_none_or(|o| o.is_empty())));

    k.set_sink(&sink("user.creds"));
    k.restart(&[]);
    k.wait_ready(200).await;
    let msgs = read_stream(&js, "CREDS", "the event, as the account's user", |m| !m.is_empty()).await;
    assert_eq!(msgs[0].subject, format!("creds.{cluster}.configmaps"));
    assert_eq!(msgs[0].json()["subject"], format!("{}/signed", ns.name));
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    let log = k.log();
    for file in ["user.creds", "stranger.creds"] {
        let text = std::fs::read_to_string(dir.path().join(file)).unwrap();
        for secret in text.lines().filter(|l| l.starts_with("SU") || l.starts_with("eyJ")) {
            assert!(!log.contains(secret), "a line of {file} leaked into the log");
        }
    }
    drop(server);
}

/// Starts a nats-server of the test's own on `dir/server.conf` (log in `dir/nats.log`),
/// connects to it with `options` (made anew for each attempt) once it accepts them, and
/// creates the stream `PREFIX` (uppercase) over the subjects `prefix.>`.
async fn own_server<F, O>(
    dir: &std::path::Path,
    url: &str,
    prefix: &str,
    options: F,
) -> (ChildGuard, jetstream::Context)
where
    F: Fn() -> O,
    O: std::future::Future<Output = async_nats::ConnectOptions>,
{
    let log = std::fs::File::create(dir.join("nats.log")).unwrap();
    let mut server = ChildGuard(
        std::process::Command::new(common::env_var("NATS_SERVER"))
            .arg("-c")
            .arg(dir.join("server.conf"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("nats-server"),
    );
    let deadline = Instant::now() + WAIT;
    loop {
        match options().await.connect(url).await {
            Ok(c) => {
                let js = jetstream::new(c);
                let (name, subjects) = (prefix.to_uppercase(), vec![format!("{prefix}.>")]);
                js.create_stream(stream::Config { name, subjects, ..Default::default() }).await.unwrap();
                return (server, js);
            }
            Err(e) => {
                let log = std::fs::read_to_string(dir.join("nats.log")).unwrap_or_default();
                assert!(server.0.try_wait().unwrap().is_none(), "nats-server exited: {e}\n{log}");
                assert!(Instant::now() < deadline, "nats-server never accepted the test client: {e}\n{log}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A nats-server of this test's own stopped and started again on the same port and store:
/// kubecast reconnects by itself (jittered backoff, forever), and the change made while the
/// server was away arrives after it is back.
#[tokio::test]
async fn kubecast_reconnects_after_the_server_was_away() {
    let _shared = shared();
    let client = client().await;
    let ns = TestNamespace::new(&client, "nats-reconnect").await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    std::fs::write(
        dir.path().join("server.conf"),
        format!("listen: 127.0.0.1:{port}\njetstream {{ store_dir: \"{d}/js\" }}\n"),
    )
    .unwrap();
    let url = format!("nats://127.0.0.1:{port}");
    let (server, js) = own_server(dir.path(), &url, "away", || async { async_nats::ConnectOptions::new() }).await;
    let config = format!("[cluster]\nname = \"{}\"\n{}", cluster_name(), cm_resource(&ns.name, ""));
    let sink =
        format!("[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{url}\"\nsubject = \"away.{{cluster}}.{{resource}}\"\n");
    create_cm(&client, &ns.name, "before", json!({}), json!({})).await;
    let mut k = Kubecast::start_with_sink(&config, &sink, "", &[]);
    let subject_of = |m: &Msg| m.json()["subject"].as_str().unwrap_or_default().to_string();
    read_stream(&js, "AWAY", "the change before", |m| m.iter().any(|m| subject_of(m).ends_with("/before"))).await;

    drop(server);
    k.wait_log("disconnected from NATS; reconnecting", 1).await;
    create_cm(&client, &ns.name, "during", json!({}), json!({})).await;
    k.wait_ready_reason("sink").await;
    let (server, js) = own_server(dir.path(), &url, "away", || async { async_nats::ConnectOptions::new() }).await;
    let msgs = read_stream(&js, "AWAY", "the change made while away", |m| {
        m.iter().any(|m| subject_of(m).ends_with("/during"))
    })
    .await;
    let during = msgs.iter().filter(|m| subject_of(m).ends_with("/during")).count();
    assert_eq!(during, 1, "delivered once (Nats-Msg-Id)");
    k.wait_log("connected to NATS", 2).await;
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    drop(server);
}
