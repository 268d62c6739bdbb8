//! The connection to the apiserver: the client, and the one rate limiter every request
//! kubecast makes (discovery, list pages, watch starts) waits on, so many streams starting at
//! once do not hammer the apiserver.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kube::Client;

use serde::{Deserialize, Serialize};

use super::gather::Gather;
use crate::model::Problem;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Goes into every CloudEvent's `source`.
    #[serde(default = "default_cluster_name")]
    pub name: String,
    /// Path of a kubeconfig; default: `KUBECONFIG`, then `~/.kube/config`, then in-cluster.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Requests per second kubecast sends to the apiserver (discovery, list pages, watch
    /// starts), all streams together.
    #[serde(default = "default_qps")]
    pub qps: u32,
    /// Requests that may go at once above `qps` (e.g. starting many streams).
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// Server-side timeout of each watch request; the watch is then resumed from where it was
    /// (no relist). kubecast also gives up on a watch silent for this long plus 5 s.
    #[serde(default = "default_watch_timeout")]
    pub watch_timeout_seconds: u32,
    /// Read the initial state with streaming lists (`sendInitialEvents`) where the apiserver
    /// supports them, falling back to paginated lists; `false`: always paginated lists.
    #[serde(default = "default_true")]
    pub streaming_lists: bool,
    /// While watch events arrive in quick succession, how long the apiserver's connection
    /// may gather them before kubecast wakes to read them (0: off). See `source/gather.rs`.
    #[serde(default = "default_watch_gather_ms")]
    pub watch_gather_ms: u32,
}

fn default_watch_gather_ms() -> u32 {
    2
}

fn default_true() -> bool {
    true
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            name: default_cluster_name(),
            kubeconfig: None,
            qps: default_qps(),
            burst: default_burst(),
            watch_timeout_seconds: default_watch_timeout(),
            streaming_lists: true,
            watch_gather_ms: default_watch_gather_ms(),
        }
    }
}

fn default_qps() -> u32 {
    20
}

fn default_burst() -> u32 {
    40
}

fn default_watch_timeout() -> u32 {
    290
}

fn default_cluster_name() -> String {
    "local".into()
}

impl ClusterConfig {
    /// Problems with `[cluster]` (keys relative to the file).
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if !is_dns_label(&self.name) {
            out.push(Problem::new(
                "cluster.name",
                format!("{:?} is not a valid cluster name (it goes into every CloudEvent source URI)", self.name),
                "use lower-case letters, digits and '-', at most 63 characters, e.g. \"prod-eu-1\"",
            ));
        }
        if self.qps == 0 {
            out.push(Problem::new("cluster.qps", "must be at least 1", "set e.g. qps = 20"));
        }
        if self.burst == 0 {
            out.push(Problem::new("cluster.burst", "must be at least 1", "set e.g. burst = 40"));
        }
        if !(1..=3600).contains(&self.watch_timeout_seconds) {
            out.push(Problem::new(
                "cluster.watch_timeout_seconds",
                format!("{} is out of range", self.watch_timeout_seconds),
                "use 1 to 3600; the default is 290",
            ));
        }
        if self.watch_gather_ms > MAX_WATCH_GATHER_MS {
            out.push(Problem::new(
                "cluster.watch_gather_ms",
                format!("{} ms is longer than kubecast allows", self.watch_gather_ms),
                format!("use 0 (off) to {MAX_WATCH_GATHER_MS}; the default is 2 (each change waits at most that long)"),
            ));
        }
        out
    }
}

/// The longest gathering window accepted: longer adds latency and saves next to nothing.
pub const MAX_WATCH_GATHER_MS: u32 = 50;

/// A DNS label (RFC 1123): cluster and namespace names.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Shared by all streams.
pub type ApiLimiter = Arc<DefaultDirectRateLimiter>;

#[derive(Debug, thiserror::Error)]
#[error(
    "cannot build a Kubernetes client: {0} (fix: correct the kubeconfig named, or point cluster.kubeconfig / KUBECONFIG at a valid one, or run in a pod with a service account)"
)]
pub struct ClientError(String);

static APISERVER_URL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// The apiserver's URL of the process's first client (`https://10.96.0.1:443` in a pod), once
/// one was made: the `source` of events in Knative ApiServerSource's form.
pub fn apiserver_url() -> Option<&'static str> {
    APISERVER_URL.get().map(String::as_str)
}

/// The client and the apiserver's address (for messages).
pub async fn client(cfg: &ClusterConfig) -> Result<(Client, String), ClientError> {
    let kcfg = match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| ClientError(format!("cluster.kubeconfig {}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| ClientError(format!("cluster.kubeconfig {}: {e}", path.display())))?
        }
        None => match std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
            Some(paths) => from_kubeconfig_env(&paths).await?,
            None => kube::Config::infer().await.map_err(|e| ClientError(e.to_string()))?,
        },
    };
    let url = kcfg.cluster_url.to_string();
    let _ = APISERVER_URL.set(url.trim_end_matches('/').to_string());
    let gather = Gather::from_millis(cfg.watch_gather_ms);
    Ok((super::connect::client(kcfg, gather).map_err(|e| ClientError(e.to_string()))?, url))
}

/// The kubeconfig files named by `KUBECONFIG` (merged in order, as kubectl does; files that
/// do not exist are skipped), each error naming the file (kube's own inference does not).
async fn from_kubeconfig_env(paths: &std::ffi::OsStr) -> Result<kube::Config, ClientError> {
    let shown = paths.to_string_lossy();
    let mut merged: Option<kube::config::Kubeconfig> = None;
    for path in std::env::split_paths(paths) {
        if !path.exists() {
            continue;
        }
        let kc = kube::config::Kubeconfig::read_from(&path)
            .map_err(|e| ClientError(format!("KUBECONFIG file {}: {e}", path.display())))?;
        merged = Some(match merged {
            None => kc,
            Some(m) => m.merge(kc).map_err(|e| ClientError(format!("KUBECONFIG file {}: {e}", path.display())))?,
        });
    }
    let Some(kc) = merged else {
        // As kube does: no file there, so in-cluster (or ~/.kube/config) it is.
        tracing::warn!(kubeconfig = %shown, "KUBECONFIG names no existing file; inferring the configuration instead (in-cluster)");
        return kube::Config::infer()
            .await
            .map_err(|e| ClientError(format!("KUBECONFIG={shown} names no existing file, and: {e}")));
    };
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|e| ClientError(format!("KUBECONFIG={shown}: {e}")))
}

/// `qps` requests per second on average, `burst` at once.
pub fn limiter(cfg: &ClusterConfig) -> ApiLimiter {
    let qps = NonZeroU32::new(cfg.qps).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(cfg.burst).unwrap_or(NonZeroU32::MIN);
    Arc::new(RateLimiter::direct(Quota::per_second(qps).allow_burst(burst)))
}
