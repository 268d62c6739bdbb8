//! The consumer examples of `examples/consumers` (Python, Go, Java) against what kubecast
//! really publishes to the Kafka broker and the NATS JetStream server of tests/env: each
//! consumer rebuilds the view of a namespace's ConfigMaps from the topic or stream, and the
//! view must equal the apiserver's list of them (deletes included), after a kill -9 of kubecast
//! whose restart re-sends what its checkpoint did not cover yet: the consumers must drop those
//! duplicates (and say how many they dropped).
//!
//! The consumers are built by `tests/env/tools consumers` (run by `tests/run`), found through
//! the keys `CONSUMER_PYTHON`, `CONSUMER_GO`, `CONSUMER_JAVA` of the env file (or of the
//! process environment). Each is run as a subprocess and prints one JSON object.

use kubecast_kit as common;

use std::collections::{BTreeMap, HashSet};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use common::{Kubecast, TestNamespace, client, create_cms, names};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::Message;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

/// Where kubecast publishes, and how to read it back.
enum Target {
    /// A topic of its own with 3 partitions (the consumers merge them, keeping each one's order).
    Kafka { topic: String },
    /// A stream of its own over `prefix.>`, with a 1 s duplicate window: kubecast's re-sends
    /// after the restart come later than that, so JetStream stores them and the consumers must
    /// drop them.
    Nats { js: Box<jetstream::Context>, stream: String, prefix: String },
}

impl Target {
    async fn kafka() -> Self {
        let topic = common::unique("consumers");
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
        let t = NewTopic::new(&topic, 3, TopicReplication::Fixed(1));
        let r = admin.create_topics(&[t], &AdminOptions::new()).await.unwrap();
        r[0].as_ref().expect("topic created");
        Self::Kafka { topic }
    }

    async fn nats() -> Self {
        let client = async_nats::connect(common::env_var("NATS_URL")).await.expect("connect to nats");
        let js = jetstream::new(client);
        let prefix = common::unique("consumers").replace('-', "_");
        let stream = prefix.to_uppercase();
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("create stream");
        Self::Nats { js: Box::new(js), stream, prefix }
    }

    fn sink(&self, mode: &str) -> String {
        match self {
            Self::Kafka { topic } => format!(
                "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"{mode}\"\n",
                common::env_var("KAFKA_BROKERS")
            ),
            Self::Nats { prefix, .. } => format!(
                "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{prefix}.{{namespace}}\"\nmode = \"{mode}\"\n",
                common::env_var("NATS_URL")
            ),
        }
    }

    /// The consumers' options to read it.
    fn consumer_args(&self) -> Vec<String> {
        match self {
            Self::Kafka { topic } => {
                vec!["--kafka".into(), common::env_var("KAFKA_BROKERS"), "--topic".into(), topic.clone()]
            }
            Self::Nats { prefix, .. } => {
                vec!["--nats".into(), common::env_var("NATS_URL"), "--subject".into(), format!("{prefix}.>")]
            }
        }
    }

    /// `(source, id)` of every event on the topic or stream, read by this test itself (not by a
    /// consumer under test), in one mode: binary (attributes in headers) or structured.
    async fn events(&self) -> Vec<(String, String)> {
        match self {
            Self::Kafka { topic } => {
                let topic = topic.clone();
                tokio::task::spawn_blocking(move || kafka_events(&topic)).await.unwrap()
            }
            Self::Nats { js, stream, .. } => nats_events(js, stream).await,
        }
    }
}

impl Drop for Target {
    /// Deletes the topic or stream (best effort, on a runtime of its own: the test's may be
    /// shutting down).
    fn drop(&mut self) {
        let what = match self {
            Self::Kafka { topic } => Err(topic.clone()),
            Self::Nats { js, stream, .. } => Ok(((**js).clone(), stream.clone())),
        };
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let five = Duration::from_secs(5);
                match what {
                    Err(topic) => {
                        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                            .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
                            .create()
                            .unwrap();
                        let _ = tokio::time::timeout(five, admin.delete_topics(&[&topic], &AdminOptions::new())).await;
                    }
                    Ok((js, stream)) => {
                        let _ = tokio::time::timeout(five, js.delete_stream(&stream)).await;
                    }
                }
            });
        })
        .join()
        .ok();
    }
}

/// `(source, id)` of a binary-mode message (attributes in `prefix`ed headers) or a
/// structured-mode one (the event JSON).
fn source_and_id(header: impl Fn(&str) -> Option<String>, prefix: &str, payload: &[u8]) -> (String, String) {
    match (header(&format!("{prefix}source")), header(&format!("{prefix}id"))) {
        (Some(source), Some(id)) => (source, id),
        _ => {
            let e: Value = serde_json::from_slice(payload).expect("a structured-mode event");
            (e["source"].as_str().unwrap().to_string(), e["id"].as_str().unwrap().to_string())
        }
    }
}

fn kafka_events(topic: &str) -> Vec<(String, String)> {
    common::topic::read_to_end(topic, false)
        .iter()
        .map(|m| source_and_id(|k: &str| common::topic::header(m, k), "ce_", m.payload().unwrap_or_default()))
        .collect()
}

async fn nats_events(js: &jetstream::Context, name: &str) -> Vec<(String, String)> {
    let mut s = js.get_stream(name).await.expect("stream");
    let count = s.info().await.unwrap().state.messages as usize;
    let c = s
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::All,
            ack_policy: consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < count {
        assert!(Instant::now() < deadline, "timed out reading stream {name}");
        let mut batch = c.fetch().max_messages(500).expires(Duration::from_millis(500)).messages().await.unwrap();
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            let header = |k: &str| m.headers.as_ref()?.get(k).map(|v| v.to_string());
            out.push(source_and_id(header, "ce-", &m.payload));
        }
    }
    out
}

/// What a consumer printed.
#[derive(Debug)]
struct Output {
    view: BTreeMap<String, String>,
    stats: Value,
}

impl Output {
    fn stat(&self, name: &str) -> u64 {
        self.stats[name].as_u64().unwrap_or_else(|| panic!("no {name} in {}", self.stats))
    }
}

/// The command of a consumer example: the env file's `key`, else the process environment's.
fn consumer_command(key: &str) -> String {
    common::env().get(key).cloned().or_else(|| std::env::var(key).ok()).unwrap_or_else(|| {
        panic!(
            "{key} is neither in the test environment file nor set: build the consumers with tests/env/tools consumers"
        )
    })
}

/// Runs the consumers `keys` at once on `args` (bounded), and returns what each printed.
async fn run_consumers(keys: &[&'static str], args: &[String]) -> Vec<(&'static str, Output)> {
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for key in keys {
        let (out, err) = (dir.path().join(format!("{key}.out")), dir.path().join(format!("{key}.err")));
        let child = Command::new(consumer_command(key))
            .args(args)
            .args(["--idle-seconds", "3"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        children.push((*key, child, out, err));
    }
    let deadline = Instant::now() + WAIT;
    let mut outputs = Vec::new();
    for (key, mut child, out, err) in children {
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{key} did not finish in {WAIT:?}; stderr:\n{}", std::fs::read_to_string(&err).unwrap());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (stdout, stderr) = (std::fs::read_to_string(&out).unwrap(), std::fs::read_to_string(&err).unwrap());
        assert!(status.success(), "{key} failed ({status}); stdout:\n{stdout}\nstderr:\n{stderr}");
        let mut stats: Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("{key} printed no JSON ({e}): {stdout}\nstderr:\n{stderr}"));
        let view = stats.as_object_mut().and_then(|o| o.remove("view")).unwrap_or_default();
        let view = serde_json::from_value(view)
            .unwrap_or_else(|e| panic!("{key}: no view {{\"ns/name\": \"rv\"}} ({e}): {stdout}"));
        outputs.push((key, Output { view, stats }));
    }
    outputs
}

/// The apiserver's list of the namespace's ConfigMaps: `ns/name` -> resourceVersion.
async fn apiserver_view(client: &Client, ns: &str) -> BTreeMap<String, String> {
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| (format!("{ns}/{}", c.metadata.name.unwrap()), c.metadata.resource_version.unwrap()))
        .collect()
}

/// Creates `name`; returns the id of its `added` event.
async fn create(client: &Client, ns: &str, name: &str) -> String {
    let c = common::create_cm(client, ns, name, json!({}), json!({"v": "0"})).await;
    format!("{}:{}:added", c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap())
}

/// Waits until the event with `id` (`uid:rv:verb`) is on the target, then until kubecast's
/// stored position has reached it: the watch read everything before that change, and the
/// position never passes an unacknowledged event, so everything before it is published.
async fn wait_published(kc: &mut Kubecast, target: &Target, id: &str) {
    let deadline = Instant::now() + WAIT;
    while !target.events().await.iter().any(|(_, i)| i == id) {
        assert!(Instant::now() < deadline, "{id} never published\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let rv =
        id.split(':').nth(1).and_then(|rv| rv.parse().ok()).unwrap_or_else(|| panic!("no resourceVersion in {id}"));
    common::settle_at(kc, rv, id).await;
}

/// The scenario, for one target and mode, checked for each of `consumers`:
///
/// 0. c00..c19 exist; kubecast starts (snapshot: 20 `added`) and stops cleanly: its
///    checkpoint covers the snapshot.
/// 1. It runs again with checkpoints written only once an hour; 10 updates, 5 deletes, c15
///    deleted and created again (same name, new uid), 10 creates; then kill -9: the checkpoint
///    is still the one of step 0.
/// 2. While it is down: updates, a delete of an updated object, a delete of an object created
///    in step 1, creates.
/// 3. It starts again: its watch resumes from step 0's checkpoint and re-sends step 1 (same
///    ids: duplicates), then step 2 (new) and the changes made now.
async fn scenario(target: Target, mode: &str, consumers: &[&'static str]) {
    let client = client().await;
    let ns = TestNamespace::new(&client, "consumers").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let patch = |name: String, v: &'static str| {
        let api = api.clone();
        async move {
            api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"v": v}}))).await.unwrap();
        }
    };
    let delete = |name: String| {
        let api = api.clone();
        async move {
            api.delete(&name, &DeleteParams::default()).await.unwrap();
        }
    };
    create_cms(&client, &ns.name, &names("c", 0..20)).await;
    let config = common::cm_config(&ns.name, "");
    let mut kc = Kubecast::start_with_sink(&config, &target.sink(mode), "flush_interval_ms = 100", &[]);
    kc.wait_log("list complete", 1).await;
    assert!(kc.stop().success(), "{}", kc.log());

    // 1.
    kc.restart(&[("KUBECAST_CHECKPOINT__FLUSH_INTERVAL_MS", "3600000")]);
    kc.wait_ready(200).await;
    for name in names("c", 0..10) {
        patch(name, "1").await;
    }
    for name in names("c", 10..16) {
        delete(name).await;
    }
    create(&client, &ns.name, "c15").await;
    for name in names("p", 0..10) {
        create(&client, &ns.name, &name).await;
    }
    let last = create(&client, &ns.name, "zz-step1").await;
    let deadline = Instant::now() + WAIT;
    while !target.events().await.iter().any(|(_, i)| *i == last) {
        assert!(Instant::now() < deadline, "step 1 never published\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    kc.kill9();
    // Past the stream's duplicate window (NATS): the re-sends are stored, as on a server whose
    // window a long outage outlasted.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    // 2.
    for name in names("c", 0..5) {
        patch(name, "2").await;
    }
    delete("c01".into()).await;
    delete("p00".into()).await;
    for name in names("q", 0..5) {
        create(&client, &ns.name, &name).await;
    }

    // 3.
    kc.restart(&[]);
    patch("c02".into(), "3").await;
    let last = create(&client, &ns.name, "zz-step3").await;
    wait_published(&mut kc, &target, &last).await;

    let events = target.events().await;
    let distinct: HashSet<&(String, String)> = events.iter().collect();
    let duplicates = events.len() - distinct.len();
    assert!(duplicates > 0, "the restart re-sent nothing: the scenario proves no dedupe\n{}", kc.log());
    let expected = apiserver_view(&client, &ns.name).await;
    assert_eq!(expected.len(), 20 - 6 + 1 + 10 + 1 - 2 + 5 + 1, "{expected:?}");

    for (key, out) in run_consumers(consumers, &target.consumer_args()).await {
        eprintln!("{key}: {} objects, {}", out.view.len(), out.stats);
        assert_eq!(out.view, expected, "{key}: its view differs from the apiserver's list ({})", out.stats);
        assert_eq!(out.stat("events") as usize, events.len(), "{key}: events read ({})", out.stats);
        assert_eq!(out.stat("duplicates") as usize, duplicates, "{key}: duplicates dropped ({})", out.stats);
        assert_eq!(out.stat("applied") as usize, distinct.len(), "{key}: events applied ({})", out.stats);
        assert_eq!(out.stat(mode) as usize, events.len(), "{key}: every event parsed in {mode} mode ({})", out.stats);
    }
    assert!(kc.stop().success(), "{}", kc.log());
}

const ALL: &[&str] = &["CONSUMER_PYTHON", "CONSUMER_GO", "CONSUMER_JAVA"];
/// The Java example reads Kafka only.
const NATS: &[&str] = &["CONSUMER_PYTHON", "CONSUMER_GO"];

#[tokio::test]
async fn kafka_binary_mode_consumers_rebuild_the_view() {
    scenario(Target::kafka().await, "binary", ALL).await;
}

#[tokio::test]
async fn kafka_structured_mode_consumers_rebuild_the_view() {
    scenario(Target::kafka().await, "structured", ALL).await;
}

#[tokio::test]
async fn nats_binary_mode_consumers_rebuild_the_view() {
    scenario(Target::nats().await, "binary", NATS).await;
}

#[tokio::test]
async fn nats_structured_mode_consumers_rebuild_the_view() {
    scenario(Target::nats().await, "structured", NATS).await;
}

/// Exactly-once into Kafka, read with `--isolation read_committed`: kubecast is killed (-9)
/// while a transaction holds changes; its successor aborts it and sends them again. The topic
/// then holds the aborted records too (a `read_uncommitted` read sees duplicates), but each
/// consumer reading committed records sees every change once: no duplicate to drop, and the
/// view equals the apiserver's.
#[tokio::test]
async fn kafka_exactly_once_read_committed_consumers_see_each_change_once() {
    let target = Target::kafka().await;
    let Target::Kafka { topic } = &target else { unreachable!() };
    let client = client().await;
    let ns = TestNamespace::new(&client, "consumers-eos").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    create_cms(&client, &ns.name, &names("c", 0..10)).await;
    let sink = format!("{}exactly_once = true\n", target.sink("binary"));
    let state = format!("flush_interval_ms = 100\nstore = \"kafka\"\n[checkpoint.kafka]\ntopic = \"{topic}-state\"\n");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, &state, &[]);
    kc.wait_ready(200).await;
    // Changes into a transaction not committed before the kill: a commit every 30 s (the most
    // exactly-once allows), the kill within seconds.
    assert!(kc.stop().success(), "{}", kc.log());
    kc.restart(&[("KUBECAST_CHECKPOINT__FLUSH_INTERVAL_MS", "30000")]);
    kc.wait_ready(200).await;
    for name in names("c", 0..5) {
        api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "1"}}))).await.unwrap();
    }
    let last = create(&client, &ns.name, "p00").await;
    let deadline = Instant::now() + WAIT;
    while !target.events().await.iter().any(|(_, i)| *i == last) {
        assert!(Instant::now() < deadline, "the open transaction's records never reached the topic\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    kc.kill9();
    kc.restart(&[]);
    let last = create(&client, &ns.name, "zz-last").await;
    wait_published(&mut kc, &target, &last).await;

    let events = target.events().await;
    let distinct: HashSet<&(String, String)> = events.iter().collect();
    assert!(events.len() > distinct.len(), "no aborted record in the topic: the scenario proves nothing\n{}", kc.log());
    let expected = apiserver_view(&client, &ns.name).await;
    let mut args = target.consumer_args();
    args.extend(["--isolation".to_string(), "read_committed".to_string()]);
    for (key, out) in run_consumers(ALL, &args).await {
        eprintln!("{key} (read_committed): {} objects, {}", out.view.len(), out.stats);
        assert_eq!(out.view, expected, "{key}: its view differs from the apiserver's list ({})", out.stats);
        assert_eq!(out.stat("duplicates"), 0, "{key}: read_committed sees each change once ({})", out.stats);
        assert_eq!(out.stat("applied") as usize, distinct.len(), "{key}: every change ({})", out.stats);
    }
    assert!(kc.stop().success(), "{}", kc.log());
}
