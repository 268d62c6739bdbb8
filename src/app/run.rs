//! `kubecast run`: wires the data flow, supervises it, shuts it down.
//!
//! ```text
//! config -> reflector per stream -> [channel] -> shaping (events filter, CloudEvent)
//!        -> [channel] -> outbound queue (order, rate limit, retry, dead letter) -> sink
//!                                                                                   |
//!   state store (file | kafka | nats) <- persister <- watermark per stream <- ack <-+
//! ```
//!
//! Every item a reflector emits is acknowledged exactly once: after the sink accepted its
//! event (or it went to the dead letter), or at once when the `events` filter drops it or it
//! carries no change (bookmarks, end of a list). Only acknowledged items move a stream's
//! checkpoint (see `state/watermark.rs`). All channels are bounded: when the sink is slow they
//! fill and the reflectors stop reading their watches (backpressure).
//!
//! The admin server is bound first (before the sink is opened and any watch starts) and
//! answers until the drain is done. Once the Lease is held, `active.rs`
//! runs the streams: supervision (`supervise.rs`) until the token fires, a stream fails or
//! the queue stops; then `shutdown.rs` drains. With `[coordination] shards` above 1,
//! `shards.rs` runs each shard this replica holds that way.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::active::{self, Active, Held};
pub use super::error::RunError;
use super::preflight::{check_dead_letter, check_nats_streams};
use super::wiring::Pipeline;
use super::{count_watch, leadership, supervise};
use crate::config::Config;
use crate::coordination::count_guard::CountGuard;
use crate::observe::admin;
use crate::observe::health::Health;
use crate::sink::Sink;
use crate::source::client;

/// Runs until `shutdown` fires or a fatal error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    for w in super::ephemeral::warnings(&config) {
        warn!("{w}");
    }
    let (client, apiserver) = client::client(&config.cluster).await?;
    let api_limiter = client::limiter(&config.cluster);
    if config.coordination.sharded().is_some() {
        return super::shards::run(config, client, apiserver, api_limiter, shutdown).await;
    }
    if config.coordination.enabled && config.checkpoint.store == crate::state::StoreKind::File {
        warn!(
            "[coordination] with the file store: a standby that takes over does not have this process's state (it is on this pod's disk) and starts its streams over, so deletes made during the handover are not reported; put the state in Kafka or NATS ([checkpoint] store) for failovers that lose nothing"
        );
    }
    let pipeline = Pipeline::new(config);
    let config = &pipeline.config;
    // The admin server answers from here until `run` returns, through the drain (`/readyz`:
    // not ready, "shutting down"; `/metrics` shows the drain).
    let health = Health::new(pipeline.stream_names());
    let admin_stop = CancellationToken::new();
    let _admin = admin_stop.clone().drop_guard();
    admin::serve(&config.admin, health.clone(), admin_stop).await?;
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await?);
    health.set_sink(sink.connected(), sink.unreachable_cause());
    check_nats_streams(config, &client, &sink).await?;
    check_dead_letter(config, &sink).await?;
    // Every Kafka topic or JetStream stream the config names, looked up (not created) and
    // logged, in the background: a missing topic or permission is said before the first event, and not ready
    // until it is fixed.
    tokio::spawn({
        let (config, client, sink, health) = (config.clone(), client.clone(), sink.clone(), health.clone());
        async move { super::connect_check::watch_at_start(&config, &client, &sink, &health).await }
    });

    let cancel = shutdown.child_token();
    tokio::spawn(supervise::probe_apiserver(client.clone(), apiserver, health.clone(), cancel.clone()));
    if sink.kafka().is_some() {
        tokio::spawn(supervise::probe_broker(sink.clone(), cancel.clone()));
    }
    // `[coordination]`: a standby waits here, its admin server up, until it holds the lease.
    let lease_stop = CancellationToken::new();
    // Fired when the lease is lost or the store fenced this process, also during the drain:
    // publishing stops at once.
    let lease_lost = CancellationToken::new();
    let mut lease = None;
    let tenure = leadership::Tenure::new(&pipeline.config.coordination, lease_lost.clone());
    let floor = super::store::epoch_floor(&pipeline.config);
    // A change of the shard count from or to 1 while replicas run: see `count_watch`.
    let mut guard = CountGuard::new(client.clone(), &pipeline.config.coordination);
    let (epoch, writer) = match leadership::elector(&client, &pipeline.config.coordination, &health, floor) {
        Some(mut elector) => {
            let cfg = pipeline.config.coordination.clone();
            let Some(epoch) = leadership::wait_for_lease(&mut elector, &cfg, &health, guard.as_mut(), &cancel).await?
            else {
                info!("stopped while standby");
                if let Some(guard) = guard {
                    guard.leave().await;
                }
                return Ok(());
            };
            let writer = elector.identity().to_string();
            let keepers = leadership::Keepers::start(&pipeline.config.cluster).await?;
            lease = Some(keepers.keep(elector, cfg, epoch, lease_stop.clone(), tenure.clone()));
            (Some(i64::from(epoch)), writer)
        }
        None => {
            crate::observe::metrics::get().leader.set(1);
            (None, pipeline.config.coordination.identity())
        }
    };
    let retry = Duration::from_secs(pipeline.config.coordination.retry_period_seconds.into());
    let watch_done = CancellationToken::new();
    let watch = guard.map(|g| count_watch::watch_while_held(g, retry, cancel.clone(), watch_done.clone()));
    let active = Active { client: &client, limiter: &api_limiter, sink, health: &health, cancel };
    let held = Held { epoch, writer, keeper: lease, stop: lease_stop, lost: lease_lost, tenure };
    let result = active::run(pipeline, active, held).await;
    watch_done.cancel();
    let Some(watch) = watch else { return result };
    let (guard, yielded) = watch.await.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    if yielded && result.is_ok() && !shutdown.is_cancelled() {
        count_watch::stand_aside(guard, retry, &health, &shutdown).await;
    } else if result.is_ok() {
        guard.leave().await;
    }
    result
}
