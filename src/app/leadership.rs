//! `[coordination]`: wait as a standby until this process holds the Lease, then keep it; a
//! holder that loses it (another took it over, or it could not renew within the deadline)
//! stops at once (see [`crate::coordination::lease`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::error::RunError;
use super::runtime;
use crate::coordination::count_guard::{CountGuard, Seen};
use crate::coordination::lease::{Attempt, CoordinationConfig, Elector};
use crate::observe::health::Health;
use crate::source::client::{self, ClusterConfig};

/// Waits until this process holds the Lease; `None` when shutdown came first. Meanwhile
/// `/readyz` says who holds it. A standby tries every retry period, and at once when its
/// watch on the Lease shows it given up (a clean stop of the holder), so a handover does not
/// wait for the next retry.
///
/// With `guard` (no shards), it takes the Lease only while no change of the shard count asks
/// it not to (see [`CountGuard`]); not ready meanwhile.
pub async fn wait_for_lease(
    elector: &mut Elector,
    cfg: &CoordinationConfig,
    health: &Health,
    mut guard: Option<&mut CountGuard>,
    cancel: &CancellationToken,
) -> Result<Option<i32>, RunError> {
    let retry = Duration::from_secs(cfg.retry_period_seconds.into());
    let mut last_holder = None;
    let mut last_seen = None;
    let mut watch = elector.watch();
    loop {
        if let Some(guard) = guard.as_deref_mut() {
            let seen = tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                seen = guard.look() => seen,
            };
            let changed = last_seen.as_ref() != Some(&seen);
            match &seen {
                Seen::Change(change) => {
                    let reason = change.reason(1);
                    if changed {
                        warn!(reason = %reason, "not taking the lease: the shard count is changing");
                    }
                    health.set_standby(Some(format!("standby: {reason}")));
                    health.set_lease_problem(Some(reason));
                    last_seen = Some(seen);
                    tokio::select! {
                        _ = cancel.cancelled() => return Ok(None),
                        _ = tokio::time::sleep(retry) => {}
                    }
                    continue;
                }
                Seen::Unknown(why) if changed => warn!(
                    why = %why,
                    "the replicas of other shard counts cannot be seen; taking the lease as before (a change of [coordination] shards from or to 1 is then not guarded: grant get, list, create, update and delete on leases in the lease namespace)"
                ),
                Seen::Unknown(_) | Seen::Alone => {}
            }
            last_seen = Some(seen);
        }
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            a = tokio::time::timeout(retry, elector.try_acquire_or_renew()) => a,
        };
        let Ok(attempt) = attempt else {
            // No answer within a retry period: while it lasts no replica can take over either.
            warn!(lease = %elector.lease(), "the lease got no answer from the apiserver within {retry:?}; retrying");
            health.set_lease_problem(Some(format!(
                "the lease cannot be read or taken: no answer from the apiserver within {retry:?}"
            )));
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = tokio::time::sleep(retry) => {}
            }
            continue;
        };
        match attempt {
            Ok(Attempt::Held { epoch }) => {
                info!(lease = %elector.lease(), identity = elector.identity(), epoch, "holding the lease: this process is the active one");
                health.set_standby(None);
                health.set_lease_problem(None);
                set_leader(elector, true, epoch);
                return Ok(Some(epoch));
            }
            Ok(Attempt::Conflict) => {}
            Ok(Attempt::Other { holder }) => {
                if last_holder.as_ref() != Some(&holder) {
                    info!(lease = %elector.lease(), holder = %holder, "standby: another process holds the lease");
                    last_holder = Some(holder.clone());
                }
                health.set_standby(Some(format!("standby: lease {} held by {holder}", elector.lease())));
                health.set_lease_problem(None);
            }
            Err(e) => {
                warn!(error = %e, "the lease cannot be read or taken; retrying");
                health.set_standby(Some(format!("standby: {e}")));
                // Not ready: no replica may ever become the active one (a forbidden Lease).
                health.set_lease_problem(Some(format!("the lease cannot be read or taken: {e}")));
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(retry) => {}
            _ = watch.released(retry) => debug!(lease = %elector.lease(), "the lease was given up: trying now"),
        }
    }
}

/// Where the Lease keepers run: a thread of their own ([`runtime::lease_thread`]) and a kube
/// client made on it, so that neither a busy runtime worker nor the main client's connections
/// stand between a keeper and its renewals.
#[derive(Clone)]
pub struct Keepers {
    thread: tokio::runtime::Handle,
    client: kube::Client,
}

impl Keepers {
    /// Starts the keepers' thread (once per process) and makes their client there.
    pub async fn start(cluster: &ClusterConfig) -> Result<Self, RunError> {
        let thread = runtime::lease_thread().map_err(RunError::LeaseThread)?;
        let cluster = cluster.clone();
        let made = thread.spawn(async move { client::client(&cluster).await });
        let (client, _) = made.await.map_err(|e| RunError::LeaseThread(std::io::Error::other(e.to_string())))??;
        Ok(Self { thread, client })
    }

    /// Keeps `elector`'s Lease ([`keep_lease`]) on the keepers' thread, through their client.
    pub fn keep(
        &self,
        elector: Elector,
        cfg: CoordinationConfig,
        epoch: i32,
        stop: CancellationToken,
        tenure: Tenure,
    ) -> JoinHandle<Result<(), RunError>> {
        let elector = elector.with_client(self.client.clone());
        self.thread.spawn(keep_lease(elector, cfg, epoch, stop, tenure))
    }
}

/// Renews the Lease every retry period until `stop` (then gives it up, so a standby takes
/// over at once). Returns an error as soon as the Lease is lost: another process holds it, it
/// was taken in another epoch meanwhile, or no renewal succeeded within the renew deadline
/// (counted from the start of the last successful attempt, and checked before each attempt,
/// so a process waking up from a pause notices without a round trip). `lost` is cancelled
/// then too, for a drain in progress.
pub async fn keep_lease(
    mut elector: Elector,
    cfg: CoordinationConfig,
    epoch: i32,
    stop: CancellationToken,
    tenure: Tenure,
) -> Result<(), RunError> {
    let retry = Duration::from_secs(cfg.retry_period_seconds.into());
    let deadline = tenure.deadline;
    let lost_token = tenure.lost.clone();
    let mut renewed = Instant::now();
    tenure.renewed(renewed);
    let result = loop {
        // A retry period, or less when the renew deadline comes first (after failed attempts):
        // the loss is noticed at the deadline, not up to a retry period after it.
        let wait = retry.min(deadline.saturating_sub(renewed.elapsed()));
        tokio::select! {
            _ = stop.cancelled() => {
                let _ = tokio::time::timeout(retry, elector.release()).await;
                set_leader(&elector, false, 0);
                return Ok(());
            }
            _ = tokio::time::sleep(wait) => {}
        }
        let left = deadline.saturating_sub(renewed.elapsed());
        if left.is_zero() {
            break Err(lost(&elector, format!("not renewed for {} s (renew_deadline_seconds)", deadline.as_secs())));
        }
        let started = Instant::now();
        match tokio::time::timeout(retry.min(left), elector.try_acquire_or_renew()).await {
            Ok(Ok(Attempt::Held { epoch: now })) if now == epoch => {
                renewed = started;
                tenure.renewed(started);
                set_leader(&elector, true, epoch);
            }
            Ok(Ok(Attempt::Held { epoch: now })) => {
                break Err(lost(&elector, format!("held by another process meanwhile (epoch {epoch} -> {now})")));
            }
            Ok(Ok(Attempt::Other { holder })) => break Err(lost(&elector, format!("{holder} holds it now"))),
            Ok(Ok(Attempt::Conflict)) => warn!("lease changed during the renewal; retrying until the renew deadline"),
            Ok(Err(e)) => warn!(error = %e, "lease not renewed; retrying until the renew deadline"),
            Err(_) => warn!("lease renewal got no answer in time; retrying until the renew deadline"),
        }
    };
    set_leader(&elector, false, 0);
    lost_token.cancel();
    result
}

/// Whether this process holds the Lease right now, as far as it can know: the keeper has not
/// reported it lost, and its last successful renewal started within the renew deadline (no
/// other process can have taken it since). Read by the Kafka transaction before it takes its
/// `transactional.id` over again.
#[derive(Clone)]
pub struct Tenure {
    origin: Instant,
    /// Milliseconds from `origin` to the start of the last successful renewal.
    renewed_ms: Arc<AtomicU64>,
    deadline: Duration,
    /// Cancelled when the Lease is lost (or the store fenced this process).
    pub lost: CancellationToken,
}

impl Tenure {
    pub fn new(cfg: &CoordinationConfig, lost: CancellationToken) -> Self {
        Self {
            origin: Instant::now(),
            renewed_ms: Arc::default(),
            deadline: Duration::from_secs(cfg.renew_deadline_seconds.into()),
            lost,
        }
    }

    fn renewed(&self, at: Instant) {
        let ms = u64::try_from(at.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX);
        self.renewed_ms.store(ms, Ordering::SeqCst);
    }

    pub fn held(&self) -> bool {
        let renewed = self.origin + Duration::from_millis(self.renewed_ms.load(Ordering::SeqCst));
        !self.lost.is_cancelled() && renewed.elapsed() < self.deadline
    }
}

/// Runs `work` while this process holds the Lease: when the keeper ends first (it lost the
/// Lease), `work` is dropped at once, wherever it waits, and the keeper's error is returned
/// (the keeper is then taken out of `keeper`). Without `[coordination]` (no keeper), `work`
/// just runs.
pub async fn while_held<T>(
    keeper: &mut Option<JoinHandle<Result<(), RunError>>>,
    work: impl Future<Output = Result<T, RunError>>,
) -> Result<T, RunError> {
    let mut work = std::pin::pin!(work);
    let Some(handle) = keeper.as_mut() else { return work.await };
    let kept = tokio::select! {
        biased;
        kept = handle => kept,
        done = &mut work => return done,
    };
    keeper.take();
    match kept {
        Ok(Err(e)) => Err(e),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // Given up on purpose (shutdown), which `work` notices itself.
        _ => work.await,
    }
}

fn lost(elector: &Elector, why: String) -> RunError {
    error!(lease = %elector.lease(), why = %why, "lost the lease: stopping at once");
    RunError::LeaseLost { lease: elector.lease(), why }
}

/// `kubecast_leader` and `kubecast_lease_epoch`; a shard's Lease: `kubecast_shard_held`.
fn set_leader(elector: &Elector, leader: bool, epoch: i32) {
    let m = crate::observe::metrics::get();
    if let Some(shard) = elector.shard() {
        let label = crate::observe::metrics::ShardLabel { shard: shard.label() };
        m.shard_held.get_or_create(&label).set(i64::from(leader));
        return;
    }
    m.leader.set(i64::from(leader));
    if leader {
        m.lease_epoch.set(i64::from(epoch));
    }
}

/// The standby's health reason while it waits; `None` for a process without coordination.
/// A Lease it creates starts above the epochs of the state store (`floor`).
pub fn elector(
    client: &kube::Client,
    cfg: &CoordinationConfig,
    health: &Arc<Health>,
    floor: Option<crate::coordination::lease::EpochFloor>,
) -> Option<Elector> {
    if !cfg.enabled {
        return None;
    }
    health.set_standby(Some("standby: waiting for the lease".into()));
    Some(Elector::new(client.clone(), cfg).with_epoch_floor(floor).with_labels(CountGuard::labels(cfg)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Sets its flag when dropped: the work was abandoned.
    struct Dropped(Arc<AtomicBool>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn lost() -> RunError {
        RunError::LeaseLost { lease: "ns/l".into(), why: "another holds it".into() }
    }

    #[tokio::test]
    async fn work_is_abandoned_as_soon_as_the_keeper_reports_the_lease_lost() {
        let dropped = Arc::new(AtomicBool::new(false));
        let guard = Dropped(dropped.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let mut keeper = Some(tokio::spawn(async move {
            let _ = rx.await;
            Err(lost())
        }));
        let work = async move {
            let _guard = guard;
            tx.send(()).unwrap(); // the Lease is lost while the work waits
            std::future::pending::<Result<(), RunError>>().await
        };
        let e = while_held(&mut keeper, work).await.unwrap_err();
        assert!(matches!(e, RunError::LeaseLost { .. }), "{e}");
        assert!(dropped.load(Ordering::SeqCst), "the work was dropped");
        assert!(keeper.is_none(), "the finished keeper is taken out");
    }

    #[tokio::test]
    async fn work_runs_to_its_end_while_the_lease_is_held_or_without_a_keeper() {
        let mut keeper = Some(tokio::spawn(std::future::pending::<Result<(), RunError>>()));
        assert_eq!(while_held(&mut keeper, async { Ok(7) }).await.unwrap(), 7);
        assert!(keeper.is_some(), "still keeping the Lease");
        // A keeper stopped on purpose (shutdown): the work goes on and says itself how it ended.
        let mut stopped = Some(tokio::spawn(async { Ok(()) }));
        while !stopped.as_ref().unwrap().is_finished() {
            tokio::task::yield_now().await;
        }
        assert_eq!(while_held(&mut stopped, async { Ok(8) }).await.unwrap(), 8);
        assert!(stopped.is_none(), "the finished keeper is taken out");
        assert_eq!(while_held(&mut None, async { Ok(9) }).await.unwrap(), 9);
    }
}
