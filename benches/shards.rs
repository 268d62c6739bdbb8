//! Sharding benchmark: the same work on 1, 2 and 4 shards, one replica per shard, or on one
//! shard count spread over 1, 2 and 4 replicas (the release binary, against the test
//! apiserver or the one with the `ShardedListAndWatch` gate on; the state in the test Kafka).
//!
//! ```text
//! cargo bench --bench shards                          # 3000 ConfigMaps; 1, 2 and 4 shards
//! cargo bench --bench shards -- --objects 10000 --shards 1,2,4,8
//! cargo bench --bench shards -- --shards 4 --replicas 1,2,4 --gate on
//! cargo bench --bench shards -- --shards 4 --replicas 1,2,4 --gate on --rate 200
//! cargo bench --bench shards -- --shards 4 --replicas 1,2,4 --gate on --rate 200 --rounds 3
//! cargo bench --bench shards -- --shards 4 --replicas 1,2,4 --gate on --retry-period 1
//! ```
//!
//! For each row, R replicas of `[coordination] shards = S` (S = 1: one replica, one Lease;
//! kubecast's default Lease timings, or with `--retry-period S` 4S / 2S / S seconds) start
//! on a namespace of N ConfigMaps; measured are the time from their start until every
//! object's snapshot event was written (by all replicas together: the shards' spreading
//! included), then the time from the first of N patches (64 at a time, or `--rate` per second:
//! every row then takes the same time, whatever the replicas cost the shared cores) until the
//! change of every object was written, each replica's CPU seconds (in all, and while the
//! changes came), peak RSS, events written and the bytes it received from the apiserver
//! (`kubecast_apiserver_received_bytes_total`; the requests of the replica that received most,
//! `kubecast_apiserver_requests_total`), and the objects of other
//! shards the replicas skipped (the apiserver did not apply the shard selector: the gate off)
//! or 0 (it did). `--gate on` runs on `tests/env/sharded` (the gate on), the default on
//! `tests/env/up` (off).
//!
//! With `--rounds N` the rows run N times in turn (1, 2, 4, 1, 2, 4, ...), and a summary
//! gives per row the medians of the busiest replica's CPU and of the most a replica received,
//! as ratios to the first row, beside the goal of 1.15 / R (two cores shared with the
//! apiserver, etcd and Kafka make one run differ from the next by up to a quarter).
//!
//! Figures are printed, never asserted. Servers: `tests/env/up` (started if needed and left
//! running; with `KUBECAST_ENV_FILE` set, that environment as it is), and with `--gate on`
//! `tests/env/sharded` (started if needed). See docs/performance.md.

use std::collections::{BTreeMap, BTreeSet};
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

/// Runs `f` on 64 of `0..n` at a time; with `rate`, starts the i-th no sooner than i / rate
/// seconds after the first.
async fn each<F, Fut>(n: usize, rate: Option<f64>, f: F) -> Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let start = tokio::time::Instant::now();
    futures::stream::iter(0..n)
        .then(|i| async move {
            if let Some(rate) = rate {
                tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
            }
            i
        })
        .map(f)
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect()
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

/// CPU seconds of each kind of thread of a running process (its name without trailing digits:
/// `rdk:broker1` -> `rdk:broker`), from /proc: where a replica's CPU went.
fn thread_cpu(pid: u32) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let name = stat[open + 1..close].trim_end_matches(|c: char| c.is_ascii_digit()).to_string();
        let f: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let ticks: f64 = [11, 12].iter().filter_map(|&i| f.get(i)?.parse::<f64>().ok()).sum();
        *out.entry(name).or_insert(0.0) += ticks / 100.0;
    }
    out
}

/// The sum of the samples of a metric family whose lines start with `prefix`.
async fn metric(kc: &mut Kubecast, prefix: &str) -> f64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    metrics.lines().filter(|l| l.starts_with(prefix)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

struct Figures {
    snapshot: Duration,
    changes: Duration,
    cpu: Vec<f64>,
    /// CPU seconds per replica from the first patch until every change was written.
    cpu_changes: Vec<f64>,
    rss: Vec<f64>,
    /// MB received from the apiserver, per replica.
    received: Vec<f64>,
    /// Events each replica wrote (its shards' snapshot and changes).
    events: Vec<usize>,
    skipped: f64,
    /// CPU seconds per kind of thread of the replica that used the most CPU.
    threads: BTreeMap<String, f64>,
    /// The requests of the replica that received the most, as `verb resource count`.
    requests: Vec<String>,
}

/// Where the replicas run: the apiserver's kubeconfig (`None`: the environment's default).
struct Target<'a> {
    env: &'a kubecast_kit::Env,
    kubeconfig: Option<String>,
    /// `--retry-period S`: Lease timings of 4S / 2S / S seconds; `None`: kubecast's defaults,
    /// what a deployment runs.
    retry_period: Option<u32>,
}

async fn run(
    target: &Target<'_>,
    client: &kube::Client,
    n: usize,
    rate: Option<f64>,
    shards: u32,
    replicas: u32,
) -> Result<Figures> {
    let env = target.env;
    let ns = TestNamespace::new(client, "bench-shards").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    each(n, None, |i| {
        let api = api.clone();
        async move {
            let cm: ConfigMap =
                serde_json::from_value(json!({"metadata": {"name": format!("cm-{i:06}")}, "data": {"v": "0"}}))?;
            api.create(&PostParams::default(), &cm).await?;
            Ok(())
        }
    })
    .await?;
    let timings = target.retry_period.map_or(String::new(), |p| {
        format!("lease_duration_seconds = {}\nrenew_deadline_seconds = {}\nretry_period_seconds = {p}\n", 4 * p, 2 * p)
    });
    let config = kubecast_kit::cm_config(
        &ns.name,
        &format!(
            "[coordination]\nenabled = true\nlease_name = \"bench\"\nlease_namespace = \"{}\"\nshards = {shards}\n{timings}",
            ns.name
        ),
    );
    let brokers = env.get("KAFKA_BROKERS").context("KAFKA_BROKERS")?;
    let checkpoint = format!(
        "store = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{}\"\n",
        kubecast_kit::unique("bench-shards-state")
    );
    let mut vars = vec![("RUST_LOG", "info")];
    if let Some(k) = &target.kubeconfig {
        vars.push(("KUBECONFIG", k.as_str()));
    }
    let mut kcs: Vec<Kubecast> =
        (0..replicas).map(|_| Kubecast::start_with_checkpoint(&config, &checkpoint, &vars)).collect();
    let snapshot = until(&kcs, "added", n, "the snapshot").await?;
    let synced: Vec<f64> = kcs.iter().map(|k| k.pid().map_or(0.0, |pid| usage(pid).0)).collect();
    let patched = Instant::now();
    each(n, rate, |i| {
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
    let (mut cpu, mut rss, mut received, mut skip) = (Vec::new(), Vec::new(), Vec::new(), 0.0);
    let mut cpu_changes = Vec::new();
    let events: Vec<usize> = kcs.iter().map(|k| k.events().len()).collect();
    let mut threads = BTreeMap::new();
    let mut requests = Vec::new();
    for (kc, synced) in kcs.iter_mut().zip(synced) {
        let pid = kc.pid().context("running")?;
        let (c, r) = usage(pid);
        cpu_changes.push(c - synced);
        if c > max(&cpu) {
            threads = thread_cpu(pid);
            let live: f64 = threads.values().sum();
            threads.insert("(threads that ended)".into(), (c - live).max(0.0));
        }
        cpu.push(c);
        rss.push(r);
        let got = metric(kc, "kubecast_apiserver_received_bytes_total").await / 1e6;
        if got > max(&received) {
            let (_, metrics) = kc.admin_get("/metrics").await;
            requests = metrics
                .lines()
                .filter_map(|l| l.strip_prefix("kubecast_apiserver_requests_total{"))
                .filter_map(|l| {
                    let (labels, count) = l.rsplit_once(' ')?;
                    let label = |k: &str| labels.split(k).nth(1)?.split('"').nth(1).map(str::to_string);
                    Some(format!("{} {} {count}", label("verb=")?, label("resource=").unwrap_or_default()))
                })
                .collect();
        }
        received.push(got);
        skip += metric(kc, "kubecast_shard_skipped_total{").await;
    }
    for kc in &mut kcs {
        kc.stop();
    }
    Ok(Figures { snapshot, changes, cpu, cpu_changes, rss, received, events, skipped: skip, threads, requests })
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

fn main() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async {
        let env = kubecast_kit::env_up(&["apiserver", "kafka"]);
        let gate = match arg("--gate").as_deref() {
            None | Some("off") => false,
            Some("on") => true,
            Some(other) => anyhow::bail!("--gate {other}: on or off"),
        };
        let (client, kubeconfig) = if gate {
            let status = std::process::Command::new(kubecast_kit::env::repo_root().join("tests/env/sharded"))
                .arg("up")
                .status()?;
            anyhow::ensure!(status.success(), "tests/env/sharded up failed");
            let kubeconfig = kubecast_kit::sharded_kubeconfig();
            (kubecast_kit::client_for(&kubeconfig).await, Some(kubeconfig))
        } else {
            (kubecast_kit::client().await, None)
        };
        let retry_period: Option<u32> =
            arg("--retry-period").map(|s| s.parse()).transpose().context("--retry-period: seconds, at least 1")?;
        anyhow::ensure!(retry_period != Some(0), "--retry-period: seconds, at least 1");
        let target = Target { env: &env, kubeconfig, retry_period };
        let n: usize = arg("--objects").map(|s| s.parse()).transpose()?.unwrap_or(3000);
        let rate: Option<f64> = arg("--rate").map(|s| s.parse()).transpose().context("--rate: changes per second")?;
        let rounds: usize = arg("--rounds").map(|s| s.parse()).transpose().context("--rounds: a count")?.unwrap_or(1);
        anyhow::ensure!(rounds >= 1, "--rounds: at least 1");
        let list = |flag: &str| -> Result<Option<Vec<u32>>> {
            arg(flag).map(|l| l.split(',').map(|s| s.trim().parse().context(flag.to_string())).collect()).transpose()
        };
        // (shards, replicas) per row: one replica per shard, or one count over several.
        let rows: Vec<(u32, u32)> = match (list("--shards")?, list("--replicas")?) {
            (None, None) => [1, 2, 4].map(|s| (s, s)).to_vec(),
            (Some(shards), None) => shards.into_iter().map(|s| (s, s)).collect(),
            (Some(shards), Some(replicas)) if shards.len() == 1 => replicas.into_iter().map(|r| (shards[0], r)).collect(),
            (None, Some(replicas)) => replicas.into_iter().map(|r| (4, r)).collect(),
            _ => anyhow::bail!("--replicas takes one --shards count"),
        };
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let model =
            cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|m| m.trim_start_matches([' ', '\t', ':']));
        println!(
            "shards: {n} ConfigMaps, changes {}, the apiserver's ShardedListAndWatch gate {}, Lease retry period {}; kubecast {} on {cores} cores ({}); {}",
            rate.map_or("64 at a time".to_string(), |r| format!("at {r} per second")),
            if gate { "on" } else { "off" },
            target.retry_period.map_or_else(
                || format!("{} s (the default)", kubecast::coordination::lease::CoordinationConfig::default().retry_period_seconds),
                |p| format!("{p} s")
            ),
            env!("CARGO_PKG_VERSION"),
            model.unwrap_or("?"),
            chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
        );
        println!(
            "{:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>12} {:>11} {:>12} {:>12} {:>11} {:>10}",
            "shards",
            "replicas",
            "snapshot",
            "changes",
            "CPU s max",
            "CPU s sum",
            "changes max",
            "RSS MB max",
            "recv MB max",
            "recv MB sum",
            "events max",
            "skipped"
        );
        // Per row, per round: the busiest replica's CPU in all and while the changes came, and
        // the most a replica received.
        let mut kept: Vec<Vec<[f64; 3]>> = vec![Vec::new(); rows.len()];
        for round in 1..=rounds {
            if rounds > 1 {
                println!("round {round} of {rounds}");
            }
            for (row, &(s, r)) in rows.iter().enumerate() {
                let f = run(&target, &client, n, rate, s, r).await.with_context(|| format!("{s} shards, {r} replicas"))?;
                kept[row].push([max(&f.cpu), max(&f.cpu_changes), max(&f.received)]);
                println!(
                    "{:>6} {:>8} {:>10.2?} {:>10.2?} {:>10.2} {:>10.2} {:>12.2} {:>11.1} {:>12.2} {:>12.2} {:>11} {:>10.0}",
                    s,
                    r,
                    f.snapshot,
                    f.changes,
                    max(&f.cpu),
                    f.cpu.iter().sum::<f64>(),
                    max(&f.cpu_changes),
                    max(&f.rss),
                    max(&f.received),
                    f.received.iter().sum::<f64>(),
                    f.events.iter().max().copied().unwrap_or(0),
                    f.skipped
                );
                let mut kinds: Vec<(&String, &f64)> = f.threads.iter().filter(|(_, c)| **c >= 0.005).collect();
                kinds.sort_by(|a, b| b.1.total_cmp(a.1));
                let kinds: Vec<String> = kinds.iter().map(|(name, c)| format!("{name} {c:.2}")).collect();
                println!("{:>17} CPU s by thread (the busiest replica): {}", "", kinds.join(", "));
                println!("{:>17} requests to the apiserver (the replica that received most): {}", "", f.requests.join(", "));
            }
        }
        summary(&rows, &kept);
        Ok(())
    })
}

/// Per row, the median over the rounds of the busiest replica's CPU (in all, and while the
/// changes came) and of the most a replica received, each as a ratio to the first row's
/// median, beside the goal of 1.15 / R relative to the first row's replicas (R = 2: 0.58x).
/// With several rounds, the spread of the per-round ratios (each round's row against the
/// same round's first row) is printed too: the rows of a round ran minutes apart, the
/// rounds longer.
fn summary(rows: &[(u32, u32)], kept: &[Vec<[f64; 3]>]) {
    let Some(&(_, r0)) = rows.first() else { return };
    // Every row has one figure per round, and there is at least one round.
    let median = |row: &[[f64; 3]], k: usize| {
        let mut v: Vec<f64> = row.iter().map(|f| f[k]).collect();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        if v.len() % 2 == 1 { v[mid] } else { (v[mid - 1] + v[mid]) / 2.0 }
    };
    let rounds = kept[0].len();
    println!(
        "medians of {rounds} round(s), ratio to the first row (per-round ratios: lowest-highest); goal per replica <= 1.15 x first-row replicas / R"
    );
    println!(
        "{:>6} {:>8} {:>24} {:>30} {:>24} {:>6}",
        "shards", "replicas", "CPU s in all", "CPU s while the changes came", "received MB", "goal"
    );
    for (row, &(s, r)) in rows.iter().enumerate() {
        let mut cells = Vec::new();
        for k in 0..3 {
            let m = median(&kept[row], k);
            let base = median(&kept[0], k);
            let ratios: Vec<f64> =
                kept[row].iter().zip(&kept[0]).filter(|(_, b)| b[k] > 0.0).map(|(f, b)| f[k] / b[k]).collect();
            let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ratios.iter().copied().fold(0.0, f64::max);
            let spread = if rounds > 1 { format!(" {lo:.2}-{hi:.2}") } else { String::new() };
            cells.push(format!("{m:.2} ({:.2}x{spread})", if base > 0.0 { m / base } else { 0.0 }));
        }
        let goal = 1.15 * f64::from(r0) / f64::from(r);
        println!("{s:>6} {r:>8} {:>24} {:>30} {:>24} {:>5.2}x", cells[0], cells[1], cells[2], goal);
    }
}
