//! Clients for the test apiservers, namespaces and ConfigMaps.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::env::kubeconfig;

/// An admin client for the test apiserver.
pub async fn client() -> Client {
    client_for(&kubeconfig()).await
}

/// A client for the apiserver of the kubeconfig file `kubeconfig`.
pub async fn client_for(kubeconfig: &str) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.expect("kubeconfig");
    Client::try_from(cfg).expect("client")
}

/// Creates ConfigMap `name` with `labels` and `data`.
pub async fn create_cm(client: &Client, ns: &str, name: &str, labels: Value, data: Value) -> ConfigMap {
    let cm: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": labels}, "data": data
    }))
    .unwrap();
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await
        .expect("create configmap")
}

/// Creates ConfigMaps `names` (data `v = "0"`) concurrently; returns name -> (uid, resourceVersion).
pub async fn create_cms(client: &Client, ns: &str, names: &[String]) -> HashMap<String, (String, String)> {
    use futures::StreamExt;
    futures::stream::iter(names.iter().cloned())
        .map(|name| async move {
            let c = create_cm(client, ns, &name, serde_json::json!({}), serde_json::json!({"v": "0"})).await;
            (name, (c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap()))
        })
        .buffer_unordered(8)
        .collect()
        .await
}

/// `prefix00`, `prefix01`, ... for `range`.
pub fn names(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i:02}")).collect()
}

/// A config watching the ConfigMaps of `ns`, with `cluster_extra` lines in `[cluster]`.
pub fn cm_config(ns: &str, cluster_extra: &str) -> String {
    format!(
        "[cluster]\nname = \"e2e\"\n{cluster_extra}\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n"
    )
}

/// [`cm_config`] with `[coordination]` on Lease `lease` in `ns`, with short timings (lease 4 s,
/// renew deadline 2 s, retry 1 s) so that takeovers happen within seconds.
pub fn lease_cm_config(ns: &str, lease: &str) -> String {
    cm_config(
        ns,
        &format!(
            "[coordination]\nenabled = true\nlease_name = \"{lease}\"\nlease_namespace = \"{ns}\"\nlease_duration_seconds = 4\nrenew_deadline_seconds = 2\nretry_period_seconds = 1\n"
        ),
    )
}

/// A unique name with a readable prefix.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}-{}-{:x}{}", std::process::id(), nanos & 0xfffff, N.fetch_add(1, Ordering::Relaxed))
}

/// Creates namespace `name` with `labels`.
pub async fn create_namespace(client: &Client, name: &str, labels: &[(&str, &str)]) -> kube::Result<Namespace> {
    let labels: BTreeMap<String, String> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: (!labels.is_empty()).then_some(labels),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await
}

/// A fresh namespace, deleted (in the background, by the server) when dropped. The test
/// environment has no controller-manager: a deleted namespace stays `Terminating`, with what
/// it held.
pub struct TestNamespace {
    pub name: String,
    client: Client,
}

impl TestNamespace {
    pub async fn new(client: &Client, prefix: &str) -> Self {
        let name = unique(prefix);
        create_namespace(client, &name, &[]).await.expect("create namespace");
        Self { name, client: client.clone() }
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        let (client, name) = (self.client.clone(), self.name.clone());
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                let _ = Api::<Namespace>::all(client).delete(&name, &DeleteParams::default()).await;
            });
        }
    }
}

/// 100 changes to the ConfigMaps `c00`..`c59` of [`create_cms`] (`existing`): 30 updates
/// (c00..c29), 20 deletes (c30..c49), 50 creates (n00..n49). Returns the ids of the updates
/// and creates (`{uid}:{rv}:{verb}`), and the uids of the deleted objects.
pub async fn hundred_changes(
    client: &Client,
    ns: &str,
    existing: &HashMap<String, (String, String)>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let mut expected = BTreeSet::new();
    for name in names("c", 0..30) {
        let c = api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "1"}}))).await.unwrap();
        expected.insert(format!("{}:{}:modified", c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap()));
    }
    let mut deleted = BTreeSet::new();
    for name in names("c", 30..50) {
        api.delete(&name, &DeleteParams::default()).await.unwrap();
        deleted.insert(existing[&name].0.clone());
    }
    for (_, (uid, rv)) in create_cms(client, ns, &names("n", 0..50)).await {
        expected.insert(format!("{uid}:{rv}:added"));
    }
    (expected, deleted)
}

/// Waits (up to 120 s) until a watch from `rv` is answered with 410 Gone, in either shape
/// (an error status, or an ERROR event).
pub async fn wait_until_expired(api: &Api<ConfigMap>, rv: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let gone = match api.watch(&WatchParams::default().timeout(1), rv).await {
            Err(kube::Error::Api(s)) => s.code == 410,
            Err(e) => panic!("watch: {e}"),
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                matches!(stream.try_next().await, Ok(Some(WatchEvent::Error(s))) if s.code == 410)
            }
        };
        if gone {
            return;
        }
        assert!(Instant::now() < deadline, "resourceVersion {rv} never expired");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A ConfigMap made to mark a point in a namespace's history ([`barrier`]).
pub struct Barrier {
    /// `<namespace>/<name>`, the subject of its events.
    pub subject: String,
    /// Its resourceVersion (the test apiservers' are numbers).
    pub rv: u64,
}

/// Creates ConfigMap `barrier-<n>` in `ns` with `labels` (which must match the label selector
/// of the stream that is to see it).
pub async fn barrier(client: &Client, ns: &str, labels: Value) -> Barrier {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let name = format!("barrier-{}", NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let cm = create_cm(client, ns, &name, labels, json!({})).await;
    let rv = cm.metadata.resource_version.unwrap();
    Barrier { subject: format!("{ns}/{name}"), rv: rv.parse().expect("the test apiserver's resourceVersions are numbers") }
}

/// Waits until `kc` has delivered every change made so far in `ns` (a namespace its config
/// watches, in one stream), instead of waiting a fixed time for stragglers: makes a
/// [`barrier`] and waits until the stream's stored resume point has reached its
/// resourceVersion. A checkpoint never passes an event the sink has not acknowledged, so every
/// event of an earlier change, repeats included, is in the sink by then. Works with every
/// state store (it asks `kubecast state list`). Returns the barrier's subject: its events are
/// the caller's to leave out ([`crate::without`]).
pub async fn settle(kc: &mut crate::Kubecast, client: &Client, ns: &str, labels: Value) -> String {
    let b = barrier(client, ns, labels).await;
    settle_at(kc, b.rv, &b.subject).await;
    b.subject
}

/// Waits until a stream of `kc` has stored a resume point at or past resourceVersion `rv`, the
/// one of the change `what` (see [`settle`]).
pub async fn settle_at(kc: &mut crate::Kubecast, rv: u64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = kc.state_list();
        let at = |s: &Value| s["resource_version"].as_str().and_then(|v| v.parse::<u64>().ok());
        if listed.as_array().is_some_and(|l| l.iter().any(|s| at(s).is_some_and(|at| at >= rv))) {
            return;
        }
        if let Some(status) = kc.exited() {
            panic!("kubecast exited ({status}) before delivering {what}\nlog:\n{}", kc.log());
        }
        assert!(
            Instant::now() < deadline,
            "no stored position reached {what} (resourceVersion {rv}) in 60 s: {listed:#}\nlog:\n{}",
            kc.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
