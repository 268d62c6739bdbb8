//! The admin HTTP server (`[admin] listen`): `/livez` (and `/healthz`), `/readyz`, `/metrics`.
//!
//! Ready means: every stream finished its initial list (or resumed from its checkpoint) and
//! the sink's broker is reachable. `/readyz` answers 503 with one line per reason otherwise
//! (a stream waiting for its kind, a stream still listing, the broker unreachable).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::info;

use super::health::Health;

/// `[admin]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of the admin server; `""` disables it.
    #[serde(default = "default_listen")]
    pub listen: String,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self { listen: default_listen() }
    }
}

impl AdminConfig {
    /// Problems with `[admin]`: `listen` is `""` or `host:port`.
    pub fn problems(&self) -> Vec<crate::model::Problem> {
        let l = self.listen.trim();
        let port_ok = l.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if l.is_empty() || port_ok {
            return Vec::new();
        }
        vec![crate::model::Problem::new(
            "admin.listen",
            format!("{:?} is not an address to listen on", self.listen),
            "write host:port, e.g. \"0.0.0.0:9090\" (all interfaces) or \"127.0.0.1:9090\", or \"\" for no admin server",
        )]
    }
}

fn default_listen() -> String {
    "0.0.0.0:9090".into()
}

#[derive(Debug, thiserror::Error)]
#[error(
    "admin server cannot listen on {addr:?}: {cause} (fix: set [admin] listen to a free address, or \"\" to disable)"
)]
pub struct AdminError {
    addr: String,
    cause: String,
}

/// Binds and serves until `cancel`; returns the bound address.
pub async fn serve(
    cfg: &AdminConfig,
    health: Arc<Health>,
    cancel: CancellationToken,
) -> Result<Option<SocketAddr>, AdminError> {
    if cfg.listen.trim().is_empty() {
        return Ok(None);
    }
    let err = |cause: String| AdminError { addr: cfg.listen.clone(), cause };
    // As `problems` read it: surrounding spaces are not part of the address.
    let listener = tokio::net::TcpListener::bind(cfg.listen.trim()).await.map_err(|e| err(e.to_string()))?;
    let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
    let app = Router::new()
        .route("/livez", get(live))
        .route("/healthz", get(live))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(health);
    info!(%addr, "admin server listening on {addr}");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(cancel.cancelled_owned()).await;
    });
    Ok(Some(addr))
}

/// Prometheus / OpenMetrics text exposition of [`super::metrics`].
async fn metrics(State(health): State<Arc<Health>>) -> ([(axum::http::header::HeaderName, &'static str); 1], String) {
    let m = super::metrics::get();
    m.sink_connected.set(i64::from(health.sink_connected()));
    ([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], m.encode())
}

async fn live() -> &'static str {
    "ok\n"
}

async fn ready(State(health): State<Arc<Health>>) -> (StatusCode, String) {
    let reasons = health.not_ready();
    if reasons.is_empty() {
        let shards = health.shards();
        match health.standby() {
            Some(standby) => (StatusCode::OK, format!("ready ({standby})\n")),
            None if !shards.is_empty() => {
                let held: Vec<String> = shards.iter().map(|s| s.label()).collect();
                (StatusCode::OK, format!("ready (shards held: {})\n", held.join(", ")))
            }
            None => (StatusCode::OK, "ready\n".into()),
        }
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, reasons.join("\n") + "\n")
    }
}
