//! The persister: writes what changed in the streams' positions every
//! `[checkpoint] flush_interval_ms` (one store write for all streams), and keeps the checkpoint
//! age and lag metrics fresh. The final write at shutdown is the caller's (`app`), after this
//! task ended: writes never overlap.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::error;

use super::store::{CheckpointError, Store};
use super::watermark::StreamCheckpoint;
use crate::observe::health::Health;
use crate::observe::metrics::StreamMetrics;

/// Writes every position that changed since its last write, in one store write. On error
/// nothing is lost: what it carried is written again next time.
///
/// Exactly-once into Kafka: the gate is sealed first (no event between its send and its
/// acknowledgement), so the positions taken cover exactly the events the write commits. If
/// the gate is broken (an event was sent and never acknowledged: the queue stopped), the open
/// transaction is aborted instead and nothing is written ([`CheckpointError::Abandoned`]).
pub async fn write_changed(store: &Store, checkpoints: &[Arc<StreamCheckpoint>]) -> Result<usize, CheckpointError> {
    let sealed = match store.gate() {
        Some(gate) => Some(gate.seal().await),
        None => None,
    };
    if sealed.as_ref().is_some_and(|s| s.broken()) {
        store.abandon().await;
        return Err(CheckpointError::Abandoned { what: store.describe() });
    }
    // The deltas: a full one copies the stream's whole index under its watermark's lock, on
    // the blocking pool, so no runtime thread does the copy (the queue's acknowledgements wait
    // on that lock only while it runs).
    // Nothing changed (kubecast idle): no task on the blocking pool either, whose threads then
    // end after their keep-alive and give their memory back.
    if !checkpoints.iter().any(|cp| cp.is_dirty()) {
        return store.write(&[]).await.map(|()| 0);
    }
    let full: Vec<bool> = checkpoints.iter().map(|cp| store.wants_full(&cp.key)).collect();
    let taking = checkpoints.to_vec();
    let (deltas, which) = tokio::task::spawn_blocking(move || {
        let mut deltas = Vec::new();
        let mut which = Vec::new();
        for (i, (cp, full)) in taking.iter().zip(full).enumerate() {
            if let Some(d) = cp.take(full) {
                deltas.push((cp.key.clone(), d));
                which.push(i);
            }
        }
        (deltas, which)
    })
    .await
    .expect("checkpoint take task");
    match store.write(&deltas).await {
        Ok(()) => Ok(deltas.len()),
        Err(e) => {
            for ((_, d), i) in deltas.iter().zip(which) {
                checkpoints[i].restore(d);
            }
            Err(e)
        }
    }
}

/// Exactly-once: how long commits may fail before the process is not ready: three commit
/// intervals, at least 30 s (a broker's leader election or a short pause passes unnoticed).
pub fn commit_alarm(every: Duration) -> Duration {
    (every * 3).max(Duration::from_secs(30))
}

/// Removes the commit-failing gauge of a `transactional.id` when dropped.
struct ForgetGauge(String);

impl Drop for ForgetGauge {
    fn drop(&mut self) {
        let label = crate::observe::metrics::TransactionalId { transactional_id: std::mem::take(&mut self.0) };
        crate::observe::metrics::get().commit_failing.remove(&label);
    }
}

/// Runs until `cancel` fires; `Err` when the store refuses this process for good (fenced by
/// a newer owner, another cluster's state). Exactly-once: while no commit has succeeded for
/// [`commit_alarm`], `health` says so with the last error (the events sent meanwhile are
/// invisible to `read_committed` consumers).
pub async fn run(
    store: Store,
    checkpoints: Vec<Arc<StreamCheckpoint>>,
    metrics: Vec<Arc<StreamMetrics>>,
    every: Duration,
    health: Arc<Health>,
    cancel: CancellationToken,
) -> Result<(), CheckpointError> {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When the checkpoints were last known to be stored as they are in memory.
    let mut current_at = std::time::Instant::now();
    let soon = store.commit_soon().unwrap_or_default();
    let exactly_once = store.gate().is_some();
    let alarm = commit_alarm(every);
    // Exactly-once: how long commits have failed, for `kubecast_exactly_once_commit_failing_seconds`.
    let failing_gauge = store.exactly_once_id().map(|id| {
        let label = crate::observe::metrics::TransactionalId { transactional_id: id.to_string() };
        let g = crate::observe::metrics::get().commit_failing.get_or_create(&label).clone();
        g.set(0.0);
        g
    });
    // Exactly-once: the events of a transaction whose destination refuses them, counted in
    // `kubecast_sink_refused` and named on `/readyz` until a commit succeeds.
    let mut refused: Option<crate::observe::refusals::RefusalHold> = None;
    // Gone with this persister (a shard given up): another replica reports it now.
    let _forget = store.exactly_once_id().map(|id| ForgetGauge(id.to_string()));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tick.tick() => {}
            // Exactly-once: the open transaction holds many events; commit it now.
            _ = soon.notified() => {}
        }
        match write_changed(&store, &checkpoints).await {
            Ok(_) => {
                current_at = std::time::Instant::now();
                drop(refused.take());
                health.set_state_problem(None);
                if let Some(g) = &failing_gauge {
                    g.set(0.0);
                }
            }
            Err(e) if e.is_fatal() => return Err(e),
            Err(e) => {
                if let CheckpointError::EventsRefused { refusal, destination, events, why, .. } = &e {
                    // The new hold first: the count never drops to zero between two refusals.
                    let hold = health.refusals().hold_many(destination, *refusal, why, *events);
                    drop(refused.replace(hold));
                }
                error!(error = %e, "checkpoints not written; retrying at the next interval");
                let failing = current_at.elapsed();
                if let Some(g) = &failing_gauge {
                    g.set(failing.as_secs_f64());
                }
                if exactly_once && failing >= alarm {
                    health.set_state_problem(Some(format!(
                        "state: no exactly-once commit succeeded for {} s (more than {} s): the events sent since are not visible to read_committed consumers yet; last error: {e}",
                        failing.as_secs(),
                        alarm.as_secs()
                    )));
                }
                // A full interval from now, also after a write that took longer than one (a
                // broker away: each attempt may wait 30 s with the gate sealed). Events flow
                // into the transaction meanwhile, up to its bound, instead of the next attempt
                // sealing the gate again at once.
                tick.reset();
            }
        }
        let g = crate::observe::metrics::get();
        for (cp, m) in checkpoints.iter().zip(&metrics) {
            g.checkpoint_age.get_or_create(&m.stream).set(current_at.elapsed().as_secs_f64());
            let lag = m.read.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(cp.acked_items());
            g.checkpoint_lag.get_or_create(&m.stream).set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }
}
