//! Sharding benchmark: the same work on 1, 2 and 4 shards, one replica per shard (the release
//! binary, against the test apiserver; the state in the test Kafka).
//!
//! ```text
//! cargo bench --bench shards                          # 3000 ConfigMaps; 1, 2 and 4 shards
//! cargo bench --bench shards -- --objects 10000 --shards 1,2,4,8
//! ```
//!
//! For each shard count S: S replicas of `[coordination] shards = S` (S = 1: one replica, one
//! Lease) start on a namespace of N ConfigMaps; measured are the time from their start until
//! every object's snapshot event was written (by all replicas together: the shards' spreading
//! included), then the time from the first of N patches (64 at a time) until the change of
//! every object was written, each replica's CPU seconds and peak RSS,
//! and the objects of other shards the replicas skipped (the apiserver did not apply the
//! shard selector: the `ShardedListAndWatch` gate off) or 0 (it did).
//!
//! Figures are printed, never asserted. Servers: `tests/env/up` (started if needed and left
//! running; with `KUBECAST_ENV_FILE` set, that environment as it is). See docs/performance.md.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kubecast_kit::{Kubecast, TestNamespace};
use serde_json::json;

fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1).cloned())
}

/// Runs `f` on 64 of `0..n` at a time.
async fn each<F, Fut>(n: usize, f: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    futures::stream::iter(0..n).map(f).buffer_unordered(64).collect::<Vec<_>>().await.into_iter().collect()
}

/// Subjects of the events of `verb` the replicas wrote, all together.
fn subjects(kcs: &[Kubecast], verb: &str) -> BTreeSet<String> {
    kcs.iter()
        .flat_map(|k| k.events())
        .filter(|e| e["type"].as_str().is_some_and(|t| t.ends_with(verb)))
        .filter_map(|e| e["subject"].as_str().map(str::to_string))
        .collect()
}

async fn until(kcs: &[Kubecast], verb: &str, n: usize, what: &str) -> Result<Duration> {
    let started = Instant::now();
    while subjects(kcs, verb).len() < n {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(900), "{what}: not done within 900 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(started.elapsed())
}

/// (CPU seconds, peak RSS in MB) of a running process, from /proc.
fn usage(pid: u32) -> (f64, f64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let hwm = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0);
    (ticks / 100.0, hwm / 1024.0)
}

async fn skipped(kc: &mut Kubecast) -> f64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    metrics
        .lines()
        .filter(|l| l.starts_with("kubecast_shard_skipped_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

struct Figures {
    snapshot: Duration,
    changes: Duration,
    cpu: Vec<f64>,
    rss: Vec<f64>,
    skipped: f64,
}

async fn run(env: &kubecast_kit::Env, client: &kube::Client, n: usize, shards: u32) -> Result<Figures> {
    let ns = TestNamespace::new(client, "bench-shards").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    each(n, |i| {
        let api = api.clone();
        async move {
            let cm: ConfigMap =
                serde_json::from_value(json!({"metadata": {"name": format!("cm-{i:06}")}, "data": {"v": "0"}}))?;
            api.create(&PostParams::default(), &cm).await?;
            Ok(())
        }
    })
    .await?;
    let config = kubecast_kit::cm_config(
        &ns.name,
        &format!(
            "[coordination]\nenabled = true\nlease_name = \"bench\"\nlease_namespace = \"{}\"\nshards = {shards}\nlease_duration_seconds = 4\nrenew_deadline_seconds = 2\nretry_period_seconds = 1\n",
            ns.name
        ),
    );
    let brokers = env.get("KAFKA_BROKERS").context("KAFKA_BROKERS")?;
    let checkpoint = format!(
        "store = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{}\"\n",
        kubecast_kit::unique("bench-shards-state")
    );
    let mut kcs: Vec<Kubecast> =
        (0..shards).map(|_| Kubecast::start_with_checkpoint(&config, &checkpoint, &[("RUST_LOG", "info")])).collect();
    let snapshot = until(&kcs, "added", n, "the snapshot").await?;
    let patched = Instant::now();
    each(n, |i| {
        let api = api.clone();
        async move {
            let patch = json!({"data": {"v": "1"}});
            api.patch(&format!("cm-{i:06}"), &PatchParams::default(), &Patch::Merge(&patch)).await?;
            Ok(())
        }
    })
    .await?;
    until(&kcs, "modified", n, "the changes").await?;
    let changes = patched.elapsed();
    let (mut cpu, mut rss, mut skip) = (Vec::new(), Vec::new(), 0.0);
    for kc in &mut kcs {
        let (c, r) = usage(kc.pid().context("running")?);
        cpu.push(c);
        rss.push(r);
        skip += skipped(kc).await;
    }
    for kc in &mut kcs {
        kc.stop();
    }
    Ok(Figures { snapshot, changes, cpu, rss, skipped: skip })
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let env = kubecast_kit::env_up(&["apiserver", "kafka"]);
        let client = kubecast_kit::client().await;
        let n: usize = arg("--objects").map(|s| s.parse()).transpose()?.unwrap_or(3000);
        let counts: Vec<u32> = match arg("--shards") {
            Some(list) => list.split(',').map(|s| s.trim().parse().context("--shards")).collect::<Result<_>>()?,
            None => vec![1, 2, 4],
        };
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let model =
            cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|m| m.trim_start_matches([' ', '\t', ':']));
        println!(
            "shards: {n} ConfigMaps, one replica per shard; kubecast {} on {cores} cores ({}); {}",
            env!("CARGO_PKG_VERSION"),
            model.unwrap_or("?"),
            chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
        );
        println!(
            "{:>6} {:>10} {:>10} {:>12} {:>12} {:>12} {:>10}",
            "shards", "snapshot", "changes", "CPU s max", "CPU s sum", "RSS MB max", "skipped"
        );
        for &s in &counts {
            let f = run(&env, &client, n, s).await.with_context(|| format!("{s} shards"))?;
            println!(
                "{:>6} {:>10.2?} {:>10.2?} {:>12.2} {:>12.2} {:>12.1} {:>10.0}",
                s,
                f.snapshot,
                f.changes,
                max(&f.cpu),
                f.cpu.iter().sum::<f64>(),
                max(&f.rss),
                f.skipped
            );
        }
        Ok(())
    })
}
