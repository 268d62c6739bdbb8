//! A replica without shards that holds the Lease, while the shard count changes from 1 (see
//! [`crate::coordination::count_guard`]): every retry period it looks at its group; when
//! replicas of another count joined after it, it gives the Lease up as at a stop (its streams
//! drain and write their last positions, then the Lease is released), and stands aside: it
//! keeps its member Lease, takes nothing and is not ready, until the rollout stops it.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::coordination::count_change::CountChange;
use crate::coordination::count_guard::{CountGuard, Seen};
use crate::observe::health::Health;

/// Looks at the group every `retry` until `done`; on a change that asks this replica to yield,
/// fires `stop` (the run drains as at shutdown) and returns the guard with `true`.
pub fn watch_while_held(
    mut guard: CountGuard,
    retry: Duration,
    stop: CancellationToken,
    done: CancellationToken,
) -> JoinHandle<(CountGuard, bool)> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = done.cancelled() => return (guard, false),
                _ = tokio::time::sleep(retry) => {}
            }
            let seen = tokio::select! {
                _ = done.cancelled() => return (guard, false),
                seen = guard.look() => seen,
            };
            if let Seen::Change(change @ CountChange::Yield { .. }) = seen {
                warn!(reason = %change.reason(1), "giving the lease up: another shard count takes over");
                stop.cancel();
                return (guard, true);
            }
        }
    })
}

/// After a yield: not ready and taking nothing, until `shutdown` (then the member Lease is
/// deleted). Should the other count be gone before that (a rollback of the rollout), this
/// process returns, so that it starts again and takes the Lease as a new standby would.
pub async fn stand_aside(mut guard: CountGuard, retry: Duration, health: &Health, shutdown: &CancellationToken) {
    loop {
        match guard.look().await {
            Seen::Change(change) => {
                let reason = change.reason(1);
                health.set_standby(Some(format!("standby: {reason}")));
                health.set_lease_problem(Some(reason));
            }
            Seen::Alone => {
                info!(
                    "the replicas of the other shard count are gone: this process stops, so that it starts again and takes the lease"
                );
                return;
            }
            Seen::Unknown(why) => warn!(why = %why, "the group's leases cannot be read; retrying"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(retry) => {}
        }
    }
    guard.leave().await;
}
