//! Wiring: the streams of a config (one per `[[resources]]` entry and namespace), their
//! positions, and the stages after the reflectors (shaping, queue, persister), built the same
//! way for `kubecast run` and for the benchmarks (which feed the reflectors' channel
//! themselves).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::{Quota, RateLimiter};
use kube::api::GroupVersionKind;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::bounds::Bounds;
pub use super::bounds::CHANNEL_CAPACITY;
use crate::config::Config;
use crate::delivery::dead_letter::DeadLetter;
use crate::delivery::queue::{DeliveryError, Job, Limiter, Queue};
use crate::delivery::retry::RetryPolicy;
use crate::model::{Position, Shard};
use crate::observe::health::Health;
use crate::observe::metrics::StreamMetrics;
use crate::shaping::Shaper;
use crate::shaping::form::EventForm;
use crate::shaping::stage::{self, StreamRoute};
use crate::sink::Sink;
use crate::sink::template::Template;
use crate::source::client::ApiLimiter;
use crate::source::reflector::{Item, Reflector, Start, StreamSpec};
use crate::state::persister;
use crate::state::store::{CheckpointError, Store, StreamKey};
use crate::state::watermark::StreamCheckpoint;

/// One stream: a `[[resources]]` entry in one namespace (or cluster-wide).
#[derive(Debug, Clone)]
pub struct StreamPlan {
    /// The stream's identity: exactly its query.
    pub key: StreamKey,
    /// Human-readable, e.g. `v1 ConfigMap in namespace shop`.
    pub name: String,
    /// Its `[[resources]]` entry.
    pub resource_index: usize,
}

/// A config's streams; once [`Pipeline::load`]ed, with their positions, ready to be started.
pub struct Pipeline {
    pub config: Config,
    pub streams: Vec<StreamPlan>,
    checkpoints: Vec<Arc<StreamCheckpoint>>,
    /// What each stream resumes from (taken by its reflector).
    starts: Vec<Option<Start>>,
    metrics: Vec<Arc<StreamMetrics>>,
    store: Option<Store>,
    /// The process's bounds, which this pipeline takes a part of.
    bounds: Bounds,
}

impl Pipeline {
    /// The streams of `config` (nothing loaded yet).
    pub fn new(config: Config) -> Self {
        let streams = plan(&config);
        let bounds = Bounds::of(&config);
        Self::with_streams(config, streams, bounds)
    }

    /// The streams of `config` for one shard of their objects (`[coordination] shards`):
    /// their own positions (`<stream id>.shard-<i>-of-<N>`) and names (`... [shard i-of-N]`),
    /// within `bounds`, the process's, shared with its other shards.
    pub fn for_shard(config: Config, shard: Shard, bounds: Bounds) -> Self {
        let streams = plan(&config)
            .into_iter()
            .map(|s| StreamPlan {
                key: s.key.with_shard(Some(shard)),
                name: format!("{} [shard {}]", s.name, shard.label()),
                ..s
            })
            .collect();
        Self::with_streams(config, streams, bounds)
    }

    fn with_streams(config: Config, streams: Vec<StreamPlan>, bounds: Bounds) -> Self {
        let metrics =
            streams.iter().map(|s| Arc::new(StreamMetrics::new(&s.key.group, &s.key.kind, &s.name))).collect();
        Self { config, streams, checkpoints: Vec::new(), starts: Vec::new(), metrics, store: None, bounds }
    }

    /// Loads every stream's position from `store`, which the persister then writes.
    pub async fn load(&mut self, store: Store) -> Result<(), CheckpointError> {
        let keys: Vec<StreamKey> = self.streams.iter().map(|s| s.key.clone()).collect();
        let started = std::time::Instant::now();
        let loaded = store.load(&keys).await?;
        tracing::info!(
            store = %store.describe(),
            streams = keys.len(),
            objects = loaded.iter().flatten().map(|p| p.objects.len()).sum::<usize>(),
            took = ?started.elapsed(),
            "stream positions loaded"
        );
        // The index is held once, by the watermark; the reflector reads it.
        (self.checkpoints, self.starts) = keys.into_iter().zip(loaded).map(|(k, p)| start(k, p)).unzip();
        self.store = Some(store);
        Ok(())
    }

    /// The store the positions were loaded from.
    pub fn store(&self) -> &Store {
        self.store.as_ref().expect("Pipeline::load first")
    }

    /// The process's bounds this pipeline shares.
    pub fn bounds(&self) -> &Bounds {
        &self.bounds
    }

    pub fn stream_names(&self) -> Vec<String> {
        self.streams.iter().map(|s| s.name.clone()).collect()
    }

    pub fn checkpoints(&self) -> &[Arc<StreamCheckpoint>] {
        &self.checkpoints
    }

    /// Per stream, as [`Pipeline::checkpoints`].
    pub fn metrics(&self) -> &[Arc<StreamMetrics>] {
        &self.metrics
    }

    /// One reflector per stream, each starting from its loaded position and sending its items
    /// to `items`.
    pub fn reflectors(
        &mut self,
        client: &kube::Client,
        limiter: &ApiLimiter,
        health: &Arc<Health>,
        items: &mpsc::Sender<Item>,
    ) -> Vec<Reflector> {
        let cluster = &self.config.cluster;
        self.streams
            .iter()
            .zip(self.starts.iter_mut())
            .enumerate()
            .map(|(id, (s, start))| {
                let rc = &self.config.resources[s.resource_index];
                let spec = StreamSpec {
                    id,
                    name: s.name.clone(),
                    resource_index: s.resource_index,
                    cluster: cluster.name.clone(),
                    client: client.clone(),
                    limiter: limiter.clone(),
                    gvk: GroupVersionKind::gvk(&s.key.group, &s.key.version, &s.key.kind),
                    namespace: s.key.namespace.clone(),
                    label_selector: rc.label_selector.clone(),
                    field_selector: rc.field_selector.clone(),
                    page_size: rc.page_size,
                    watch_timeout_seconds: cluster.watch_timeout_seconds,
                    initial: rc.initial,
                    missing_kind: rc.missing_kind,
                    streaming_lists: cluster.streaming_lists,
                    health: health.clone(),
                    shard: s.key.shard,
                };
                Reflector::new(
                    spec,
                    start.take().expect("one reflector per stream, after Pipeline::load"),
                    items.clone(),
                )
            })
            .collect()
    }

    /// Starts the stages after the reflectors: shaping (reading `items`), the queue into
    /// `sink`, and the persister. Both report to `health` (destinations that refuse every
    /// event; exactly-once commits failing for too long).
    pub fn start_downstream(
        &self,
        sink: Arc<Sink>,
        items: mpsc::Receiver<Item>,
        health: &Arc<Health>,
        cancel: &CancellationToken,
    ) -> Downstream {
        let config = &self.config;
        let refusals = health.refusals();
        let persister = tokio::spawn(persister::run(
            self.store().clone(),
            self.checkpoints.clone(),
            self.metrics.clone(),
            Duration::from_millis(config.checkpoint.flush_interval_ms),
            health.clone(),
            cancel.clone(),
        ));
        let routes_of: Vec<(Option<Arc<Template>>, Option<Limiter>)> = config
            .resources
            .iter()
            .map(|rc| {
                let route = rc.route(config.sink.kind).map(|t| Arc::new(Template::parse(t).expect("validated")));
                (route, rc.rate_per_second.map(|r| rate_limiter(r, r)))
            })
            .collect();
        let routes = self
            .streams
            .iter()
            .zip(&self.metrics)
            .map(|(s, metrics)| StreamRoute {
                shaper: s.resource_index,
                metrics: metrics.clone(),
                route: routes_of[s.resource_index].0.clone(),
                limiter: routes_of[s.resource_index].1.clone(),
            })
            .collect();
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>(self.bounds.channel_capacity());
        let shapers: Vec<Shaper> = config.resources.iter().map(|rc| Shaper::new(&rc.shaping())).collect();
        let shaper = tokio::spawn(stage::run(
            items,
            jobs_tx,
            routes,
            shapers,
            EventForm::for_sink(&config.sink, sink.sends_structured()),
        ));
        let d = &config.delivery;
        let retry = RetryPolicy::new(d);
        let queue = Queue {
            sink: sink.clone(),
            limiter: (d.rate_per_second > 0).then(|| rate_limiter(d.rate_per_second, d.burst)),
            retry,
            dead_letter: Arc::new(
                DeadLetter::new(&d.dead_letter, &config.checkpoint.dir, retry).reporting_to(refusals.clone()),
            ),
            in_flight: self.bounds.in_flight.part(),
            capacity: self.bounds.queue.part(),
            checkpoints: self.checkpoints.clone(),
            metrics: self.metrics.clone(),
            gate: self.store().gate(),
            refusals,
        };
        let queue = tokio::spawn(async move { queue.run(jobs_rx).await });
        Downstream { shaper, queue, persister: Some(persister) }
    }
}

/// The running stages after the reflectors.
pub struct Downstream {
    /// Ends when the reflectors' channel is closed and every item was handed to the queue.
    pub shaper: JoinHandle<()>,
    /// Ends when everything taken was delivered (the shaper gone), or with a fatal error.
    pub queue: JoinHandle<Result<(), DeliveryError>>,
    /// Ends when the cancel token fires, or when the store refuses this process.
    /// (`None` once supervision saw it end.)
    pub persister: Option<JoinHandle<Result<(), CheckpointError>>>,
}

/// A stream's watermark, holding its loaded position and index, and where its reflector
/// starts: the position's resume point and the watermark's index (no copy of it).
fn start(key: StreamKey, loaded: Option<Position>) -> (Arc<StreamCheckpoint>, Option<Start>) {
    let (resume, acked_ahead, snapshot) =
        loaded.as_ref().map(|p| (p.resource_version.clone(), p.acked_ahead.clone(), p.snapshot)).unwrap_or_default();
    let relist = loaded.as_ref().is_some_and(|p| p.adopted_from.is_some() && p.resource_version.is_none());
    let floors = loaded.as_ref().map(|p| p.floors.clone()).unwrap_or_default();
    let checkpoint = Arc::new(StreamCheckpoint::new(key, loaded));
    let start = Start { resume, acked_ahead, index: checkpoint.index(), snapshot, relist, floors };
    (checkpoint, Some(start))
}

/// The streams of `config`, in stream order (one per resource and namespace).
pub fn plan(config: &Config) -> Vec<StreamPlan> {
    let mut out = Vec::new();
    for (resource_index, rc) in config.resources.iter().enumerate() {
        let (group, version) = rc.group_version();
        let scopes: Vec<Option<String>> =
            if rc.namespaces.is_empty() { vec![None] } else { rc.namespaces.iter().cloned().map(Some).collect() };
        for namespace in scopes {
            let name = match &namespace {
                Some(ns) => format!("{} in namespace {ns}", rc.describe()),
                None => format!("{} (cluster-wide)", rc.describe()),
            };
            let key = StreamKey {
                cluster: config.cluster.name.clone(),
                group: group.to_string(),
                version: version.to_string(),
                kind: rc.kind.clone(),
                namespace,
                label_selector: rc.label_selector.clone(),
                field_selector: rc.field_selector.clone(),
                shard: None,
            };
            out.push(StreamPlan { key, name, resource_index });
        }
    }
    out
}

fn rate_limiter(rate: u32, burst: u32) -> Limiter {
    let rate = NonZeroU32::new(rate).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(burst).unwrap_or(rate);
    Arc::new(RateLimiter::direct(Quota::per_second(rate).allow_burst(burst)))
}
