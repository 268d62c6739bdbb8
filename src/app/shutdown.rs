//! Shutdown, within one deadline (`[delivery] shutdown_timeout_seconds` from the signal):
//! stop reading (the reflectors end), let the shaping stage hand over what it took and the
//! queue deliver what it holds, flush the producer, stop the persister; then, whatever
//! happened before, write every stream's final checkpoint. A stage still busy at the deadline
//! is stopped: what it held was not acknowledged, so it is not in any checkpoint and is sent
//! again after the restart. (A panic of a stage is passed on instead: no final write, the
//! restart sends again what came after the last one.)
//!
//! The state writes are bounded too: a write of the persister still running and the final
//! write get until the deadline, and at least [`FINAL_WRITE_GRACE`] (a store that does not
//! answer, e.g. Kafka down, would hold each of them for its own timeout). One that does not
//! finish by then is given up: nothing acknowledged since the last write is lost, the restart
//! resumes from that write and sends it again (exactly-once: a commit cut off either never
//! happened or commits exactly the state sealed with it).

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::supervise::{Outcome, flatten, task_error};
use super::wiring::Downstream;
use crate::observe::health::Health;
use crate::sink::Sink;
use crate::source::reflector::ReflectorError;
use crate::state::persister::write_changed;
use crate::state::store::{CheckpointError, Store};
use crate::state::watermark::StreamCheckpoint;

/// The least time the state writes of the drain get, even when the deadline has passed.
pub const FINAL_WRITE_GRACE: Duration = Duration::from_secs(2);

/// What the drain needs.
pub struct Drain<'a> {
    pub health: &'a Health,
    pub cancel: &'a CancellationToken,
    pub streams: JoinSet<Result<(), ReflectorError>>,
    pub downstream: Downstream,
    /// Whether the queue already ended (then it is not waited for again).
    pub queue_done: bool,
    pub sink: &'a Arc<Sink>,
    pub store: &'a Store,
    pub checkpoints: &'a [Arc<StreamCheckpoint>],
    /// From now until everything but the final checkpoint write is done.
    pub timeout: Duration,
    pub outcome: &'a mut Outcome,
    /// Fired when publishing must stop at once (the lease was lost): the deadline is now.
    pub stop_now: &'a CancellationToken,
}

pub async fn drain(d: Drain<'_>) {
    let Drain {
        health,
        cancel,
        mut streams,
        mut downstream,
        queue_done,
        sink,
        store,
        checkpoints,
        timeout,
        outcome,
        stop_now,
    } = d;
    let deadline = Instant::now() + timeout;
    // The deadline, or at once when `stop_now` fires.
    let cut = || async {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            _ = stop_now.cancelled() => {}
        }
    };
    health.set_shutting_down();
    cancel.cancel();
    // The reflectors end at once on the token.
    let joined = async {
        while let Some(joined) = streams.join_next().await {
            if let Some(e) = task_error(joined) {
                outcome.fail(e.into(), cancel);
            }
        }
    };
    let finished = tokio::select! {
        _ = joined => true,
        _ = cut() => false,
    };
    if !finished {
        streams.abort_all();
    }
    // The shaper hands the queue what it took; the queue delivers meanwhile (both can wait on
    // a slow or unreachable sink: bounded by the deadline).
    finish_by(cut(), &mut downstream.shaper, "shaping").await;
    if !queue_done {
        let done = tokio::select! {
            done = &mut downstream.queue => Ok(done),
            _ = cut() => Err(()),
        };
        match done {
            Ok(done) => {
                if let Err(e) = flatten(done) {
                    outcome.fail(e.into(), cancel);
                }
            }
            Err(_) => {
                downstream.queue.abort();
                warn!(
                    ?timeout,
                    "shutdown deadline: events still queued are not acknowledged; they are sent again after restart"
                );
            }
        }
    }
    let left =
        if stop_now.is_cancelled() { Duration::ZERO } else { deadline.saturating_duration_since(Instant::now()) };
    // librdkafka's flush blocks its thread: on the blocking pool, not on a runtime thread.
    let flushing = sink.clone();
    let flushed = tokio::task::spawn_blocking(move || flushing.flush(left)).await.expect("producer flush task");
    if let Err(e) = flushed {
        // Not acknowledged, so not in any checkpoint: sent again after the restart.
        warn!(error = %e, "not everything handed to the producer was delivered before the shutdown deadline");
    }
    // The state writes below get until the deadline, and at least the grace.
    let write_by = deadline.max(Instant::now() + FINAL_WRITE_GRACE);
    // The persister stops on the token (checked between its writes); a write of it in progress
    // is waited for (writes never overlap), until `write_by`.
    if let Some(mut persister) = downstream.persister.take() {
        match tokio::time::timeout_at(write_by, &mut persister).await {
            Ok(Ok(Err(e))) => settle(e, outcome, cancel),
            Ok(_) => {}
            Err(_) => {
                persister.abort();
                warn!(
                    store = %store.describe(),
                    "shutdown deadline: a checkpoint write still waits for the store; no final write (what was acknowledged since the last write is sent again after the restart)"
                );
                return;
            }
        }
    }
    // Not when another process owns the state now (the lease was lost, or the store fenced
    // this one): only the owner writes it.
    if stop_now.is_cancelled() {
        warn!("no final checkpoint write: this process no longer owns the state");
        return;
    }
    // Always otherwise, whatever happened above: the acknowledged position of every stream
    // (exactly-once: unless an event was sent and never acknowledged; then the open
    // transaction is aborted instead).
    match tokio::time::timeout_at(write_by, write_changed(store, checkpoints)).await {
        Ok(Ok(_)) => info!(within_deadline = Instant::now() <= deadline, "final checkpoints written"),
        Ok(Err(e)) => settle(e, outcome, cancel),
        Err(_) => warn!(
            store = %store.describe(),
            "shutdown deadline: the final checkpoint write got no answer from the store; given up (what was acknowledged since the last write is sent again after the restart)"
        ),
    }
}

/// A write's error: the run's result, unless the open transaction was abandoned because the
/// queue was stopped in the middle (nothing lost: the restart sends it again).
fn settle(e: CheckpointError, outcome: &mut Outcome, cancel: &CancellationToken) {
    match e {
        CheckpointError::Abandoned { .. } => warn!(error = %e, "no final checkpoint write"),
        e => outcome.fail(e.into(), cancel),
    }
}

/// Waits for `task` until `cut` completes, else stops it.
async fn finish_by(cut: impl std::future::Future<Output = ()>, task: &mut JoinHandle<()>, what: &str) {
    let finished = tokio::select! {
        _ = &mut *task => true,
        _ = cut => false,
    };
    if !finished {
        task.abort();
        warn!("shutdown deadline: {what} stopped before it finished");
    }
}
