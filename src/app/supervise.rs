//! Supervision: waits until the token fires, a stream fails (a fatal reflector error) or the
//! queue stops (a fatal delivery error); the first error is the run's result, and any of them
//! cancels everything else.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::observe::health::Health;

use super::error::RunError;
use crate::delivery::queue::DeliveryError;
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

    pub fn into_result(self) -> Result<(), RunError> {
        self.0.map_or(Ok(()), Err)
    }
}

/// Runs until `cancel` fires, a stream fails or the queue ends. Returns whether the queue ended.
pub async fn until_stopped(
    streams: &mut JoinSet<Result<(), ReflectorError>>,
    queue: &mut JoinHandle<Result<(), DeliveryError>>,
    cancel: &CancellationToken,
    outcome: &mut Outcome,
) -> bool {
    loop {
        tokio::select! {
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
            Ok(Err(e)) if matches!(e, kube::Error::Api(_)) => health.set_apiserver_unreachable(None),
            outcome => {
                let error = match outcome {
                    Ok(Err(e)) => e.to_string(),
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
