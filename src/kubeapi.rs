//! The connection to the apiserver: the client, and the one rate limiter every request
//! kubecast makes (discovery, list pages, watch starts) waits on, so many streams starting at
//! once do not hammer the apiserver.

use std::num::NonZeroU32;
use std::sync::Arc;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use kube::Client;

use crate::config::ClusterConfig;

/// Shared by all streams.
pub type ApiLimiter = Arc<DefaultDirectRateLimiter>;

#[derive(Debug, thiserror::Error)]
#[error(
    "cannot build a Kubernetes client: {0} (fix: set cluster.kubeconfig or KUBECONFIG, or run in a pod with a service account)"
)]
pub struct ClientError(String);

pub async fn client(cfg: &ClusterConfig) -> Result<Client, ClientError> {
    let kcfg = match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| ClientError(format!("cluster.kubeconfig {}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| ClientError(format!("cluster.kubeconfig {}: {e}", path.display())))?
        }
        None => kube::Config::infer().await.map_err(|e| ClientError(e.to_string()))?,
    };
    Client::try_from(kcfg).map_err(|e| ClientError(e.to_string()))
}

/// `qps` requests per second on average, `burst` at once.
pub fn limiter(cfg: &ClusterConfig) -> ApiLimiter {
    let qps = NonZeroU32::new(cfg.qps).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(cfg.burst).unwrap_or(NonZeroU32::MIN);
    Arc::new(RateLimiter::direct(Quota::per_second(qps).allow_burst(burst)))
}
