//! The CloudEvents HTTP receiver example of `examples/receivers/http` (the official CloudEvents
//! Python SDK), run as a process of its own: `RECEIVER_HTTP` of the env file, built by
//! `tests/env/tools consumers`. Its log (a JSON line per accepted request, written before its
//! 2xx) is what the tests judge.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::Kubecast;

const WAIT: Duration = Duration::from_secs(120);

/// The receiver example, run as a process of its own.
pub struct Receiver {
    child: Option<Child>,
    /// The env file's key of its command: `RECEIVER_HTTP` (Python) or `RECEIVER_HTTP2` (Go).
    command: &'static str,
    host: String,
    port: u16,
    pub args: Vec<String>,
    tls: bool,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Receiver {
    pub fn start(args: &[&str]) -> Self {
        Self::start_on("127.0.0.1", args)
    }

    /// The Go receiver of `examples/receivers/go` (the CloudEvents Go SDK): HTTP/2 over TLS
    /// (ALPN) or, with `--h2c`, over cleartext with prior knowledge; its log also says each
    /// request's protocol (`proto`).
    pub fn start_go(args: &[&str]) -> Self {
        Self::launch("RECEIVER_HTTP2", "127.0.0.1", args)
    }

    /// Listening on `host` (e.g. the node's host address, for pods).
    pub fn start_on(host: &str, args: &[&str]) -> Self {
        Self::launch("RECEIVER_HTTP", host, args)
    }

    fn launch(command: &'static str, host: &str, args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("received.jsonl");
        let tls = args.contains(&"--tls-cert");
        let mut r =
            Self { child: None, command, host: host.to_string(), port: 0, args: args.iter().map(|a| a.to_string()).collect(), tls, log, _dir: dir };
        r.restart();
        r
    }

    /// Starts it (again, on the same port and log, after `stop`).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop it first");
        let cmd = crate::env().get(self.command).cloned().unwrap_or_else(|| {
            panic!("{} is not in the test environment file: build it with tests/env/tools consumers", self.command)
        });
        let mut child = Command::new(cmd)
            .args(["--host", &self.host, "--port", &self.port.to_string(), "--log"])
            .arg(&self.log)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the HTTP receiver");
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        let said: Value = serde_json::from_str(&first).unwrap_or_else(|e| panic!("the receiver said {first:?}: {e}"));
        self.port = said["port"].as_u64().unwrap() as u16;
        self.child = Some(child);
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn url(&self) -> String {
        format!("{}://{}:{}/", if self.tls { "https" } else { "http" }, self.host, self.port)
    }

    /// Every request it accepted so far.
    pub fn accepted(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().filter(|l| !l.is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    /// Waits until it accepted at least `n` requests (bounded); returns them.
    pub async fn wait_accepted(&self, n: usize, kc: &mut Kubecast) -> Vec<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let got = self.accepted();
            if got.len() >= n {
                return got;
            }
            if let Some(status) = kc.exited() {
                panic!("kubecast exited ({status}) with {} of {n} events accepted\n{}", got.len(), kc.log());
            }
            assert!(Instant::now() < deadline, "{} of {n} events accepted\n{}", got.len(), kc.log());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop();
    }
}

