//! Reflector benchmark: relist-diff time and memory of kubecast with many watched objects.
//!
//! ```text
//! cargo bench --bench reflector                          # 10000 and 100000 objects
//! cargo bench --bench reflector -- --objects 10000       # a chosen list of sizes
//! ```
//!
//! It runs the real release binary against the *compacting* apiserver of the test environment
//! (`tests/env/compacting up`, which this benchmark runs itself and leaves running: watch cache
//! off, etcd compacted every 5 s, so a resourceVersion expires within seconds). Per size N it
//! creates N ConfigMaps of ~1 KB in a fresh namespace, then:
//!
//! 1. **snapshot**: kubecast on a fresh state dir; wall time until its `list complete` log line
//!    and until all N events are in the file sink; peak RSS (`VmHWM`) and the steady RSS
//!    (`VmRSS` 12 s after the last event: past kubecast's 10 s allocator purge epoch).
//! 2. **RSS per object**: (steady RSS at N - steady RSS on an empty namespace) / N, against the
//!    goal of at most ~1 KB per watched object. The empty-namespace baseline is measured once.
//! 3. **relist-diff**: SIGTERM (final checkpoint), change 2% of the objects (1% modified, 0.5%
//!    deleted, 0.5% created), wait until a watch from the checkpoint's resourceVersion gets 410
//!    Gone, restart on the same state dir; wall time until `list complete` (origin resync), the
//!    events it emitted (should be exactly the changes), peak RSS, checkpoint bytes per object.
//! 4. **resumed**: stop and restart once more: it resumes from the fresh checkpoint without a
//!    list, so its steady RSS is the index plus the watch, with no list having ever been held in
//!    memory (the snapshot's steady RSS can include heap the allocator kept after the list).
//!
//! Figures are printed, never asserted. Progress goes to stderr, results to stdout. The
//! ConfigMaps are deleted (deletecollection) and the namespace deleted afterwards;
//! the test environment has no controller-manager, so a deleted namespace stays `Terminating`
//! forever, but empty. Namespaces left by an interrupted run (label
//! `app.kubernetes.io/managed-by=kubecast-bench`) are emptied at the next start.
//! With `KUBECAST_COMPACTING_ENV_FILE` set, that apiserver is used as it is (not started).
//! The process harness, the client and the namespace come from the test kit (`tests/kit`).
//! See docs/performance.md.

use std::collections::BTreeMap;
use std::fs;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kubecast_kit::Kubecast;
use serde_json::{Value, json};

/// Sizes measured when `--objects` is not given.
const DEFAULT_OBJECTS: &[usize] = &[10_000, 100_000];
/// Requests in flight while creating, changing and deleting objects.
const IN_FLIGHT: usize = 64;
/// Bytes of `data` per ConfigMap.
const PAYLOAD_BYTES: usize = 1000;
const MANAGED_BY: &str = "app.kubernetes.io/managed-by=kubecast-bench";
/// How long after the list "steady state" is read: past kubecast's 10 s allocator purge epoch
/// (`src/app/allocator.rs`), so memory freed after the list is given back before it is read.
const SETTLE: Duration = Duration::from_secs(12);
/// Only against hangs (a kubecast that never finishes its list): not a measured limit.
const HANG_GUARD: Duration = Duration::from_secs(30 * 60);
/// The kubecast log lines the benchmark waits for.
const LIST_COMPLETE: &str = "list complete; watching";
const RESUMING: &str = "resuming from checkpoint";
/// Log lines of a list that starts over (an expired continue token; a failed streaming list).
const LIST_RESTARTS: &[&str] = &["restarting the list", "listing again"];

#[tokio::main]
async fn main() -> Result<()> {
    let sizes = parse_args()?;
    eprintln!("starting the compacting apiserver (tests/env/compacting up; left running)");
    let kubeconfig = kubecast_kit::compacting_up();
    let client = kubecast_kit::client_for(&kubeconfig).await;
    kubecast_kit::set_bin(env!("CARGO_BIN_EXE_kubecast"));
    eprintln!("kubecast binary: {}", kubecast_kit::bin().display());

    sweep_leftovers(&client).await?;

    eprintln!("\n== baseline: kubecast watching an empty namespace");
    let baseline = in_namespace(&client, "kubecast-bench-empty", |ns| measure_baseline(&kubeconfig, ns)).await?;
    eprintln!("baseline steady RSS {} (peak {})", mib(baseline.rss_kb), mib(baseline.hwm_kb));

    let (mut rows, mut failed) = (Vec::new(), Vec::new());
    for &n in &sizes {
        eprintln!("\n== {n} objects");
        match in_namespace(&client, &format!("kubecast-bench-{n}"), |ns| measure_size(&client, &kubeconfig, ns, n))
            .await
        {
            Ok(row) => {
                print_details(&row, &baseline);
                rows.push(row);
            }
            // The other sizes still run, and the table shows what was measured.
            Err(e) => {
                eprintln!("{n} objects: FAILED: {e:?}");
                failed.push(n);
            }
        }
    }
    print_table(&rows, &baseline);
    if !failed.is_empty() {
        bail!("no figures for {failed:?} objects (see the errors above)");
    }
    Ok(())
}

/// `--objects 10000,100000` (or `--objects=...`); `cargo bench` also passes `--bench`.
fn parse_args() -> Result<Vec<usize>> {
    let mut sizes = DEFAULT_OBJECTS.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let list = match arg.as_str() {
            "--objects" => args.next().ok_or_else(|| anyhow!("--objects needs a value, e.g. 10000,100000"))?,
            a if a.starts_with("--objects=") => a["--objects=".len()..].to_string(),
            "--bench" => continue,
            other => {
                eprintln!(
                    "ignoring argument {other:?} (usage: cargo bench --bench reflector -- --objects 10000,100000)"
                );
                continue;
            }
        };
        sizes = list
            .split(',')
            .map(|s| s.trim().replace('_', "").parse::<usize>().with_context(|| format!("--objects: bad number {s:?}")))
            .collect::<Result<_>>()?;
        if sizes.contains(&0) {
            bail!("--objects: sizes must be at least 1");
        }
    }
    Ok(sizes)
}

// ------------------------------------------------------------------------------------------
// Measurements

/// Memory of a process, from /proc/<pid>/status, in KiB.
#[derive(Debug, Clone, Copy, Default)]
struct Mem {
    /// VmRSS: resident now.
    rss_kb: u64,
    /// VmHWM: peak resident since the process started.
    hwm_kb: u64,
}

/// Events the relist-diff wrote to the sink, by verb.
#[derive(Debug, Default)]
struct DiffEvents {
    added: usize,
    modified: usize,
    deleted: usize,
    /// Events whose `origin` is not `resync` (there should be none).
    not_resync: usize,
}

impl DiffEvents {
    fn total(&self) -> usize {
        self.added + self.modified + self.deleted
    }
}

/// The changes made between the snapshot and the relist.
#[derive(Debug, Default)]
struct Changes {
    modified: usize,
    deleted: usize,
    created: usize,
}

impl Changes {
    fn total(&self) -> usize {
        self.modified + self.deleted + self.created
    }
}

/// A `list complete` log line: wall time since kubecast started, and its own fields.
#[derive(Debug, Default)]
struct ListDone {
    wall: Duration,
    /// `elapsed_ms`: kubecast's time for the list and the diff (without start-up), including
    /// any restarted attempts.
    elapsed_ms: u64,
    objects: u64,
    events: u64,
    /// `origin`: "snapshot" for a first list, "resync" for a relist-diff.
    origin: String,
    /// `mode`: "paginated" or "streaming" (empty if the line has no such field).
    mode: String,
    /// Lists started over before this one completed (continue token expired by compaction).
    restarts: usize,
    /// With restarts: ms from the last restart to the `list complete` line (the attempt that
    /// succeeded, with its diff), from the log's timestamps.
    last_attempt_ms: Option<u64>,
}

impl ListDone {
    /// "12.34", or "12.34 (2 list restarts)".
    fn wall_cell(&self) -> String {
        match self.restarts {
            0 => format!("{:.2}", secs(self.wall)),
            k => format!("{:.2} ({k} list restart{})", secs(self.wall), if k > 1 { "s" } else { "" }),
        }
    }

    /// "kubecast list+diff 123 ms, origin resync, mode paginated, objects=.. events=..", with the
    /// last attempt's time after restarts.
    fn describe(&self) -> String {
        let mut out = format!("kubecast list+diff {} ms", self.elapsed_ms);
        if self.restarts > 0 {
            out += &format!(
                " incl. {} restart{} (last attempt {} ms)",
                self.restarts,
                if self.restarts > 1 { "s" } else { "" },
                self.last_attempt_ms.map_or("?".into(), |ms| ms.to_string())
            );
        }
        out += &format!(", origin {}", self.origin);
        if !self.mode.is_empty() {
            out += &format!(", mode {}", self.mode);
        }
        out + &format!(", objects={} events={}", self.objects, self.events)
    }
}

#[derive(Debug, Default)]
struct Row {
    objects: usize,
    create_time: Duration,
    // 1. snapshot
    snapshot: ListDone,
    snapshot_sink: Duration,
    snapshot_mem: Mem,
    // 3. relist-diff
    checkpoint_bytes: u64,
    checkpoint_objects: usize,
    changes: Changes,
    expiry_wait: Duration,
    relist: ListDone,
    relist_mem: Mem,
    relist_events: DiffEvents,
    // 4. resumed from the fresh checkpoint
    resumed_mem: Mem,
    /// The resumed run listed after all (its resourceVersion had expired): its RSS includes a list.
    resumed_relisted: bool,
}

/// Steady RSS of kubecast watching the (empty) namespace `ns`.
async fn measure_baseline(kubeconfig: &str, ns: String) -> Result<Mem> {
    let mut kc = Run::start(&ns, kubeconfig);
    kc.wait_log(LIST_COMPLETE, HANG_GUARD).await?;
    tokio::time::sleep(SETTLE).await;
    let mem = kc.mem()?;
    kc.stop().await?;
    Ok(mem)
}

async fn measure_size(client: &Client, kubeconfig: &str, ns: String, n: usize) -> Result<Row> {
    let ns = ns.as_str();
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let mut row = Row { objects: n, ..Default::default() };

    let t = Instant::now();
    eprintln!("creating {n} ConfigMaps of ~{PAYLOAD_BYTES} B in {ns} ({IN_FLIGHT} in flight)");
    create_configmaps(&api, (0..n).map(|i| object_name("obj", i)).collect()).await?;
    row.create_time = t.elapsed();

    // 1. Snapshot on a fresh state dir.
    eprintln!("snapshot: starting kubecast on a fresh state dir");
    let mut kc = Run::start(ns, kubeconfig);
    let mut events = LineCounter::new(kc.events_path());
    row.snapshot = kc.wait_list_complete().await?;
    eprintln!("snapshot: list complete after {:.2} s; waiting for {n} events in the sink", secs(row.snapshot.wall));
    row.snapshot_sink = kc.wait_lines(&mut events, n as u64, HANG_GUARD).await?.context("events in the sink")?;
    tokio::time::sleep(SETTLE).await;
    row.snapshot_mem = kc.mem()?;
    eprintln!("snapshot: all events in the sink after {:.2} s; stopping (SIGTERM)", secs(row.snapshot_sink));
    kc.stop().await?;

    let (cp_bytes, cp) = kc.checkpoint()?;
    row.checkpoint_bytes = cp_bytes;
    row.checkpoint_objects = cp["objects"].as_array().map_or(0, Vec::len);
    let rv = cp["resource_version"].as_str().context("checkpoint without resource_version")?.to_string();
    if row.checkpoint_objects != n {
        eprintln!("WARNING: the checkpoint holds {} objects, expected {n}", row.checkpoint_objects);
    }

    // 3. Relist-diff. The changes come first: they also make the checkpoint's resourceVersion
    // expire, since compaction only removes revisions older than newer writes.
    row.changes = change_configmaps(&api, n).await?;
    let t = Instant::now();
    eprintln!("relist: waiting until a watch from the checkpoint's resourceVersion {rv} gets 410 Gone");
    wait_until_expired(&api, &rv).await?;
    row.expiry_wait = t.elapsed();

    let before = events.poll()?;
    let diff_from = events.offset;
    eprintln!("relist: restarting kubecast on the same state dir");
    kc.restart();
    row.relist = kc.wait_list_complete().await?;
    let expected = row.changes.total() as u64;
    if kc.wait_lines(&mut events, before + expected, Duration::from_secs(120)).await?.is_none() {
        eprintln!("WARNING: fewer diff events than the {expected} changes within 120 s");
    }
    tokio::time::sleep(Duration::from_secs(1)).await; // room for any event beyond the expected ones
    row.relist_mem = kc.mem()?;
    row.relist_events = diff_events(&kc.events_path(), diff_from)?;
    eprintln!(
        "relist: list complete after {:.2} s, {} events; stopping",
        secs(row.relist.wall),
        row.relist_events.total()
    );
    kc.stop().await?;

    // 4. Resumed: at once, before the new checkpoint's resourceVersion can expire.
    kc.restart();
    kc.wait_log(RESUMING, HANG_GUARD).await?;
    tokio::time::sleep(SETTLE).await;
    row.resumed_mem = kc.mem()?;
    row.resumed_relisted = kc.log().contains(LIST_COMPLETE);
    kc.stop().await?;
    Ok(row)
}

/// 1% modified, 0.5% deleted, 0.5% created (at least one of each).
async fn change_configmaps(api: &Api<ConfigMap>, n: usize) -> Result<Changes> {
    let modified = (n / 100).max(1).min(n);
    let deleted = (n / 200).max(1).min(n - modified);
    let created = (n / 200).max(1);
    eprintln!("changing {modified} ConfigMaps, deleting {deleted}, creating {created}");
    for_all("modify", (0..modified).collect(), |i| {
        let (api, name) = (api.clone(), object_name("obj", i));
        async move {
            let (params, patch) = (PatchParams::default(), Patch::Merge(json!({"data": {"changed": "yes"}})));
            retry(|| api.patch(&name, &params, &patch)).await.map(drop).context("patch")
        }
    })
    .await?;
    for_all("delete", (modified..modified + deleted).collect(), |i| {
        let (api, name) = (api.clone(), object_name("obj", i));
        async move {
            let params = DeleteParams::default();
            match retry(|| api.delete(&name, &params)).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()), // a retry after a lost reply
                Err(e) => Err(e).context("delete"),
            }
        }
    })
    .await?;
    create_configmaps(api, (0..created).map(|i| object_name("new", i)).collect()).await?;
    Ok(Changes { modified, deleted, created })
}

/// Waits until a watch from `rv` is answered with 410 Gone, either as the HTTP status or as an
/// ERROR event in the stream.
async fn wait_until_expired(api: &Api<ConfigMap>, rv: &str) -> Result<()> {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let gone = match api.watch(&WatchParams::default().timeout(1), rv).await {
            Err(kube::Error::Api(s)) => s.code == 410,
            Err(e) => return Err(e).context("watch"),
            Ok(stream) => {
                let mut stream = std::pin::pin!(stream);
                matches!(stream.try_next().await, Ok(Some(WatchEvent::Error(s))) if s.code == 410)
            }
        };
        if gone {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("resourceVersion {rv} did not expire within {HANG_GUARD:?}: is this the compacting apiserver?");
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Tallies the events the sink file holds after byte `from`.
fn diff_events(path: &Path, from: u64) -> Result<DiffEvents> {
    let mut file = fs::File::open(path)?;
    file.seek(SeekFrom::Start(from))?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    let mut out = DiffEvents::default();
    for line in text.lines() {
        let ev: Value = serde_json::from_str(line).with_context(|| format!("sink line is not JSON: {line}"))?;
        match ev["type"].as_str().and_then(|t| t.rsplit('.').next()) {
            Some("added") => out.added += 1,
            Some("modified") => out.modified += 1,
            Some("deleted") => out.deleted += 1,
            other => bail!("event of unexpected type {other:?}: {line}"),
        }
        if ev["origin"] != "resync" {
            out.not_resync += 1;
        }
    }
    Ok(out)
}

// ------------------------------------------------------------------------------------------
// Report

fn print_details(r: &Row, baseline: &Mem) {
    let ch = &r.changes;
    let ev = &r.relist_events;
    println!("\n{} objects:", r.objects);
    println!("  created in {:.1} s ({:.0}/s)", secs(r.create_time), r.objects as f64 / secs(r.create_time));
    println!(
        "  snapshot: list complete at {:.2} s ({}), all events in the sink at {:.2} s",
        secs(r.snapshot.wall),
        r.snapshot.describe(),
        secs(r.snapshot_sink),
    );
    println!(
        "  snapshot memory: peak {}, steady {} (baseline {}), {} B per object",
        mib(r.snapshot_mem.hwm_kb),
        mib(r.snapshot_mem.rss_kb),
        mib(baseline.rss_kb),
        per_object(r.snapshot_mem.rss_kb, baseline.rss_kb, r.objects)
    );
    println!(
        "  checkpoint: {} bytes for {} objects, {:.0} B per object",
        r.checkpoint_bytes,
        r.checkpoint_objects,
        r.checkpoint_bytes as f64 / r.objects as f64
    );
    println!(
        "  changes: {} modified, {} deleted, {} created; resourceVersion expired {:.1} s after them",
        ch.modified,
        ch.deleted,
        ch.created,
        secs(r.expiry_wait)
    );
    println!("  relist-diff: list complete at {:.2} s after restart ({})", secs(r.relist.wall), r.relist.describe());
    println!(
        "  relist-diff events: {} modified, {} deleted, {} added = {} (expected {}){}{}",
        ev.modified,
        ev.deleted,
        ev.added,
        ev.total(),
        ch.total(),
        if (ev.modified, ev.deleted, ev.added) == (ch.modified, ch.deleted, ch.created) {
            ""
        } else {
            "  <-- MISMATCH"
        },
        if ev.not_resync > 0 { format!("  ({} not origin=resync)", ev.not_resync) } else { String::new() }
    );
    println!("  relist-diff memory: peak {}", mib(r.relist_mem.hwm_kb));
    println!(
        "  resumed from the checkpoint: steady {}, peak {}, {} B per object{}",
        mib(r.resumed_mem.rss_kb),
        mib(r.resumed_mem.hwm_kb),
        per_object(r.resumed_mem.rss_kb, baseline.rss_kb, r.objects),
        if r.resumed_relisted { " (it relisted: the resourceVersion had expired)" } else { "" }
    );
}

fn print_table(rows: &[Row], baseline: &Mem) {
    println!("\nbaseline (empty namespace): steady RSS {}, peak {}", mib(baseline.rss_kb), mib(baseline.hwm_kb));
    println!("goal: at most ~1 KB (1024 B) of RSS per watched object in steady state");
    println!("RSS/object = (steady RSS - baseline) / objects; 'resumed' = restarted from the checkpoint, no list");
    println!("list restart = the list's continue token expired (etcd compaction): kubecast listed again from page 1\n");
    let header = [
        "objects",
        "snapshot s",
        "all in sink s",
        "snapshot peak RSS MiB",
        "steady RSS MiB",
        "RSS/object B",
        "resumed RSS/object B",
        "relist-diff s",
        "relist peak RSS MiB",
        "diff events",
        "checkpoint B/object",
    ];
    let mut lines = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    for r in rows {
        let per = per_object(r.snapshot_mem.rss_kb, baseline.rss_kb, r.objects);
        let resumed = per_object(r.resumed_mem.rss_kb, baseline.rss_kb, r.objects);
        lines.push(vec![
            r.objects.to_string(),
            r.snapshot.wall_cell(),
            format!("{:.2}", secs(r.snapshot_sink)),
            format!("{:.1}", r.snapshot_mem.hwm_kb as f64 / 1024.0),
            format!("{:.1}", r.snapshot_mem.rss_kb as f64 / 1024.0),
            format!("{per} {}", if per <= 1024 { "(ok)" } else { "(> 1 KB)" }),
            format!("{resumed} {}", if resumed <= 1024 { "(ok)" } else { "(> 1 KB)" }),
            r.relist.wall_cell(),
            format!("{:.1}", r.relist_mem.hwm_kb as f64 / 1024.0),
            format!("{}/{}", r.relist_events.total(), r.changes.total()),
            format!("{:.0}", r.checkpoint_bytes as f64 / r.objects as f64),
        ]);
    }
    let widths: Vec<usize> = (0..header.len()).map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0)).collect();
    for (i, line) in lines.iter().enumerate() {
        let cells: Vec<String> = line.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        println!("{}", cells.join(" | "));
        if i == 0 {
            println!("{}", widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("-+-"));
        }
    }
}

/// Bytes of RSS per object above the baseline.
fn per_object(rss_kb: u64, baseline_kb: u64, n: usize) -> i64 {
    (rss_kb as i64 - baseline_kb as i64) * 1024 / n as i64
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ------------------------------------------------------------------------------------------
// The kubecast process

/// kubecast watching the ConfigMaps of one namespace (one stream, with the default page size
/// and rate limit, checkpoints flushed every second) on the compacting apiserver, in a fresh
/// directory of the test kit's harness (config, checkpoint dir, file sink, log); `RUST_LOG=info`.
struct Run {
    kc: Kubecast,
    kubeconfig: String,
}

impl Run {
    /// Starts `kubecast run`; its stderr is appended to the instance's log.
    fn start(ns: &str, kubeconfig: &str) -> Self {
        let config = format!(
            "[cluster]\nname = \"bench\"\n\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n"
        );
        let env = [("KUBECONFIG", kubeconfig), ("RUST_LOG", "info")];
        let kc = Kubecast::start_with_checkpoint(&config, "flush_interval_ms = 1000", &env);
        Self { kc, kubeconfig: kubeconfig.to_string() }
    }

    /// Starts it again on the same state dir, events file and log.
    fn restart(&mut self) {
        self.kc.restart(&[("KUBECONFIG", &self.kubeconfig), ("RUST_LOG", "info")]);
    }

    fn events_path(&self) -> PathBuf {
        self.kc.events_path.clone()
    }

    /// The stream's checkpoint file and its JSON.
    /// The stream's checkpoint as kubecast loads it (the snapshot with its journal applied),
    /// and its size on disk (snapshot and journal).
    fn checkpoint(&self) -> Result<(u64, Value)> {
        let path = self.kc.checkpoint_files().into_iter().next().context("no checkpoint file")?;
        let journal = path.with_extension("journal");
        let bytes = fs::metadata(&path)?.len() + fs::metadata(&journal).map_or(0, |m| m.len());
        Ok((bytes, kubecast_kit::process::checkpoint_with_journal(&path)))
    }
    /// This run's log so far.
    fn log(&self) -> String {
        self.kc.run_log()
    }

    /// An error if kubecast exited.
    fn check_running(&mut self) -> Result<()> {
        match self.kc.exited() {
            Some(status) => bail!("kubecast exited ({status}); its log:\n{}", self.log()),
            None => Ok(()),
        }
    }

    /// Waits for a log line containing `needle`; returns the time since start and the line.
    async fn wait_log(&mut self, needle: &str, guard: Duration) -> Result<(Duration, String)> {
        loop {
            if let Some(line) = self.log().lines().find(|l| l.contains(needle)) {
                return Ok((self.kc.started().elapsed(), line.to_string()));
            }
            self.check_running()?;
            if self.kc.started().elapsed() > guard {
                bail!("no {needle:?} in kubecast's log after {guard:?}:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_list_complete(&mut self) -> Result<ListDone> {
        let (wall, line) = self.wait_log(LIST_COMPLETE, HANG_GUARD).await?;
        let field = |key| log_field(&line, key).with_context(|| format!("no {key}= in {line:?}"));
        let log = self.log();
        let before: Vec<&str> = log.lines().take_while(|l| !l.contains(LIST_COMPLETE)).collect();
        let restarts: Vec<&str> =
            before.into_iter().filter(|l| LIST_RESTARTS.iter().any(|needle| l.contains(needle))).collect();
        let last_attempt_ms = restarts.last().and_then(|restart| {
            let ms = log_time(&line)?.signed_duration_since(log_time(restart)?).num_milliseconds();
            u64::try_from(ms).ok()
        });
        Ok(ListDone {
            wall,
            elapsed_ms: field("elapsed_ms")?,
            objects: field("objects")?,
            events: field("events")?,
            origin: log_str_field(&line, "origin").unwrap_or_default(),
            mode: log_str_field(&line, "mode").unwrap_or_default(),
            restarts: restarts.len(),
            last_attempt_ms,
        })
    }

    /// Waits until the sink holds `lines` events; the time since start, or `None` after `guard`.
    async fn wait_lines(&mut self, counter: &mut LineCounter, lines: u64, guard: Duration) -> Result<Option<Duration>> {
        let deadline = Instant::now() + guard;
        loop {
            if counter.poll()? >= lines {
                return Ok(Some(self.kc.started().elapsed()));
            }
            self.check_running()?;
            if Instant::now() > deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn mem(&self) -> Result<Mem> {
        let pid = self.kc.pid().context("kubecast is not running")?;
        let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kb = |key: &str| -> Result<u64> {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .with_context(|| format!("no {key} in /proc/{pid}/status"))
        };
        Ok(Mem { rss_kb: kb("VmRSS:")?, hwm_kb: kb("VmHWM:")? })
    }

    /// SIGTERM (kubecast writes its final checkpoints) and waits for the exit.
    async fn stop(&mut self) -> Result<()> {
        match self.kc.stop_within(Duration::from_secs(120)).await {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!("kubecast exited with {status} after SIGTERM; its log:\n{}", self.log()),
            None => bail!("kubecast did not exit within 120 s of SIGTERM; its log:\n{}", self.log()),
        }
    }
}

/// The value of a string field `key="text"` in a text log line.
fn log_str_field(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(" {key}=\""))? + key.len() + 3;
    Some(line[start..].split('"').next()?.to_string())
}

/// The timestamp a text log line starts with (RFC 3339).
fn log_time(line: &str) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    chrono::DateTime::parse_from_rfc3339(line.split_whitespace().next()?).ok()
}

/// The value of an integer field `key=123` in a text log line.
fn log_field(line: &str, key: &str) -> Option<u64> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let digits: String = line[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Counts the lines of a growing file, reading only what was appended since the last poll.
struct LineCounter {
    path: PathBuf,
    /// Bytes counted so far (always at the end of a line).
    offset: u64,
    lines: u64,
}

impl LineCounter {
    fn new(path: PathBuf) -> Self {
        Self { path, offset: 0, lines: 0 }
    }

    fn poll(&mut self) -> Result<u64> {
        let Ok(mut file) = fs::File::open(&self.path) else { return Ok(self.lines) };
        file.seek(SeekFrom::Start(self.offset))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        // Count complete lines only; a partial last line is read again next time.
        if let Some(last) = buf.iter().rposition(|&b| b == b'\n') {
            self.lines += buf[..=last].iter().filter(|&&b| b == b'\n').count() as u64;
            self.offset += last as u64 + 1;
        }
        Ok(self.lines)
    }
}

// ------------------------------------------------------------------------------------------
// The test environment and the objects

/// Runs `body` in a fresh namespace (named `prefix-<pid>`), which is emptied and deleted
/// afterwards, also when `body` failed.
async fn in_namespace<T, F, Fut>(client: &Client, prefix: &str, body: F) -> Result<T>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let name = format!("{prefix}-{}", std::process::id());
    let label = MANAGED_BY.split_once('=').expect("label");
    kubecast_kit::create_namespace(client, &name, &[label]).await.context("create namespace")?;
    let result = body(name.clone()).await;
    let cleaned = delete_namespace(client, &name).await;
    let value = result?;
    if let Err(e) = cleaned {
        // The figures are measured: report them anyway. The next run sweeps the namespace.
        eprintln!("WARNING: cleanup of namespace {name} failed: {e:#}");
    }
    Ok(value)
}

/// Empties and deletes the namespaces an interrupted run left behind.
async fn sweep_leftovers(client: &Client) -> Result<()> {
    let namespaces = Api::<Namespace>::all(client.clone()).list(&ListParams::default().labels(MANAGED_BY)).await?;
    for ns in namespaces.items {
        let name = ns.metadata.name.unwrap_or_default();
        let terminating = ns.metadata.deletion_timestamp.is_some();
        if !terminating || count_configmaps(client, &name).await? > 0 {
            eprintln!("emptying namespace {name}, left by an earlier run");
            delete_namespace(client, &name).await?;
        }
    }
    Ok(())
}

/// Deletes the ConfigMaps of `ns` with deletecollection, then the namespace (the test env has
/// no controller-manager to empty a deleted namespace).
///
/// The apiserver lists a collection in pages of 10000 and deletes each page one object after
/// the other; on the compacting apiserver the next page's continue token has usually expired
/// by then, and the call fails with 410 Expired. What it deleted stays deleted, so the call is
/// repeated while the collection keeps shrinking.
async fn delete_namespace(client: &Client, ns: &str) -> Result<()> {
    let t = Instant::now();
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let (dp, lp) = (DeleteParams::default(), ListParams::default());
    let mut remaining = count_configmaps(client, ns).await?;
    while remaining > 0 {
        eprintln!("cleanup: deletecollection of the {remaining} ConfigMaps of {ns} ({:.0} s)", secs(t.elapsed()));
        match retry(|| api.delete_collection(&dp, &lp)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) => eprintln!("  deletecollection: {} {}; repeating it", s.code, s.reason),
            Err(e) => return Err(e).context("deletecollection"),
        }
        let left = count_configmaps(client, ns).await?;
        if left >= remaining {
            bail!("deletecollection in {ns} makes no progress ({left} ConfigMaps left)");
        }
        remaining = left;
    }
    match Api::<Namespace>::all(client.clone()).delete(ns, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
        Err(e) => return Err(e).context("delete namespace"),
    }
    eprintln!("cleanup: {ns} emptied and deleted in {:.1} s", secs(t.elapsed()));
    Ok(())
}

/// How many ConfigMaps `ns` holds (one short request: a one-item page and its remaining count).
async fn count_configmaps(client: &Client, ns: &str) -> Result<u64> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let lp = ListParams::default().limit(1);
    let page = retry(|| api.list_metadata(&lp)).await?;
    Ok(page.items.len() as u64 + page.metadata.remaining_item_count.map_or(0, |n| n.max(0) as u64))
}

fn object_name(prefix: &str, i: usize) -> String {
    format!("{prefix}-{i:06}")
}

/// Creates ConfigMaps with ~PAYLOAD_BYTES of data each.
async fn create_configmaps(api: &Api<ConfigMap>, names: Vec<String>) -> Result<()> {
    for_all("create", names, |name| {
        let api = api.clone();
        async move {
            let payload: String = name.chars().chain(std::iter::once(';')).cycle().take(PAYLOAD_BYTES).collect();
            let cm = ConfigMap {
                metadata: ObjectMeta { name: Some(name), ..Default::default() },
                data: Some(BTreeMap::from([("payload".to_string(), payload)])),
                ..Default::default()
            };
            let params = PostParams::default();
            match retry(|| api.create(&params, &cm)).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(()), // a retry after a lost reply
                Err(e) => Err(e).context("create"),
            }
        }
    })
    .await
}

/// Runs `f` on every item, IN_FLIGHT at a time, printing progress every 5 s.
async fn for_all<T, F, Fut>(what: &str, items: Vec<T>, f: F) -> Result<()>
where
    F: FnMut(T) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let total = items.len();
    let started = Instant::now();
    let mut last_report = Instant::now();
    let mut done = 0usize;
    let mut results = futures::stream::iter(items).map(f).buffer_unordered(IN_FLIGHT);
    while let Some(result) = results.next().await {
        result?;
        done += 1;
        if last_report.elapsed() >= Duration::from_secs(5) || done == total {
            let rate = done as f64 / secs(started.elapsed()).max(1e-3);
            eprintln!("  {what}: {done}/{total} ({rate:.0}/s, {:.0} s)", secs(started.elapsed()));
            last_report = Instant::now();
        }
    }
    Ok(())
}

/// Retries a request on overload and connection errors (429, 5xx, transport), a few times.
async fn retry<T, Fut>(mut request: impl FnMut() -> Fut) -> kube::Result<T>
where
    Fut: Future<Output = kube::Result<T>>,
{
    let mut attempt = 1;
    loop {
        match request().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt < 8 && transient(&e) => {
                tokio::time::sleep(Duration::from_millis(250 * attempt)).await;
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 429 || s.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}
