//! `[coordination] shards` above 1: this replica runs the shards it holds, each as its own set
//! of streams (`Pipeline::for_shard`), its own sink connection, state (positions and, with
//! Kafka, `transactional.id`) and Lease (`<lease_name>-<i>-of-<N>`), through `active.rs` as an
//! unsharded run does once.
//!
//! Every retry period the coordinator renews this replica's member Lease, lists the group's
//! Leases (`coordination::members`), and decides what to take and give up
//! (`coordination::assignment::decide`): free shards are taken (the least busy replicas first), and
//! the busiest replica gives one up when another holds two fewer, or when it holds more than
//! `ceil(N / R)`. Giving up is a clean stop of that shard: its streams drain, its last
//! checkpoint is written, then its Lease is released and the next holder takes it at once. A
//! shard whose Lease is lost (this replica paused past its renew deadline, or fenced by the
//! store) stops at once without writing; the replica goes on with the others. Any other
//! failure of a shard stops the replica, as it stops an unsharded run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::active::{self, Active, Held};
use super::error::RunError;
use super::preflight::{check_dead_letter, check_nats_streams};
use super::wiring::Pipeline;
use super::{leadership, supervise};
use crate::config::Config;
use crate::coordination::assignment::{View, decide};
use crate::coordination::count_change::{CountChange, count_change};
use crate::coordination::lease::{Attempt, Elector};
use crate::coordination::members::{Members, shard_labels};
use crate::model::Shard;
use crate::observe::admin;
use crate::observe::health::Health;
use crate::observe::metrics::ShardLabel;
use crate::sink::Sink;
use crate::source::client::ApiLimiter;
use crate::state::store::CheckpointError;

/// What every shard of this replica shares.
struct Shared {
    config: Config,
    client: kube::Client,
    limiter: ApiLimiter,
    /// Where each shard's Lease is kept (a thread of its own).
    keepers: leadership::Keepers,
    /// The process's health; each shard's streams report to a health of their own under it.
    health: Arc<Health>,
}

/// Runs this replica's part of a sharded deployment until `shutdown` fires or a shard fails.
pub async fn run(
    config: Config,
    client: kube::Client,
    apiserver: String,
    limiter: ApiLimiter,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let cfg = config.coordination.clone();
    let count = cfg.shards;
    let identity = cfg.identity();
    let health = Health::sharded();
    health.set_standby(Some(format!("standby: holding none of the {count} shards yet")));
    let cancel = shutdown.child_token();
    // Answers until every shard drained and `run` returns.
    let admin_stop = CancellationToken::new();
    let _admin = admin_stop.clone().drop_guard();
    admin::serve(&config.admin, health.clone(), admin_stop).await?;
    tokio::spawn(supervise::probe_apiserver(client.clone(), apiserver, health.clone(), cancel.clone()));
    let m = crate::observe::metrics::get();
    for s in Shard::all(count) {
        m.shard_held.get_or_create(&ShardLabel { shard: s.label() }).set(0);
    }
    m.leader.set(0);
    info!(shards = count, identity = %identity, lease = %format!("{}/{}-<i>-of-{count}", cfg.namespace(), cfg.lease_name), "sharded: taking a share of the shards");

    let keepers = leadership::Keepers::start(&config.cluster).await?;
    let shared = Arc::new(Shared { config, client: client.clone(), limiter, keepers, health: health.clone() });
    let floor = super::store::epoch_floor(&shared.config);
    let elector =
        |s: Shard| Elector::for_shard(client.clone(), &cfg, s, shard_labels(&cfg)).with_epoch_floor(floor.clone());
    let mut electors: BTreeMap<Shard, Elector> = Shard::all(count).map(|s| (s, elector(s))).collect();
    let mut members = Members::new(client.clone(), &cfg, identity.clone());
    let mut units: JoinSet<(Shard, Result<(), RunError>)> = JoinSet::new();
    let mut running: BTreeMap<Shard, CancellationToken> = BTreeMap::new();
    let mut releasing: Option<Shard> = None;
    let retry = Duration::from_secs(cfg.retry_period_seconds.into());
    let mut failure: Option<RunError> = None;
    // Each call to the apiserver gets a retry period: a connection that stopped answering must
    // not hold up the shards' handovers, the noticing of a failed shard, or the stop.
    let no_answer = || format!("no answer from the apiserver within {retry:?}");
    while failure.is_none() && !cancel.is_cancelled() {
        // Why the Leases cannot be read or taken in this round: not ready while it lasts.
        let mut problem = None;
        match tokio::time::timeout(retry, members.heartbeat()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(error = %e, "this replica's member lease not renewed; retrying");
                problem = Some(format!("the lease cannot be read or taken: {e}"));
            }
            Err(_) => warn!("this replica's member lease not renewed: {}; retrying", no_answer()),
        }
        let listed = match tokio::time::timeout(retry, members.list()).await {
            Ok(listed) => listed.map_err(|e| e.to_string()),
            Err(_) => Err(no_answer()),
        };
        match listed {
            Err(e) => {
                warn!(error = %e, "the shards' leases cannot be listed; retrying");
                problem = Some(format!("the lease cannot be read or taken: {e}"));
            }
            Ok(group) => 'decide: {
                let leases = group.shards.iter().map(|(name, l)| {
                    let holder = l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).filter(|h| !h.is_empty());
                    (name.as_str(), holder)
                });
                let change = count_change(
                    &identity,
                    group.joined,
                    count,
                    &cfg.lease_name,
                    &group.other_counts,
                    leases,
                    &group.members,
                );
                if let Some(change) = change {
                    if matches!(change, CountChange::Yield { .. }) && !running.is_empty() {
                        warn!(reason = %change.reason(count), "giving every shard up: another shard count takes over");
                        for token in running.values() {
                            token.cancel();
                        }
                    }
                    problem = Some(change.reason(count));
                    break 'decide;
                }
                let holders = Shard::all(count)
                    .map(|s| match electors.get_mut(&s) {
                        None => Some(identity.clone()), // running here
                        // A Lease that still names this replica while the shard does not run
                        // here (lost at a missed renew deadline, or taken by an attempt that
                        // timed out after its write) is free: taken back like any other.
                        Some(e) => e
                            .observe(group.shards.get(&s.lease_name(&cfg.lease_name)))
                            .filter(|holder| *holder != identity),
                    })
                    .collect();
                // The replicas of another count take none of this count's shards.
                let mut members = group.members;
                for o in &group.other_counts {
                    members.remove(&o.identity);
                }
                let mut view = View { members, holders };
                view.members.insert(identity.clone());
                let decision = decide(&identity, count, &view);
                if let Some(s) = decision.release
                    && releasing.is_none()
                    && let Some(token) = running.get(&s)
                {
                    info!(shard = %s, replicas = view.members.len(), "giving this shard up to a less busy replica: draining it, then releasing its lease");
                    token.cancel();
                    releasing = Some(s);
                }
                for s in decision.acquire {
                    let Some(mut e) = electors.remove(&s) else { continue };
                    match tokio::time::timeout(retry, e.try_acquire_or_renew()).await {
                        Ok(Ok(Attempt::Held { epoch })) => {
                            info!(shard = %s, lease = %e.lease(), epoch, "holding the shard's lease: running its streams");
                            let token = cancel.child_token();
                            running.insert(s, token.clone());
                            units.spawn(run_shard(shared.clone(), s, e, epoch, token));
                        }
                        Ok(Ok(_)) => {
                            electors.insert(s, e);
                        }
                        Ok(Err(err)) => {
                            warn!(shard = %s, error = %err, "the shard's lease cannot be taken; retrying");
                            problem = Some(format!("the lease cannot be read or taken: {err}"));
                            electors.insert(s, e);
                        }
                        Err(_) => {
                            electors.insert(s, e);
                        }
                    }
                }
            }
        }
        health.set_lease_problem(problem);
        set_standby(&health, &running, count);
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = tokio::time::sleep(retry) => {}
            Some(joined) = units.join_next() => {
                let (s, result) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
                failure = ended(s, result, &health);
                running.remove(&s);
                electors.insert(s, elector(s));
                if releasing == Some(s) {
                    releasing = None;
                }
                set_standby(&health, &running, count);
            }
        }
    }
    // Stop every shard (each drains and gives its Lease up), then leave the group.
    health.set_shutting_down();
    cancel.cancel();
    while let Some(joined) = units.join_next().await {
        let (s, result) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
        if let Some(e) = ended(s, result, &health)
            && failure.is_none()
        {
            failure = Some(e);
        }
    }
    if tokio::time::timeout(retry, members.leave()).await.is_err() {
        warn!("this replica's member lease not deleted: {} (it expires)", no_answer());
    }
    info!("kubecast stopped");
    failure.map_or(Ok(()), Err)
}

/// A shard stopped: given up or lost (the replica goes on), or failed (returned: the replica
/// stops).
fn ended(s: Shard, result: Result<(), RunError>, health: &Health) -> Option<RunError> {
    health.set_shard(s, None);
    let label = ShardLabel { shard: s.label() };
    crate::observe::metrics::get().shard_held.get_or_create(&label).set(0);
    match result {
        Ok(()) => {
            info!(shard = %s, "shard stopped; its lease is given up");
            None
        }
        Err(e) if owner_lost(&e) => {
            warn!(shard = %s, error = %e, "shard lost: stopped at once, its state is left to the next holder");
            None
        }
        Err(e) => {
            error!(shard = %s, error = %e, "shard failed: stopping this replica");
            Some(e)
        }
    }
}

/// The shard's Lease was lost, or its store refused this process: another replica owns it.
fn owner_lost(e: &RunError) -> bool {
    matches!(
        e,
        RunError::LeaseLost { .. }
            | RunError::Checkpoint(CheckpointError::Fenced { .. } | CheckpointError::Superseded { .. })
    )
}

fn set_standby(health: &Health, running: &BTreeMap<Shard, CancellationToken>, count: u32) {
    let m = crate::observe::metrics::get();
    m.leader.set(i64::from(!running.is_empty()));
    health.set_standby(running.is_empty().then(|| format!("standby: holding none of the {count} shards")));
}

/// One shard held: its Lease kept, its sink opened, its streams run until `cancel` (given up
/// or shutdown) or a failure; its Lease released last.
async fn run_shard(
    shared: Arc<Shared>,
    shard: Shard,
    elector: Elector,
    epoch: i32,
    cancel: CancellationToken,
) -> (Shard, Result<(), RunError>) {
    let cfg = shared.config.coordination.clone();
    let writer = elector.identity().to_string();
    let (stop, lost) = (CancellationToken::new(), CancellationToken::new());
    let tenure = leadership::Tenure::new(&cfg, lost.clone());
    let keeper = shared.keepers.keep(elector, cfg, epoch, stop.clone(), tenure.clone());
    let pipeline = Pipeline::for_shard(shared.config.clone(), shard);
    let opened = async {
        let config = &pipeline.config;
        let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await?);
        check_nats_streams(config, &shared.client, &sink).await?;
        check_dead_letter(config, &sink).await?;
        Ok::<_, RunError>(sink)
    };
    // Stopped before its sink is open: nothing ran, the Lease is given up at once.
    let opened = tokio::select! {
        opened = opened => Some(opened),
        _ = cancel.cancelled() => None,
    };
    let sink = match opened {
        Some(Ok(sink)) => sink,
        stopped_or_failed => {
            stop.cancel();
            let _ = keeper.await;
            return (shard, stopped_or_failed.transpose().map(drop));
        }
    };
    let health = Health::new(pipeline.stream_names());
    health.set_sink(sink.connected(), sink.unreachable_cause());
    shared.health.set_shard(shard, Some(health.clone()));
    if sink.kafka().is_some() {
        tokio::spawn(supervise::probe_broker(sink.clone(), cancel.clone()));
    }
    // The destinations of this shard's streams, looked up as at the start of an unsharded run.
    tokio::spawn({
        let (config, client, sink, health, cancel) =
            (pipeline.config.clone(), shared.client.clone(), sink.clone(), health.clone(), cancel.clone());
        async move {
            tokio::select! {
                () = super::connect_check::watch_at_start(&config, &client, &sink, &health) => {}
                () = cancel.cancelled() => {}
            }
        }
    });
    let active = Active { client: &shared.client, limiter: &shared.limiter, sink, health: &health, cancel };
    let held = Held { epoch: Some(i64::from(epoch)), writer, keeper: Some(keeper), stop, lost, tenure };
    let streams = pipeline.stream_names();
    let result = active::run(pipeline, active, held).await;
    // Its streams run elsewhere now: their gauges here would be stale (a stall or a checkpoint
    // age frozen at their last value, alerting on a replica that no longer runs them).
    crate::observe::metrics::forget_stream_gauges(&streams);
    (shard, result)
}
