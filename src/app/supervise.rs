//! Supervision: waits until the token fires, a stream fails (a fatal reflector error) or the
//! queue stops (a fatal delivery error); the first error is the run's result, and any of them
//! cancels everything else.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::observe::health::Health;
use crate::observe::metrics::StreamMetrics;
use crate::state::store::CheckpointError;
use crate::state::watermark::StreamCheckpoint;

use super::error::RunError;
use crate::delivery::queue::DeliveryError;
use crate::observe::kube_error::in_words;
use crate::sink::Sink;
use crate::source::reflector::ReflectorError;

/// The first error of a run.
#[derive(Default)]
pub struct Outcome(Option<RunError>);

impl Outcome {
    /// Records `e` (the first one is the run's result) and stops everything.
    pub fn fail(&mut self, e: RunError, cancel: &CancellationToken) {
        error!(error = %e, "stopping");
        if self.0.is_none() {
            self.0 = Some(e);
        }
        cancel.cancel();
    }

    /// Whether the run stops because this process lost the lease.
    pub fn lease_lost(&self) -> bool {
        matches!(self.0, Some(RunError::LeaseLost { .. }))
    }

    /// Whether the run stops because the state store refuses this process (another owns it).
    pub fn fenced(&self) -> bool {
        matches!(&self.0, Some(RunError::Checkpoint(e)) if e.is_fatal())
    }

    pub fn into_result(self) -> Result<(), RunError> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Runs until `cancel` fires, a stream fails or the queue ends. Returns whether the queue ended.
pub async fn until_stopped(
    streams: &mut JoinSet<Result<(), ReflectorError>>,
    queue: &mut JoinHandle<Result<(), DeliveryError>>,
    lease: &mut Option<JoinHandle<Result<(), RunError>>>,
    persister: &mut Option<JoinHandle<Result<(), CheckpointError>>>,
    cancel: &CancellationToken,
    outcome: &mut Outcome,
) -> bool {
    loop {
        let persister_stopped = async {
            match persister.as_mut() {
                Some(handle) => handle.await,
                None => std::future::pending().await,
            }
        };
        let lease_lost = async {
            match lease.as_mut() {
                Some(handle) => handle.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            kept = lease_lost => {
                lease.take();
                match kept {
                    Ok(Err(e)) => outcome.fail(e, cancel),
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    _ => {}
                }
                return false;
            }
            stopped = persister_stopped => {
                persister.take();
                match stopped {
                    Ok(Err(e)) => outcome.fail(e.into(), cancel),
                    Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    _ => {}
                }
                return false;
            }
            Some(joined) = streams.join_next() => {
                if let Some(e) = task_error(joined) {
                    outcome.fail(e.into(), cancel);
                }
            }
            done = &mut *queue => {
                if let Err(e) = flatten(done) {
                    outcome.fail(e.into(), cancel);
                }
                return true;
            }
            _ = cancel.cancelled() => return false,
        }
    }
}

/// While kubecast is not ready, asks the apiserver for its version every few seconds: when it
/// cannot be reached, the log and `/readyz` name its address and the error (the streams only
/// say that their initial sync is not done). Once everything is ready it stops asking (the
/// watches then tell), and starts again when something is not ready.
pub async fn probe_apiserver(client: kube::Client, url: String, health: Arc<Health>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut reported: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if health.not_ready().is_empty() {
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(4), client.apiserver_version()).await {
            Ok(Ok(_)) => {
                if reported.take().is_some() {
                    info!(apiserver = %url, "apiserver reachable again");
                }
                health.set_apiserver_unreachable(None);
            }
            Ok(Err(kube::Error::Api(_))) => {
                // It answered (with an error status): reachable.
                if reported.take().is_some() {
                    info!(apiserver = %url, "apiserver reachable again");
                }
                health.set_apiserver_unreachable(None);
            }
            outcome => {
                let error = match outcome {
                    Ok(Err(e)) => in_words(&e).to_string(),
                    _ => "no answer within 4 s".to_string(),
                };
                let reason = format!("apiserver {url} not reachable: {error}");
                if reported.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    warn!(apiserver = %url, error = %error, "the apiserver cannot be reached; the streams retry with backoff");
                    reported = Some(std::time::Instant::now());
                }
                health.set_apiserver_unreachable(Some(reason));
            }
        }
    }
}

/// Reports streams whose checkpoint has not moved for `stall_after` while they have items
/// pending (shaped, not acknowledged): `/readyz` names the stream, the last failed event and
/// its reason, `kubecast_stream_stalled` is 1, and a warning says the same (then once a
/// minute while it lasts).
pub async fn watch_stalls(
    names: Vec<String>,
    checkpoints: Vec<Arc<StreamCheckpoint>>,
    metrics: Vec<Arc<StreamMetrics>>,
    health: Arc<Health>,
    stall_after: Duration,
    cancel: CancellationToken,
) {
    let now = std::time::Instant::now();
    let mut last = vec![(u64::MAX, now, None::<std::time::Instant>); checkpoints.len()];
    let mut tick = tokio::time::interval((stall_after / 4).clamp(Duration::from_millis(200), Duration::from_secs(5)));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        for (i, cp) in checkpoints.iter().enumerate() {
            let (acked, moved_at, reported) = &mut last[i];
            let now_acked = cp.acked_items();
            if now_acked != *acked {
                (*acked, *moved_at) = (now_acked, std::time::Instant::now());
            }
            let pending = metrics[i].read.load(std::sync::atomic::Ordering::Relaxed) > now_acked;
            let stalled_for = moved_at.elapsed();
            let gauge = crate::observe::metrics::get().stream_stalled.get_or_create(&metrics[i].stream).clone();
            if pending && stalled_for >= stall_after {
                let (event_id, why) = metrics[i].last_failure().unwrap_or_else(|| {
                    (
                        "?".into(),
                        "no send failed yet: the sink is slow or the event waits behind its object's earlier one"
                            .into(),
                    )
                });
                let reason = format!(
                    "stream {}: checkpoint stalled for {} s behind items not yet delivered (last failed event {event_id}: {why})",
                    names[i],
                    stalled_for.as_secs()
                );
                if reported.is_none_or(|at| at.elapsed() >= Duration::from_secs(60)) {
                    warn!(stream = %names[i], stalled_seconds = stalled_for.as_secs(), event_id = %event_id, reason = %why, "stream stalled: its checkpoint has not moved while events are pending");
                    *reported = Some(std::time::Instant::now());
                }
                gauge.set(1);
                health.set_stalled(i, Some(reason));
            } else if reported.take().is_some() || gauge.get() != 0 {
                info!(stream = %names[i], "stream moves again");
                gauge.set(0);
                health.set_stalled(i, None);
            }
        }
    }
}

/// Keeps the sink's reachability fresh for readiness, also when no events flow.
pub async fn probe_broker(sink: Arc<Sink>, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let sink = sink.clone();
        let _ = tokio::task::spawn_blocking(move || sink.kafka().map(|k| k.probe(Duration::from_secs(4)))).await;
    }
}

/// The queue task's result; a panic is passed on.
pub fn flatten(done: Result<Result<(), DeliveryError>, tokio::task::JoinError>) -> Result<(), DeliveryError> {
    match done {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Ok(()),
    }
}

/// A stream task's error; a panic is passed on.
pub fn task_error(joined: Result<Result<(), ReflectorError>, tokio::task::JoinError>) -> Option<ReflectorError> {
    match joined {
        Ok(r) => r.err(),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}
