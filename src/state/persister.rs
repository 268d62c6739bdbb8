//! The persister: writes each stream's position when it changed, every
//! `[checkpoint] flush_interval_ms`, off the async workers, and keeps the checkpoint age and
//! lag metrics fresh. The final write at shutdown is the caller's (`app`).

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::error;

use super::watermark::StreamCheckpoint;
use crate::observe::metrics::StreamMetrics;

/// Runs until `cancel` fires.
pub async fn run(
    checkpoints: Vec<Arc<StreamCheckpoint>>,
    metrics: Vec<Arc<StreamMetrics>>,
    every: Duration,
    cancel: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When each checkpoint was last known to be on disk as it is in memory.
    let mut current_at = vec![std::time::Instant::now(); checkpoints.len()];
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (i, cp) in checkpoints.iter().enumerate() {
            if cancel.is_cancelled() {
                return; // the final writes are the shutdown's
            }
            let cp2 = cp.clone();
            // File I/O off the async workers.
            match tokio::task::spawn_blocking(move || cp2.persist_if_dirty()).await {
                Ok(Ok(_)) => current_at[i] = std::time::Instant::now(),
                Ok(Err(e)) => error!(error = %e, "checkpoint not written; retrying at the next interval"),
                Err(_) => {}
            }
            let m = &metrics[i];
            let g = crate::observe::metrics::get();
            g.checkpoint_age.get_or_create(&m.stream).set(current_at[i].elapsed().as_secs_f64());
            let lag = m.read.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(cp.acked_items());
            g.checkpoint_lag.get_or_create(&m.stream).set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }
}
