//! The active part of a run: once this process holds its Lease (or needs none), it opens the
//! state, starts the streams and the stages after them, supervises them until the token
//! fires or something fails, drains, and gives the Lease up last. `kubecast run` runs it
//! once; with `[coordination] shards` above 1 it runs once per shard held (`shards.rs`).

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::error::RunError;
use super::wiring::Pipeline;
use super::{leadership, shutdown, store, supervise};
use crate::observe::health::Health;
use crate::sink::Sink;
use crate::sink::kafka::transaction::OwnerCheck;
use crate::source::client::ApiLimiter;
use crate::source::reflector::Item;
use crate::state::store::Owner;

/// What the active part runs with.
pub struct Active<'a> {
    pub client: &'a kube::Client,
    pub limiter: &'a ApiLimiter,
    pub sink: Arc<Sink>,
    /// Where the streams report (a shard's own, with shards).
    pub health: &'a Arc<Health>,
    /// Fires to stop (shutdown, or a shard given up): then the drain.
    pub cancel: CancellationToken,
}

/// The Lease held, and how to give it up.
pub struct Held {
    /// The lease epoch (`None` without `[coordination]`).
    pub epoch: Option<i64>,
    pub writer: String,
    /// The lease keeper (`None` without `[coordination]`).
    pub keeper: Option<JoinHandle<Result<(), RunError>>>,
    /// Stops the keeper, which then gives the Lease up.
    pub stop: CancellationToken,
    /// Fired when the lease is lost or the store fenced this process, also during the drain:
    /// publishing stops at once.
    pub lost: CancellationToken,
    /// Whether the Lease is held right now (the keeper's renewals; see `leadership::Tenure`).
    pub tenure: leadership::Tenure,
}

/// Runs `pipeline` while the Lease is held, until `active.cancel` fires or something fails.
pub async fn run(mut pipeline: Pipeline, active: Active<'_>, held: Held) -> Result<(), RunError> {
    let Active { client, limiter: api_limiter, sink, health, cancel } = active;
    let Held { epoch, writer, keeper: mut lease, stop: lease_stop, lost: lease_lost, tenure } = held;
    // The state, opened and read only by the active process, and only while it holds the
    // Lease: abandoned as soon as the keeper reports it lost.
    match leadership::while_held(&mut lease, open_state(&mut pipeline, client, &sink, epoch, writer, health, &cancel))
        .await
    {
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

    let (items_tx, items_rx) = mpsc::channel::<Item>(pipeline.bounds().channel_capacity());
    let reflectors = pipeline.reflectors(client, api_limiter, health, &items_tx);
    drop(items_tx);
    let mut streams = JoinSet::new();
    for r in reflectors {
        streams.spawn(r.run(cancel.clone()));
    }
    info!(streams = pipeline.streams.len(), sink = %pipeline.config.sink.kind, store = %pipeline.store().describe(), "kubecast running");
    let mut downstream = pipeline.start_downstream(sink.clone(), items_rx, health, &cancel);
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
        health,
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
/// Shutdown (or the shard given up) ends every wait in it at once: a broker that does not
/// answer can hold a step for minutes (the state topic's creation up to 60 s,
/// `init_transactions` 30 s, the load up to 300 s), longer than a pod's grace period, and the
/// Lease would then not be given back. Nothing is written before the load ends, so stopping
/// anywhere in it leaves the state as it was (a blocking broker call still running ends by
/// itself, its result unused).
async fn open_state(
    pipeline: &mut Pipeline,
    client: &kube::Client,
    sink: &Sink,
    epoch: Option<i64>,
    writer: String,
    health: &Health,
    cancel: &CancellationToken,
) -> Result<bool, RunError> {
    let opened = async {
        let owner = Owner { cluster_uid: store::cluster_uid(client).await, epoch, writer };
        let keys: Vec<_> = pipeline.streams.iter().map(|s| s.key.clone()).collect();
        let Some(state) = store::open(&pipeline.config, sink, &keys, owner, health, pipeline.bounds(), cancel).await?
        else {
            return Ok(false);
        };
        pipeline.load(state).await?;
        Ok(true)
    };
    tokio::select! {
        opened = opened => opened,
        () = cancel.cancelled() => Ok(false),
    }
}

/// Stops the lease keeper, if it still runs: it gives the Lease up, so a standby takes over at
/// once.
async fn stop_keeper(lease: Option<JoinHandle<Result<(), RunError>>>, stop: &CancellationToken) {
    stop.cancel();
    if let Some(keeper) = lease {
        let _ = keeper.await;
    }
}
