//! Shared test harness: the real servers started by `tests/env/up` (one environment shared by
//! every test), a Kubernetes client for them, and a way to run the kubecast binary against
//! them and read what it emitted.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::Value;

/// Key/value pairs of the env file written by `tests/env/up`.
pub fn env() -> &'static HashMap<String, String> {
    static ENV: OnceLock<HashMap<String, String>> = OnceLock::new();
    ENV.get_or_init(|| {
        let path = std::env::var("KUBECAST_ENV_FILE").map(PathBuf::from).unwrap_or_else(|_| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/kubecast-env/env")
        });
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("test environment file {} is missing ({e}): run the suite with ./tests/run, or start the servers with tests/env/up", path.display())
        });
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').trim_matches('\'').to_string()))
            .collect()
    })
}

/// The env file of the compacting apiserver (`tests/env/compacting up`): watch cache off,
/// etcd compaction every 5 s, so resource versions expire (410 Gone) within seconds.
pub fn compacting_kubeconfig() -> String {
    static KC: OnceLock<String> = OnceLock::new();
    KC.get_or_init(|| {
        let path = std::env::var("KUBECAST_COMPACTING_ENV_FILE")
            .map(PathBuf::from)
            .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/kubecast-env-compacting/env"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{} is missing ({e}): run the suite with ./tests/run, or start it with tests/env/compacting up",
                path.display()
            )
        });
        text.lines()
            .find_map(|l| l.strip_prefix("KUBECONFIG="))
            .unwrap_or_else(|| panic!("no KUBECONFIG in {}: is the compacting apiserver running?", path.display()))
            .trim()
            .to_string()
    })
    .clone()
}

pub fn env_var(key: &str) -> String {
    env()
        .get(key)
        .cloned()
        .unwrap_or_else(|| panic!("{key} is not in the test environment file: is that server started by tests/env/up?"))
}

pub fn kubeconfig() -> String {
    env_var("KUBECONFIG")
}

/// An admin client for the test apiserver.
pub async fn client() -> Client {
    client_for(&kubeconfig()).await
}

pub async fn client_for(kubeconfig: &str) -> Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.expect("kubeconfig");
    Client::try_from(cfg).expect("client")
}

/// Creates a ConfigMap with `labels` and `data`.
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

/// A unique name with a readable prefix.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("{prefix}-{}-{:x}{}", std::process::id(), nanos & 0xfffff, N.fetch_add(1, Ordering::Relaxed))
}

/// A fresh namespace, deleted (in the background, by the server) when dropped.
pub struct TestNamespace {
    pub name: String,
    client: Client,
}

impl TestNamespace {
    pub async fn new(client: &Client, prefix: &str) -> Self {
        let name = unique(prefix);
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap();
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create namespace");
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

/// A kubecast process with a file sink, reading its output.
pub struct Kubecast {
    child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub events_path: PathBuf,
    pub stderr_path: PathBuf,
    /// Where the current run's part of the log starts (each run appends to the same log).
    run_log_start: usize,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_kubecast")
}

impl Kubecast {
    /// Starts `kubecast run` with `config` (TOML without `[sink]` and `[checkpoint]` tables:
    /// the harness adds a file sink and a checkpoint dir in a fresh directory) and the test
    /// apiserver's kubeconfig.
    pub fn start(config: &str) -> Self {
        Self::start_with(config, &[])
    }

    pub fn start_with(config: &str, extra_env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::write_config(dir.path(), config, "");
        Self::spawn_in(dir, extra_env)
    }

    /// Starts kubecast with the given `[sink]` section (and its sub-tables) instead of the
    /// harness's file sink.
    pub fn start_with_sink(config: &str, sink: &str, checkpoint: &str, extra_env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::write_config(dir.path(), config, checkpoint);
        let mut k = Self::spawn_in_stopped(dir);
        k.set_sink(sink);
        k.restart(extra_env);
        k
    }

    /// Replaces the `[sink]` section of the config (for the next start).
    pub fn set_sink(&mut self, sink: &str) {
        let path = self.dir.path().join("kubecast.toml");
        let cfg = std::fs::read_to_string(&path).unwrap();
        let start = cfg.find("[sink]").unwrap();
        let end = cfg[start..].find("[checkpoint]").unwrap() + start;
        std::fs::write(&path, format!("{}{sink}\n{}", &cfg[..start], &cfg[end..])).unwrap();
    }

    fn spawn_in_stopped(dir: tempfile::TempDir) -> Self {
        let events_path = dir.path().join("events.jsonl");
        let stderr_path = dir.path().join("kubecast.log");
        Self { child: None, dir, events_path, stderr_path, run_log_start: 0 }
    }

    /// Like `start`, with extra lines for the `[checkpoint]` table (e.g. flush_interval_ms).
    pub fn start_with_checkpoint(config: &str, checkpoint: &str, extra_env: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::write_config(dir.path(), config, checkpoint);
        Self::spawn_in(dir, extra_env)
    }

    fn write_config(dir: &Path, config: &str, checkpoint: &str) {
        let full = format!(
            "{config}\n[sink]\ntype = \"file\"\npath = \"{}\"\n\n[checkpoint]\ndir = \"{}\"\n{checkpoint}\n",
            dir.join("events.jsonl").display(),
            dir.join("state").display()
        );
        std::fs::write(dir.join("kubecast.toml"), full).unwrap();
    }

    /// Starts kubecast again on the same config, checkpoints and events file (which it
    /// appends to), e.g. after `kill9`.
    pub fn restart(&mut self, extra_env: &[(&str, &str)]) {
        assert!(self.child.is_none(), "stop or kill it first");
        self.run_log_start = self.log().len();
        self.child = Some(Self::spawn_child(self.dir.path(), extra_env));
    }

    fn spawn_in(dir: tempfile::TempDir, extra_env: &[(&str, &str)]) -> Self {
        let child = Self::spawn_child(dir.path(), extra_env);
        let events_path = dir.path().join("events.jsonl");
        let stderr_path = dir.path().join("kubecast.log");
        Self { child: Some(child), dir, events_path, stderr_path, run_log_start: 0 }
    }

    fn spawn_child(dir: &Path, extra_env: &[(&str, &str)]) -> Child {
        let mut cmd = Command::new(bin());
        cmd.args(["run", "--config"]).arg(dir.join("kubecast.toml"));
        cmd.env("KUBECONFIG", kubeconfig())
            .env("RUST_LOG", "info,kubecast=debug")
            // Any free port: many instances run at once.
            .env("KUBECAST_ADMIN__LISTEN", "127.0.0.1:0");
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        // Appends, so the log of every run of this instance is kept.
        let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join("kubecast.log")).unwrap();
        cmd.stdout(Stdio::null()).stderr(log).spawn().expect("spawn kubecast")
    }

    /// Waits until the log contains `needle` `count` times (e.g. "list complete": from then on
    /// every change arrives as a watch event).
    pub async fn wait_log(&mut self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.log().matches(needle).count() < count {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
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
        while !self.log()[self.run_log_start..].contains(marker) {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("kubecast exited ({status}) before its admin server started\nlog:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "no {marker:?} in the log:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let log = self.log()[self.run_log_start..].to_string();
        let line = log.lines().rfind(|l| l.contains(marker)).unwrap();
        let addr = line[line.find(marker).unwrap() + marker.len()..].split_whitespace().next().unwrap().to_string();
        let mut conn = tokio::net::TcpStream::connect(&addr).await.expect("connect to the admin server");
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
        unsafe_kill(self.child.as_ref().expect("running").id(), sig);
    }

    /// kill -9: no shutdown, no final checkpoint.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// The checkpoint files of this instance, parsed.
    pub fn checkpoints(&self) -> Vec<Value> {
        let dir = self.dir.path().join("state");
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).into_iter().flatten() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "json") {
                out.push(serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap());
            }
        }
        out
    }

    /// Every event emitted so far, parsed.
    pub fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.events_path)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("sink line is not JSON ({e}): {l}")))
            .collect()
    }

    /// Polls until `done(events)` holds, or panics after `timeout` with the log.
    pub async fn wait_for(&mut self, what: &str, timeout: Duration, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let evs = self.events();
            if done(&evs) {
                return evs;
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("kubecast exited ({status}) while waiting for {what}\nlog:\n{}", self.log());
            }
            if Instant::now() > deadline {
                panic!("timed out waiting for {what}; events so far:\n{}\nlog:\n{}", pretty(&evs), self.log());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// SIGTERM and wait for the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        unsafe_kill(child.id(), "TERM");
        child.wait().unwrap()
    }

    /// Waits for the process to exit by itself (bounded), returning its status.
    pub async fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child.take();
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

fn unsafe_kill(pid: u32, sig: &str) {
    let _ = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
}

pub fn pretty(evs: &[Value]) -> String {
    evs.iter()
        .map(|e| format!("  {} {} {} origin={}", e["type"], e["subject"], e["id"], e["origin"]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Events whose subject is `subject`.
pub fn about<'a>(evs: &'a [Value], subject: &str) -> Vec<&'a Value> {
    evs.iter().filter(|e| e["subject"] == subject).collect()
}

/// The verb (last segment of `type`) of an event.
pub fn verb(e: &Value) -> &str {
    e["type"].as_str().unwrap().rsplit('.').next().unwrap()
}
