//! Shared by the delivery benchmarks: the recorded stream of ~10 KB Pods, kubecast driven
//! through its real wiring (`app::wiring::Pipeline`) into a given sink, and CPU time. The test
//! servers, their env file and clients come from the test kit (`tests/kit`).

// Each benchmark uses a part of it.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kube::api::{ApiResource, GroupVersionKind, WatchEvent};
use kubecast::app::wiring::Pipeline;
use kubecast::config::Config;
use kubecast::model::{Change, CloudEvent, Effect, EventSource, IndexEntry, IndexOp, Origin, RawObject, Verb};
use kubecast::sink::Sink;
use kubecast::source::reflector::Item;
use kubecast::state::store::file::FileStore;
use kubecast::state::store::kafka::{KafkaStore, KafkaStoreConfig};
use kubecast::state::store::{Owner, Store};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub const OBJECTS: usize = 5000;

/// The value after `flag` on the command line.
pub fn arg(flag: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != flag).nth(1)
}

/// `--events N` from the command line, or `default`.
pub fn events_arg(default: usize) -> usize {
    arg("--events").map(|v| v.parse().expect("--events N")).unwrap_or(default)
}

/// Whether this run measures `side` (`--side raw` or `--side kubecast`: one side only, e.g.
/// under `perf record`; both by default).
pub fn side(side: &str) -> bool {
    arg("--side").is_none_or(|s| s == side)
}

/// The env file of the test environment with `service` running (`kubecast_kit::env_up`: runs
/// `tests/env/up service`, idempotent, left running; with `KUBECAST_ENV_FILE` set, that
/// environment as it is).
pub fn env_up(service: &str) -> kubecast_kit::Env {
    kubecast_kit::env_up(&[service])
}

/// `key` of the env file `env`.
pub fn env_value(env: &kubecast_kit::Env, key: &str) -> String {
    env.get(key).cloned().unwrap_or_else(|| panic!("{key} in env file"))
}

pub fn pods() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods")
}

/// What a raw client is handed for each recorded event, ready to send: the object's uid (the
/// key) and its JSON text (the payload). kubecast's side gets the watch lines instead.
pub fn payloads(recording: &[bytes::Bytes]) -> Vec<(String, Vec<u8>)> {
    recording
        .iter()
        .map(|line| {
            let object = object(line);
            (object.metadata.uid.clone().unwrap(), object.text().to_vec())
        })
        .collect()
}

/// Runs `work` as the binary's `main` runs kubecast: the allocator's options set first, then
/// kubecast's runtime (`app::runtime`).
pub fn run_like_the_binary<F: std::future::Future>(work: F) -> F::Output {
    kubecast::app::allocator::configure();
    kubecast::app::runtime::build().unwrap().block_on(work)
}

/// A recorded line as the watch reader hands it over: in a buffer of its own, as the HTTP
/// client's read buffer that the reader slices the line out of (a large event arrives as one
/// frame; the copy here stands for the client filling that buffer from the socket), so that
/// the event is its only owner and frees it once delivered, as in the binary. (Decoding straight from the
/// recording would keep every object alive for the whole run and make each later allocation
/// fresh memory, which the binary does not do.)
pub fn read(line: &bytes::Bytes) -> bytes::Bytes {
    bytes::Bytes::copy_from_slice(line)
}

/// The object of a recorded watch line, decoded as the reflector does.
pub fn object(line: &bytes::Bytes) -> RawObject {
    match kubecast::source::watch::decode_line(line).unwrap() {
        WatchEvent::Modified(o) => o,
        other => panic!("{other:?}"),
    }
}

/// `--rounds N` (default 5): how many times each side runs, alternating.
pub fn rounds_arg() -> usize {
    arg("--rounds").map(|v| v.parse().expect("--rounds N")).unwrap_or(5).max(1)
}

/// Lets the machine settle before a measured run: the writes of the run before it (the
/// broker's files, a deleted stream or topic) are flushed to disk (`sync`), then a second's
/// pause. Without it the run after a run paid for the flushing of its predecessor's ~0.2-1 GB
/// (the second run of a pair was slower, whichever side it was).
pub fn settle() {
    let _ = std::process::Command::new("sync").status();
    std::thread::sleep(std::time::Duration::from_secs(1));
}

/// Runs both sides of round `round` one after the other: the raw side first in odd rounds
/// (counting from 1), kubecast's first in even ones, so that neither always runs on the
/// machine the other left behind.
pub async fn in_turn<R, K>(round: usize, raw: impl Future<Output = R>, kubecast: impl Future<Output = K>) -> (R, K) {
    if round.is_multiple_of(2) {
        let r = raw.await;
        (r, kubecast.await)
    } else {
        let k = kubecast.await;
        (raw.await, k)
    }
}

/// The figures of one round: the raw client's (wall seconds, CPU seconds) and those of each
/// other run, by name.
pub struct Round {
    pub raw: (f64, f64),
    pub runs: Vec<(&'static str, (f64, f64))>,
}

/// The figures of each round, then each run's medians over the rounds and its throughput
/// ratio to the raw client of the same round (the machine's speed drifts between rounds: a
/// ratio compares runs that ran next to each other). Goals are printed for runs named
/// `kubecast…`.
pub fn report(events: usize, raw_name: &str, rounds: &[Round]) {
    let per10k = |cpu: f64| cpu / events as f64 * 10_000.0;
    let line = |name: &str, (s, cpu): (f64, f64)| {
        println!("{name:<44} {:>10.0} {:>8.2} {:>22.3}", events as f64 / s, s, per10k(cpu))
    };
    for (i, round) in rounds.iter().enumerate() {
        println!();
        println!(
            "{:<44} {:>10} {:>8} {:>22}",
            format!("round {}/{}", i + 1, rounds.len()),
            "events/s",
            "wall s",
            "CPU s per 10k events"
        );
        line(raw_name, round.raw);
        for (name, figures) in &round.runs {
            line(name, *figures);
        }
    }
    println!();
    println!("medians over {} rounds:", rounds.len());
    let raw_eps = median(rounds.iter().map(|r| events as f64 / r.raw.0).collect());
    println!("{raw_name}: {raw_eps:.0} events/s");
    for (k, (name, _)) in rounds[0].runs.iter().enumerate() {
        if rounds.iter().all(|r| r.runs[k].1.0.is_nan()) {
            println!("{name}: not run");
            continue;
        }
        let ratios: Vec<f64> = rounds.iter().map(|r| r.raw.0 / r.runs[k].1.0).collect();
        let each: Vec<String> = ratios.iter().map(|x| format!("{x:.2}")).collect();
        let eps = median(rounds.iter().map(|r| events as f64 / r.runs[k].1.0).collect());
        let per_cpu = median(rounds.iter().map(|r| events as f64 / r.runs[k].1.1.max(1e-9)).collect());
        let goal = |g: &str| if name.starts_with("kubecast") { format!(" (goal {g})") } else { String::new() };
        println!(
            "{name}: {eps:.0} events/s; / raw throughput: {:.2}x{} (rounds: {}); events per CPU second: {per_cpu:.0}{}",
            median(ratios.clone()),
            goal(">= 0.7x"),
            each.join(", "),
            goal(">= 20000 on one core"),
        );
    }
}

/// `--broker-cpu N`: while the value lives, the test environment's `server` (`kafka` or
/// `nats`, all its threads) runs on CPU N only and this process on the other CPUs, as when the
/// broker has machines of its own; both get every CPU back when it is dropped. `None` without
/// the flag. Uses `taskset` (util-linux).
pub fn pin_broker(server: &str) -> Option<Pinned> {
    let cpu: usize = arg("--broker-cpu")?.parse().expect("--broker-cpu N (a CPU number)");
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    assert!(cpus >= 2 && cpu < cpus, "--broker-cpu {cpu}: needs at least 2 CPUs and N below {cpus}");
    let state = kubecast_kit::env_file().parent().unwrap().to_path_buf();
    let pid = std::fs::read_to_string(state.join(server).join("pid")).expect("the broker's pid file");
    let pinned = Pinned { broker: pid.trim().to_string(), all: format!("0-{}", cpus - 1) };
    let others: Vec<String> = (0..cpus).filter(|c| *c != cpu).map(|c| c.to_string()).collect();
    taskset(&pinned.broker, &cpu.to_string());
    taskset(&std::process::id().to_string(), &others.join(","));
    println!("{server} server on CPU {cpu}, this benchmark on CPUs {}", others.join(","));
    Some(pinned)
}

/// What [`pin_broker`] pinned, given every CPU back on drop.
pub struct Pinned {
    broker: String,
    all: String,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        taskset(&self.broker, &self.all);
        taskset(&std::process::id().to_string(), &self.all);
    }
}

/// Sets the CPUs of every thread of process `pid`.
fn taskset(pid: &str, cpus: &str) {
    let out = std::process::Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", cpus, pid])
        .output()
        .expect("taskset (util-linux)");
    assert!(out.status.success(), "taskset {cpus} {pid}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The median of `v` (the mean of the middle two for an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// For each `(run, like)` pair: the median over the rounds of `run`'s throughput relative to
/// `like`'s in the same round (e.g. kubecast against a raw client sending kubecast's own
/// messages: the broker then does the same work for both).
pub fn report_like_for_like(rounds: &[Round], pairs: &[(&str, &str)]) {
    let figures = |round: &Round, name: &str| round.runs.iter().find(|(n, _)| *n == name).map(|(_, f)| *f);
    for (run, like) in pairs {
        let ratios: Vec<f64> = rounds
            .iter()
            .filter_map(|r| Some(figures(r, like)?.0 / figures(r, run)?.0))
            .filter(|x| x.is_finite())
            .collect();
        if ratios.is_empty() {
            continue;
        }
        let each: Vec<String> = ratios.iter().map(|x| format!("{x:.2}")).collect();
        println!("{run} / {like}: {:.2}x (rounds: {})", median(ratios), each.join(", "));
    }
}

/// `events` changes of `OBJECTS` Pods, ~8 KB each, as the lines a watch delivers them in
/// (`{"type":"MODIFIED","object":{...}}`, compact, in the apiserver's key order).
/// The resourceVersion of the first recorded line; line `i` has this plus `i`.
pub const FIRST_RESOURCE_VERSION: usize = 1000;

pub fn record(events: usize) -> Arc<Vec<bytes::Bytes>> {
    // On a thread of its own, so that a profile tells it from the measured work.
    let record = move || {
        (0..events)
            .map(|i| {
                let pod = as_apiserver_writes_it(&pod(i % OBJECTS, i / OBJECTS), FIRST_RESOURCE_VERSION + i);
                bytes::Bytes::from([&b"{\"type\":\"MODIFIED\",\"object\":"[..], pod.as_bytes(), b"}"].concat())
            })
            .collect()
    };
    Arc::new(std::thread::Builder::new().name("record".into()).spawn(record).unwrap().join().unwrap())
}

/// `pod`'s JSON in the order the apiserver writes a built-in kind (Go struct order): `kind`,
/// `apiVersion`, `metadata` (name, namespace, uid, resourceVersion, ..., managedFields last),
/// `spec`, `status`; with `resource_version`.
fn as_apiserver_writes_it(pod: &Value, resource_version: usize) -> String {
    let m = &pod["metadata"];
    let metadata = format!(
        r#"{{"name":{},"namespace":{},"uid":{},"resourceVersion":"{resource_version}","creationTimestamp":"2026-11-21T10:00:00Z","labels":{},"annotations":{},"ownerReferences":{},"managedFields":{}}}"#,
        m["name"], m["namespace"], m["uid"], m["labels"], m["annotations"], m["ownerReferences"], m["managedFields"]
    );
    format!(
        r#"{{"kind":"Pod","apiVersion":"v1","metadata":{metadata},"spec":{},"status":{}}}"#,
        pod["spec"], pod["status"]
    )
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

/// The config of kubecast's side: one stream, the v1 Pods of namespace `shop` (the recording's),
/// `keep_managed_fields = true` so that shaping leaves each object as the watch delivered it
/// (the raw side sends the same bytes), the `[sink]` table `sink`, checkpoints in `dir`. Loaded
/// as the binary loads its file (`KUBECAST_*__*` variables apply).
pub fn config(dir: &Path, sink: &str) -> Config {
    config_with(dir, sink, "")
}

/// [`config`] with `checkpoint` lines in `[checkpoint]` (e.g. `store = "kafka"`).
pub fn config_with(dir: &Path, sink: &str, checkpoint: &str) -> Config {
    let text = format!(
        "[cluster]\nname = \"bench\"\n\n[checkpoint]\ndir = \"{}\"\n{checkpoint}\n\n{sink}\n\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nnamespaces = [\"shop\"]\nkeep_managed_fields = true\n",
        dir.join("state").display()
    );
    let path = dir.join("kubecast.toml");
    std::fs::write(&path, text).unwrap();
    Config::load(Some(&path)).unwrap_or_else(|e| panic!("the benchmark's config: {e}"))
}

/// The same stream through kubecast's own wiring into the sink of the `[sink]` table `sink`:
/// the sink opened and the stages after the reflectors started as `kubecast run` does
/// (`Sink::open`, `Pipeline::new`, `Pipeline::start_downstream`: shaping, the queue, the
/// persister), the reflectors' channel fed with the items a reflector makes of the recorded
/// watch lines ([`item`]). Measured from the first item to the last acknowledgement.
pub async fn kubecast(sink: &str, recording: &Arc<Vec<bytes::Bytes>>) -> (f64, f64) {
    kubecast_paced(sink, recording, None, "").await
}

/// [`kubecast`], the items fed at `pace` per second when given (else as fast as the stages
/// take them), `checkpoint` lines added to `[checkpoint]`. With `[sink.kafka] exactly_once`
/// the state is a Kafka store on the sink's cluster (a fresh state topic) whose transaction
/// the sink joins, as `kubecast run` opens them; the measurement then ends with the final
/// commit (the events are visible to `read_committed` consumers only from there).
pub async fn kubecast_paced(
    sink: &str,
    recording: &Arc<Vec<bytes::Bytes>>,
    pace: Option<u32>,
    checkpoint: &str,
) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let mut pipeline = Pipeline::new(config_with(dir.path(), sink, checkpoint));
    let config = pipeline.config.clone();
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await.expect("sink"));
    let store = match sink.kafka().filter(|k| k.exactly_once()) {
        Some(k) => {
            let name = format!("bench-state.{}.{}", std::process::id(), kubecast_kit::unique("eos"));
            let cfg = KafkaStoreConfig {
                client: k.client_config().clone(),
                topic: name.clone(),
                create_topic: true,
                transactional_id: name,
                exactly_once: true,
                replication_factor: None,
                min_insync_replicas: None,
            };
            let store = KafkaStore::open(cfg, Owner::default()).await.expect("Kafka state store");
            k.attach(store.transaction().clone(), pipeline.bounds().uncommitted());
            Store::Kafka(Arc::new(store))
        }
        None => Store::File(FileStore::open(&config.checkpoint.dir, Owner::default()).expect("checkpoint store")),
    };
    pipeline.load(store).await.expect("positions");
    let source = Arc::new(EventSource::new(&config.cluster.name, &pods()));
    // Shared with the caller; each line is copied as it is read (`read`).
    let recording = recording.clone();
    let events = recording.len();
    let cancel = CancellationToken::new();
    settle();
    let (threads0, cpu0, t0) = (thread_cpu(), cpu_seconds(), Instant::now());
    let (items_tx, items_rx) = mpsc::channel::<Item>(pipeline.bounds().channel_capacity());
    // Tasks of the runtime, as in the binary: its two workers run everything, the thread
    // blocked on the benchmark's main future stays idle.
    let mut downstream =
        pipeline.start_downstream(sink, items_rx, &kubecast::observe::health::Health::new(Vec::new()), &cancel);
    let reflector = tokio::spawn(async move {
        let mut tick = pace.map(|p| {
            let mut t = tokio::time::interval(std::time::Duration::from_secs(1) / p.max(1));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            t
        });
        for (seq, line) in recording.iter().enumerate() {
            if let Some(t) = tick.as_mut() {
                t.tick().await;
            }
            if items_tx.send(item(seq as u64, &read(line), &source)).await.is_err() {
                return;
            }
        }
        // The channel closes here: the shaper ends, then the queue once all is delivered.
    });
    downstream.queue.await.unwrap().expect("delivered");
    let exactly_once = pipeline.store().gate().is_some();
    if exactly_once {
        // The last transaction commits with the final state write.
        cancel.cancel();
        downstream.persister.take().unwrap().await.unwrap().expect("persisted");
        kubecast::state::persister::write_changed(pipeline.store(), pipeline.checkpoints())
            .await
            .expect("final commit");
    }
    let figures = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    reflector.await.unwrap();
    downstream.shaper.await.unwrap();
    println!("kubecast{} {}", if exactly_once { " (exactly once)" } else { "" }, cpu_split(&threads0, events));
    cancel.cancel();
    if let Some(p) = downstream.persister {
        p.await.unwrap().expect("persisted");
    }
    figures
}

/// What a reflector emits for a recorded watch line (a MODIFIED event): the object decoded as
/// it decodes it (`watch::decode_line`: the text checked and kept, the identity decoded), its
/// effect on the stream's position (the index entry, the resourceVersion) and the change.
pub fn item(seq: u64, line: &bytes::Bytes, source: &Arc<EventSource>) -> Item {
    let object = object(line);
    let m = &object.metadata;
    let uid = m.uid.clone().unwrap();
    let rv = m.resource_version.clone().unwrap();
    let entry =
        IndexEntry { namespace: m.namespace.clone(), name: m.name.clone().unwrap(), resource_version: rv.clone() };
    Item {
        stream: 0,
        seq,
        effect: Effect::Watched { op: IndexOp::Upsert(uid, entry), rv },
        change: Some(Change { verb: Verb::Modified, origin: Origin::Watch, object, source: source.clone() }),
        delivered_before: false,
    }
}

/// The CloudEvent kubecast sends for a recorded line (the benchmark's config leaves it as the
/// change made it), for the raw clients that send kubecast's own messages.
pub fn event(line: &bytes::Bytes, source: &Arc<EventSource>) -> CloudEvent {
    item(0, line, source).change.unwrap().into_cloudevent().unwrap()
}

/// A live thread of this process, from `/proc/self/task/<tid>/{stat,status}`.
pub struct Thread {
    /// Its name without trailing digits (a kind of thread).
    pub name: String,
    /// CPU seconds, user and system.
    pub cpu: f64,
    /// Context switches: voluntary (it waited for work) and involuntary.
    pub voluntary: f64,
    pub involuntary: f64,
}

/// Every live thread of this process.
pub fn threads() -> Vec<Thread> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let name = stat[open + 1..close].trim_end_matches(|c: char| c.is_ascii_digit()).to_string();
        let f: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let cpu = (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0;
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let count = |field: &str| {
            status.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
        };
        out.push(Thread {
            name,
            cpu,
            voluntary: count("voluntary_ctxt_switches:"),
            involuntary: count("nonvoluntary_ctxt_switches:"),
        });
    }
    out
}

/// CPU seconds (user + system) of each live thread of this process, summed by thread name
/// with trailing digits dropped (`rdk:broker1` -> `rdk:broker`), the CPU seconds of the test
/// environment's Kafka and NATS servers (`kafka server`, `nats server`) with their read and
/// write system calls, how often this process's threads slept (`thread sleeps`), and the
/// process's minor page faults: a snapshot, to show where a measured window's CPU went (see [`cpu_split`]).
pub fn thread_cpu() -> (std::collections::BTreeMap<String, f64>, u64) {
    let mut out = std::collections::BTreeMap::new();
    for t in threads() {
        *out.entry(t.name).or_insert(0.0) += t.cpu;
        // How often the thread went to sleep (voluntary switches: it waited for work).
        *out.entry("thread sleeps".to_string()).or_insert(0.0) += t.voluntary;
    }
    // The test environment's servers (not threads of this process): their CPU is on the
    // same cores, so what a side costs the broker shows too.
    let env_file = kubecast_kit::env_file();
    let state = env_file.parent().unwrap();
    for server in ["kafka", "nats"] {
        let Ok(pid) = std::fs::read_to_string(state.join(server).join("pid")) else { continue };
        if let Some(cpu) = process_cpu(&format!("/proc/{}/stat", pid.trim())) {
            out.insert(format!("{server} server"), cpu);
        }
        // Its read and write system calls (how many messages each one moves).
        if let Ok(io) = std::fs::read_to_string(format!("/proc/{}/io", pid.trim())) {
            for (field, name) in [("syscr: ", "reads"), ("syscw: ", "writes")] {
                if let Some(n) = io.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.parse::<f64>().ok()) {
                    out.insert(format!("{server} server {name}"), n);
                }
            }
        }
    }
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let minflt = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().nth(7).unwrap().parse().unwrap();
    (out, minflt)
}

/// The CPU per thread name and the minor page faults between two [`thread_cpu`] snapshots, as
/// one line.
pub fn cpu_split(before: &(std::collections::BTreeMap<String, f64>, u64), events: usize) -> String {
    let after = thread_cpu();
    let mut parts: Vec<String> = after
        .0
        .iter()
        .map(|(name, cpu)| (name, cpu - before.0.get(name).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d > 0.0)
        .map(|(name, d)| match name.ends_with(" reads") || name.ends_with(" writes") || name.ends_with(" sleeps") {
            // Counts per event.
            true => format!("{name} {:.2}", d / events as f64),
            false => format!("{name} {:.1} µs", d / events as f64 * 1e6),
        })
        .collect();
    parts.push(format!("{:.2} page faults", (after.1 - before.1) as f64 / events as f64));
    format!("per event: {}", parts.join(", "))
}

/// User + system CPU time of this process, from /proc/self/stat (clock ticks of 1/100 s).
pub fn cpu_seconds() -> f64 {
    process_cpu("/proc/self/stat").unwrap()
}

/// User + system CPU seconds from a `/proc/<pid>/stat` file, if it can be read.
fn process_cpu(stat_path: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some((f[11].parse::<f64>().ok()? + f[12].parse::<f64>().ok()?) / 100.0)
}
