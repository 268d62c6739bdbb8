//! The single-node cluster of `tests/env/node` (kubelet, containerd, kube-proxy, scheduler and
//! controller-manager on the test apiserver): the kubecast image imported into the node's
//! containerd, `helm` and `kubectl` against it, the pods of a release and their metrics.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::env::{env, env_var, repo_root};

/// Panics, naming the fix, when the node does not run.
pub fn require() {
    assert!(
        env().contains_key("KUBECAST_NODE"),
        "the node of tests/env/node does not run (no KUBECAST_NODE in the env file): run the suite with tests/run, or start it with `tests/env/node up` (root)"
    );
}

/// The kubecast image, built by `docker/build` and imported into the node's containerd once per
/// test binary: (repository, tag). `KUBECAST_IMAGE_ARCHIVE` names an archive built already
/// (tests/run builds it beside the tests' build); else it is built now.
pub fn image() -> &'static (String, String) {
    static IMAGE: OnceLock<(String, String)> = OnceLock::new();
    IMAGE.get_or_init(|| {
        require();
        let archive = match std::env::var_os("KUBECAST_IMAGE_ARCHIVE") {
            Some(a) => PathBuf::from(a),
            None => {
                let out = repo_root().join("target/image/kubecast.oci.tar");
                if !out.exists() {
                    run(Command::new(repo_root().join("docker/build")).arg("--out").arg(&out), "docker/build");
                }
                out
            }
        };
        let out = run(Command::new(env_var("KUBECAST_NODE_CTR")).args(["images", "import"]).arg(&archive), "ctr images import");
        // "unpacking localhost/kubecast:0.1.0 (sha256:...)...done"
        let name = text(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("unpacking ").and_then(|r| r.split_whitespace().next()).map(str::to_string))
            .unwrap_or_else(|| panic!("ctr images import {} named no image: {}", archive.display(), text(&out.stdout)));
        let (repo, tag) = name.rsplit_once(':').expect("an image name with a tag");
        (repo.to_string(), tag.to_string())
    })
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `cmd`, which must succeed; its output.
pub fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what} failed ({}):\n{}\n{}", out.status, text(&out.stdout), text(&out.stderr));
    out
}

/// `kubectl ARGS` with the admin kubeconfig; must succeed; its stdout.
pub fn kubectl(args: &[&str]) -> String {
    text(&run(Command::new(env_var("KUBECTL")).env("KUBECONFIG", env_var("KUBECONFIG")).args(args), &format!("kubectl {args:?}")).stdout)
}

/// `kubectl ARGS`, which may fail: (success, stdout + stderr).
pub fn kubectl_try(args: &[&str]) -> (bool, String) {
    let out = Command::new(env_var("KUBECTL")).env("KUBECONFIG", env_var("KUBECONFIG")).args(args).output().expect("kubectl");
    (out.status.success(), text(&out.stdout) + &text(&out.stderr))
}

/// `helm ARGS` with the admin kubeconfig; must succeed; its stdout.
pub fn helm(args: &[&str]) -> String {
    text(&run(Command::new(env_var("HELM")).env("KUBECONFIG", env_var("KUBECONFIG")).args(args), &format!("helm {args:?}")).stdout)
}

/// `kubectl rollout status` of a Deployment (waits for the rollout: no fixed sleep).
pub fn rollout(ns: &str, deployment: &str) {
    kubectl(&["-n", ns, "rollout", "status", &format!("deployment/{deployment}"), "--timeout=180s"]);
}

/// One pod as the tests need it.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    pub ip: String,
    pub ready: bool,
    pub deleting: bool,
    pub restarts: u64,
    /// The last termination reason of its kubecast container (e.g. "OOMKilled").
    pub last_terminated: Option<String>,
    /// The pod-template-hash label (its ReplicaSet).
    pub template_hash: String,
}

/// The pods of `ns` matching `selector`.
pub fn pods(ns: &str, selector: &str) -> Vec<Pod> {
    let list: Value = serde_json::from_str(&kubectl(&["-n", ns, "get", "pods", "-l", selector, "-o", "json"])).unwrap();
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let statuses = p["status"]["containerStatuses"].as_array().cloned().unwrap_or_default();
            let c = statuses.iter().find(|c| c["name"] == "kubecast").cloned().unwrap_or(Value::Null);
            Pod {
                name: p["metadata"]["name"].as_str().unwrap().to_string(),
                ip: p["status"]["podIP"].as_str().unwrap_or("").to_string(),
                ready: p["status"]["conditions"]
                    .as_array()
                    .is_some_and(|cs| cs.iter().any(|c| c["type"] == "Ready" && c["status"] == "True")),
                deleting: !p["metadata"]["deletionTimestamp"].is_null(),
                restarts: c["restartCount"].as_u64().unwrap_or(0),
                last_terminated: c["lastState"]["terminated"]["reason"].as_str().map(str::to_string),
                template_hash: p["metadata"]["labels"]["pod-template-hash"].as_str().unwrap_or("").to_string(),
            }
        })
        .collect()
}

/// The samples of `/metrics` of the pod at `ip` (admin port 9090): name{labels} -> value; None
/// when it does not answer.
pub fn metrics(ip: &str) -> Option<BTreeMap<String, f64>> {
    use std::io::{Read, Write};
    let addr = format!("{ip}:9090").parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: kubecast\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let (_, body) = body.split_once("\r\n\r\n")?;
    Some(
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.rsplit_once(' '))
            .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
            .collect(),
    )
}

/// The sum of the samples of metric `name` (any labels).
pub fn sum(samples: &BTreeMap<String, f64>, name: &str) -> f64 {
    samples
        .iter()
        .filter(|(k, _)| k.strip_prefix(name).is_some_and(|rest| rest.is_empty() || rest.starts_with('{')))
        .map(|(_, v)| v)
        .sum()
}

/// Waits (up to `timeout`) until `cond` holds; whether it did.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Which pods publish, sampled every 100 ms from their `kubecast_events_published_total`
/// (pods listed anew every second): the overlaps of two publishers and the handover gaps.
pub struct Publishers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<Interval>>>,
}

/// One sampling interval: the pods whose published counter grew in it.
#[derive(Clone, Debug)]
pub struct Interval {
    pub at: Instant,
    pub publishing: Vec<String>,
}

/// What [`Publishers::finish`] found.
#[derive(Debug)]
pub struct Publishing {
    /// The longest run of consecutive 100 ms intervals in which two or more pods published.
    pub overlap_intervals: usize,
    /// The pods that published at once in that run.
    pub overlap_pods: Vec<String>,
    /// Each change of publisher: (old, new, the time from the old one's last increase to the
    /// new one's first).
    pub handovers: Vec<(String, String, Duration)>,
    /// Every pod that published at some point.
    pub publishers: Vec<String>,
    /// The intervals sampled.
    pub intervals: Vec<Interval>,
}

impl Publishing {
    /// The time from `t` to the first interval after it in which a pod published.
    pub fn first_after(&self, t: Instant) -> Option<Duration> {
        self.intervals.iter().find(|i| i.at >= t && !i.publishing.is_empty()).map(|i| i.at.duration_since(t))
    }
}

impl Publishers {
    /// Starts sampling; returns once every pod running now was sampled twice (their counts
    /// at the start are a baseline, not publishing: a pod that appears later counts from 0).
    pub fn start(ns: &str, selector: &str) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rounds = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (ns, selector, flag, done) = (ns.to_string(), selector.to_string(), stop.clone(), rounds.clone());
        let thread = std::thread::spawn(move || {
            let mut last: BTreeMap<String, f64> = BTreeMap::new();
            let mut baseline = true;
            let mut restarted: BTreeMap<String, usize> = BTreeMap::new();
            let mut ips: Vec<(String, String)> = Vec::new();
            let mut listed = Instant::now() - Duration::from_secs(5);
            let mut out = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = Instant::now();
                if t0.duration_since(listed) >= Duration::from_secs(1) {
                    ips = pods(&ns, &selector).into_iter().filter(|p| !p.ip.is_empty()).map(|p| (p.name, p.ip)).collect();
                    listed = t0;
                }
                let mut publishing = Vec::new();
                for (name, ip) in &ips {
                    let Some(m) = metrics(ip) else { continue };
                    let n = sum(&m, "kubecast_events_published_total");
                    let mut before = last.insert(name.clone(), n).unwrap_or(0.0);
                    if n < before {
                        // The container restarted: a new process, counting from 0.
                        before = 0.0;
                        *restarted.entry(name.clone()).or_insert(0) += 1;
                    }
                    if n > before && !baseline {
                        publishing.push(match restarted.get(name) {
                            Some(k) => format!("{name} (restart {k})"),
                            None => name.clone(),
                        });
                    }
                }
                baseline = false;
                if done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) > 0 {
                    out.push(Interval { at: t0, publishing });
                }
                std::thread::sleep(Duration::from_millis(100).saturating_sub(t0.elapsed()));
            }
            out
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while rounds.load(std::sync::atomic::Ordering::Relaxed) < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        Self { stop, thread: Some(thread) }
    }

    pub fn finish(mut self) -> Publishing {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let intervals = self.thread.take().unwrap().join().expect("the publishers' sampler");
        summarize(&intervals)
    }
}

impl Drop for Publishers {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Overlaps and handovers of a series of intervals.
pub fn summarize(intervals: &[Interval]) -> Publishing {
    let (mut run, mut best, mut best_pods) = (0, 0, Vec::new());
    let mut handovers = Vec::new();
    let mut publishers: Vec<String> = Vec::new();
    let mut current: Option<(String, Instant)> = None; // the publisher and its last increase
    for i in intervals {
        if i.publishing.len() >= 2 {
            run += 1;
            if run > best {
                best = run;
                best_pods = i.publishing.clone();
            }
        } else {
            run = 0;
        }
        for p in &i.publishing {
            if !publishers.contains(p) {
                publishers.push(p.clone());
            }
        }
        match (&current, i.publishing.as_slice()) {
            (_, []) => {}
            (Some((old, since)), [new, ..]) if old != new && !i.publishing.contains(old) => {
                handovers.push((old.clone(), new.clone(), i.at.duration_since(*since)));
                current = Some((new.clone(), i.at));
            }
            (Some((old, _)), _) if i.publishing.contains(old) => current = Some((old.clone(), i.at)),
            (_, [new, ..]) => current = Some((new.clone(), i.at)),
        }
    }
    Publishing { overlap_intervals: best, overlap_pods: best_pods, handovers, publishers, intervals: intervals.to_vec() }
}

/// SIGKILLs the kubecast process of pod `pod` (found by its `POD_NAME` in /proc: the node's
/// containers are this machine's processes): a crash, no final checkpoint, the Lease kept.
/// Whether one was found.
pub fn kill9_pod(pod: &str) -> bool {
    let want = format!("POD_NAME={pod}");
    let mut found = false;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let path = entry.path();
        let Ok(cmd) = std::fs::read(path.join("cmdline")) else { continue };
        if !cmd.split(|b| *b == 0).next().is_some_and(|a| a.ends_with(b"/kubecast")) {
            continue;
        }
        let Ok(environ) = std::fs::read(path.join("environ")) else { continue };
        if environ.split(|b| *b == 0).any(|v| v == want.as_bytes()) {
            let pid = entry.file_name().to_string_lossy().into_owned();
            found |= std::process::Command::new("kill").args(["-KILL", &pid]).status().is_ok_and(|s| s.success());
        }
    }
    found
}

/// Keeps the log of every container of the pods of `ns` matching `selector`, from its start to
/// its end, in `target/cluster-logs/NS/POD-RESTARTS.log`: a deleted, drained or killed pod's
/// log stays for the failure that needs it. Stops when dropped.
pub struct LogKeeper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub dir: PathBuf,
}

impl LogKeeper {
    pub fn start(ns: &str, selector: &str) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let dir = repo_root().join("target/cluster-logs").join(ns);
        std::fs::create_dir_all(&dir).expect("the log directory");
        let (ns, selector, flag, out) = (ns.to_string(), selector.to_string(), stop.clone(), dir.clone());
        std::thread::spawn(move || {
            let mut followed = std::collections::HashSet::new();
            let mut children = Vec::new();
            while !flag.load(Ordering::Relaxed) {
                let (ok, listed) = kubectl_try(&[
                    "-n",
                    &ns,
                    "get",
                    "pods",
                    "-l",
                    &selector,
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.name} {.status.containerStatuses[?(@.name==\"kubecast\")].restartCount} {.status.containerStatuses[?(@.name==\"kubecast\")].state.running.startedAt}{\"\\n\"}{end}",
                ]);
                if ok {
                    for line in listed.lines() {
                        let f: Vec<&str> = line.split_whitespace().collect();
                        // Running only: a container not started has no log to follow yet.
                        if f.len() < 3 || !followed.insert((f[0].to_string(), f[1].to_string())) {
                            continue;
                        }
                        let Ok(file) = std::fs::File::create(out.join(format!("{}-{}.log", f[0], f[1]))) else { continue };
                        let child = Command::new(env_var("KUBECTL"))
                            .env("KUBECONFIG", env_var("KUBECONFIG"))
                            .args(["-n", &ns, "logs", "-f", f[0], "-c", "kubecast"])
                            .stdout(file.try_clone().expect("a log file"))
                            .stderr(file)
                            .spawn();
                        if let Ok(c) = child {
                            children.push(c);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            // Let the followers write what is buffered, then stop them.
            std::thread::sleep(Duration::from_millis(500));
            for mut c in children {
                let _ = c.kill();
                let _ = c.wait();
            }
        });
        Self { stop, dir }
    }
}

impl Drop for LogKeeper {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
