//! Wires the data flow for `kubecast run`:
//!
//! ```text
//! config -> reflector per stream -> [channel] -> shaping (events filter, CloudEvent)
//!        -> [channel] -> outbound queue (order, rate limit, retry, dead letter) -> sink
//!                                                                                   |
//!            checkpoint files <- persister <- watermark per stream <- ack <---------+
//! ```
//!
//! Every item a reflector emits is acknowledged exactly once: after the sink accepted its
//! event (or it went to the dead letter), or at once when the `events` filter drops it or it
//! carries no change (bookmarks, end of a list). Only acknowledged items move a stream's
//! checkpoint (see `ack.rs`). All channels are bounded: when the sink is slow they fill and the
//! reflectors stop reading their watches (backpressure).
//!
//! Shutdown (the token fires): the reflectors stop, the queue delivers what it already took
//! (within `[delivery] shutdown_timeout_seconds`), the producer is flushed, then every stream's
//! final checkpoint is written.

use std::sync::Arc;
use std::time::Duration;

use kube::api::GroupVersionKind;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use std::num::NonZeroU32;

use governor::{Quota, RateLimiter};

use crate::ack::StreamCheckpoint;
use crate::admin::{AdminError, Health};
use crate::checkpoint::{CheckpointError, CheckpointStore, StreamKey};
use crate::config::{Config, ResourceConfig};
use crate::delivery::dead_letter::DeadLetter;
use crate::delivery::queue::{DeliveryError, Job, Limiter, Queue};
use crate::delivery::retry::RetryPolicy;
use crate::kubeapi::{self, ClientError};
use crate::metrics::{StreamMetrics, verb_index};
use crate::reflector::{Item, Reflector, ReflectorError, StreamSpec};
use crate::shaping::Shaper;
use crate::sink::template::{Fields, Template, TypeFields};
use crate::sink::{Outbound, Sink, SinkError};
use crate::telemetry::EventTrace;

/// Capacity of each channel between stages (reflectors -> shaping -> queue).
const CHANNEL_CAPACITY: usize = 1024;
/// Items the shaping stage takes from its channel at once.
const SHAPE_BATCH: usize = 128;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Reflector(#[from] ReflectorError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    #[error(transparent)]
    Admin(#[from] AdminError),
}

/// What the shaping stage knows of a stream.
struct Stream {
    resource: Arc<ResourceConfig>,
    /// Index of its `[[resources]]` entry (and of its shaper).
    resource_index: usize,
    metrics: Arc<StreamMetrics>,
    route: Option<Arc<Template>>,
    limiter: Option<Limiter>,
}

/// Runs until `shutdown` fires or a fatal error occurs.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), RunError> {
    let client = kubeapi::client(&config.cluster).await?;
    let api_limiter = kubeapi::limiter(&config.cluster);
    let store = CheckpointStore::open(&config.checkpoint.dir)?;
    let sink = Arc::new(Sink::open(&config.sink, config.delivery.max_in_flight).await?);
    check_nats_streams(&config, &client, &sink).await?;
    let names = stream_names(&config);
    let health = Health::new(names.clone(), sink.connected());

    let (tx, rx) = mpsc::channel::<Item>(CHANNEL_CAPACITY);
    let mut streams = Vec::new();
    let mut checkpoints = Vec::new();
    let mut reflectors = Vec::new();
    for (resource_index, rc) in config.resources.iter().enumerate() {
        let rc = Arc::new(rc.clone());
        let route = rc.route(config.sink.kind).map(|t| Arc::new(Template::parse(t).expect("validated")));
        let limiter = rc.rate_per_second.map(|r| rate_limiter(r, r));
        let (group, version) = rc.group_version();
        let scopes: Vec<Option<String>> =
            if rc.namespaces.is_empty() { vec![None] } else { rc.namespaces.iter().cloned().map(Some).collect() };
        for namespace in scopes {
            let key = StreamKey {
                cluster: config.cluster.name.clone(),
                group: group.to_string(),
                version: version.to_string(),
                kind: rc.kind.clone(),
                namespace: namespace.clone(),
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
            };
            let (checkpoint, loaded) = StreamCheckpoint::load(store.clone(), key)?;
            let spec = StreamSpec {
                id: streams.len(),
                name: names[streams.len()].clone(),
                resource_index,
                cluster: config.cluster.name.clone(),
                client: client.clone(),
                limiter: api_limiter.clone(),
                gvk: GroupVersionKind::gvk(group, version, &rc.kind),
                namespace,
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
                page_size: rc.page_size,
                watch_timeout_seconds: config.cluster.watch_timeout_seconds,
                initial: rc.initial,
                missing_kind: rc.missing_kind,
                streaming_lists: config.cluster.streaming_lists,
                health: health.clone(),
            };
            reflectors.push(Reflector::new(spec, loaded, tx.clone()));
            let metrics = Arc::new(StreamMetrics::new(group, &rc.kind, &names[streams.len()]));
            streams.push(Stream {
                resource: rc.clone(),
                resource_index,
                metrics,
                route: route.clone(),
                limiter: limiter.clone(),
            });
            checkpoints.push(Arc::new(checkpoint));
        }
    }
    drop(tx);

    let cancel = shutdown.child_token();
    crate::admin::serve(&config.admin, health.clone(), cancel.clone()).await?;
    if sink.kafka().is_some() {
        tokio::spawn(probe_broker(sink.clone(), cancel.clone()));
    }
    let mut tasks = JoinSet::new();
    for r in reflectors {
        tasks.spawn(r.run(cancel.clone()));
    }
    info!(streams = streams.len(), sink = %config.sink.kind, "kubecast running");

    let stream_metrics: Vec<Arc<StreamMetrics>> = streams.iter().map(|s| s.metrics.clone()).collect();
    let persister = tokio::spawn(persist_periodically(
        checkpoints.clone(),
        stream_metrics.clone(),
        Duration::from_millis(config.checkpoint.flush_interval_ms),
        cancel.clone(),
    ));
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(CHANNEL_CAPACITY);
    let shapers: Vec<Shaper> = config.resources.iter().map(Shaper::new).collect();
    let shaper = tokio::spawn(shape_all(rx, jobs_tx, streams, shapers, sink.sends_structured()));
    let d = &config.delivery;
    let retry = RetryPolicy::new(d);
    let queue = Queue {
        sink: sink.clone(),
        limiter: (d.rate_per_second > 0).then(|| rate_limiter(d.rate_per_second, d.burst)),
        retry,
        dead_letter: Arc::new(DeadLetter::new(&d.dead_letter, &config.checkpoint.dir, retry)),
        max_in_flight: d.max_in_flight,
        capacity: d.queue_capacity,
        checkpoints: checkpoints.clone(),
        metrics: stream_metrics,
    };
    let mut queue_task = tokio::spawn(async move { queue.run(jobs_rx).await });

    let mut result: Result<(), RunError> = Ok(());
    let mut fail = |e: RunError, cancel: &CancellationToken| {
        error!(error = %e, "stopping");
        if result.is_ok() {
            result = Err(e);
        }
        cancel.cancel();
    };
    let mut queue_done = false;
    loop {
        tokio::select! {
            Some(joined) = tasks.join_next() => {
                if let Some(e) = task_error(joined) {
                    fail(e.into(), &cancel);
                }
            }
            done = &mut queue_task, if !queue_done => {
                queue_done = true;
                if let Err(e) = flatten(done) {
                    fail(e.into(), &cancel);
                }
                break;
            }
            _ = cancel.cancelled() => break,
        }
    }
    // Stop reading; deliver what was taken, within the shutdown timeout.
    health.set_shutting_down();
    cancel.cancel();
    while let Some(joined) = tasks.join_next().await {
        if let Some(e) = task_error(joined) {
            fail(e.into(), &cancel);
        }
    }
    let _ = shaper.await;
    if !queue_done {
        let timeout = Duration::from_secs(d.shutdown_timeout_seconds);
        match tokio::time::timeout(timeout, &mut queue_task).await {
            Ok(done) => {
                if let Err(e) = flatten(done) {
                    fail(e.into(), &cancel);
                }
            }
            Err(_) => {
                queue_task.abort();
                warn!(
                    ?timeout,
                    "shutdown timeout: events still queued are not acknowledged; they are sent again after restart"
                );
            }
        }
    }
    if let Err(e) = sink.flush(Duration::from_secs(d.shutdown_timeout_seconds)) {
        // Not acknowledged, so not in any checkpoint: sent again after the restart.
        warn!(error = %e, "not everything handed to the producer was delivered before the shutdown timeout");
    }
    let _ = persister.await;
    for cp in &checkpoints {
        if let Err(e) = cp.persist_if_dirty() {
            fail(e.into(), &cancel);
        }
    }
    info!("kubecast stopped; checkpoints written");
    result
}

/// The stream names, in stream order (one per resource and namespace).
fn stream_names(config: &Config) -> Vec<String> {
    config
        .resources
        .iter()
        .flat_map(|rc| {
            if rc.namespaces.is_empty() {
                vec![format!("{} (cluster-wide)", rc.describe())]
            } else {
                rc.namespaces.iter().map(|ns| format!("{} in namespace {ns}", rc.describe())).collect()
            }
        })
        .collect()
}

/// JetStream: a stream must cover the subjects events go to. Checked at start for each
/// resource's subjects (its kind found by discovery; a namespace of the configured ones, or
/// `default`); when NATS is not reachable yet, checked once it is (then a missing stream is
/// logged, and the events wait and retry instead of stopping kubecast).
async fn check_nats_streams(config: &Config, client: &kube::Client, sink: &Arc<Sink>) -> Result<(), RunError> {
    let Some(n) = sink.nats() else { return Ok(()) };
    if !n.jetstream() {
        warn!("sink.nats.jetstream = false: core NATS is at-most-once; events can be lost when the connection drops");
        return Ok(());
    }
    let subjects = nats_sample_subjects(config, client, n).await;
    if n.is_connected() {
        return Ok(n.ensure_streams(&subjects).await?);
    }
    warn!("NATS is not reachable yet; the JetStream streams are checked once it is, and events wait until then");
    let sink = sink.clone();
    tokio::spawn(async move {
        let Some(n) = sink.nats() else { return };
        while !n.is_connected() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Err(e) = n.ensure_streams(&subjects).await {
            error!(error = %e, "events to these subjects are retried until a stream covers them");
        }
    });
    Ok(())
}

async fn nats_sample_subjects(config: &Config, client: &kube::Client, n: &crate::sink::NatsSink) -> Vec<String> {
    let mut out = Vec::new();
    for rc in &config.resources {
        let (group, version) = rc.group_version();
        let gvk = GroupVersionKind::gvk(group, version, &rc.kind);
        let Ok((ar, caps)) = kube::discovery::pinned_kind(client, &gvk).await else {
            continue; // not served (yet): the reflector waits for it or fails
        };
        let namespaces: Vec<String> = if !rc.namespaces.is_empty() {
            rc.namespaces.clone()
        } else if caps.scope == kube::discovery::Scope::Namespaced {
            vec!["default".into()]
        } else {
            vec![String::new()]
        };
        let route = rc.subject.as_deref().map(|t| Template::parse(t).expect("validated"));
        let of_type = TypeFields::new(&config.cluster.name, &ar).intern();
        for namespace in namespaces {
            for verb in &rc.events {
                let fields = Fields { of_type, namespace: namespace.clone(), verb: verb.as_str() };
                let subject = n.subject_for(route.as_ref(), &fields);
                if !out.contains(&subject) {
                    out.push(subject);
                }
            }
        }
    }
    out
}

/// Keeps the sink's reachability fresh for readiness, also when no events flow.
async fn probe_broker(sink: Arc<Sink>, cancel: CancellationToken) {
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

fn flatten(done: Result<Result<(), DeliveryError>, tokio::task::JoinError>) -> Result<(), DeliveryError> {
    match done {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Ok(()),
    }
}

fn task_error(joined: Result<Result<(), ReflectorError>, tokio::task::JoinError>) -> Option<ReflectorError> {
    match joined {
        Ok(r) => r.err(),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

fn rate_limiter(rate: u32, burst: u32) -> Limiter {
    let rate = NonZeroU32::new(rate).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(burst).unwrap_or(rate);
    Arc::new(RateLimiter::direct(Quota::per_second(rate).allow_burst(burst)))
}

/// The filter/transform stage: shaping (`src/shaping`: safe payload, change detection,
/// redaction, `events` and CEL filters, payload mode), then the CloudEvent's destination fields.
async fn shape_all(
    mut rx: mpsc::Receiver<Item>,
    tx: mpsc::Sender<Job>,
    streams: Vec<Stream>,
    mut shapers: Vec<Shaper>,
    seal: bool,
) {
    // Items are taken in batches (one wake-up of this task per batch, and the permits of a
    // whole batch returned to the reflectors at once).
    let mut items = Vec::with_capacity(SHAPE_BATCH);
    while rx.recv_many(&mut items, SHAPE_BATCH).await > 0 {
        for item in items.drain(..) {
            let job = shape(item, &streams, &mut shapers, seal);
            if tx.send(job).await.is_err() {
                return;
            }
        }
    }
}

/// `seal`: the sink sends structured events, built here once
/// ([`crate::event::CloudEvent::seal_structured`]).
fn shape(item: Item, streams: &[Stream], shapers: &mut [Shaper], seal: bool) -> Job {
    let stream = &streams[item.stream];
    let shaper = &mut shapers[stream.resource_index];
    let m = &stream.metrics;
    m.read.store(item.seq + 1, std::sync::atomic::Ordering::Relaxed);
    let verb = item.change.as_ref().map_or(crate::config::Verb::Added, |c| c.verb);
    let msg = item.change.and_then(|change| {
        m.observed[verb_index(change.verb)].inc();
        let wanted = stream.resource.wants(change.verb);
        if !wanted && !shaper.keeps_state() {
            m.filtered(change.verb, "verb");
            return None;
        }
        let verb = change.verb;
        let fields = Fields {
            of_type: change.source.type_fields(),
            namespace: change.object.metadata.namespace.clone().unwrap_or_default(),
            verb: verb.as_str(),
        };
        let key = change.object.metadata.uid.clone().unwrap_or_default();
        let started = std::time::SystemTime::now();
        let mut trace = EventTrace::start(
            &fields.of_type.kind,
            verb.as_str(),
            &fields.namespace,
            change.object.metadata.name.as_deref().unwrap_or_default(),
        );
        match change.into_cloudevent() {
            Ok(mut event) => {
                // Not sent (filtered out, status only...): acknowledged with the job.
                let shaped = shaper.apply(verb, &key, wanted, &mut event);
                if let Some(t) = &mut trace {
                    t.child("shape", started, vec![]);
                    t.annotate(vec![
                        opentelemetry::KeyValue::new("cloudevents.event_id", event.id().to_string()),
                        opentelemetry::KeyValue::new("cloudevents.event_type", event.attributes.ty().to_string()),
                    ]);
                    if shaped.is_ok() {
                        let (parent, state) = t.w3c();
                        event.attributes.set_extension("traceparent", parent);
                        if let Some(state) = state {
                            event.attributes.set_extension("tracestate", state);
                        }
                        t.mark_queued();
                    }
                }
                if let Err(why) = shaped {
                    m.filtered(verb, why.as_str());
                    if let Some(t) = trace {
                        t.end(format!("filtered ({})", why.as_str()).into(), None);
                    }
                    return None;
                }
                if seal {
                    event.seal_structured();
                }
                Some(Box::new(Outbound { event, fields, route: stream.route.clone(), trace }))
            }
            // Cannot happen with objects from a real apiserver (they all have uid and
            // resourceVersion); acknowledged so the stream does not stall on it.
            Err(e) => {
                warn!(error = %e, "object cannot become an event; skipped");
                None
            }
        }
    });
    Job { stream: item.stream, seq: item.seq, effect: item.effect, msg, limiter: stream.limiter.clone(), verb }
}

async fn persist_periodically(
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
            let cp2 = cp.clone();
            // File I/O off the async workers.
            match tokio::task::spawn_blocking(move || cp2.persist_if_dirty()).await {
                Ok(Ok(_)) => current_at[i] = std::time::Instant::now(),
                Ok(Err(e)) => error!(error = %e, "checkpoint not written; retrying at the next interval"),
                Err(_) => {}
            }
            let m = &metrics[i];
            let g = crate::metrics::get();
            g.checkpoint_age.get_or_create(&m.stream).set(current_at[i].elapsed().as_secs_f64());
            let lag = m.read.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(cp.acked_items());
            g.checkpoint_lag.get_or_create(&m.stream).set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }
}
