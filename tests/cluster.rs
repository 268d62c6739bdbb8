//! The chart's whole lifecycle on a real node (`tests/env/node`): the image built by
//! `docker/build`, `helm install` / `upgrade`, `kubectl delete pod`, `kubectl drain` with the
//! PodDisruptionBudget, an OOM kill; each under a steady ~50 changes/s read by an independent
//! consumer (tests/kit `traffic`) that judges the result: nothing lost, per-object order,
//! duplicates counted (at least once) or refused (exactly once). The pods' metrics, sampled
//! every 100 ms, say who published when: never two at once, and how long each handover took.

use kubecast_kit as common;

use std::time::Duration;

use common::node::{self, Publishers, Publishing, kubectl, kubectl_try, pods};
use common::traffic::{Delivery, Source, Traffic, Verdict};
use common::{TestNamespace, client};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use serde_json::{Value, json};

/// Only one release on the node at a time: its two cores are the pods' too.
static NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WAIT: Duration = Duration::from_secs(120);
const RATE: u64 = 50;
/// Objects created before the install: listed once (origin = snapshot), never again, however
/// often the active pod changes (the state is resumed from the broker).
const STATIC: usize = 10;

#[derive(Clone, Copy, PartialEq)]
enum Sink {
    Kafka {
        exactly_once: bool,
    },
    Nats,
    /// The CloudEvents HTTP receiver example, on the node's host address; the positions in a
    /// NATS key-value bucket (the receiver keeps none).
    Http,
}

/// A release of the chart in a namespace of its own, watching ConfigMaps of another one (the
/// load's), publishing to a topic (or stream) of its own.
struct Release {
    ns: TestNamespace,
    /// Every kubecast container's log, kept after its pod is gone.
    _logs: node::LogKeeper,
    load: TestNamespace,
    topic: String,
    sink: Sink,
    receiver: Option<common::receiver::Receiver>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.expect("a blocking step")
}

/// `a` with `b`'s keys merged in, recursively (what helm does with several values files).
fn merged(mut a: Value, b: &Value) -> Value {
    if let (Some(a), Some(b)) = (a.as_object_mut(), b.as_object()) {
        for (k, v) in b {
            let cur = a.remove(k).unwrap_or(Value::Null);
            a.insert(k.clone(), if cur.is_object() && v.is_object() { merged(cur, v) } else { v.clone() });
        }
        return Value::Object(a.clone());
    }
    b.clone()
}

impl Release {
    async fn new(sink: Sink) -> Self {
        node::require();
        let client = client().await;
        let ns = TestNamespace::new(&client, "rel").await;
        // What the controller-manager's root-ca-cert-publisher (off on the test node, see
        // tests/env/README.md) puts in every namespace: the pods' token volume mounts it.
        let ca = std::fs::read_to_string(common::env_var("KUBECAST_TEST_CA")).expect("the apiserver's CA");
        common::create_cm(&client, &ns.name, "kube-root-ca.crt", json!({}), json!({"ca.crt": ca})).await;
        let load = TestNamespace::new(&client, "load").await;
        for i in 0..STATIC {
            common::create_cm(&client, &load.name, &format!("static-{i}"), json!({}), json!({"v": "0"})).await;
        }
        let topic = common::unique("cluster");
        let logs = node::LogKeeper::start(&ns.name, Self::selector());
        eprintln!("[cluster] {topic}: the pods' logs are kept in {}", logs.dir.display());
        // On 127.0.0.1: what the node's pods send to the host address reaches it (a DNAT rule).
        let receiver = (sink == Sink::Http).then(|| common::receiver::Receiver::start(&[]));
        Self { ns, load, topic, sink, receiver, _logs: logs }
    }

    fn api(&self, client: &kube::Client) -> Api<ConfigMap> {
        Api::namespaced(client.clone(), &self.load.name)
    }

    /// The values every install here starts from, then `extra`.
    fn values(&self, extra: Value) -> Value {
        let (repo, tag) = node::image();
        let sink = match self.sink {
            Sink::Kafka { exactly_once } => json!({
                "type": "kafka",
                "kafka": {"brokers": common::env_var("KAFKA_NODE_BROKERS"), "topic": self.topic,
                          "mode": "structured", "exactly_once": exactly_once}
            }),
            Sink::Nats => json!({
                "type": "nats",
                "nats": {"url": common::env_var("NATS_NODE_URL"), "subject": format!("{}.{{namespace}}", self.topic),
                         "create_stream": true, "stream": {"name": self.topic, "subjects": [format!("{}.>", self.topic)]}}
            }),
            Sink::Http => json!({
                "type": "http",
                "http": {"url": self.receiver.as_ref().expect("the receiver").url().replace("127.0.0.1", &common::env_var("KUBECAST_NODE_HOST_IP")), "mode": "structured"}
            }),
        };
        let checkpoint = match self.sink {
            Sink::Kafka { .. } => {
                json!({"flush_interval_ms": 200, "kafka": {"topic": format!("{}-state", self.topic)}})
            }
            Sink::Nats => json!({"flush_interval_ms": 200, "nats": {"bucket": format!("{}-state", self.topic)}}),
            Sink::Http => json!({"store": "nats", "flush_interval_ms": 200,
                                 "nats": {"bucket": format!("{}-state", self.topic), "url": common::env_var("NATS_NODE_URL")}}),
        };
        merged(
            json!({
                "image": {"repository": repo, "tag": tag, "pullPolicy": "Never"},
                "logFormat": "text",
                "logLevel": "info,kubecast=debug",
                "config": {
                    "cluster": {"name": self.topic},
                    "checkpoint": checkpoint,
                    "sink": sink,
                    "delivery": {"shutdown_timeout_seconds": 10},
                    "resources": [{"api_version": "v1", "kind": "ConfigMap", "resource": "configmaps",
                                   "namespaces": [self.load.name]}]
                }
            }),
            &extra,
        )
    }

    fn source(&self) -> Source {
        match self.sink {
            Sink::Kafka { exactly_once } => Source::Kafka {
                brokers: common::env_var("KAFKA_BROKERS"),
                topic: self.topic.clone(),
                read_committed: exactly_once,
            },
            Sink::Nats => Source::Nats { url: common::env_var("NATS_URL"), stream: self.topic.clone() },
            Sink::Http => Source::HttpLog { path: self.receiver.as_ref().expect("the receiver").log.clone() },
        }
    }

    fn selector() -> &'static str {
        "app.kubernetes.io/instance=kubecast"
    }

    /// `helm install` or `helm upgrade` with `values`, then `kubectl rollout status`.
    async fn helm(&self, verb: &'static str, values: &Value) {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), serde_json::to_vec(values).unwrap()).unwrap();
        let (ns, path) = (self.ns.name.clone(), file.path().to_owned());
        blocking(move || {
            let chart = common::repo_root().join("charts/kubecast");
            node::helm(&[verb, "kubecast", chart.to_str().unwrap(), "-n", &ns, "-f", path.to_str().unwrap()]);
            node::rollout(&ns, "kubecast");
        })
        .await;
    }

    /// Pods of the release that are not being deleted.
    fn pods(&self) -> Vec<node::Pod> {
        pods(&self.ns.name, Self::selector()).into_iter().filter(|p| !p.deleting).collect()
    }

    /// The pods whose `kubecast_leader` is 1.
    fn leaders(&self) -> Vec<String> {
        self.pods()
            .into_iter()
            .filter(|p| node::metrics(&p.ip).is_some_and(|m| node::sum(&m, "kubecast_leader") == 1.0))
            .map(|p| p.name)
            .collect()
    }

    /// Waits until exactly one pod leads; its name.
    async fn one_leader(&self) -> String {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let l = self.leaders();
            if l.len() == 1 {
                return l[0].clone();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not exactly one leader after {WAIT:?}: {l:?}, pods {:?}",
                self.pods()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Logs of every pod of the release (for a failure's message).
    /// Deletes the release's only pod and waits until its replacement leads.
    async fn replace_the_pod(&self) {
        let pod = self.pods().remove(0).name;
        let ns = self.ns.name.clone();
        blocking(move || kubectl(&["-n", &ns, "delete", "pod", &pod, "--wait=true"])).await;
        node::rollout(&self.ns.name, "kubecast");
        self.one_leader().await;
    }

    fn logs(&self) -> String {
        let (_, out) = kubectl_try(&["-n", &self.ns.name, "logs", "-l", Self::selector(), "--tail=40", "--prefix"]);
        out
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = kubectl_try(&["delete", "namespace", &self.ns.name, "--wait=false"]);
    }
}

/// Every static object listed once, never again (the state resumed, no snapshot).
fn no_second_snapshot(events: &[common::traffic::Seen]) {
    for i in 0..STATIC {
        let name = format!("static-{i}");
        let n =
            events.iter().filter(|e| e.name == name).map(|e| e.id.as_str()).collect::<std::collections::HashSet<_>>();
        assert_eq!(n.len(), 1, "{name} listed once (the state resumed from the broker, no second snapshot)");
    }
}

/// A figure for the test output, also when the test passes (the harness captures `println!`):
/// the handover gaps are this suite's measurements.
fn figure(line: String) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "[cluster] {line}");
}

/// Never two publishers longer than one sampling interval (a handover's boundary).
fn one_publisher(p: &Publishing, what: &str) {
    figure(format!("{what}: publishers {:?}; handovers (old -> new, gap): {:?}", p.publishers, p.handovers));
    assert!(
        p.overlap_intervals <= 1,
        "{what}: {:?} published at once for {} x 100 ms",
        p.overlap_pods,
        p.overlap_intervals
    );
}

fn report(what: &str, v: &Verdict) {
    figure(format!(
        "{what}: {} changes written, {} events read, {} duplicates",
        v.written.count(),
        v.seen,
        v.duplicates
    ));
}

/// Each pod mounts the ConfigMap its own template names, and that ConfigMap holds the config
/// whose checksum the template carries: no pod runs a config its template did not carry.
fn pods_run_their_own_config(r: &Release) {
    let list: Value =
        serde_json::from_str(&kubectl(&["-n", &r.ns.name, "get", "pods", "-l", Release::selector(), "-o", "json"]))
            .unwrap();
    for p in list["items"].as_array().unwrap() {
        let name = p["metadata"]["name"].as_str().unwrap();
        let want = p["metadata"]["annotations"]["checksum/config"].as_str().expect("checksum/config on the pod");
        let cm = p["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "kubecast-config")
            .and_then(|v| v["configMap"]["name"].as_str())
            .expect("a config volume");
        let (ok, data) =
            kubectl_try(&["-n", &r.ns.name, "get", "configmap", cm, "-o", "jsonpath={.data.kubecast\\.toml}"]);
        if !ok {
            continue; // gone with its ReplicaSet: a pod of it cannot start any more
        }
        use sha2::Digest;
        let got = format!("{:x}", sha2::Sha256::digest(data.as_bytes()));
        assert_eq!(got, want, "pod {name} mounts ConfigMap {cm}, whose content is not its template's");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_install_upgrade_delete_drain_and_crash_lose_nothing() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: false }).await;
    let client = client().await;
    let ha = json!({"replicas": 2, "coordination": {"enabled": true}, "podDisruptionBudget": {"enabled": true}});
    r.helm("install", &r.values(ha.clone())).await;
    let first = r.one_leader().await;
    println!("installed: {} pods Ready, {first} leads", r.pods().len());

    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());

    // helm upgrade with another config, under load.
    let watch = Publishers::start(&r.ns.name, Release::selector());
    let mut v2 = r.values(ha.clone());
    v2["config"]["cluster"]["qps"] = json!(30);
    r.helm("upgrade", &v2).await;
    pods_run_their_own_config(&r);
    let leader = r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the upgrade: {}", r.logs());
    one_publisher(&watch.finish(), "helm upgrade");

    // kubectl delete pod of the active one: the standby takes over.
    let watch = Publishers::start(&r.ns.name, Release::selector());
    let ns = r.ns.name.clone();
    let gone = leader.clone();
    blocking(move || kubectl(&["-n", &ns, "delete", "pod", &gone, "--wait=true"])).await;
    let next = r.one_leader().await;
    assert_ne!(next, leader, "another pod leads after the active one was deleted");
    assert!(traffic.flowing(50, WAIT).await, "events flow after the delete: {}", r.logs());
    node::rollout(&r.ns.name, "kubecast");
    one_publisher(&watch.finish(), "kubectl delete pod (clean stop)");

    // kubectl drain with the PDB: one pod is evicted, the other stays (its replacement cannot
    // be scheduled on the cordoned node), events keep flowing; uncordon brings the second back.
    let watch = Publishers::start(&r.ns.name, Release::selector());
    let node_name = common::env_var("KUBECAST_NODE");
    let n = node_name.clone();
    let (drained, out) = blocking(move || {
        let selector = format!("--pod-selector={}", Release::selector());
        kubectl_try(&["drain", &n, "--ignore-daemonsets", "--delete-emptydir-data", &selector, "--timeout=25s"])
    })
    .await;
    let running: Vec<_> = r.pods().into_iter().filter(|p| p.ready).collect();
    println!(
        "drain: finished = {drained}; pods still Ready: {:?}",
        running.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
    assert!(!drained, "the PDB (minAvailable 1) keeps the drain from evicting the last pod: {out}");
    assert_eq!(running.len(), 1, "one pod is left running by the drain");
    r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow during the drain: {}", r.logs());
    kubectl(&["uncordon", &node_name]);
    node::rollout(&r.ns.name, "kubecast");
    one_publisher(&watch.finish(), "kubectl drain");

    // A crash: the active kubecast SIGKILLed (no final checkpoint, the Lease not given up): the
    // standby takes over once the Lease expires; the kubelet restarts the killed container.
    let leader = r.one_leader().await;
    // The leader's identity in the Lease: its pod's name and uid (what a replacement of the
    // same name, or a replica given the same configured identity, does not share).
    let uid = kubectl(&["-n", &r.ns.name, "get", "pod", &leader, "-o", "jsonpath={.metadata.uid}"]);
    // The release's Lease (`kubecast`), not the replicas' member Leases (each names its own).
    let holders = kubectl(&["-n", &r.ns.name, "get", "lease", "kubecast", "-o", "jsonpath={.spec.holderIdentity}"]);
    let identity = format!("{leader}-{}", uid.trim().replace('-', "").get(..8).expect("a pod uid"));
    // (`-<pid>` follows where kubecast is not the container's first process.)
    let held_as = |h: &str| h.strip_prefix(&identity).is_some_and(|r| r.is_empty() || r.starts_with('-'));
    assert!(holders.split_whitespace().any(held_as), "{identity} holds the Lease: {holders}");
    let restarts = |pod: &str| r.pods().into_iter().find(|p| p.name == pod).map_or(0, |p| p.restarts);
    let before = restarts(&leader);
    let watch = Publishers::start(&r.ns.name, Release::selector());
    let killed = std::time::Instant::now();
    assert!(node::kill9_pod(&leader), "the kubecast process of {leader} found and killed");
    // The new leader: the standby once the Lease expired, or the killed pod's restarted
    // container (the same pod, the same identity: it takes the Lease back at once).
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let l = r.leaders();
        if l.len() == 1 && (l[0] != leader || restarts(&leader) > before) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no new leader after the crash: {l:?}, {:?}", r.pods());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(traffic.flowing(50, WAIT).await, "events flow after the crash: {}", r.logs());
    node::rollout(&r.ns.name, "kubecast");
    let p = watch.finish();
    figure(format!("crash: the first event of the new leader {:?} after the kill", p.first_after(killed)));
    one_publisher(&p, "active pod killed (crash)");

    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report("install, upgrade, delete, drain, crash", &verdict);
    no_second_snapshot(&verdict.events);
}

/// One replica installed with `sink`, its pod deleted under load: the Deployment's
/// replacement resumes from the stored positions; nothing lost, no second snapshot.
async fn install_and_delete_the_pod(sink: Sink, what: &str) {
    let _node = NODE.lock().await;
    let r = Release::new(sink).await;
    let client = client().await;
    r.helm("install", &r.values(json!({}))).await;
    r.one_leader().await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());
    r.replace_the_pod().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the pod was replaced: {}", r.logs());
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report(what, &verdict);
    no_second_snapshot(&verdict.events);
}

/// The NATS sink; the positions in its key-value bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_install_and_a_deleted_pod_lose_nothing() {
    install_and_delete_the_pod(Sink::Nats, "NATS install and delete pod").await;
}

/// The HTTP sink from a pod to a CloudEvents receiver, the positions in NATS; the events judged
/// from the receiver's own log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_install_and_a_deleted_pod_lose_nothing() {
    install_and_delete_the_pod(Sink::Http, "HTTP install and delete pod").await;
}

/// Waits until the release's pods hold every one of `count` shards between them
/// (`kubecast_shard_held` of `<i>-of-<count>`), each once.
async fn all_shards_held(r: &Release, count: u32) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut held = Vec::new();
        for p in r.pods() {
            if let Some(m) = node::metrics(&p.ip) {
                held.extend(
                    m.iter()
                        .filter(|(k, v)| k.starts_with("kubecast_shard_held{") && **v == 1.0)
                        .filter(|(k, _)| k.contains(&format!("-of-{count}\"")))
                        .map(|(k, _)| k.clone()),
                );
            }
        }
        let distinct: std::collections::BTreeSet<_> = held.iter().collect();
        if held.len() == count as usize && distinct.len() == count as usize {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the {count} shards never all held once: {held:?}\n{}", r.logs());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The largest gap between two events read, in the order read.
fn largest_gap(events: &[common::traffic::Seen]) -> Duration {
    let mut at: Vec<std::time::Instant> = events.iter().map(|e| e.at).collect();
    at.sort();
    at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default()
}

/// `helm upgrade` of `coordination.shards` from 2 to 4 and then to 3, 2 replicas, exactly-once,
/// under load: every change once for a read_committed consumer, no second snapshot (each count
/// resumes from the last one's positions), and the largest gap between events printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_through_helm_upgrades_of_the_shard_count() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: true }).await;
    let client = client().await;
    let values = |shards: u32| r.values(json!({"replicas": 2, "coordination": {"enabled": true, "shards": shards}}));
    r.helm("install", &values(2)).await;
    all_shards_held(&r, 2).await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());
    let mut gaps = Vec::new();
    for shards in [4, 3] {
        let before = traffic.events().len();
        r.helm("upgrade", &values(shards)).await;
        all_shards_held(&r, shards).await;
        assert!(traffic.flowing(50, WAIT).await, "events flow with {shards} shards: {}", r.logs());
        gaps.push((shards, largest_gap(&traffic.events()[before.saturating_sub(1)..])));
    }
    let verdict = traffic.finish(Delivery::ExactlyOnce, WAIT).await;
    report("shards 2 -> 4 -> 3, exactly once", &verdict);
    figure(format!("shards 2 -> 4 -> 3: largest gap between events after each upgrade: {gaps:?}"));
    no_second_snapshot(&verdict.events);
}

/// The way managed Kafka services run: the sink and the state store over SASL_SSL
/// (SCRAM-SHA-512) from a pod, the password from a Secret (`secretEnv`), the broker's CA from
/// a ConfigMap mounted over the image's system CA bundle (`extraVolumes`), with no CA in the
/// config. Events flow, the replacement of the pod resumes from the state in Kafka, and the
/// password is in no log line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_over_sasl_ssl_from_a_pod_with_a_secret_and_the_system_ca_bundle() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: false }).await;
    let client = client().await;
    let password = common::env_var("KAFKA_SCRAM_PASSWORD");
    let ca = std::fs::read_to_string(common::env_var("KAFKA_CA_FILE")).expect("the test broker's CA");
    common::create_cm(&client, &r.ns.name, "kafka-ca", json!({}), json!({"ca.crt": ca})).await;
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": "kafka-credentials"},
        "stringData": {"password": password}
    }))
    .unwrap();
    Api::namespaced(client.clone(), &r.ns.name).create(&Default::default(), &secret).await.expect("the Secret");
    let mut values = r.values(json!({
        "secretEnv": [{"name": "KAFKA_PASSWORD", "secretName": "kafka-credentials", "key": "password"}],
        "extraVolumes": [{"name": "kafka-ca", "configMap": {"name": "kafka-ca"}}],
        // The image's system CA bundle replaced by the test CA: no `ssl.ca.location` in the
        // config, kubecast finds the bundle itself (librdkafka's own OpenSSL would not).
        "extraVolumeMounts": [{"name": "kafka-ca", "mountPath": "/etc/ssl/certs/ca-certificates.crt",
                               "subPath": "ca.crt", "readOnly": true}]
    }));
    values["config"]["sink"]["kafka"]["brokers"] = json!(common::env_var("KAFKA_NODE_SASL_SSL_BROKERS"));
    values["config"]["sink"]["kafka"]["properties"] = json!({
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": common::env_var("KAFKA_SCRAM_USER"),
        "sasl.password": "${env:KAFKA_PASSWORD}"
    });
    r.helm("install", &values).await;
    r.one_leader().await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow over SASL_SSL: {}", r.logs());
    r.replace_the_pod().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the pod was replaced: {}", r.logs());
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report("Kafka over SASL_SSL from a pod", &verdict);
    no_second_snapshot(&verdict.events);
    // Every container's log, the replaced pod's too (kept by the release's log keeper).
    let logs: String = std::fs::read_dir(&r._logs.dir)
        .unwrap()
        .map(|f| std::fs::read_to_string(f.unwrap().path()).unwrap_or_default())
        .collect();
    assert!(logs.contains("kubecast running"), "the pods' logs were kept: {}", r._logs.dir.display());
    assert!(!logs.contains(&password), "the SCRAM password is in no log line");
}

/// Sidecar mode: the chart's PodTemplate's container and volumes added to a Deployment of 3
/// replicas of another workload; one of the three kubecasts is active.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecar_in_three_replicas_one_active() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: false }).await;
    let client = client().await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        serde_json::to_vec(&r.values(json!({"mode": "sidecar", "coordination": {"enabled": true}}))).unwrap(),
    )
    .unwrap();
    let chart = common::repo_root().join("charts/kubecast");
    node::helm(&[
        "install",
        "kubecast",
        chart.to_str().unwrap(),
        "-n",
        &r.ns.name,
        "-f",
        file.path().to_str().unwrap(),
    ]);
    let tpl: Value =
        serde_json::from_str(&kubectl(&["-n", &r.ns.name, "get", "podtemplate", "kubecast-sidecar", "-o", "json"]))
            .unwrap();
    let spec = &tpl["template"]["spec"];
    let mut containers = spec["containers"].as_array().unwrap().clone();
    containers.push(
        json!({"name": "app", "image": common::env_var("KUBECAST_NODE_IMAGE_PAUSE"), "imagePullPolicy": "Never"}),
    );
    let host = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "host", "namespace": r.ns.name},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "host"}},
            "template": {
                "metadata": {"labels": {"app": "host", "app.kubernetes.io/instance": "kubecast"},
                             "annotations": tpl["template"]["metadata"]["annotations"].clone()},
                "spec": {"serviceAccountName": spec["serviceAccountName"], "containers": containers,
                         "volumes": spec["volumes"], "securityContext": spec["securityContext"]}
            }
        }
    });
    let manifest = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(manifest.path(), serde_json::to_vec(&host).unwrap()).unwrap();
    kubectl(&["apply", "-f", manifest.path().to_str().unwrap()]);
    let ns = r.ns.name.clone();
    blocking(move || node::rollout(&ns, "host")).await;
    assert_eq!(r.pods().len(), 3, "three host pods, each with a kubecast sidecar");
    let leader = r.one_leader().await;
    println!("sidecar: 3 replicas Ready, {leader} leads");

    let watch = Publishers::start(&r.ns.name, Release::selector());
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(100, WAIT).await, "events flow from the sidecars: {}", r.logs());
    let p = watch.finish();
    one_publisher(&p, "sidecar, 3 replicas");
    assert_eq!(p.publishers, vec![leader.clone()], "only the leader publishes");
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report("sidecar", &verdict);
}

/// From 1 replica without coordination to 2 with it, with another config, under load: the old
/// pod (no Lease) must be gone before any new pod publishes, and no pod of the old ReplicaSet
/// may run the new config.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_to_two_with_the_lease_never_two_publishers() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: false }).await;
    let client = client().await;
    r.helm("install", &r.values(json!({}))).await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());

    let watch = Publishers::start(&r.ns.name, Release::selector());
    let mut v2 = r.values(json!({"replicas": 2, "coordination": {"enabled": true}}));
    v2["config"]["cluster"]["qps"] = json!(25);
    r.helm("upgrade", &v2).await;
    pods_run_their_own_config(&r);
    r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the upgrade: {}", r.logs());
    one_publisher(&watch.finish(), "1 replica -> 2 with the Lease");
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report("1 -> 2 replicas", &verdict);
    no_second_snapshot(&verdict.events);
}

/// Exactly once: a rolling upgrade and a deleted active pod leave a read_committed consumer
/// with every change exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_through_a_rolling_upgrade_and_a_deleted_active_pod() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: true }).await;
    let client = client().await;
    let ha = json!({"replicas": 2, "coordination": {"enabled": true}, "podDisruptionBudget": {"enabled": true}});
    r.helm("install", &r.values(ha.clone())).await;
    r.one_leader().await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());

    let mut v2 = r.values(ha);
    v2["config"]["cluster"]["qps"] = json!(30);
    r.helm("upgrade", &v2).await;
    let leader = r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the upgrade: {}", r.logs());

    let ns = r.ns.name.clone();
    blocking(move || kubectl(&["-n", &ns, "delete", "pod", &leader, "--wait=true"])).await;
    r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the delete: {}", r.logs());
    let verdict = traffic.finish(Delivery::ExactlyOnce, WAIT).await;
    report("exactly once: upgrade and delete", &verdict);
    no_second_snapshot(&verdict.events);
}

/// A pod OOM-killed by a small memory limit (a stream that keeps the previous version of every
/// object, `keep_previous`, meets objects larger than the limit allows), then the limit raised
/// (`helm upgrade`): the replacement resumes from the broker state, no snapshot, nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oom_killed_pod_and_its_replacement_lose_nothing() {
    let _node = NODE.lock().await;
    let r = Release::new(Sink::Kafka { exactly_once: false }).await;
    let client = client().await;
    let small = |limit: &str| {
        let mut v = r.values(json!({"resources": {"limits": {"memory": limit}, "requests": {"memory": "32Mi"}}}));
        v["config"]["resources"][0]["keep_previous"] = json!(true);
        v
    };
    r.helm("install", &small("64Mi")).await;
    let traffic = Traffic::start_after(&r.api(&client), r.source(), 20, RATE, STATIC, WAIT).await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the install: {}", r.logs());

    // ~100 MB of objects, each kept in memory: more than 64 MiB.
    let api = r.api(&client);
    let big = "x".repeat(400 * 1024);
    for i in 0..250 {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": format!("big-{i}")}, "data": {"v": big}})).unwrap();
        api.create(&Default::default(), &cm).await.expect("a big ConfigMap");
        if pods(&r.ns.name, Release::selector()).iter().any(|p| p.last_terminated.as_deref() == Some("OOMKilled")) {
            break;
        }
    }
    let ns = r.ns.name.clone();
    let oom = blocking(move || {
        node::wait_until(WAIT, || {
            pods(&ns, Release::selector()).iter().any(|p| p.last_terminated.as_deref() == Some("OOMKilled"))
        })
    })
    .await;
    assert!(oom, "the kubecast container was OOM-killed at 64Mi: {:?}\n{}", r.pods(), r.logs());
    println!("OOMKilled: {:?}", r.pods().iter().map(|p| (&p.name, p.restarts, &p.last_terminated)).collect::<Vec<_>>());

    // The fix a user makes: a larger limit. The new pod resumes from the broker state.
    r.helm("upgrade", &small("512Mi")).await;
    r.one_leader().await;
    assert!(traffic.flowing(50, WAIT).await, "events flow after the limit was raised: {}", r.logs());
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    report("OOM kill, then a larger limit", &verdict);
    no_second_snapshot(&verdict.events);
}
