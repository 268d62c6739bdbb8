//! Shutdown: stop reading (the reflectors end), let the shaping stage hand over what it took,
//! deliver what the queue holds within `[delivery] shutdown_timeout_seconds`, flush the
//! producer, stop the persister and write every stream's final checkpoint.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::supervise::{Outcome, flatten, task_error};
use super::wiring::Downstream;
use crate::observe::health::Health;
use crate::sink::Sink;
use crate::source::reflector::ReflectorError;
use crate::state::watermark::StreamCheckpoint;

/// What the drain needs.
pub struct Drain<'a> {
    pub health: &'a Health,
    pub cancel: &'a CancellationToken,
    pub streams: JoinSet<Result<(), ReflectorError>>,
    pub downstream: Downstream,
    /// Whether the queue already ended (then it is not waited for again).
    pub queue_done: bool,
    pub sink: &'a Arc<Sink>,
    pub checkpoints: &'a [Arc<StreamCheckpoint>],
    pub timeout: Duration,
    pub outcome: &'a mut Outcome,
}

pub async fn drain(d: Drain<'_>) {
    let Drain { health, cancel, mut streams, mut downstream, queue_done, sink, checkpoints, timeout, outcome } = d;
    // Stop reading; deliver what was taken, within the shutdown timeout.
    health.set_shutting_down();
    cancel.cancel();
    while let Some(joined) = streams.join_next().await {
        if let Some(e) = task_error(joined) {
            outcome.fail(e.into(), cancel);
        }
    }
    let _ = downstream.shaper.await;
    if !queue_done {
        match tokio::time::timeout(timeout, &mut downstream.queue).await {
            Ok(done) => {
                if let Err(e) = flatten(done) {
                    outcome.fail(e.into(), cancel);
                }
            }
            Err(_) => {
                downstream.queue.abort();
                warn!(
                    ?timeout,
                    "shutdown timeout: events still queued are not acknowledged; they are sent again after restart"
                );
            }
        }
    }
    if let Err(e) = sink.flush(timeout) {
        // Not acknowledged, so not in any checkpoint: sent again after the restart.
        warn!(error = %e, "not everything handed to the producer was delivered before the shutdown timeout");
    }
    let _ = downstream.persister.await;
    for cp in checkpoints {
        if let Err(e) = cp.persist_if_dirty() {
            outcome.fail(e.into(), cancel);
        }
    }
}
