//! Wires the data flow for `kubecast run`:
//!
//! ```text
//! config -> reflector per stream -> [bounded channel] -> events filter -> CloudEvent -> sink
//!                                                                                     |
//!              checkpoint files <- persister <- watermark per stream <- ack <---------+
//! ```
//!
//! Every item a reflector emits is acknowledged exactly once: after the sink accepted its
//! event, or at once when the `events` filter drops it or it carries no change (bookmarks, end
//! of a list). Only acknowledged items move a stream's checkpoint (see `ack.rs`). When the sink
//! is slow the channel fills and the reflectors stop reading their watches (backpressure).
//!
//! Shutdown (the token fires): the reflectors stop, the sink delivers what is already in the
//! channel, then every stream's final checkpoint is written.

use std::sync::Arc;
use std::time::Duration;

use kube::api::GroupVersionKind;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::ack::StreamCheckpoint;
use crate::checkpoint::{CheckpointError, CheckpointStore, StreamKey};
use crate::config::{Config, ResourceConfig};
use crate::kubeapi::{self, ClientError};
use crate::reflector::{Item, Reflector, ReflectorError, StreamSpec};
use crate::sink::{Sink, SinkError};

/// Capacity of the channel between the reflectors and the sink.
const CHANNEL_CAPACITY: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Reflector(#[from] ReflectorError),
    #[error("sink: {0}")]
    Sink(#[from] SinkError),
}

/// What the sink side knows of a stream.
struct Stream {
    resource: Arc<ResourceConfig>,
    checkpoint: Arc<StreamCheckpoint>,
}

/// Runs until `shutdown` fires or a fatal error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = kubeapi::client(&config.cluster).await?;
    let limiter = kubeapi::limiter(&config.cluster);
    let store = CheckpointStore::open(&config.checkpoint.dir)?;
    let mut sink = Sink::open(&config.sink).await?;

    let (tx, mut rx) = mpsc::channel::<Item>(CHANNEL_CAPACITY);
    let mut streams = Vec::new();
    let mut reflectors = Vec::new();
    for (resource_index, rc) in config.resources.iter().enumerate() {
        let rc = Arc::new(rc.clone());
        let (group, version) = rc.group_version();
        let scopes: Vec<Option<String>> =
            if rc.namespaces.is_empty() { vec![None] } else { rc.namespaces.iter().cloned().map(Some).collect() };
        for namespace in scopes {
            let key = StreamKey {
                cluster: config.cluster.name.clone(),
                group: group.to_string(),
                version: version.to_string(),
                kind: rc.kind.clone(),
                namespace: namespace.clone(),
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
            };
            let (checkpoint, loaded) = StreamCheckpoint::load(store.clone(), key)?;
            let name = match &namespace {
                Some(ns) => format!("{} in namespace {ns}", rc.describe()),
                None => format!("{} (cluster-wide)", rc.describe()),
            };
            let spec = StreamSpec {
                id: streams.len(),
                name,
                resource_index,
                cluster: config.cluster.name.clone(),
                client: client.clone(),
                limiter: limiter.clone(),
                gvk: GroupVersionKind::gvk(group, version, &rc.kind),
                namespace,
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
                page_size: rc.page_size,
                watch_timeout_seconds: config.cluster.watch_timeout_seconds,
                initial: rc.initial,
                missing_kind: rc.missing_kind,
                streaming_lists: config.cluster.streaming_lists,
            };
            reflectors.push(Reflector::new(spec, loaded, tx.clone()));
            streams.push(Stream { resource: rc.clone(), checkpoint: Arc::new(checkpoint) });
        }
    }
    drop(tx);

    let cancel = shutdown.child_token();
    let mut tasks = JoinSet::new();
    for r in reflectors {
        tasks.spawn(r.run(cancel.clone()));
    }
    info!(streams = streams.len(), sink = %config.sink.kind, "kubecast running");

    let checkpoints: Vec<Arc<StreamCheckpoint>> = streams.iter().map(|s| s.checkpoint.clone()).collect();
    let persister = tokio::spawn(persist_periodically(
        checkpoints.clone(),
        Duration::from_millis(config.checkpoint.flush_interval_ms),
        cancel.clone(),
    ));

    let mut result: Result<(), RunError> = Ok(());
    let mut fail = |e: RunError, cancel: &CancellationToken| {
        error!(error = %e, "stopping");
        if result.is_ok() {
            result = Err(e);
        }
        cancel.cancel();
    };
    loop {
        tokio::select! {
            maybe = rx.recv() => {
                let Some(item) = maybe else { break };
                if let Err(e) = deliver(&mut sink, &streams[item.stream], item).await {
                    // The checkpoint stays at the last acknowledged event.
                    fail(e.into(), &cancel);
                    break;
                }
            }
            Some(joined) = tasks.join_next() => {
                if let Some(e) = task_error(joined) {
                    fail(e.into(), &cancel);
                }
            }
        }
    }
    cancel.cancel();
    while let Some(joined) = tasks.join_next().await {
        if let Some(e) = task_error(joined) {
            fail(e.into(), &cancel);
        }
    }
    let _ = persister.await;
    for cp in &checkpoints {
        if let Err(e) = cp.persist_if_dirty() {
            error!(error = %e, "final checkpoint not written");
            if result.is_ok() {
                result = Err(e.into());
            }
        }
    }
    info!("kubecast stopped; checkpoints written");
    result
}

fn task_error(joined: Result<Result<(), ReflectorError>, tokio::task::JoinError>) -> Option<ReflectorError> {
    match joined {
        Ok(r) => r.err(),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// Filters, builds and sends one item's event, then acknowledges the item.
async fn deliver(sink: &mut Sink, stream: &Stream, item: Item) -> Result<(), SinkError> {
    if let Some(change) = item.change {
        if stream.resource.wants(change.verb) {
            match change.into_cloudevent() {
                Ok(event) => sink.send(&event).await?,
                // Cannot happen with objects from a real apiserver (they all have uid and
                // resourceVersion); acknowledged so the stream does not stall on it.
                Err(e) => warn!(error = %e, "object cannot become an event; skipped"),
            }
        }
    }
    stream.checkpoint.ack(item.seq, item.effect);
    Ok(())
}

async fn persist_periodically(checkpoints: Vec<Arc<StreamCheckpoint>>, every: Duration, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        for cp in &checkpoints {
            let cp = cp.clone();
            // File I/O off the async workers.
            match tokio::task::spawn_blocking(move || cp.persist_if_dirty()).await {
                Ok(Err(e)) => error!(error = %e, "checkpoint not written; retrying at the next interval"),
                Ok(Ok(_)) | Err(_) => {}
            }
        }
    }
}
