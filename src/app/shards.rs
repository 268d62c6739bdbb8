//! `[coordination] shards` above 1: this replica runs the shards it holds, each as its own set
//! of streams (`Pipeline::for_shard`), its own sink connection, state (positions and, with
//! Kafka, `transactional.id`) and Lease (`<lease_name>-<i>-of-<N>`), through `active.rs` as an
//! unsharded run does once.
//!
//! Every retry period the coordinator renews this replica's member Lease, lists the group's
//! Leases (`coordination::members`), and decides what to take and give up
//! (`coordination::assignment::decide`): free shards are taken (the least busy replicas first), and
//! the busiest replica gives one up when another holds two fewer, or when it holds more than
//! `ceil(N / R)`. A replica takes nothing in its first round: one retry period after its member
//! Lease is written, the replicas that started with it are in its view. Giving up is a clean stop of that shard: its streams drain, its last
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
use super::bounds::Bounds;
use super::error::RunError;
use super::preflight::{check_dead_letter, check_nats_streams};
use super::wiring::Pipeline;
use super::{leadership, supervise};
use crate::config::Config;
use crate::coordination::assignment::{Decision, Seen, View, decide};
use crate::coordination::count_change::CountChange;
use crate::coordination::lease::{Attempt, CoordinationConfig, Elector, EpochFloor};
use crate::coordination::members::{Group, Members, shard_labels};
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
    /// The process's memory bounds, shared by its shards.
    bounds: Bounds,
}

/// Runs this replica's part of a sharded deployment until `shutdown` fires or a shard fails:
/// every retry period one round of [`Coordinator`] steps (membership, decision, apply,
/// readiness), then a wait for the next round, a shard that ended, or the stop.
pub async fn run(
    config: Config,
    client: kube::Client,
    apiserver: String,
    limiter: ApiLimiter,
    shutdown: CancellationToken,
) -> Result<(), RunError> {
    let count = config.coordination.shards;
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
    let keepers = leadership::Keepers::start(&config.cluster).await?;
    let bounds = Bounds::of(&config);
    let shared = Arc::new(Shared { config, client, limiter, keepers, health, bounds });
    let mut c = Coordinator::new(shared, cancel);
    while c.failure.is_none() && !c.cancel.is_cancelled() {
        let problem = match c.membership().await {
            Err(problem) => Some(problem),
            Ok((group, heartbeat_problem)) => match c.decision(group) {
                Err(count_change) => Some(count_change),
                Ok(decision) => c.apply(decision).await.or(heartbeat_problem),
            },
        };
        c.readiness(problem);
        c.wait().await;
    }
    c.stop().await
}

/// This replica's coordinator: the shards it runs, the Leases it watches, the shard being given
/// up.
struct Coordinator {
    shared: Arc<Shared>,
    cfg: CoordinationConfig,
    identity: String,
    /// Each call to the apiserver gets a retry period: a connection that stopped answering
    /// must not hold up the shards' handovers, the noticing of a failed shard, or the stop.
    retry: Duration,
    floor: Option<EpochFloor>,
    /// The shards not running here, each with the elector that watches its Lease.
    electors: BTreeMap<Shard, Elector>,
    members: Members,
    units: JoinSet<(Shard, Result<(), RunError>)>,
    /// The shards running here, each with the token that stops it.
    running: BTreeMap<Shard, CancellationToken>,
    /// The shard being given up (one at a time).
    releasing: Option<Shard>,
    /// Whether a round has passed since this replica's member Lease was first written: it takes
    /// no shard before, so that the replicas starting with it (a rollout, a scale-up, a shard
    /// count change) are in its view and it takes its share, not every shard, only to hand most
    /// of them over again after listing them.
    joined: bool,
    failure: Option<RunError>,
    cancel: CancellationToken,
}

impl Coordinator {
    fn new(shared: Arc<Shared>, cancel: CancellationToken) -> Self {
        let cfg = shared.config.coordination.clone();
        let (count, identity) = (cfg.shards, cfg.identity());
        info!(shards = count, identity = %identity, lease = %format!("{}/{}-<i>-of-{count}", cfg.namespace(), cfg.lease_name), "sharded: taking a share of the shards");
        let floor = super::store::epoch_floor(&shared.config);
        let members = Members::new(shared.client.clone(), &cfg, identity.clone());
        let mut c = Coordinator {
            retry: Duration::from_secs(cfg.retry_period_seconds.into()),
            electors: BTreeMap::new(),
            members,
            units: JoinSet::new(),
            running: BTreeMap::new(),
            releasing: None,
            joined: false,
            failure: None,
            shared,
            cfg,
            identity,
            floor,
            cancel,
        };
        c.electors = Shard::all(count).map(|s| (s, c.elector(s))).collect();
        c
    }

    fn elector(&self, s: Shard) -> Elector {
        Elector::for_shard(self.shared.client.clone(), &self.cfg, s, shard_labels(&self.cfg))
            .with_epoch_floor(self.floor.clone())
    }

    fn no_answer(&self) -> String {
        format!("no answer from the apiserver within {:?}", self.retry)
    }

    /// Step 1, membership: renews this replica's member Lease and lists the group's Leases.
    /// `Err`: why the Leases cannot be listed; with the group, why the member Lease was not
    /// renewed, if it was not.
    async fn membership(&mut self) -> Result<(Group, Option<String>), String> {
        let mut problem = None;
        match tokio::time::timeout(self.retry, self.members.heartbeat()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(error = %e, "this replica's member lease not renewed; retrying");
                problem = Some(format!("the lease cannot be read or taken: {e}"));
            }
            Err(_) => warn!("this replica's member lease not renewed: {}; retrying", self.no_answer()),
        }
        let listed = match tokio::time::timeout(self.retry, self.members.list()).await {
            Ok(listed) => listed.map_err(|e| e.to_string()),
            Err(_) => Err(self.no_answer()),
        };
        match listed {
            Ok(group) => Ok((group, problem)),
            Err(e) => {
                warn!(error = %e, "the shards' leases cannot be listed; retrying");
                Err(format!("the lease cannot be read or taken: {e}"))
            }
        }
    }

    /// Step 2, decision: what to take and give up, from the group's Leases. `Err` while
    /// replicas of another shard count run (see `count_change`): then this one takes nothing,
    /// and gives everything up if its count yields.
    fn decision(&mut self, group: Group) -> Result<Decision, String> {
        let count = self.cfg.shards;
        let change = group.count_change(&self.identity, count, &self.cfg.lease_name);
        if let Some(change) = change {
            if matches!(change, CountChange::Yield { .. }) && !self.running.is_empty() {
                warn!(reason = %change.reason(count), "giving every shard up: another shard count takes over");
                self.running.values().for_each(CancellationToken::cancel);
            }
            return Err(change.reason(count));
        }
        let seen: Vec<Seen> = Shard::all(count)
            .map(|s| match self.electors.get_mut(&s) {
                None => Seen::RunningHere,
                Some(e) => Seen::Lease(e.observe(group.shards.get(&s.lease_name(&self.cfg.lease_name)))),
            })
            .collect();
        let others = group.other_counts.iter().map(|o| o.identity.as_str());
        let view = View::of(&self.identity, group.members.clone(), others, seen);
        let mut decision = decide(&self.identity, count, &view);
        if !self.joined {
            self.joined = true;
            if !decision.acquire.is_empty() {
                info!(
                    replicas = view.members.len(),
                    "joined the group: taking shards from the next round on, with the replicas that start beside this one in view"
                );
                decision.acquire.clear();
            }
        }
        if let Some(s) = decision.release
            && self.releasing.is_none()
            && self.running.contains_key(&s)
        {
            info!(shard = %s, replicas = view.members.len(), "giving this shard up to a less busy replica: draining it, then releasing its lease");
        }
        Ok(decision)
    }

    /// Step 3, apply: gives up the shard to release (one at a time), tries to take the shards to
    /// acquire and starts each one taken. Why a Lease could not be taken, if one could not.
    async fn apply(&mut self, decision: Decision) -> Option<String> {
        if let Some(s) = decision.release
            && self.releasing.is_none()
            && let Some(token) = self.running.get(&s)
        {
            token.cancel();
            self.releasing = Some(s);
        }
        let mut problem = None;
        for s in decision.acquire {
            let Some(mut e) = self.electors.remove(&s) else { continue };
            match tokio::time::timeout(self.retry, e.try_acquire_or_renew()).await {
                Ok(Ok(Attempt::Held { epoch })) => {
                    info!(shard = %s, lease = %e.lease(), epoch, "holding the shard's lease: running its streams");
                    let token = self.cancel.child_token();
                    self.running.insert(s, token.clone());
                    self.units.spawn(run_shard(self.shared.clone(), s, e, epoch, token));
                }
                Ok(Err(err)) => {
                    warn!(shard = %s, error = %err, "the shard's lease cannot be taken; retrying");
                    problem = Some(format!("the lease cannot be read or taken: {err}"));
                    self.electors.insert(s, e);
                }
                // Held by another, or no answer in time: tried again next round.
                Ok(Ok(_)) | Err(_) => {
                    self.electors.insert(s, e);
                }
            }
        }
        problem
    }

    /// Step 4, readiness: not ready while a Lease cannot be read or taken (or another count
    /// runs); a standby while no shard runs here.
    fn readiness(&self, problem: Option<String>) {
        self.shared.health.set_lease_problem(problem);
        set_standby(&self.shared.health, &self.running, self.cfg.shards);
    }

    /// Until the next round, a shard that ended (its Lease watched again), or the stop.
    async fn wait(&mut self) {
        tokio::select! {
            _ = self.cancel.cancelled() => {}
            _ = tokio::time::sleep(self.retry) => {}
            Some(joined) = self.units.join_next() => {
                let (s, result) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
                self.failure = ended(s, result, &self.shared.health);
                self.running.remove(&s);
                let elector = self.elector(s);
                self.electors.insert(s, elector);
                if self.releasing == Some(s) {
                    self.releasing = None;
                }
                set_standby(&self.shared.health, &self.running, self.cfg.shards);
            }
        }
    }

    /// Stops every shard (each drains and gives its Lease up), then leaves the group.
    async fn stop(mut self) -> Result<(), RunError> {
        self.shared.health.set_shutting_down();
        self.cancel.cancel();
        while let Some(joined) = self.units.join_next().await {
            let (s, result) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
            if let Some(e) = ended(s, result, &self.shared.health)
                && self.failure.is_none()
            {
                self.failure = Some(e);
            }
        }
        if tokio::time::timeout(self.retry, self.members.leave()).await.is_err() {
            warn!("this replica's member lease not deleted: {} (it expires)", self.no_answer());
        }
        info!("kubecast stopped");
        self.failure.map_or(Ok(()), Err)
    }
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
    let pipeline = Pipeline::for_shard(shared.config.clone(), shard, shared.bounds.clone());
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
