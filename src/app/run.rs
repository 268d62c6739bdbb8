//! `kubecast run`: wires the data flow, supervises it, shuts it down.
//!
//! ```text
//! config -> reflector per stream -> [channel] -> shaping (events filter, CloudEvent)
//!        -> [channel] -> outbound queue (order, rate limit, retry, dead letter) -> sink
//!                                                                                   |
//!   state store (file | kafka | nats) <- persister <- watermark per stream <- ack <-+
//! ```
//!
//! Every item a reflector emits is acknowledged exactly once: after the sink accepted its
//! event (or it went to the dead letter), or at once when the `events` filter drops it or it
//! carries no change (bookmarks, end of a list). Only acknowledged items move a stream's
//! checkpoint (see `state/watermark.rs`). All channels are bounded: when the sink is slow they
//! fill and the reflectors stop reading their watches (backpressure).
//!
//! The admin server is bound before any watch starts. Supervision (`supervise.rs`) runs until
//! the token fires, a stream fails or the queue stops; then `shutdown.rs` drains.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use super::error::RunError;
use super::preflight::{check_dead_letter, check_nats_streams};
use super::wiring::{CHANNEL_CAPACITY, Pipeline};
use super::{leadership, shutdown, store, supervise};
use crate::config::Config;
use crate::observe::admin;
use crate::observe::health::Health;
use crate::sink::Sink;
use crate::sink::kafka::transaction::OwnerCheck;
use crate::source::client;
use crate::source::reflector::Item;
use crate::state::store::Owner;

/// Runs until `shutdown` fires or a fatal error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    let (client, apiserver) = client::client(&config.cluster).await?;
    let api_limiter = client::limiter(&config.cluster);
    let mut pipeline = Pipeline::new(config);
    let config = &pipeline.config;
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await?);
    check_nats_streams(config, &client, &sink).await?;
    check_dead_letter(config, &sink).await?;
    let health = Health::new(pipeline.stream_names(), sink.connected(), sink.unreachable_cause());

    let cancel = shutdown.child_token();
    admin::serve(&pipeline.config.admin, health.clone(), cancel.clone()).await?;
    tokio::spawn(supervise::probe_apiserver(client.clone(), apiserver, health.clone(), cancel.clone()));
    if sink.kafka().is_some() {
        tokio::spawn(supervise::probe_broker(sink.clone(), cancel.clone()));
    }
    // `[coordination]`: a standby waits here, its admin server up, until it holds the lease.
    let lease_stop = CancellationToken::new();
    // Fired when the lease is lost or the store fenced this process, also during the drain:
    // publishing stops at once.
    let lease_lost = CancellationToken::new();
    let mut lease = None;
    let tenure = leadership::Tenure::new(&pipeline.config.coordination, lease_lost.clone());
    let (epoch, writer) = match leadership::elector(&client, &pipeline.config.coordination, &health) {
        Some(mut elector) => {
            let cfg = pipeline.config.coordination.clone();
            let Some(epoch) = leadership::wait_for_lease(&mut elector, &cfg, &health, &cancel).await? else {
                info!("stopped while standby");
                return Ok(());
            };
            let writer = elector.identity().to_string();
            let keeper = leadership::keep_lease(elector, cfg, epoch, lease_stop.clone(), tenure.clone());
            lease = Some(tokio::spawn(keeper));
            (Some(i64::from(epoch)), writer)
        }
        None => {
            crate::observe::metrics::get().leader.set(1);
            (None, pipeline.config.coordination.identity())
        }
    };
    // The state, opened and read only by the active process, and only while it holds the
    // Lease: abandoned as soon as the keeper reports it lost.
    match leadership::while_held(&mut lease, open_state(&mut pipeline, &client, &sink, epoch, writer, &cancel)).await {
        Ok(true) => {}
        Ok(false) => {
            info!("stopped before the state store could be opened");
            stop_keeper(lease, &lease_stop).await;
            return Ok(());
        }
        Err(e) => {
            if matches!(e, RunError::LeaseLost { .. }) {
                warn!(
                    "lost the lease while opening the state store: opening abandoned, the state is left to the new holder"
                );
            }
            cancel.cancel();
            stop_keeper(lease, &lease_stop).await;
            return Err(e);
        }
    }

    // Kafka: after a transaction the broker aborted for its age, the producer takes its
    // transactional.id over again only while this process holds the Lease (always without
    // coordination: the only guard there is the one process the chart runs).
    let owner: OwnerCheck = if lease.is_some() {
        let tenure = tenure.clone();
        Arc::new(move || tenure.held())
    } else {
        Arc::new(|| true)
    };
    pipeline.store().may_take_over(owner);

    let (items_tx, items_rx) = mpsc::channel::<Item>(CHANNEL_CAPACITY);
    let reflectors = pipeline.reflectors(&client, &api_limiter, &health, &items_tx);
    drop(items_tx);
    let mut streams = JoinSet::new();
    for r in reflectors {
        streams.spawn(r.run(cancel.clone()));
    }
    info!(streams = pipeline.streams.len(), sink = %pipeline.config.sink.kind, store = %pipeline.store().describe(), "kubecast running");
    let mut downstream = pipeline.start_downstream(sink.clone(), items_rx, &cancel);
    let stall_after = pipeline.config.delivery.stall_after_seconds;
    if stall_after > 0 {
        tokio::spawn(supervise::watch_stalls(
            pipeline.stream_names(),
            pipeline.checkpoints().to_vec(),
            pipeline.metrics().to_vec(),
            health.clone(),
            std::time::Duration::from_secs(stall_after),
            cancel.clone(),
        ));
    }

    let mut outcome = supervise::Outcome::default();
    let queue_done = supervise::until_stopped(
        &mut streams,
        &mut downstream.queue,
        &mut lease,
        &mut downstream.persister,
        &cancel,
        &mut outcome,
    )
    .await;
    // A process that lost the lease, or that the store fenced, stops publishing at once: no
    // drain, and no more state writes (another process owns the state).
    let owner_lost = outcome.lease_lost() || outcome.fenced();
    if owner_lost {
        lease_lost.cancel();
    }
    let timeout = if owner_lost {
        std::time::Duration::ZERO
    } else {
        std::time::Duration::from_secs(pipeline.config.delivery.shutdown_timeout_seconds)
    };
    shutdown::drain(shutdown::Drain {
        health: &health,
        cancel: &cancel,
        streams,
        downstream,
        queue_done,
        sink: &sink,
        store: pipeline.store(),
        checkpoints: pipeline.checkpoints(),
        timeout,
        outcome: &mut outcome,
        stop_now: &lease_lost,
    })
    .await;
    // Given up only now, after the final checkpoint: a standby takes over where this one ended.
    lease_stop.cancel();
    if let Some(lease) = lease
        && let Ok(Err(e)) = lease.await
    {
        outcome.fail(e, &cancel);
    }
    info!("kubecast stopped");
    outcome.into_result()
}

/// Opens the state store and loads every stream's position; `false` when shutdown came first.
async fn open_state(
    pipeline: &mut Pipeline,
    client: &kube::Client,
    sink: &Sink,
    epoch: Option<i64>,
    writer: String,
    cancel: &CancellationToken,
) -> Result<bool, RunError> {
    let owner = Owner { cluster_uid: store::cluster_uid(client).await, epoch, writer };
    let keys: Vec<_> = pipeline.streams.iter().map(|s| s.key.clone()).collect();
    let Some(state) = store::open(&pipeline.config, sink, &keys, owner, cancel).await? else {
        return Ok(false);
    };
    pipeline.load(state).await?;
    Ok(true)
}

/// Stops the lease keeper, if it still runs: it gives the Lease up, so a standby takes over at
/// once.
async fn stop_keeper(lease: Option<JoinHandle<Result<(), RunError>>>, stop: &CancellationToken) {
    stop.cancel();
    if let Some(keeper) = lease {
        let _ = keeper.await;
    }
}
