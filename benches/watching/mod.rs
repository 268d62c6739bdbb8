//! What the `reflector` and `scale` benchmarks share: kubecast watching the ConfigMaps of one
//! namespace (the release binary in the test kit's harness: a file sink, a file checkpoint, its
//! log), what it costs the process (`/proc`), its log lines, and the ConfigMaps themselves
//! (made, changed and deleted many at a time, with retries on overload).

#![allow(dead_code)] // each benchmark uses a part

use std::collections::BTreeMap;
use std::fs;
use std::future::Future;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kubecast_kit::Kubecast;
use serde_json::{Value, json};

/// Requests in flight while creating, changing and deleting objects.
pub const IN_FLIGHT: usize = 64;
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by=kubecast-bench";
/// How long after the list "steady state" is read: past kubecast's 10 s allocator purge epoch
/// (`src/app/allocator.rs`), so memory freed after the list is given back before it is read.
pub const SETTLE: Duration = Duration::from_secs(15);
/// Only against hangs (a kubecast that never finishes its list): not a measured limit.
pub const HANG_GUARD: Duration = Duration::from_secs(30 * 60);
/// The kubecast log lines the benchmark waits for.
pub const LIST_COMPLETE: &str = "list complete; watching";
pub const RESUMING: &str = "resuming from checkpoint";
/// Log lines of a list that starts over (an expired continue token; a failed streaming list).
pub const LIST_RESTARTS: &[&str] = &["restarting the list", "listing again"];

/// Memory of a process, from /proc/<pid>/status, in KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct Mem {
    /// VmRSS: resident now.
    pub rss_kb: u64,
    /// VmHWM: peak resident since the process started.
    pub hwm_kb: u64,
}

/// Events the relist-diff wrote to the sink, by verb.
#[derive(Debug, Default)]
pub struct DiffEvents {
    pub added: usize,
    pub modified: usize,
    pub deleted: usize,
    /// Events whose `origin` is not `resync` (there should be none).
    pub not_resync: usize,
}

impl DiffEvents {
    /// "10 modified, 5 deleted, 5 added = 20 events for 20 changes", marked where they differ
    /// from `changes` or an event is not a resync.
    pub fn against(&self, changes: &Changes) -> String {
        let same = (self.modified, self.deleted, self.added) == (changes.modified, changes.deleted, changes.created);
        let mut out = format!(
            "{} modified, {} deleted, {} added = {} events for {} changes",
            self.modified,
            self.deleted,
            self.added,
            self.total(),
            changes.total()
        );
        if !same {
            out += "  <-- MISMATCH";
        }
        if self.not_resync > 0 {
            out += &format!("  ({} not origin=resync)", self.not_resync);
        }
        out
    }

    pub fn total(&self) -> usize {
        self.added + self.modified + self.deleted
    }
}

/// The changes made between the snapshot and the relist.
#[derive(Debug, Default)]
pub struct Changes {
    pub modified: usize,
    pub deleted: usize,
    pub created: usize,
}

impl Changes {
    /// What [`change_configmaps`] does to `n` objects.
    pub fn of(n: usize) -> Self {
        let modified = (n / 100).max(1).min(n);
        let deleted = (n / 200).max(1).min(n - modified);
        Self { modified, deleted, created: (n / 200).max(1) }
    }

    pub fn total(&self) -> usize {
        self.modified + self.deleted + self.created
    }
}

/// A `list complete` log line: wall time since kubecast started, and its own fields.
#[derive(Debug, Default)]
pub struct ListDone {
    pub wall: Duration,
    /// `elapsed_ms`: kubecast's time for the list and the diff (without start-up), including
    /// any restarted attempts.
    pub elapsed_ms: u64,
    pub objects: u64,
    pub events: u64,
    /// `origin`: "snapshot" for a first list, "resync" for a relist-diff.
    pub origin: String,
    /// `mode`: "paginated" or "streaming" (empty if the line has no such field).
    pub mode: String,
    /// Lists started over before this one completed (continue token expired by compaction).
    pub restarts: usize,
    /// With restarts: ms from the last restart to the `list complete` line (the attempt that
    /// succeeded, with its diff), from the log's timestamps.
    pub last_attempt_ms: Option<u64>,
}

impl ListDone {
    /// "12.34", or "12.34 (2 list restarts)".
    pub fn wall_cell(&self) -> String {
        match self.restarts {
            0 => format!("{:.2}", secs(self.wall)),
            k => format!("{:.2} ({k} list restart{})", secs(self.wall), if k > 1 { "s" } else { "" }),
        }
    }

    /// "kubecast list+diff 123 ms, origin resync, mode paginated, objects=.. events=..", with the
    /// last attempt's time after restarts.
    pub fn describe(&self) -> String {
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

/// 1% modified, 0.5% deleted, 0.5% created (at least one of each), of the objects
/// `obj-0..n`; the new ones are `new-*` with `payload` bytes of data. Each modification
/// writes a value no earlier run wrote, so it is a change even on objects kept from one.
pub async fn change_configmaps(api: &Api<ConfigMap>, n: usize, payload: usize) -> Result<Changes> {
    let c = Changes::of(n);
    eprintln!("changing {} ConfigMaps, deleting {}, creating {}", c.modified, c.deleted, c.created);
    let stamp = chrono::Utc::now().to_rfc3339();
    for_all("modify", (0..c.modified).collect(), |i| {
        let (api, name) = (api.clone(), object_name("obj", i));
        let patch = Patch::Merge(json!({"data": {"changed": stamp}}));
        async move {
            let params = PatchParams::default();
            retry(|| api.patch(&name, &params, &patch)).await.map(drop).context("patch")
        }
    })
    .await?;
    delete_configmaps(api, (c.modified..c.modified + c.deleted).map(|i| object_name("obj", i)).collect()).await?;
    create_configmaps(api, (0..c.created).map(|i| object_name("new", i)).collect(), payload).await?;
    Ok(c)
}

/// Undoes the deletions and creations of [`change_configmaps`]: `obj-0..n` again, nothing else.
pub async fn restore_configmaps(api: &Api<ConfigMap>, n: usize, payload: usize) -> Result<()> {
    let c = Changes::of(n);
    delete_configmaps(api, (0..c.created).map(|i| object_name("new", i)).collect()).await?;
    create_configmaps(api, (c.modified..c.modified + c.deleted).map(|i| object_name("obj", i)).collect(), payload).await
}

/// Deletes ConfigMaps by name (those already gone count as deleted).
pub async fn delete_configmaps(api: &Api<ConfigMap>, names: Vec<String>) -> Result<()> {
    for_all("delete", names, |name| {
        let api = api.clone();
        async move {
            let params = DeleteParams::default();
            match retry(|| api.delete(&name, &params)).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()), // a retry after a lost reply
                Err(e) => Err(e).context("delete"),
            }
        }
    })
    .await
}

/// Waits until a watch from `rv` is answered with 410 Gone, either as the HTTP status or as an
/// ERROR event in the stream.
pub async fn wait_until_expired(api: &Api<ConfigMap>, rv: &str) -> Result<()> {
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
pub fn diff_events(path: &Path, from: u64) -> Result<DiffEvents> {
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

/// Bytes of RSS per object above the baseline.
pub fn per_object(rss_kb: u64, baseline_kb: u64, n: usize) -> i64 {
    (rss_kb as i64 - baseline_kb as i64) * 1024 / n as i64
}

pub fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

// ------------------------------------------------------------------------------------------
// The kubecast process

/// kubecast watching the ConfigMaps of one namespace (one stream, with the default page size
/// and rate limit, checkpoints flushed every second) on the given apiserver, in a fresh
/// directory of the test kit's harness (config, checkpoint dir, file sink, log); `RUST_LOG=info`.
pub struct Run {
    pub kc: Kubecast,
    pub kubeconfig: String,
}

impl Run {
    /// Starts `kubecast run`; its stderr is appended to the instance's log.
    pub fn start(ns: &str, kubeconfig: &str) -> Self {
        let config = format!(
            "[cluster]\nname = \"bench\"\n\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n"
        );
        let env = [("KUBECONFIG", kubeconfig), ("RUST_LOG", "info")];
        let kc = Kubecast::start_with_checkpoint(&config, "flush_interval_ms = 1000", &env);
        Self { kc, kubeconfig: kubeconfig.to_string() }
    }

    /// Starts it again on the same state dir, events file and log.
    pub fn restart(&mut self) {
        self.kc.restart(&[("KUBECONFIG", &self.kubeconfig), ("RUST_LOG", "info")]);
    }

    pub fn events_path(&self) -> PathBuf {
        self.kc.events_path.clone()
    }

    /// The stream's checkpoint file and its JSON.
    /// The stream's checkpoint as kubecast loads it (the snapshot with its journal applied),
    /// and its size on disk (snapshot and journal).
    pub fn checkpoint(&self) -> Result<(u64, Value)> {
        let path = self.kc.checkpoint_files().into_iter().next().context("no checkpoint file")?;
        let journal = path.with_extension("journal");
        let bytes = fs::metadata(&path)?.len() + fs::metadata(&journal).map_or(0, |m| m.len());
        Ok((bytes, kubecast_kit::process::checkpoint_with_journal(&path)))
    }
    /// This run's log so far.
    pub fn log(&self) -> String {
        self.kc.run_log()
    }

    /// An error if kubecast exited.
    pub fn check_running(&mut self) -> Result<()> {
        match self.kc.exited() {
            Some(status) => bail!("kubecast exited ({status}); its log:\n{}", self.log()),
            None => Ok(()),
        }
    }

    /// Waits for a log line containing `needle`; returns the time since start and the line.
    pub async fn wait_log(&mut self, needle: &str, guard: Duration) -> Result<(Duration, String)> {
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

    pub async fn wait_list_complete(&mut self) -> Result<ListDone> {
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
    pub async fn wait_lines(
        &mut self,
        counter: &mut LineCounter,
        lines: u64,
        guard: Duration,
    ) -> Result<Option<Duration>> {
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

    pub fn mem(&self) -> Result<Mem> {
        mem_of(self.kc.pid().context("kubecast is not running")?)
    }

    /// The CPU seconds (user + system) kubecast spent since it started.
    pub fn cpu(&self) -> Result<f64> {
        cpu_seconds(self.kc.pid().context("kubecast is not running")?)
    }

    /// kubecast's `/metrics` text.
    pub async fn metrics(&mut self) -> String {
        self.kc.admin_get("/metrics").await.1
    }

    /// Waits until `/readyz` answers 200; the time since start.
    pub async fn wait_ready(&mut self, guard: Duration) -> Result<Duration> {
        loop {
            if self.kc.admin_get("/readyz").await.0 == 200 {
                return Ok(self.kc.started().elapsed());
            }
            self.check_running()?;
            if self.kc.started().elapsed() > guard {
                bail!("kubecast not ready after {guard:?}; its log:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM (kubecast writes its final checkpoints), waits for the exit and returns how
    /// long the exit took.
    pub async fn stop_timed(&mut self) -> Result<Duration> {
        let t = Instant::now();
        self.stop().await?;
        Ok(t.elapsed())
    }

    /// SIGTERM (kubecast writes its final checkpoints) and waits for the exit.
    pub async fn stop(&mut self) -> Result<()> {
        match self.kc.stop_within(Duration::from_secs(120)).await {
            Some(status) if status.success() => Ok(()),
            Some(status) => bail!("kubecast exited with {status} after SIGTERM; its log:\n{}", self.log()),
            None => bail!("kubecast did not exit within 120 s of SIGTERM; its log:\n{}", self.log()),
        }
    }
}

/// Memory of process `pid`, from /proc/<pid>/status.
pub fn mem_of(pid: u32) -> Result<Mem> {
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

/// The CPU seconds (user + system) process `pid` spent, from /proc/<pid>/stat.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses: state is the first, utime the
    // 12th, stime the 13th, in clock ticks.
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let tick =
        |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).with_context(|| format!("/proc/{pid}/stat"));
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Ok((tick(11)? + tick(12)?) / hz)
}

/// The sum of the samples of metric `name` in a Prometheus text exposition whose labels
/// include every `(label, value)` of `labels`.
pub fn sum_samples(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['{', ' '])))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// The value of a string field `key="text"` in a text log line.
pub fn log_str_field(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(" {key}=\""))? + key.len() + 3;
    Some(line[start..].split('"').next()?.to_string())
}

/// The timestamp a text log line starts with (RFC 3339).
pub fn log_time(line: &str) -> Option<chrono::DateTime<chrono::FixedOffset>> {
    chrono::DateTime::parse_from_rfc3339(line.split_whitespace().next()?).ok()
}

/// The value of an integer field `key=123` in a text log line.
pub fn log_field(line: &str, key: &str) -> Option<u64> {
    let start = line.find(&format!(" {key}="))? + key.len() + 2;
    let digits: String = line[start..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Counts the lines of a growing file, reading only what was appended since the last poll.
pub struct LineCounter {
    pub path: PathBuf,
    /// Bytes counted so far (always at the end of a line).
    pub offset: u64,
    pub lines: u64,
}

impl LineCounter {
    pub fn new(path: PathBuf) -> Self {
        Self { path, offset: 0, lines: 0 }
    }

    pub fn poll(&mut self) -> Result<u64> {
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
pub async fn in_namespace<T, F, Fut>(client: &Client, prefix: &str, body: F) -> Result<T>
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
pub async fn sweep_leftovers(client: &Client) -> Result<()> {
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
pub async fn delete_namespace(client: &Client, ns: &str) -> Result<()> {
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
pub async fn count_configmaps(client: &Client, ns: &str) -> Result<u64> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let lp = ListParams::default().limit(1);
    let page = retry(|| api.list_metadata(&lp)).await?;
    Ok(page.items.len() as u64 + page.metadata.remaining_item_count.map_or(0, |n| n.max(0) as u64))
}

pub fn object_name(prefix: &str, i: usize) -> String {
    format!("{prefix}-{i:06}")
}

/// Creates ConfigMaps with `payload` bytes of data each (those that exist already are left).
pub async fn create_configmaps(api: &Api<ConfigMap>, names: Vec<String>, payload: usize) -> Result<()> {
    for_all("create", names, |name| {
        let api = api.clone();
        async move {
            let payload: String = name.chars().chain(std::iter::once(';')).cycle().take(payload).collect();
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
pub async fn for_all<T, F, Fut>(what: &str, items: Vec<T>, f: F) -> Result<()>
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
pub async fn retry<T, Fut>(mut request: impl FnMut() -> Fut) -> kube::Result<T>
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

pub fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 429 || s.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) => true,
        _ => false,
    }
}
