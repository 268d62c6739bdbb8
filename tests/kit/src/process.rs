//! Running the kubecast binary: [`Kubecast`], one instance in a fresh directory (its config,
//! checkpoints, file sink and log), started, signalled, restarted and read.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::env::kubeconfig;

static BIN: OnceLock<PathBuf> = OnceLock::new();

/// Sets the kubecast binary to run, e.g. `set_bin(env!("CARGO_BIN_EXE_kubecast"))`, before the
/// first start. Without it: `CARGO_BIN_EXE_kubecast` from the environment if cargo set it,
/// else the `kubecast` of the cargo profile directory the running test or benchmark was built
/// in (`target/<profile>/deps/<test>` -> `target/<profile>/kubecast`), which cargo builds
/// before running integration tests and benchmarks.
pub fn set_bin(path: impl Into<PathBuf>) {
    let path = path.into();
    let set = BIN.get_or_init(|| path.clone());
    assert_eq!(*set, path, "the kubecast binary was already chosen");
}

/// `kubecast dead-letter ARGS --config CONFIG`, which must succeed: its stdout.
pub fn dead_letter_ok(config: &Path, args: &[&str]) -> String {
    let out = Command::new(bin())
        .arg("dead-letter")
        .args(args)
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run kubecast dead-letter");
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "kubecast dead-letter {args:?} failed:\n{e}\n{o}");
    o
}

/// The kubecast binary (see [`set_bin`]).
pub fn bin() -> &'static Path {
    BIN.get_or_init(|| {
        if let Some(path) = std::env::var_os("CARGO_BIN_EXE_kubecast") {
            return path.into();
        }
        let exe = std::env::current_exe().expect("the running executable");
        let profile =
            exe.parent().filter(|dir| dir.ends_with("deps")).and_then(Path::parent).unwrap_or_else(|| {
                panic!("{} is not in target/<profile>/deps: call kubecast_kit::set_bin", exe.display())
            });
        let bin = profile.join(format!("kubecast{}", std::env::consts::EXE_SUFFIX));
        assert!(
            bin.exists(),
            "{} does not exist: build it (cargo build), or call kubecast_kit::set_bin",
            bin.display()
        );
        bin
    })
}

/// A kubecast process with a file sink, reading its output.
///
/// Each start passes `KUBECONFIG` (the test apiserver's unless `extra_env` names one),
/// `RUST_LOG=info,kubecast=debug` and an admin server on any free port, then `extra_env`;
/// `KUBECAST_*` variables of the caller's environment are not passed on (only the config
/// file and `extra_env` count).
pub struct Kubecast {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub events_path: PathBuf,
    pub stderr_path: PathBuf,
    /// Where the current run's part of the log starts (each run appends to the same log).
    run_log_start: usize,
    /// When the current run was spawned.
    started: Instant,
    /// The `extra_env` of the current (or last) run.
    extra_env: Vec<(String, String)>,
}

impl Kubecast {
    /// Starts `kubecast run` with `config` (TOML without `[sink]` and `[checkpoint]` tables:
    /// the harness adds a file sink and a checkpoint dir in a fresh directory) and the test
    /// apiserver's kubeconfig.
    pub fn start(config: &str) -> Self {
        Self::start_with(config, &[])
    }

    pub fn start_with(config: &str, extra_env: &[(&str, &str)]) -> Self {
        Self::start_with_checkpoint(config, "", extra_env)
    }

    /// Like `start`, with extra lines for the `[checkpoint]` table (e.g. flush_interval_ms).
    pub fn start_with_checkpoint(config: &str, checkpoint: &str, extra_env: &[(&str, &str)]) -> Self {
        let mut k = Self::stopped(config, checkpoint);
        k.restart(extra_env);
        k
    }

    /// Starts kubecast with the given `[sink]` section (and its sub-tables) instead of the
    /// harness's file sink.
    pub fn start_with_sink(config: &str, sink: &str, checkpoint: &str, extra_env: &[(&str, &str)]) -> Self {
        let mut k = Self::stopped(config, checkpoint);
        k.set_sink(sink);
        k.restart(extra_env);
        k
    }

    /// An instance in a fresh directory, not started yet.
    fn stopped(config: &str, checkpoint: &str) -> Self {
        let dir = tempfile::Builder::new().prefix("kubecast-").tempdir().expect("tempdir");
        let full = format!(
            "{config}\n[sink]\ntype = \"file\"\npath = \"{}\"\n\n[checkpoint]\ndir = \"{}\"\n{checkpoint}\n",
            dir.path().join("events.jsonl").display(),
            dir.path().join("state").display()
        );
        std::fs::write(dir.path().join("kubecast.toml"), full).unwrap();
        let events_path = dir.path().join("events.jsonl");
        let stderr_path = dir.path().join("kubecast.log");
        Self { child: None, dir, events_path, stderr_path, run_log_start: 0, started: Instant::now(), extra_env: Vec::new() }
    }

    /// Replaces the `[sink]` section of the config (for the next start).
    pub fn set_sink(&mut self, sink: &str) {
        let path = self.dir.path().join("kubecast.toml");
        let cfg = std::fs::read_to_string(&path).unwrap();
        let start = cfg.find("[sink]").unwrap();
        let end = cfg[start..].find("[checkpoint]").unwrap() + start;
        std::fs::write(&path, format!("{}{sink}\n{}", &cfg[..start], &cfg[end..])).unwrap();
    }

    /// Starts kubecast again on the same config, checkpoints and events file (which it
    /// appends to), e.g. after `kill9`.
    pub fn restart(&mut self, extra_env: &[(&str, &str)]) {
        assert!(self.child.is_none(), "stop or kill it first");
        self.run_log_start = self.log().len();
        self.extra_env = extra_env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let dir = self.dir.path();
        let mut cmd = Command::new(bin());
        cmd.args(["run", "--config"]).arg(dir.join("kubecast.toml"));
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("KUBECAST_") {
                cmd.env_remove(key);
            }
        }
        if !extra_env.iter().any(|(k, _)| *k == "KUBECONFIG") {
            cmd.env("KUBECONFIG", kubeconfig());
        }
        cmd.env("RUST_LOG", "info,kubecast=debug")
            // Any free port: many instances run at once.
            .env("KUBECAST_ADMIN__LISTEN", "127.0.0.1:0");
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        // Appends, so the log of every run of this instance is kept.
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.stderr_path).unwrap();
        self.started = Instant::now();
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn().expect("spawn kubecast");
        self.child = Some(child);
    }

    /// The process id of the current run, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// When the current run was spawned.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The exit status of the current run if it exited by itself (it is then no longer running).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().unwrap()?;
        self.child = None;
        Some(status)
    }

    /// Waits until the log contains `needle` `count` times (e.g. "list complete": from then on
    /// every change arrives as a watch event).
    pub async fn wait_log(&mut self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.log().matches(needle).count() < count {
            if let Some(status) = self.exited() {
                panic!("kubecast exited ({status}) while waiting for {needle:?}\nlog:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no {needle:?} in the log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `GET path` on the admin server of the current run: (status code, body).
    pub async fn admin_get(&mut self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let marker = "admin server listening on ";
        // The current run's address: the previous runs' lines are in the log too.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.run_log().contains(marker) {
            if let Some(status) = self.exited() {
                panic!("kubecast exited ({status}) before its admin server started\nlog:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no {marker:?} in the log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let log = self.run_log();
        let line = log.lines().rfind(|l| l.contains(marker)).unwrap();
        let addr = line[line.find(marker).unwrap() + marker.len()..].split_whitespace().next().unwrap().to_string();
        let mut conn = match tokio::net::TcpStream::connect(&addr).await {
            Ok(conn) => conn,
            Err(e) => panic!("connect to the admin server ({e}); kubecast {:?}\nlog:\n{}", self.exited(), self.log()),
        };
        conn.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
        let mut resp = String::new();
        conn.read_to_string(&mut resp).await.unwrap();
        let status = resp.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = resp.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        (status, body)
    }

    /// Polls `/readyz` until its body contains `text` (bounded).
    pub async fn wait_ready_reason(&mut self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (status, body) = self.admin_get("/readyz").await;
            if body.contains(text) {
                assert_eq!(status, 503, "a reason means not ready");
                return;
            }
            assert!(Instant::now() < deadline, "/readyz never said {text:?} (last: {status} {body})\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Polls `/readyz` until its status is `want` (bounded); returns the body.
    pub async fn wait_ready(&mut self, want: u16) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (status, body) = self.admin_get("/readyz").await;
            if status == want {
                return body;
            }
            assert!(Instant::now() < deadline, "/readyz stayed {status} ({body}), wanted {want}\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Sends a signal (e.g. "STOP", "CONT") to the running process.
    pub fn signal(&self, sig: &str) {
        kill(self.pid().expect("running"), sig);
    }

    /// kill -9: no shutdown, no final checkpoint.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// The checkpoint files of this instance.
    pub fn checkpoint_files(&self) -> Vec<PathBuf> {
        let dir = self.dir.path().join("state");
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "json") {
                out.push(p);
            }
        }
        out
    }

    /// The checkpoints of this instance: each snapshot file with the lines of its journal
    /// applied (as kubecast loads them; an incomplete last line is being written: skipped).
    pub fn checkpoints(&self) -> Vec<Value> {
        self.checkpoint_files().iter().map(|p| checkpoint_with_journal(p)).collect()
    }

    /// `kubecast state list -o json` on this instance's config and environment: every stream's
    /// stored state, in whichever store it is (`[]` while none is stored).
    pub fn state_list(&self) -> Value {
        let mut cmd = Command::new(bin());
        cmd.args(["state", "list", "-o", "json", "--config"]).arg(self.dir.path().join("kubecast.toml"));
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("KUBECAST_") {
                cmd.env_remove(key);
            }
        }
        cmd.env("KUBECONFIG", kubeconfig()).env("RUST_LOG", "warn");
        for (k, v) in &self.extra_env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run kubecast state list");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "kubecast state list failed:\n{}{text}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("kubecast state list -o json ({e}):\n{text}"))
    }

    /// Every event emitted so far, parsed.
    pub fn events(&self) -> Vec<Value> {
        crate::sink::read_events(&self.events_path)
    }

    /// Polls until `done(events)` holds, or panics after `timeout` with the log.
    pub async fn wait_for(&mut self, what: &str, timeout: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let evs = self.events();
            if done(&evs) {
                return evs;
            }
            if let Some(status) = self.exited() {
                panic!("kubecast exited ({status}) while waiting for {what}\nlog:\n{}", self.log());
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; events so far:\n{}\nlog:\n{}", crate::pretty(&evs), self.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The log of every run of this instance.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The current (or last) run's part of the log.
    pub fn run_log(&self) -> String {
        self.log().get(self.run_log_start..).unwrap_or_default().to_string()
    }

    /// SIGTERM and wait for the exit status.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        kill(child.id(), "TERM");
        child.wait().unwrap()
    }

    /// SIGTERM and wait (without blocking the runtime) for the exit status; `None` if it still
    /// runs after `timeout` (it is then killed when dropped).
    pub async fn stop_within(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.signal("TERM");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits for the process to exit by itself (bounded), returning its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            if Instant::now() > deadline {
                panic!("kubecast did not exit within {timeout:?}\nlog:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Kubecast {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn kill(pid: u32, sig: &str) {
    let _ = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
}

/// A file store snapshot (`<id>.json`) with its journal (`<id>.journal`) applied: the same
/// shape as the snapshot (`resource_version`, `objects` as `[uid, namespace, name, rv]`,
/// `acked_ahead`).
pub fn checkpoint_with_journal(snapshot: &Path) -> Value {
    let mut snap: Value = serde_json::from_slice(&std::fs::read(snapshot).unwrap()).unwrap();
    let seq = snap["seq"].as_u64().unwrap_or(0);
    let mut objects: std::collections::BTreeMap<String, Value> = snap["objects"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|o| (o[0].as_str().unwrap().to_string(), o))
        .collect();
    let journal = snapshot.with_extension("journal");
    let text = std::fs::read_to_string(&journal).unwrap_or_default();
    for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
        let l: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{}: {e}: {line}", journal.display()));
        if l["seq"].as_u64().unwrap() <= seq {
            continue;
        }
        for o in l["upserts"].as_array().into_iter().flatten() {
            objects.insert(o[0].as_str().unwrap().to_string(), o.clone());
        }
        for uid in l["removes"].as_array().into_iter().flatten() {
            objects.remove(uid.as_str().unwrap());
        }
        snap["resource_version"] = l["resource_version"].clone();
        snap["acked_ahead"] = l.get("acked_ahead").cloned().unwrap_or(Value::Array(vec![]));
    }
    snap["objects"] = Value::Array(objects.into_values().collect());
    snap
}
