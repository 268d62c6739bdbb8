//! The test servers' env files, written by `tests/env/up` and `tests/env/compacting up`.
//!
//! Where they are: `KUBECAST_ENV_FILE` (resp. `KUBECAST_COMPACTING_ENV_FILE`), else
//! `$KUBECAST_ENV_STATE/env` (resp. `$KUBECAST_ENV_COMPACTING_STATE/env`, the scripts' own
//! variables), else `<repo>/target/kubecast-env/env` (resp. `target/kubecast-env-compacting/env`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The key/value pairs of an env file.
pub type Env = HashMap<String, String>;

/// The repository's root (this crate lives in `tests/kit`).
pub fn repo_root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let kit = Path::new(env!("CARGO_MANIFEST_DIR"));
        kit.ancestors().nth(2).expect("tests/kit is two levels below the repository").to_path_buf()
    })
}

/// The env file of the main test environment (see the module documentation).
pub fn env_file() -> PathBuf {
    located("KUBECAST_ENV_FILE", "KUBECAST_ENV_STATE", "target/kubecast-env")
}

/// The env file of the apiserver with the `ShardedListAndWatch` gate on (`tests/env/sharded`).
pub fn sharded_env_file() -> PathBuf {
    located("KUBECAST_SHARDED_ENV_FILE", "KUBECAST_ENV_SHARDED_STATE", "target/kubecast-env-sharded")
}

/// The kubeconfig of the apiserver with the `ShardedListAndWatch` gate on.
pub fn sharded_kubeconfig() -> String {
    let path = sharded_env_file();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{} is missing ({e}): run the suite with ./tests/run, or start it with tests/env/sharded up", path.display())
    });
    parse(&text)
        .remove("KUBECONFIG")
        .unwrap_or_else(|| panic!("no KUBECONFIG in {}: is the sharded apiserver running?", path.display()))
}

/// The env file of the compacting apiserver.
pub fn compacting_env_file() -> PathBuf {
    located("KUBECAST_COMPACTING_ENV_FILE", "KUBECAST_ENV_COMPACTING_STATE", "target/kubecast-env-compacting")
}

fn located(file_var: &str, state_var: &str, default_state: &str) -> PathBuf {
    if let Some(file) = std::env::var_os(file_var) {
        return file.into();
    }
    std::env::var_os(state_var).map_or_else(|| repo_root().join(default_state), PathBuf::from).join("env")
}

fn parse(text: &str) -> Env {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').trim_matches('\'').to_string()))
        .collect()
}

/// Key/value pairs of the env file written by `tests/env/up` (read once).
pub fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let path = env_file();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!("test environment file {} is missing ({e}): run the suite with ./tests/run, or start the servers with tests/env/up", path.display())
        });
        parse(&text)
    })
}

/// The kubeconfig of the compacting apiserver (`tests/env/compacting up`): watch cache off,
/// etcd compaction every 5 s, so resource versions expire (410 Gone) within seconds.
pub fn compacting_kubeconfig() -> String {
    static KC: OnceLock<String> = OnceLock::new();
    KC.get_or_init(|| {
        let path = compacting_env_file();
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{} is missing ({e}): run the suite with ./tests/run, or start it with tests/env/compacting up",
                path.display()
            )
        });
        parse(&text)
            .remove("KUBECONFIG")
            .unwrap_or_else(|| panic!("no KUBECONFIG in {}: is the compacting apiserver running?", path.display()))
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

/// For the benchmarks: makes sure `services` of the main environment run and returns its env
/// file, read now. `tests/env/up` is idempotent and leaves running servers alone. With
/// `KUBECAST_ENV_FILE` set, that environment is used as it is: nothing is started.
pub fn env_up(services: &[&str]) -> Env {
    up("KUBECAST_ENV_FILE", &repo_root().join("tests/env/up"), services);
    let path = env_file();
    parse(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("env file {}: {e}", path.display())))
}

/// For the benchmarks: makes sure the compacting apiserver runs (`tests/env/compacting up`,
/// unless `KUBECAST_COMPACTING_ENV_FILE` is set) and returns its kubeconfig.
pub fn compacting_up() -> String {
    up("KUBECAST_COMPACTING_ENV_FILE", &repo_root().join("tests/env/compacting"), &["up"]);
    compacting_kubeconfig()
}

/// For the scale benchmark: makes sure its apiserver runs (`tests/env/scale up`, unless
/// `KUBECAST_SCALE_ENV_FILE` is set) and returns its env file's keys (`KUBECONFIG`,
/// `KUBECAST_ENV_STATE`, `KUBECAST_TEST_ETCD_ENDPOINT`, ...).
pub fn scale_up() -> Env {
    up("KUBECAST_SCALE_ENV_FILE", &repo_root().join("tests/env/scale"), &["up"]);
    let path = located("KUBECAST_SCALE_ENV_FILE", "KUBECAST_ENV_SCALE_STATE", "target/kubecast-env-scale");
    parse(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("env file {}: {e}", path.display())))
}

fn up(file_var: &str, script: &Path, args: &[&str]) {
    if std::env::var_os(file_var).is_some() {
        return;
    }
    let status = Command::new(script).args(args).status().unwrap_or_else(|e| panic!("{}: {e}", script.display()));
    assert!(status.success(), "{} {} failed ({status}); see tests/env/README.md", script.display(), args.join(" "));
}

/// Runs `tests/env/<args[0]> <args[1..]>` (e.g. `["down", "kafka"]`), which must succeed.
pub fn env_script(args: &[&str]) {
    let script = repo_root().join("tests/env").join(args[0]);
    let status = Command::new(&script).args(&args[1..]).status().expect("tests/env script");
    assert!(status.success(), "tests/env/{args:?} failed");
}

/// A shared server stopped by a test (`tests/env/down <service>`); started again
/// (`tests/env/up <service>`) when this is dropped, also when the test fails.
pub struct Stopped(&'static str);

impl Stopped {
    pub fn now(service: &'static str) -> Self {
        env_script(&["down", service]);
        Self(service)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        env_script(&["up", self.0]);
    }
}

/// A shared server paused (SIGSTOP: its connections stay open, nothing answers) by a test.
/// The pause is bounded twice: dropping this resumes it (SIGCONT; also when the test fails),
/// and a watchdog process of its own resumes it after `at_most` whatever happens to the test
/// process (killed, hung).
pub struct Paused {
    pid: String,
    watchdog: Option<std::process::Child>,
}

impl Paused {
    /// Pauses `service` (`kafka`, `nats`, ...) of the main environment: its pid is in
    /// `<state>/<service>/pid`, next to the env file.
    pub fn now(service: &str, at_most: std::time::Duration) -> Self {
        use std::os::unix::process::CommandExt;
        let file = env_file().parent().expect("the env file's directory").join(service).join("pid");
        let pid = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())).trim().to_string();
        assert!(pid.parse::<u32>().is_ok(), "{}: not a pid: {pid:?}", file.display());
        // First the watchdog, in a process group of its own (not signalled with the test's).
        let watchdog = Command::new("sh")
            .args(["-c", &format!("sleep {}; kill -CONT {pid}", at_most.as_secs().max(1))])
            .process_group(0)
            .spawn()
            .expect("pause watchdog");
        signal(&pid, "STOP");
        Self { pid, watchdog: Some(watchdog) }
    }
}

fn signal(pid: &str, sig: &str) {
    let status = Command::new("kill").args([&format!("-{sig}"), pid]).status().expect("kill");
    assert!(status.success(), "kill -{sig} {pid} failed");
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-CONT", &self.pid]).status();
        if let Some(w) = self.watchdog.take() {
            // The whole group: the shell and its sleep.
            let mut w = w;
            let _ = Command::new("kill").args(["-TERM", "--", &format!("-{}", w.id())]).status();
            let _ = w.wait();
        }
    }
}
