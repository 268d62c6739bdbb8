//! State-store benchmark: for each store (`file`, `kafka`, `nats`), the cost of keeping the
//! stream positions, and the takeover time of a standby.
//!
//! ```text
//! cargo bench --bench state                             # 10000 and 100000 objects
//! cargo bench --bench state -- --objects 10000          # chosen sizes
//! cargo bench --bench state -- --takeover-objects 0     # skip the takeover part
//! cargo bench --bench state -- --objects 0              # only the takeover part
//! ```
//!
//! 1. **Writes and load** (in process, through the real stores against the test environment's
//!    Kafka and NATS and a temporary directory): one stream of N objects; the first write
//!    (the whole index, as after the first list), then 100 changes per second for
//!    `--seconds` (default 10) with the persister's write every second; the state bytes each
//!    store wrote per second meanwhile (keys and values; file: bytes appended or renamed into
//!    place); then a fresh store on the same place loads the state (time, and whether it got
//!    the N objects back).
//! 2. **Takeover** (the release binary, against the test apiserver): `--takeover-objects`
//!    ConfigMaps (default 10000), two kubecast processes on one Lease (client-go's defaults:
//!    15 s lease, 10 s renew deadline, 2 s retry) and one store; the leader is SIGKILLed and a
//!    ConfigMap changed at once: time from the kill to that change's event from the new
//!    leader, and the new leader's state load time (its log).
//!
//! Figures are printed, never asserted. Servers: `tests/env/up` (started if needed and left
//! running; with `KUBECAST_ENV_FILE` set, that environment as it is). See docs/performance.md.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kubecast::model::{Effect, IndexEntry, IndexOp};
use kubecast::state::persister::write_changed;
use kubecast::state::store::file::FileStore;
use kubecast::state::store::kafka::{KafkaStore, KafkaStoreConfig};
use kubecast::state::store::nats::{NatsStore, NatsStoreConfig};
use kubecast::state::store::{Owner, Store, StreamKey};
use kubecast::state::watermark::StreamCheckpoint;
use kubecast_kit::{Kubecast, TestNamespace};
use serde_json::json;
use std::sync::Arc;

const DEFAULT_OBJECTS: &[usize] = &[10_000, 100_000];
const CHANGES_PER_SECOND: usize = 100;

fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1).cloned())
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    File,
    Kafka,
    Nats,
}

const KINDS: [Kind; 3] = [Kind::File, Kind::Kafka, Kind::Nats];

struct Place {
    kind: Kind,
    dir: tempfile::TempDir,
    name: String,
    env: kubecast_kit::Env,
}

impl Place {
    fn new(kind: Kind, env: &kubecast_kit::Env) -> Self {
        Place {
            kind,
            dir: tempfile::tempdir().unwrap(),
            name: kubecast_kit::unique("bench-state").replace('.', "-"),
            env: env.clone(),
        }
    }

    async fn open(&self, epoch: i64) -> Result<Store> {
        let owner = Owner { cluster_uid: Some("bench".into()), epoch: Some(epoch), writer: format!("bench-{epoch}") };
        Ok(match self.kind {
            Kind::File => Store::File(FileStore::open(self.dir.path(), owner)?),
            Kind::Kafka => {
                let mut client = rdkafka::ClientConfig::new();
                client.set("bootstrap.servers", &self.env["KAFKA_BROKERS"]);
                let cfg = KafkaStoreConfig {
                    client,
                    topic: self.name.clone(),
                    create_topic: true,
                    transactional_id: self.name.clone(),
                    exactly_once: false,
                    replication_factor: None,
                    min_insync_replicas: None,
                };
                Store::Kafka(Arc::new(KafkaStore::open(cfg, owner).await?))
            }
            Kind::Nats => {
                let client = async_nats::connect(self.env["NATS_URL"].as_str()).await?;
                let cfg = NatsStoreConfig { client, bucket: self.name.clone(), create_bucket: true, replicas: None };
                Store::Nats(Arc::new(NatsStore::open(cfg, owner).await?))
            }
        })
    }

    /// The `[checkpoint]` lines of a kubecast config on this place.
    fn lines(&self) -> String {
        match self.kind {
            Kind::File => String::new(),
            Kind::Kafka => format!(
                "store = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"{}\"\ntopic = \"{}\"\n",
                self.env["KAFKA_BROKERS"], self.name
            ),
            Kind::Nats => format!(
                "store = \"nats\"\n[checkpoint.nats]\nurl = \"{}\"\nbucket = \"{}\"\n",
                self.env["NATS_URL"], self.name
            ),
        }
    }
}

fn uid(i: usize) -> String {
    format!("{:08x}-0000-4000-8000-{:012x}", i, i)
}

fn entry(i: usize, rv: u64) -> IndexEntry {
    IndexEntry { namespace: Some("bench".into()), name: format!("cm-{i:07}"), resource_version: rv.to_string() }
}

struct Figures {
    first_write: Duration,
    first_bytes: u64,
    steady_bytes_per_second: f64,
    load: Duration,
    loaded: usize,
}

async fn writes_and_load(kind: Kind, env: &kubecast_kit::Env, n: usize, seconds: u64) -> Result<Figures> {
    let place = Place::new(kind, env);
    let key = StreamKey {
        cluster: place.name.clone(),
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        namespace: Some("bench".into()),
        label_selector: String::new(),
        field_selector: String::new(),
        shard: None,
    };
    let keys = vec![key.clone()];
    let store = place.open(0).await?;
    store.load(&keys).await?;
    let cp = Arc::new(StreamCheckpoint::new(key, None));
    let cps = vec![cp.clone()];
    let mut rv = 1_000_000u64;
    // As a first list does: an upsert per object, then the end of the list.
    for i in 0..n {
        cp.ack(i as u64, Effect::Diffed(IndexOp::Upsert(uid(i), entry(i, rv))));
    }
    cp.ack(n as u64, Effect::Listed { rv: rv.to_string() });
    let t = Instant::now();
    write_changed(&store, &cps).await?;
    let (first_write, first_bytes) = (t.elapsed(), store.bytes_written());

    let mut seq = n as u64 + 1;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let before = store.bytes_written();
    let started = Instant::now();
    for s in 0..seconds as usize {
        for c in 0..CHANGES_PER_SECOND {
            rv += 1;
            let i = (s * CHANGES_PER_SECOND + c) * 7919 % n;
            cp.ack(seq, Effect::Watched { op: IndexOp::Upsert(uid(i), entry(i, rv)), rv: rv.to_string() });
            seq += 1;
        }
        tick.tick().await;
        write_changed(&store, &cps).await?;
    }
    let steady_bytes_per_second = (store.bytes_written() - before) as f64 / started.elapsed().as_secs_f64();
    drop(store);

    let fresh = place.open(1).await?;
    let t = Instant::now();
    let loaded = fresh.load(&keys).await?;
    let load = t.elapsed();
    let loaded = loaded[0].as_ref().map_or(0, |p| p.objects.len());
    Ok(Figures { first_write, first_bytes, steady_bytes_per_second, load, loaded })
}

async fn create_cms(api: &Api<ConfigMap>, n: usize) -> Result<()> {
    futures::stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let cm: ConfigMap = serde_json::from_value(json!({
                    "metadata": {"name": format!("cm-{i:06}")},
                    "data": {"v": "0"}
                }))?;
                api.create(&PostParams::default(), &cm).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
}

/// Kill to first event of the new leader, and the new leader's load time.
async fn takeover(kind: Kind, env: &kubecast_kit::Env, client: &kube::Client, n: usize) -> Result<(Duration, String)> {
    let ns = TestNamespace::new(client, "bench-takeover").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    create_cms(&api, n).await?;
    let place = Place::new(kind, env);
    let config = kubecast_kit::cm_config(
        &ns.name,
        &format!("[coordination]\nenabled = true\nlease_name = \"bench\"\nlease_namespace = \"{}\"\n", ns.name),
    );
    let mut a = Kubecast::start_with_checkpoint(&config, &place.lines(), &[("RUST_LOG", "info")]);
    a.wait_for("the snapshot", Duration::from_secs(600), |e| e.len() >= n).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // a flush or two: the position is stored
    let mut b = Kubecast::start_with_checkpoint(&config, &place.lines(), &[("RUST_LOG", "info")]);
    b.wait_log("standby: another process holds the lease", 1).await;
    a.kill9();
    let killed = Instant::now();
    let c = api.patch("cm-000000", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "1"}}))).await?;
    // `modified` from a leader that resumed, `added` (origin snapshot) from one that had no
    // state (the file store on another pod's disk): the change either way.
    let id = format!("{}:{}:", c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap());
    b.wait_for("the change from the new leader", Duration::from_secs(600), |e| {
        e.iter().any(|e| e["id"].as_str().is_some_and(|i| i.starts_with(&id)))
    })
    .await;
    let took = killed.elapsed();
    let log = b.log();
    let load = log
        .lines()
        .find(|l| l.contains("stream positions loaded"))
        .and_then(|l| l.split("took=").nth(1))
        .map(|t| t.split_whitespace().next().unwrap_or("").to_string())
        .unwrap_or_else(|| "?".into());
    b.stop();
    Ok((took, load))
}

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let env = kubecast_kit::env_up(&["apiserver", "kafka", "nats"]);
        let sizes: Vec<usize> = match arg("--objects") {
            Some(list) => list.split(',').map(|s| s.trim().parse().context("--objects")).collect::<Result<_>>()?,
            None => DEFAULT_OBJECTS.to_vec(),
        };
        let seconds: u64 = arg("--seconds").map(|s| s.parse()).transpose()?.unwrap_or(10);
        println!("state stores: one stream, N objects, then {CHANGES_PER_SECOND} changes/s for {seconds} s");
        println!(
            "{:>6} {:>8} {:>14} {:>12} {:>16} {:>10} {:>8}",
            "store", "N", "first write", "first MB", "steady bytes/s", "load", "loaded"
        );
        for &n in sizes.iter().filter(|&&n| n > 0) {
            for kind in KINDS {
                let f = writes_and_load(kind, &env, n, seconds).await.with_context(|| format!("{kind:?} at {n}"))?;
                println!(
                    "{:>6} {:>8} {:>12.2?} {:>12.1} {:>16.0} {:>10.2?} {:>8}",
                    format!("{kind:?}").to_lowercase(),
                    n,
                    f.first_write,
                    f.first_bytes as f64 / 1e6,
                    f.steady_bytes_per_second,
                    f.load,
                    f.loaded
                );
            }
        }
        let takeover_n: usize = arg("--takeover-objects").map(|s| s.parse()).transpose()?.unwrap_or(10_000);
        if takeover_n > 0 {
            let client = kubecast_kit::client().await;
            println!("takeover: {takeover_n} ConfigMaps, lease 15 s / renew 10 s / retry 2 s (client-go's defaults)");
            for kind in KINDS {
                let (took, load) = takeover(kind, &env, &client, takeover_n).await?;
                println!(
                    "{:>6}: leader killed -> first event of the new leader {:.1?} (its state load {load})",
                    format!("{kind:?}").to_lowercase(),
                    took
                );
            }
        }
        Ok(())
    })
}
