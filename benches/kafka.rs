//! Delivery throughput: kubecast's delivery path vs a raw rdkafka producer, same payloads, same
//! broker, same run. Prints figures; asserts nothing about time.
//!
//!     cargo bench --bench kafka                   # 50000 events over 5000 objects
//!     cargo bench --bench kafka -- --events 20000
//!
//! The stream is "recorded" deterministically: ~10 KB Pods (labels, annotations,
//! managedFields, five containers with env, status), each object modified several times.
//! kubecast's side runs the library's own path for each change: decoding the object's identity
//! from the watch's JSON (the rest is passed through untouched), CloudEvent building, the
//! outbound queue (per-object order, `max_in_flight` 1000), the Kafka sink (binary mode: `ce_*`
//! headers, value = the object) with delivery reports, and the acknowledgement watermark. The
//! raw side sends the same object JSON with the same key, 1000 in flight. Needs the test
//! Kafka: it runs `tests/env/up kafka` (idempotent; left running).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use kube::api::{ApiResource, GroupVersionKind};
use kubecast::ack::{Effect, IndexOp, StreamCheckpoint};
use kubecast::checkpoint::{CheckpointStore, IndexEntry, StreamKey};
use kubecast::config::Verb;
use kubecast::delivery::dead_letter::DeadLetter;
use kubecast::delivery::queue::{Job, Queue};
use kubecast::delivery::retry::RetryPolicy;
use kubecast::delivery::{DeadLetterConfig, DeliveryConfig};
use kubecast::event::{Change, EventSource, Origin};
use kubecast::object::RawObject;
use kubecast::sink::kafka::KafkaConfig;
use kubecast::sink::template::Fields;
use kubecast::sink::{Outbound, Sink};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;
use serde_json::{Value, json};
use tokio::sync::mpsc;

const OBJECTS: usize = 5000;

/// The allocator of the kubecast binary (src/main.rs), so both sides run as they would there.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    let events: usize = std::env::args()
        .skip_while(|a| a != "--events")
        .nth(1)
        .map(|v| v.parse().expect("--events N"))
        .unwrap_or(50_000);
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let status =
        std::process::Command::new(repo.join("tests/env/up")).arg("kafka").status().expect("tests/env/up kafka");
    assert!(status.success(), "tests/env/up kafka failed");
    let env = std::fs::read_to_string(repo.join("target/kubecast-env/env")).expect("env file");
    let brokers = env.lines().find_map(|l| l.strip_prefix("KAFKA_BROKERS=")).expect("KAFKA_BROKERS").to_string();

    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
    let recording = record(events);
    let bytes: usize = recording.iter().map(Vec::len).sum();
    println!(
        "recorded stream: {events} events over {OBJECTS} Pods, {:.1} KB per object on average",
        bytes as f64 / events as f64 / 1024.0
    );

    let run = std::process::id();
    // Warm the broker (topic creation, connections) outside the measurements.
    raw(&brokers, &format!("bench.warmup.{run}"), &recording[..1000.min(events)]).await;

    let (raw_s, raw_cpu) = raw(&brokers, &format!("bench.raw.{run}"), &recording).await;
    let (kc_s, kc_cpu) = kubecast(&brokers, &format!("bench.kubecast.{run}"), &recording, &ar).await;

    let per10k = |cpu: f64| cpu / events as f64 * 10_000.0;
    println!();
    println!("{:<22} {:>12} {:>14} {:>22}", "", "events/s", "wall s", "CPU s per 10k events");
    println!(
        "{:<22} {:>12.0} {:>14.2} {:>22.3}",
        "raw rdkafka producer",
        events as f64 / raw_s,
        raw_s,
        per10k(raw_cpu)
    );
    println!("{:<22} {:>12.0} {:>14.2} {:>22.3}", "kubecast delivery", events as f64 / kc_s, kc_s, per10k(kc_cpu));
    let ratio = raw_s / kc_s;
    println!();
    println!("kubecast / raw throughput: {ratio:.2}x (goal >= 0.7x)");
    println!("kubecast events per CPU second: {:.0} (goal >= 20000 on one core)", events as f64 / kc_cpu.max(1e-9));
}

/// `events` changes of `OBJECTS` Pods, ~10 KB each, as the JSON text a watch delivers them in.
fn record(events: usize) -> Vec<Vec<u8>> {
    (0..events)
        .map(|i| {
            let mut pod = pod(i % OBJECTS, i / OBJECTS);
            pod["metadata"]["resourceVersion"] = (1000 + i).to_string().into();
            serde_json::to_vec(&pod).unwrap()
        })
        .collect()
}

fn pod(n: usize, generation: usize) -> Value {
    let env: Vec<Value> = (0..12)
        .map(|e| json!({"name": format!("SETTING_{e}"), "value": format!("value-{e}-{}", "x".repeat(20))}))
        .collect();
    let containers: Vec<Value> = (0..5)
        .map(|c| {
            json!({
                "name": format!("c{c}"), "image": format!("registry.example.com/team/app-{c}:1.{generation}.0"),
                "ports": [{"containerPort": 8080 + c, "protocol": "TCP"}],
                "env": env, "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                "volumeMounts": [{"name": "config", "mountPath": "/etc/app"}, {"name": "data", "mountPath": "/data"}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080 + c}, "periodSeconds": 10}
            })
        })
        .collect();
    let statuses: Vec<Value> = (0..5)
        .map(|c| json!({"name": format!("c{c}"), "ready": true, "restartCount": generation, "image": "registry.example.com/team/app", "imageID": format!("registry.example.com/team/app@sha256:{}", "ab".repeat(32)), "containerID": format!("containerd://{}", "cd".repeat(32)), "state": {"running": {"startedAt": "2026-11-21T10:00:00Z"}}}))
        .collect();
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("web-{n:05}"), "namespace": "shop", "uid": format!("00000000-0000-0000-0000-{n:012}"),
            "labels": {"app": "web", "tier": "frontend", "pod-template-hash": "7d9c8f6b5"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-11-21T10:00:00Z", "prometheus.io/scrape": "true"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9c8f6b5", "uid": "11111111-2222-3333-4444-555555555555", "controller": true}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {"f:app": {}, "f:tier": {}}}, "f:spec": {"f:containers": {"k:{\"name\":\"c0\"}": {"f:image": {}, "f:env": {}}}}}}]
        },
        "spec": {"containers": containers, "volumes": [{"name": "config", "configMap": {"name": "web-config"}}, {"name": "data", "emptyDir": {}}], "nodeName": format!("node-{}", n % 50), "serviceAccountName": "web"},
        "status": {"phase": "Running", "podIP": format!("10.1.{}.{}", n / 250, n % 250), "conditions": [{"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}], "containerStatuses": statuses}
    })
}

/// A raw idempotent producer sending each object's JSON with its uid as key, 1000 in flight.
async fn raw(brokers: &str, topic: &str, recording: &[Vec<u8>]) -> (f64, f64) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .unwrap();
    // The key (uid) is known to a raw producer in advance; kubecast must read it from the JSON.
    let payloads: Vec<(String, &[u8])> = recording
        .iter()
        .map(|b| (serde_json::from_slice::<RawObject>(b).unwrap().metadata.uid.unwrap(), b.as_slice()))
        .collect();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let mut in_flight: FuturesUnordered<
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), rdkafka::error::KafkaError>> + '_>>,
    > = FuturesUnordered::new();
    for (key, payload) in &payloads {
        if in_flight.len() >= 1000 {
            in_flight.next().await.unwrap().expect("delivered");
        }
        let producer = producer.clone();
        in_flight.push(Box::pin(async move {
            producer
                .send(FutureRecord::to(topic).key(key).payload(*payload), Timeout::Never)
                .await
                .map(|_| ())
                .map_err(|(e, _)| e)
        }));
    }
    while let Some(r) = in_flight.next().await {
        r.expect("delivered");
    }
    producer.flush(Duration::from_secs(30)).unwrap();
    (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0)
}

/// The same stream through kubecast's delivery path.
async fn kubecast(brokers: &str, topic: &str, recording: &[Vec<u8>], ar: &ApiResource) -> (f64, f64) {
    let sink = Arc::new(Sink::Kafka(
        kubecast::sink::KafkaSink::new(&KafkaConfig {
            brokers: brokers.to_string(),
            topic: topic.to_string(),
            mode: Default::default(),
            tombstones: false,
            properties: Default::default(),
        })
        .unwrap(),
    ));
    let dir = tempfile::tempdir().unwrap();
    let store = CheckpointStore::open(dir.path()).unwrap();
    let key = StreamKey {
        cluster: "bench".into(),
        group: "".into(),
        version: "v1".into(),
        kind: "Pod".into(),
        namespace: Some("shop".into()),
        label_selector: "".into(),
        field_selector: "".into(),
    };
    let (checkpoint, _) = StreamCheckpoint::load(store, key).unwrap();
    let cfg = DeliveryConfig::default();
    let retry = RetryPolicy::new(&cfg);
    let queue = Queue {
        sink,
        limiter: None,
        retry,
        dead_letter: Arc::new(DeadLetter::new(&DeadLetterConfig::default(), dir.path(), retry)),
        max_in_flight: cfg.max_in_flight,
        capacity: cfg.queue_capacity,
        checkpoints: vec![Arc::new(checkpoint)],
    };
    let source = Arc::new(EventSource::new("bench", ar));
    let recording = recording.to_vec();
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let (tx, rx) = mpsc::channel::<Job>(1024);
    let producer = tokio::spawn(async move {
        for (seq, bytes) in recording.into_iter().enumerate() {
            // What the reflector does with a watch event's object: decode only its identity.
            let object: RawObject = serde_json::from_slice(&bytes).unwrap();
            let uid = object.metadata.uid.clone().unwrap();
            let rv = object.metadata.resource_version.clone().unwrap();
            let entry = IndexEntry {
                namespace: Some("shop".into()),
                name: object.metadata.name.clone().unwrap(),
                resource_version: rv.clone(),
            };
            let fields = Fields {
                cluster: "bench".into(),
                group: "core".into(),
                version: "v1".into(),
                kind: "Pod".into(),
                resource: "pods".into(),
                namespace: "shop".into(),
                verb: "modified".into(),
            };
            let change = Change { verb: Verb::Modified, origin: Origin::Watch, object, source: source.clone() };
            let event = change.into_cloudevent().unwrap();
            let job = Job {
                stream: 0,
                seq: seq as u64,
                effect: Effect::Watched { op: IndexOp::Upsert(uid.clone(), entry), rv },
                msg: Some(Outbound { event, key: uid, fields, route: None }),
                limiter: None,
            };
            if tx.send(job).await.is_err() {
                return;
            }
        }
    });
    queue.run(rx).await.expect("delivered");
    producer.await.unwrap();
    (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0)
}

/// User + system CPU time of this process, from /proc/self/stat (clock ticks of 1/100 s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}
