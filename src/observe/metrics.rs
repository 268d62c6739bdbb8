//! Prometheus metrics (`/metrics` on the admin server, prometheus-client text format). Names
//! have the `kubecast_` prefix and base units; counters end in `_total`. Labels are bounded by
//! the configuration: `group` + `kind` (one per `[[resources]]` entry), `verb` (3 values),
//! `stream` (one per resource and namespace), `reason` (a fixed set).
//!
//! One process-wide set, reached with [`get`], so that each stage records what it sees next to
//! where it happens.

use std::sync::OnceLock;

use crate::model::Verb;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceVerb {
    pub group: String,
    pub kind: String,
    pub verb: &'static str,
}

/// A request to the apiserver: its verb (`list`, `watch`, `get`, `create`, `update`,
/// `patch`, `delete`, `discovery`) and the plural resource it names (`""` for discovery).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequest {
    pub verb: &'static str,
    pub resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Filtered {
    pub group: String,
    pub kind: String,
    pub verb: &'static str,
    /// `verb` (not in `events`), `filter` (CEL false or error with `filter_error = "drop"`),
    /// `status_only`, `unreadable`.
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Resource {
    pub group: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Stream {
    /// e.g. `v1 ConfigMap in namespace shop`, `apps/v1 Deployment (cluster-wide)`.
    pub stream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShardLabel {
    /// e.g. `1-of-4`.
    pub shard: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransactionalId {
    pub transactional_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Build {
    pub version: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    pub events_observed: Family<ResourceVerb, Counter>,
    pub events_filtered: Family<Filtered, Counter>,
    pub events_published: Family<ResourceVerb, Counter>,
    pub events_acked: Family<ResourceVerb, Counter>,
    pub events_dead_lettered: Family<ResourceVerb, Counter>,
    pub filter_errors: Family<Resource, Counter>,
    pub retries: Family<Resource, Counter>,
    pub queue_depth: Gauge,
    pub in_flight: Gauge,
    pub publish_latency: Histogram,
    pub checkpoint_age: Family<Stream, Gauge<f64, AtomicU64>>,
    pub commit_failing: Family<TransactionalId, Gauge<f64, AtomicU64>>,
    pub checkpoint_lag: Family<Stream, Gauge>,
    pub stream_stalled: Family<Stream, Gauge>,
    pub leader: Gauge,
    pub lease_epoch: Gauge,
    pub relists: Family<Stream, Counter>,
    pub full_lists: Family<Stream, Counter>,
    pub gone: Family<Stream, Counter>,
    pub resync_events: Family<Stream, Counter>,
    pub watch_restarts: Family<Stream, Counter>,
    pub watch_objects_slow: Counter,
    /// Windows in which an apiserver connection gathered events arriving fast.
    pub watch_gathered: Counter,
    /// Bytes of the apiserver's response bodies (lists, watches, Leases).
    pub apiserver_received_bytes: Counter,
    /// Requests sent to the apiserver, by verb and resource.
    pub apiserver_requests: Family<ApiRequest, Counter>,
    pub sink_connected: Gauge,
    /// Events held because their destination refuses every event (a set-up mistake), by
    /// [`crate::model::Refusal`] label.
    pub sink_refused: Family<Reason, Gauge>,
    pub build_info: Family<Build, Gauge>,
    /// Exactly-once into Kafka: transactions committed and aborted.
    pub transactions: Family<Outcome, Counter>,
    /// Exactly-once into Kafka: events in the open transaction.
    pub transaction_events: Gauge,
    /// Exactly-once into Kafka: their bytes.
    pub transaction_bytes: Gauge,
    /// Exactly-once into Kafka: times sends waited for a commit to free room.
    pub transaction_full: Counter,
    /// `[coordination] shards`: 1 per shard this process holds.
    pub shard_held: Family<ShardLabel, Gauge>,
    /// Per stream of a shard: 1 when the apiserver applied its shard selector on the last list.
    pub shard_server_side: Family<Stream, Gauge>,
    /// Per stream of a shard: objects of other shards the apiserver sent, skipped by kubecast.
    pub shard_skipped: Family<Stream, Counter>,
    pub shard_selector_dropped: Family<Stream, Counter>,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("kubecast");
        let m = Metrics {
            registry: Registry::default(),
            events_observed: Family::default(),
            events_filtered: Family::default(),
            events_published: Family::default(),
            events_acked: Family::default(),
            events_dead_lettered: Family::default(),
            filter_errors: Family::default(),
            retries: Family::default(),
            queue_depth: Gauge::default(),
            in_flight: Gauge::default(),
            publish_latency: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            checkpoint_age: Family::default(),
            commit_failing: Family::default(),
            checkpoint_lag: Family::default(),
            stream_stalled: Family::default(),
            leader: Gauge::default(),
            lease_epoch: Gauge::default(),
            relists: Family::default(),
            full_lists: Family::default(),
            gone: Family::default(),
            resync_events: Family::default(),
            watch_gathered: Counter::default(),
            apiserver_received_bytes: Counter::default(),
            apiserver_requests: Family::default(),
            watch_restarts: Family::default(),
            watch_objects_slow: Counter::default(),
            sink_connected: Gauge::default(),
            sink_refused: Family::default(),
            build_info: Family::default(),
            transactions: Family::default(),
            transaction_events: Gauge::default(),
            transaction_bytes: Gauge::default(),
            transaction_full: Counter::default(),
            shard_held: Family::default(),
            shard_server_side: Family::default(),
            shard_skipped: Family::default(),
            shard_selector_dropped: Family::default(),
        };
        let r = &mut registry;
        r.register("events_observed", "Changes read from the watches and lists", m.events_observed.clone());
        r.register(
            "events_filtered",
            "Changes not sent (events verbs, CEL filter, status-only, unreadable); acknowledged all the same",
            m.events_filtered.clone(),
        );
        r.register("events_published", "Events the sink accepted (broker acknowledgement)", m.events_published.clone());
        r.register(
            "events_acked",
            "Events acknowledged to their stream's checkpoint (published or dead-lettered)",
            m.events_acked.clone(),
        );
        r.register("events_dead_lettered", "Events written to the dead letter", m.events_dead_lettered.clone());
        r.register("filter_errors", "CEL filter evaluations that failed at run time", m.filter_errors.clone());
        r.register("retries", "Send attempts retried after a retriable failure", m.retries.clone());
        r.register("queue_depth", "Events held by the outbound queue (waiting or in flight)", m.queue_depth.clone());
        r.register("in_flight", "Events sent and not yet acknowledged by the sink", m.in_flight.clone());
        r.register_with_unit(
            "publish_latency",
            "Time from a send attempt to the sink's acknowledgement",
            Unit::Seconds,
            m.publish_latency.clone(),
        );
        r.register_with_unit(
            "checkpoint_age",
            "Time since the stream's checkpoint was last written",
            Unit::Seconds,
            m.checkpoint_age.clone(),
        );
        r.register_with_unit(
            "exactly_once_commit_failing",
            "Exactly-once: time since the last commit of the transactional.id succeeded, while its commits fail (0 while they succeed); the events sent meanwhile are invisible to read_committed consumers",
            Unit::Seconds,
            m.commit_failing.clone(),
        );
        r.register(
            "checkpoint_lag",
            "Items of the stream read but not yet acknowledged (what a crash would re-send)",
            m.checkpoint_lag.clone(),
        );
        r.register(
            "stream_stalled",
            "1 while the stream's checkpoint has not moved for [delivery] stall_after_seconds with items pending",
            m.stream_stalled.clone(),
        );
        r.register(
            "leader",
            "1 while this process holds the [coordination] lease and runs the streams (1 without coordination)",
            m.leader.clone(),
        );
        r.register("lease_epoch", "leaseTransitions of the lease this process holds", m.lease_epoch.clone());
        r.register(
            "relists",
            "Lists after the first one (410 Gone, restarts without a usable checkpoint)",
            m.relists.clone(),
        );
        r.register(
            "full_lists",
            "Paginated lists finished as one unpaginated request because their continue token expired (the apiserver compacted the list's resourceVersion before its last page)",
            m.full_lists.clone(),
        );
        r.register("gone", "410 Gone answers (resourceVersion expired)", m.gone.clone());
        r.register("resync_events", "Events derived from a relist-diff (origin = resync)", m.resync_events.clone());
        r.register(
            "watch_restarts",
            "Watches opened again (timeout, closed or idle connection, error)",
            m.watch_restarts.clone(),
        );
        r.register(
            "watch_objects_slow_decoded",
            "Watch events with an object (added, modified, deleted) not in the apiserver's usual line layout, decoded the slow way; 0 on a standard apiserver",
            m.watch_objects_slow.clone(),
        );
        r.register(
            "watch_gathered",
            "Windows in which an apiserver connection gathered watch events that came in quick succession, to read them at once (cluster.watch_gather_ms)",
            m.watch_gathered.clone(),
        );
        r.register(
            "apiserver_received_bytes",
            "Bytes of the response bodies this process received from the apiserver (lists, watches, its Leases); with shards, what the apiserver's filtering saves shows here. Not counted with a proxy in the kubeconfig or exec credentials",
            m.apiserver_received_bytes.clone(),
        );
        r.register(
            "apiserver_requests",
            "Requests this process sent to the apiserver, by verb (list: one per page of a paginated list; watch: a streaming list or a watch; get, create, update, patch, delete, discovery) and resource (plural, e.g. configmaps, leases). Not counted with a proxy in the kubeconfig or exec credentials",
            m.apiserver_requests.clone(),
        );
        r.register("sink_connected", "1 when the sink's broker is reachable", m.sink_connected.clone());
        r.register(
            "sink_refused",
            "Events held because their destination refuses every event, a mistake in the set-up (reason: missing_topic, missing_stream, topic_not_authorized, cluster_not_authorized, ...): retried until it is fixed, never dead-lettered; /readyz names the destination and the fix",
            m.sink_refused.clone(),
        );
        r.register("build_info", "The running kubecast's version (always 1)", m.build_info.clone());
        r.register(
            "kafka_transactions",
            "Kafka transactions of the state store (with [sink.kafka] exactly_once: and the events), by outcome: committed, aborted, commit_pending (a commit that did not finish in time, finished before the next one)",
            m.transactions.clone(),
        );
        r.register(
            "kafka_transaction_events",
            "Events in the open Kafka transaction ([sink.kafka] exactly_once), not visible to read_committed consumers yet",
            m.transaction_events.clone(),
        );
        r.register_with_unit(
            "kafka_transaction",
            "Bytes of the events in the open Kafka transaction ([sink.kafka] exactly_once; at most max_uncommitted_bytes)",
            Unit::Bytes,
            m.transaction_bytes.clone(),
        );
        r.register(
            "kafka_transaction_full",
            "Times the uncommitted events reached [sink.kafka] max_uncommitted_events or max_uncommitted_bytes: sends waited for a commit to free room",
            m.transaction_full.clone(),
        );
        r.register(
            "shard_held",
            "1 for each [coordination] shard this process holds and runs (label shard: <index>-of-<count>), 0 once given up or lost",
            m.shard_held.clone(),
        );
        r.register(
            "shard_server_side",
            "Per stream of a shard: 1 when the apiserver applied the shard selector to the stream's last list (metadata.shardInfo), 0 when it did not and kubecast filters by the same hash itself",
            m.shard_server_side.clone(),
        );
        r.register(
            "shard_skipped",
            "Per stream of a shard: objects of other shards the apiserver sent (it did not apply the shard selector), skipped by kubecast",
            m.shard_skipped.clone(),
        );
        r.register(
            "shard_selector_dropped",
            "Per stream of a shard: times the stream stopped sending the shard selector and listed again, filtering on its own side, because an apiserver that had applied the selector sent an object of another shard (a watch served by an apiserver without the feature gate, or a shard hash that differs)",
            m.shard_selector_dropped.clone(),
        );
        for r in crate::model::Refusal::ALL {
            let _ = m.sink_refused.get_or_create(&Reason { reason: r.label() });
        }
        m.build_info.get_or_create(&Build { version: env!("CARGO_PKG_VERSION") }).set(1);
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// One stream's counters, resolved once (no label lookup per event). Indexed by verb:
/// added, modified, deleted.
pub struct StreamMetrics {
    pub resource: Resource,
    pub stream: Stream,
    pub observed: [Counter; 3],
    pub published: [Counter; 3],
    pub acked: [Counter; 3],
    pub dead_lettered: [Counter; 3],
    /// Per verb, per [`FILTER_REASONS`].
    filtered: [[Counter; 4]; 3],
    pub retries: Counter,
    /// Items the reflector emitted (for the checkpoint lag).
    pub read: AtomicU64,
    /// The last failed send of the stream: (event id, reason), for stall reports.
    last_failure: std::sync::Mutex<Option<(String, String)>>,
}

impl StreamMetrics {
    pub fn new(group: &str, kind: &str, stream: &str) -> Self {
        let m = get();
        let per_verb = |f: &Family<ResourceVerb, Counter>| {
            Verb::ALL.map(|v| f.get_or_create(&resource_verb(group, kind, v.as_str())).clone())
        };
        Self {
            resource: resource(group, kind),
            stream: Stream { stream: stream.to_string() },
            observed: per_verb(&m.events_observed),
            published: per_verb(&m.events_published),
            acked: per_verb(&m.events_acked),
            dead_lettered: per_verb(&m.events_dead_lettered),
            filtered: Verb::ALL.map(|v| {
                FILTER_REASONS.map(|reason| {
                    let r = resource(group, kind);
                    let key = Filtered { group: r.group, kind: r.kind, verb: v.as_str(), reason };
                    m.events_filtered.get_or_create(&key).clone()
                })
            }),
            retries: m.retries.get_or_create(&resource(group, kind)).clone(),
            read: AtomicU64::new(0),
            last_failure: std::sync::Mutex::new(None),
        }
    }

    /// Records a failed send (the failure path only).
    pub fn note_failure(&self, event_id: &str, reason: &str) {
        *self.last_failure.lock().expect("metrics lock") = Some((event_id.to_string(), reason.to_string()));
    }

    /// The last failed send: (event id, reason).
    pub fn last_failure(&self) -> Option<(String, String)> {
        self.last_failure.lock().expect("metrics lock").clone()
    }

    /// A send that had failed went through (the slow path only).
    pub fn clear_failure(&self) {
        *self.last_failure.lock().expect("metrics lock") = None;
    }

    /// A change not sent, and why (one of [`FILTER_REASONS`]).
    pub fn filtered(&self, verb: Verb, reason: &'static str) {
        let r = FILTER_REASONS.iter().position(|x| *x == reason).expect("a known filter reason");
        self.filtered[verb.index()][r].inc();
    }
}

/// The `reason` label values of `kubecast_events_filtered_total` (see `shaping::Dropped`).
pub const FILTER_REASONS: [&str; 4] = ["verb", "filter", "status_only", "unreadable"];

/// Per-stream counter of the reflector (relists, 410s, resync events, watch restarts).
pub fn stream_counter(family: &Family<Stream, Counter>, stream: &str) -> Counter {
    family.get_or_create(&Stream { stream: stream.to_string() }).clone()
}

/// Removes the per-stream gauges of `streams` (a shard that stopped here: its streams' stall,
/// checkpoint age and lag, and whether the apiserver filters them, are reported where they run).
pub fn forget_stream_gauges(streams: &[String]) {
    let m = get();
    for stream in streams {
        let label = Stream { stream: stream.clone() };
        m.stream_stalled.remove(&label);
        m.checkpoint_age.remove(&label);
        m.checkpoint_lag.remove(&label);
        m.shard_server_side.remove(&label);
    }
}

/// Labels of a resource from its `api_version` / group.
pub fn resource(group: &str, kind: &str) -> Resource {
    Resource { group: if group.is_empty() { "core".into() } else { group.to_string() }, kind: kind.to_string() }
}

pub fn resource_verb(group: &str, kind: &str, verb: &'static str) -> ResourceVerb {
    let r = resource(group, kind);
    ResourceVerb { group: r.group, kind: r.kind, verb }
}

/// One part's share of a process-wide gauge that several parts add to (each shard's queue and
/// Kafka transaction): [`GaugeShare::set`] moves the gauge by the difference, and dropping the
/// share takes it back, so the gauge is the sum of the parts that run.
#[derive(Debug)]
pub struct GaugeShare {
    gauge: Gauge,
    mine: std::sync::atomic::AtomicI64,
}

impl GaugeShare {
    pub fn new(gauge: &Gauge) -> Self {
        Self { gauge: gauge.clone(), mine: Default::default() }
    }

    pub fn set(&self, value: i64) {
        let old = self.mine.swap(value, std::sync::atomic::Ordering::Relaxed);
        if old != value {
            self.gauge.inc_by(value - old);
        }
    }
}

impl Drop for GaugeShare {
    fn drop(&mut self) {
        self.set(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn exposition_has_prefix_units_and_totals() {
        let m = super::get();
        m.events_observed.get_or_create(&super::resource_verb("", "ConfigMap", "added")).inc();
        m.publish_latency.observe(0.002);
        let text = m.encode();
        assert!(
            text.contains("kubecast_events_observed_total{group=\"core\",kind=\"ConfigMap\",verb=\"added\"} 1"),
            "{text}"
        );
        assert!(text.contains("kubecast_publish_latency_seconds_bucket"), "{text}");
        assert!(text.contains("kubecast_build_info{version=\""), "{text}");
        assert!(text.contains("# TYPE kubecast_queue_depth gauge"), "{text}");
    }

    #[test]
    fn shares_of_a_gauge_add_up_and_leave_with_their_part() {
        let gauge = super::Gauge::default();
        let (a, b) = (super::GaugeShare::new(&gauge), super::GaugeShare::new(&gauge));
        a.set(5);
        b.set(3);
        assert_eq!(gauge.get(), 8);
        a.set(2);
        assert_eq!(gauge.get(), 5);
        drop(b);
        assert_eq!(gauge.get(), 2, "a part that stopped no longer counts");
        drop(a);
        assert_eq!(gauge.get(), 0);
    }

    #[test]
    fn a_stopped_shard_s_stream_gauges_are_removed() {
        let m = super::get();
        let stream = "v1 ConfigMap (cluster-wide) [shard 3-of-4] forget-test".to_string();
        let label = super::Stream { stream: stream.clone() };
        m.stream_stalled.get_or_create(&label).set(1);
        m.checkpoint_age.get_or_create(&label).set(42.0);
        assert!(m.encode().contains("forget-test"));
        super::forget_stream_gauges(&[stream]);
        assert!(!m.encode().contains("forget-test"), "{}", m.encode());
    }
}
