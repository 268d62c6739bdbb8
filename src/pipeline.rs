//! Wires the data flow for `kubecast run`:
//!
//! ```text
//! config -> discovery -> reflector per stream -> (events filter) -> CloudEvent -> sink
//! ```
//!
//! Reflectors send [`Change`]s into one bounded channel; when the sink is slow the channel
//! fills and the reflectors stop reading their watches (backpressure), they never buffer
//! without bound.

use std::sync::Arc;

use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::discovery::{self, Scope};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{Config, ResourceConfig};
use crate::event::{Change, EventSource};
use crate::reflector::{Reflector, ReflectorError, StreamSpec};
use crate::sink::{Sink, SinkError};

/// Capacity of the channel between the reflectors and the sink.
const CHANNEL_CAPACITY: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(
        "cannot build a Kubernetes client: {0} (fix: set cluster.kubeconfig or KUBECONFIG, or run in a pod with a service account)"
    )]
    Client(String),
    #[error("resources[{index}] ({resource}): {message}")]
    Resource { index: usize, resource: String, message: String },
    #[error(transparent)]
    Reflector(#[from] ReflectorError),
    #[error("sink: {0}")]
    Sink(#[from] SinkError),
}

/// A resolved `[[resources]]` entry.
struct Resolved {
    cfg: ResourceConfig,
    source: EventSource,
}

/// Runs until `shutdown` fires (then drains what the reflectors already handed over) or a
/// fatal error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = make_client(&config).await?;
    let mut sink = Sink::open(&config.sink).await?;

    let mut resolved = Vec::new();
    let mut specs = Vec::new();
    for (index, rc) in config.resources.iter().enumerate() {
        let (ar, scope) = resolve(&client, index, rc).await?;
        resolved.push(Arc::new(Resolved { cfg: rc.clone(), source: EventSource::new(&config.cluster.name, &ar) }));
        for ns in namespaces_for(index, rc, &scope)? {
            let api: Api<DynamicObject> = match &ns {
                Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
                None => Api::all_with(client.clone(), &ar),
            };
            let name = match &ns {
                Some(ns) => format!("{} in namespace {ns}", rc.describe()),
                None => format!("{} (cluster-wide)", rc.describe()),
            };
            specs.push(StreamSpec {
                tag: index,
                name,
                api,
                resource: ar.clone(),
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
                page_size: 500,
            });
        }
    }

    let (tx, mut rx) = mpsc::channel::<(usize, Change)>(CHANNEL_CAPACITY);
    let cancel = shutdown.child_token();
    let mut reflectors = JoinSet::new();
    for spec in specs {
        let (tx, cancel) = (tx.clone(), cancel.clone());
        reflectors.spawn(async move { Reflector::new(spec).run(tx, cancel).await });
    }
    drop(tx);
    info!(streams = reflectors.len(), "kubecast running");

    let mut result = Ok(());
    loop {
        tokio::select! {
            maybe = rx.recv() => match maybe {
                Some((index, change)) => {
                    let r = &resolved[index];
                    if !r.cfg.wants(change.verb) {
                        continue;
                    }
                    match r.source.build(change) {
                        Ok(event) => sink.send(&event).await?,
                        Err(e) => warn!(source = r.source.source(), error = %e, "object cannot become an event; skipped"),
                    }
                }
                None => break,
            },
            Some(joined) = reflectors.join_next() => {
                match joined {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        error!(error = %e, "stream failed");
                        result = Err(RunError::Reflector(e));
                        cancel.cancel();
                    }
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Err(_) => {}
                }
            }
        }
    }
    result
}

async fn make_client(config: &Config) -> Result<Client, RunError> {
    let kcfg = match &config.cluster.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| RunError::Client(format!("cluster.kubeconfig {}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| RunError::Client(format!("cluster.kubeconfig {}: {e}", path.display())))?
        }
        None => kube::Config::infer().await.map_err(|e| RunError::Client(e.to_string()))?,
    };
    Client::try_from(kcfg).map_err(|e| RunError::Client(e.to_string()))
}

async fn resolve(client: &Client, index: usize, rc: &ResourceConfig) -> Result<(ApiResource, Scope), RunError> {
    let (group, version) = rc.group_version();
    let gvk = GroupVersionKind::gvk(group, version, &rc.kind);
    match discovery::pinned_kind(client, &gvk).await {
        Ok((ar, caps)) => {
            if !caps.supports_operation(discovery::verbs::WATCH) || !caps.supports_operation(discovery::verbs::LIST) {
                return Err(RunError::Resource {
                    index,
                    resource: rc.describe(),
                    message: "the server does not allow list and watch on this kind (fix: choose a watchable kind)"
                        .into(),
                });
            }
            Ok((ar, caps.scope))
        }
        Err(e) => {
            let message = match &e {
                kube::Error::Api(s) if s.code == 404 => format!(
                    "the server does not serve api_version {:?} (fix: check api_version; for a CRD, install it first)",
                    rc.api_version
                ),
                kube::Error::Api(s) if s.code == 403 => {
                    format!("discovery is forbidden: {}", s.message)
                }
                kube::Error::Discovery(_) => format!(
                    "kind {:?} is not served in {:?} (fix: check the spelling of kind, and `kubectl api-resources`)",
                    rc.kind, rc.api_version
                ),
                other => format!("discovery failed: {other}"),
            };
            Err(RunError::Resource { index, resource: rc.describe(), message })
        }
    }
}

/// `None` = one cluster-wide stream.
fn namespaces_for(index: usize, rc: &ResourceConfig, scope: &Scope) -> Result<Vec<Option<String>>, RunError> {
    if rc.namespaces.is_empty() {
        return Ok(vec![None]);
    }
    if matches!(scope, Scope::Cluster) {
        return Err(RunError::Resource {
            index,
            resource: rc.describe(),
            message: format!("namespaces is set, but {} is cluster-scoped (fix: remove namespaces)", rc.kind),
        });
    }
    Ok(rc.namespaces.iter().cloned().map(Some).collect())
}
