//! Scale benchmark: kubecast watching 100k and 1M objects, from the process's side and the
//! apiserver's.
//!
//! ```text
//! cargo bench --bench scale                                 # 100000 and 1000000 objects
//! cargo bench --bench scale -- --objects 100000 --rest-seconds 60
//! ```
//!
//! It runs the release binary against the scale apiserver of the test environment
//! (`tests/env/scale up`, which it runs itself and leaves running: the watch cache on and
//! streaming lists allowed, as on a real cluster; an etcd with room for a million objects).
//! Per size N, in the namespace `kubecast-scale-N`, whose N small ConfigMaps (64 bytes of data)
//! are created at the first run and kept for the next (a second run creates nothing):
//!
//! 1. **snapshot**: kubecast on a fresh state dir: wall time until its `list complete` line and
//!    until all N events are in the file sink, its CPU seconds, peak RSS, the bytes it received
//!    from the apiserver, then the steady RSS 12 s later (past the allocator's purge epoch).
//! 2. **at rest**: nothing changes for `--rest-seconds` (default 300, a little more than one
//!    watch's server-side timeout of 290 s): kubecast's CPU, bytes received and requests,
//!    scaled to an hour.
//! 3. **resume**: SIGTERM (the final checkpoint: its time and size), then a restart on the same
//!    state: the time until it resumed (checkpoint loaded) and until `/readyz`, the lists it
//!    made (none is the goal), CPU, peak and steady RSS.
//! 4. **relist after 410 Gone**: SIGTERM, 2% of the objects changed (1% modified, 0.5%
//!    deleted, 0.5% created), the apiserver restarted (`tests/env/scale restart`: its new
//!    watch cache starts at the current revision, so the checkpoint's resourceVersion is
//!    answered with 410 Gone, as it is after an outage longer than the cache's history), then
//!    kubecast restarted: its relist-diff's time, events (exactly the changes), CPU, peak RSS
//!    against the steady RSS, requests and bytes. The changes are undone afterwards.
//!
//! The requests are kubecast's own count (`kubecast_apiserver_requests_total` by verb: the
//! apiserver's `apiserver_request_total` counts its internal watchers too, and a watch only once
//! it ends); the apiserver's side is the CPU of the apiserver and etcd processes per phase and
//! the watch events it sent (`apiserver_watch_events_total` of ConfigMaps). Figures are
//! printed, never asserted; the goals are printed beside them. Progress goes to stderr, results
//! to stdout. `tests/env/scale down --clean` removes the objects. With `KUBECAST_SCALE_ENV_FILE`
//! set, that environment is used as it is (nothing is started, and the 410 phase needs its
//! `tests/env/scale restart`). See docs/performance.md.

mod watching;

use std::fs;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use watching::*;

const DEFAULT_OBJECTS: &[usize] = &[100_000, 1_000_000];
/// Bytes of `data` per ConfigMap: small objects, as the issue of scale is their number.
const PAYLOAD_BYTES: usize = 64;
const DEFAULT_REST: Duration = Duration::from_secs(300);
const LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "kubecast-bench-scale");
/// The goals (docs/performance.md), printed beside the figures.
const GOAL_STEADY_MB_AT_1M: f64 = 128.0;
const GOAL_SNAPSHOT_S_AT_1M: f64 = 60.0;
const GOAL_RELIST_PEAK: f64 = 1.5;

#[tokio::main]
async fn main() -> Result<()> {
    let (sizes, rest) = parse_args()?;
    eprintln!("starting the scale apiserver (tests/env/scale up; left running)");
    let env = kubecast_kit::scale_up();
    let kubeconfig = env.get("KUBECONFIG").context("no KUBECONFIG in the scale env file")?.clone();
    let state = PathBuf::from(env.get("KUBECAST_ENV_STATE").context("no KUBECAST_ENV_STATE in the scale env file")?);
    let etcd = env.get("KUBECAST_TEST_ETCD_ENDPOINT").context("no etcd endpoint in the scale env file")?.clone();
    let client = kubecast_kit::client_for(&kubeconfig).await;
    kubecast_kit::set_bin(env!("CARGO_BIN_EXE_kubecast"));
    let cluster = Cluster { client, kubeconfig, state, etcd };
    print_machine(&cluster).await;

    eprintln!("\n== baseline: kubecast watching an empty namespace");
    let ns = cluster.namespace(0).await?;
    let mut kc = Run::start(&ns, &cluster.kubeconfig);
    kc.wait_log(LIST_COMPLETE, HANG_GUARD).await?;
    tokio::time::sleep(SETTLE).await;
    let baseline = kc.mem()?;
    kc.stop().await?;
    println!("baseline (an empty namespace): steady RSS {}, peak {}", mib(baseline.rss_kb), mib(baseline.hwm_kb));

    let mut failed = Vec::new();
    for &n in &sizes {
        eprintln!("\n== {n} objects");
        match measure(&cluster, n, rest).await {
            Ok(figures) => figures.print(&baseline),
            Err(e) => {
                eprintln!("{n} objects: FAILED: {e:?}");
                failed.push(n);
            }
        }
    }
    if !failed.is_empty() {
        bail!("no figures for {failed:?} objects (see the errors above)");
    }
    Ok(())
}

/// `--objects 100000,1000000`, `--rest-seconds 300` (0: no phase at rest).
fn parse_args() -> Result<(Vec<usize>, Duration)> {
    let (mut sizes, mut rest) = (DEFAULT_OBJECTS.to_vec(), DEFAULT_REST);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || inline.clone().or_else(|| args.next()).ok_or_else(|| anyhow!("{key} needs a value"));
        match key.as_str() {
            "--objects" => {
                sizes = value()?
                    .split(',')
                    .map(|s| {
                        s.trim()
                            .replace('_', "")
                            .parse::<usize>()
                            .with_context(|| format!("--objects: bad number {s:?}"))
                    })
                    .collect::<Result<_>>()?;
                if sizes.contains(&0) {
                    bail!("--objects: sizes must be at least 1");
                }
            }
            "--rest-seconds" => {
                rest = Duration::from_secs(value()?.parse().context("--rest-seconds: a number of seconds")?)
            }
            "--bench" => {}
            other => eprintln!(
                "ignoring argument {other:?} (usage: cargo bench --bench scale -- --objects 100000,1000000 --rest-seconds 300)"
            ),
        }
    }
    Ok((sizes, rest))
}

/// The scale apiserver: its client and kubeconfig, its state dir (the pid files of the
/// apiserver and etcd), etcd's client URL.
struct Cluster {
    client: Client,
    kubeconfig: String,
    state: PathBuf,
    etcd: String,
}

impl Cluster {
    /// `kubecast-scale-<n>` (`kubecast-scale-empty` for 0), created if missing.
    async fn namespace(&self, n: usize) -> Result<String> {
        let name = if n == 0 { "kubecast-scale-empty".to_string() } else { format!("kubecast-scale-{n}") };
        match kubecast_kit::create_namespace(&self.client, &name, &[LABEL]).await {
            Ok(_) => Ok(name),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(name), // kept from an earlier run
            Err(e) => Err(e).context("create namespace"),
        }
    }

    fn pid(&self, service: &str) -> Result<u32> {
        let path = self.state.join(service).join("pid");
        let text = fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
        text.trim().parse().with_context(|| format!("{}: not a pid", path.display()))
    }

    /// The CPU seconds the apiserver and etcd spent so far.
    fn control_plane_cpu(&self) -> Result<f64> {
        Ok(cpu_seconds(self.pid("apiserver")?)? + cpu_seconds(self.pid("etcd")?)?)
    }

    /// Events the apiserver sent to ConfigMap watchers so far (every watcher; since it started).
    async fn watch_events(&self) -> Result<f64> {
        let req = http::Request::get("/metrics").body(Vec::new())?;
        let text = self.client.request_text(req).await.context("the apiserver's /metrics")?;
        Ok(sum_samples(&text, "apiserver_watch_events_total", &[("resource", "configmaps")]))
    }

    /// etcd's database size in bytes (its gRPC gateway's status).
    async fn etcd_db_bytes(&self) -> Option<u64> {
        let out = Command::new("curl")
            .args([
                "-fsS",
                "--max-time",
                "5",
                "-X",
                "POST",
                "-d",
                "{}",
                &format!("{}/v3/maintenance/status", self.etcd),
            ])
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        v["dbSize"].as_str()?.parse().ok()
    }

    /// `tests/env/scale restart`: the apiserver again, its watch cache empty.
    fn restart_apiserver(&self) -> Result<()> {
        let script = kubecast_kit::repo_root().join("tests/env/scale");
        let status = Command::new(&script)
            .arg("restart")
            .env("KUBECAST_ENV_SCALE_STATE", &self.state)
            .status()
            .with_context(|| format!("{}", script.display()))?;
        if !status.success() {
            bail!("tests/env/scale restart failed ({status})");
        }
        Ok(())
    }
}

/// The requests kubecast sent to the apiserver (`kubecast_apiserver_requests_total`), by verb.
#[derive(Debug, Clone, Copy, Default)]
struct Requests {
    list: f64,
    watch: f64,
    /// Every other verb (discovery, get, ...).
    other: f64,
}

impl Requests {
    fn of(metrics: &str) -> Requests {
        let name = "kubecast_apiserver_requests_total";
        let (list, watch) =
            (sum_samples(metrics, name, &[("verb", "list")]), sum_samples(metrics, name, &[("verb", "watch")]));
        Requests { list, watch, other: sum_samples(metrics, name, &[]) - list - watch }
    }

    fn since(self, before: Requests) -> Requests {
        Requests { list: self.list - before.list, watch: self.watch - before.watch, other: self.other - before.other }
    }

    fn describe(&self) -> String {
        format!("{:.0} list, {:.0} watch, {:.0} other", self.list, self.watch, self.other)
    }
}

/// One phase's costs: wall time, kubecast's CPU, its requests and the bytes it received, and
/// the apiserver's side: the CPU of the apiserver and etcd, the watch events it sent.
#[derive(Debug, Default)]
struct Phase {
    wall: Duration,
    cpu: f64,
    requests: Requests,
    received_mb: f64,
    control_plane_cpu: f64,
    watch_events: f64,
    mem: Mem,
}

/// Readings at the start of a phase (kubecast's are zero before it starts).
#[derive(Default)]
struct Mark {
    cpu: f64,
    requests: Requests,
    received: f64,
    control_plane_cpu: f64,
    watch_events: f64,
}

impl Mark {
    async fn now(cluster: &Cluster, kc: Option<&mut Run>) -> Result<(Instant, Mark)> {
        let mut mark = Mark {
            control_plane_cpu: cluster.control_plane_cpu()?,
            watch_events: cluster.watch_events().await?,
            ..Default::default()
        };
        if let Some(kc) = kc {
            let metrics = kc.metrics().await;
            mark.cpu = kc.cpu()?;
            mark.requests = Requests::of(&metrics);
            mark.received = sum_samples(&metrics, "kubecast_apiserver_received_bytes_total", &[]);
        }
        Ok((Instant::now(), mark))
    }

    /// The phase from this mark (taken at `at`) to now, kubecast still running.
    async fn phase(&self, at: Instant, cluster: &Cluster, kc: &mut Run) -> Result<Phase> {
        let metrics = kc.metrics().await;
        Ok(Phase {
            wall: at.elapsed(),
            cpu: kc.cpu()? - self.cpu,
            requests: Requests::of(&metrics).since(self.requests),
            received_mb: (sum_samples(&metrics, "kubecast_apiserver_received_bytes_total", &[]) - self.received) / 1e6,
            control_plane_cpu: cluster.control_plane_cpu()? - self.control_plane_cpu,
            watch_events: cluster.watch_events().await? - self.watch_events,
            mem: kc.mem()?,
        })
    }
}

#[derive(Debug, Default)]
struct Figures {
    objects: usize,
    /// Objects created by this run (0: all kept from an earlier one), and the time it took.
    created: usize,
    create_time: Duration,
    etcd_mb: f64,
    snapshot: ListDone,
    snapshot_sink: Duration,
    snapshot_phase: Phase,
    steady: Mem,
    rest: Option<Phase>,
    stop_time: Duration,
    checkpoint_bytes: u64,
    resumed_at: Duration,
    resume_ready: Duration,
    resume: Phase,
    resume_steady: Mem,
    resume_listed: bool,
    changes: Changes,
    relist: ListDone,
    relist_phase: Phase,
    relist_events: DiffEvents,
}

async fn measure(cluster: &Cluster, n: usize, rest: Duration) -> Result<Figures> {
    let mut f = Figures { objects: n, ..Default::default() };
    let ns = cluster.namespace(n).await?;
    let api = Api::<ConfigMap>::namespaced(cluster.client.clone(), &ns);
    (f.created, f.create_time) = ensure_objects(cluster, &api, &ns, n).await?;
    f.etcd_mb = cluster.etcd_db_bytes().await.unwrap_or(0) as f64 / 1e6;

    // 1. Snapshot.
    eprintln!("snapshot: kubecast on a fresh state dir");
    let (at, before) = Mark::now(cluster, None).await?;
    let mut kc = Run::start(&ns, &cluster.kubeconfig);
    let mut events = LineCounter::new(kc.events_path());
    f.snapshot = kc.wait_list_complete().await?;
    eprintln!("snapshot: list complete after {:.2} s; waiting for {n} events in the sink", secs(f.snapshot.wall));
    f.snapshot_sink = kc.wait_lines(&mut events, n as u64, HANG_GUARD).await?.context("events in the sink")?;
    f.snapshot_phase = before.phase(at, cluster, &mut kc).await?;
    f.snapshot_phase.wall = f.snapshot_sink;
    tokio::time::sleep(SETTLE).await;
    f.steady = kc.mem()?;

    // 2. At rest.
    if !rest.is_zero() {
        eprintln!("at rest: {} s with no change", rest.as_secs());
        let (at, mark) = Mark::now(cluster, Some(&mut kc)).await?;
        tokio::time::sleep(rest).await;
        f.rest = Some(mark.phase(at, cluster, &mut kc).await?);
    }

    // 3. Resume.
    eprintln!("resume: stopping (SIGTERM) and starting again on the same state");
    f.stop_time = kc.stop_timed().await?;
    f.checkpoint_bytes = kc.checkpoint()?.0;
    let (at, mark) = Mark::now(cluster, None).await?;
    kc.restart();
    f.resumed_at = kc.wait_log(RESUMING, HANG_GUARD).await?.0;
    f.resume_ready = kc.wait_ready(HANG_GUARD).await?;
    f.resume = mark.phase(at, cluster, &mut kc).await?;
    f.resume.wall = f.resume_ready;
    tokio::time::sleep(SETTLE).await;
    f.resume_steady = kc.mem()?;
    f.resume_listed = kc.log().contains(LIST_COMPLETE);
    let rv = kc.checkpoint()?.1["resource_version"].as_str().unwrap_or_default().to_string();
    kc.stop().await?;

    // 4. Relist after 410 Gone.
    f.changes = change_configmaps(&api, n, PAYLOAD_BYTES).await?;
    eprintln!("relist: restarting the apiserver (its watch cache forgets the history)");
    cluster.restart_apiserver()?;
    let client = kubecast_kit::client_for(&cluster.kubeconfig).await;
    wait_until_expired(&Api::<ConfigMap>::namespaced(client, &ns), &rv).await?;
    let (at, mark) = Mark::now(cluster, None).await?;
    let diff_from = events.offset;
    let lines_before = events.poll()?;
    kc.restart();
    f.relist = kc.wait_list_complete().await?;
    let expected = f.changes.total() as u64;
    if kc.wait_lines(&mut events, lines_before + expected, Duration::from_secs(300)).await?.is_none() {
        eprintln!("WARNING: fewer diff events than the {expected} changes within 300 s");
    }
    f.relist_phase = mark.phase(at, cluster, &mut kc).await?;
    f.relist_phase.wall = f.relist.wall;
    f.relist_events = diff_events(&kc.events_path(), diff_from)?;
    kc.stop().await?;
    eprintln!("restoring the objects");
    restore_configmaps(&api, n, PAYLOAD_BYTES).await?;
    Ok(f)
}

/// Makes `obj-0..n` exist in `ns`, creating what is missing (a run interrupted while creating
/// left a prefix, give or take the requests in flight). Returns how many it created and how
/// long that took.
async fn ensure_objects(cluster: &Cluster, api: &Api<ConfigMap>, ns: &str, n: usize) -> Result<(usize, Duration)> {
    let have = count_configmaps(&cluster.client, ns).await? as usize;
    if have == n {
        eprintln!("{ns} holds the {n} ConfigMaps of an earlier run: kept");
        return Ok((0, Duration::ZERO));
    }
    if have > n {
        bail!("{ns} holds {have} ConfigMaps, not {n}: delete the namespace's objects (tests/env/scale down --clean)");
    }
    let from = have.saturating_sub(4 * IN_FLIGHT);
    eprintln!("creating ConfigMaps {from}..{n} of ~{PAYLOAD_BYTES} B in {ns} ({IN_FLIGHT} in flight)");
    let t = Instant::now();
    create_configmaps(api, (from..n).map(|i| object_name("obj", i)).collect(), PAYLOAD_BYTES).await?;
    let took = t.elapsed();
    let now = count_configmaps(&cluster.client, ns).await? as usize;
    if now != n {
        bail!(
            "{ns} holds {now} ConfigMaps after creating, not {n}: clean it (tests/env/scale down --clean) and run again"
        );
    }
    Ok((n - have, took))
}

impl Figures {
    fn print(&self, baseline: &Mem) {
        let n = self.objects;
        let mb = |kb: u64| kb as f64 / 1024.0;
        println!("\n{n} objects (ConfigMaps with {PAYLOAD_BYTES} B of data; etcd database {:.0} MB):", self.etcd_mb);
        if self.created > 0 {
            println!(
                "  created {} in {:.1} s ({:.0}/s)",
                self.created,
                secs(self.create_time),
                self.created as f64 / secs(self.create_time)
            );
        }
        let s = &self.snapshot_phase;
        let goal =
            if n >= 1_000_000 { format!(" (goal at 1M: <= {GOAL_SNAPSHOT_S_AT_1M:.0} s)") } else { String::new() };
        println!(
            "  snapshot: list complete at {:.2} s ({}), all {n} events in the sink at {:.2} s{goal}",
            secs(self.snapshot.wall),
            self.snapshot.describe(),
            secs(self.snapshot_sink)
        );
        println!("    {}", s.describe());
        let steady_goal =
            if n >= 1_000_000 { format!(" (goal at 1M: <= {GOAL_STEADY_MB_AT_1M:.0} MB)") } else { String::new() };
        println!(
            "  steady after the snapshot: RSS {:.1} MiB{steady_goal}, {} B per object above the baseline; peak {:.1} MiB",
            mb(self.steady.rss_kb),
            per_object(self.steady.rss_kb, baseline.rss_kb, n),
            mb(self.steady.hwm_kb)
        );
        if let Some(r) = &self.rest {
            let per_hour = 3600.0 / secs(r.wall);
            println!(
                "  at rest for {:.0} s: {}; per hour: {:.1} s CPU, {:.2} MB, {:.1} watch, {:.1} list",
                secs(r.wall),
                r.describe(),
                r.cpu * per_hour,
                r.received_mb * per_hour,
                r.requests.watch * per_hour,
                r.requests.list * per_hour
            );
        }
        println!(
            "  stop: final checkpoint and exit in {:.2} s; checkpoint {:.1} MB ({:.0} B per object)",
            secs(self.stop_time),
            self.checkpoint_bytes as f64 / 1e6,
            self.checkpoint_bytes as f64 / n as f64
        );
        let r = &self.resume;
        println!(
            "  resume: checkpoint loaded at {:.2} s, ready at {:.2} s{}; steady RSS {:.1} MiB ({} B per object), peak {:.1} MiB",
            secs(self.resumed_at),
            secs(self.resume_ready),
            if self.resume_listed { " (it LISTED: the resourceVersion had expired)" } else { "" },
            mb(self.resume_steady.rss_kb),
            per_object(self.resume_steady.rss_kb, baseline.rss_kb, n),
            mb(self.resume_steady.hwm_kb)
        );
        println!("    {}", r.describe());
        let (ch, ev) = (&self.changes, &self.relist_events);
        let p = &self.relist_phase;
        let ratio = mb(p.mem.hwm_kb) / mb(self.resume_steady.rss_kb);
        let ratio_snapshot = mb(p.mem.hwm_kb) / mb(self.steady.rss_kb);
        println!(
            "  relist after 410 Gone: list complete at {:.2} s ({}); {}",
            secs(self.relist.wall),
            self.relist.describe(),
            ev.against(ch)
        );
        println!(
            "    peak RSS {:.1} MiB = {ratio:.2}x the steady RSS when resumed, {ratio_snapshot:.2}x after the snapshot \
             (goal <= {GOAL_RELIST_PEAK}x); {}",
            mb(p.mem.hwm_kb),
            p.describe()
        );
    }
}

impl Phase {
    fn describe(&self) -> String {
        format!(
            "kubecast: CPU {:.2} s, requests {}, {:.1} MB received; apiserver+etcd: CPU {:.2} s, {:.0} watch events sent",
            self.cpu,
            self.requests.describe(),
            self.received_mb,
            self.control_plane_cpu,
            self.watch_events
        )
    }
}

/// The machine, versions and date the figures are taken on.
async fn print_machine(cluster: &Cluster) {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model =
        cpuinfo.lines().find_map(|l| l.strip_prefix("model name")).map(|m| m.trim_start_matches([' ', '\t', ':']));
    let mem_gib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next()?.split_whitespace().nth(1)?.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0 / 1024.0);
    let version = cluster.client.apiserver_version().await.map(|v| v.git_version).unwrap_or_else(|_| "?".into());
    println!(
        "scale: kubecast {} (release) on {cores} cores ({}), {mem_gib:.1} GiB; kube-apiserver {version} with the watch cache, \
         the same cores; {}",
        env!("CARGO_PKG_VERSION"),
        model.unwrap_or("?"),
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC")
    );
}
