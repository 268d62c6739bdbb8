//! Shared health state: written by the streams and the sink, read by `/readyz`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use super::refusals::Refusals;
use crate::model::Shard;

/// Where a stream is, as readiness sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StreamPhase {
    Starting = 0,
    WaitingForKind = 1,
    Synced = 2,
}

/// The sink whose connection readiness and `kubecast_sink_connected` report.
#[derive(Debug)]
enum SinkSignal {
    /// Not open yet: the process is starting (its admin server already answers).
    Opening,
    /// Whether its broker is reachable, and why not when the sink knows.
    Open { connected: Arc<AtomicBool>, cause: Arc<Mutex<Option<String>>> },
    /// `[coordination] shards`: each shard held has a sink of its own, with its own health.
    PerShard,
}

/// Shared health state, written by the streams and the sink, read by `/readyz`.
#[derive(Debug)]
pub struct Health {
    streams: Vec<(String, AtomicU8)>,
    sink: Mutex<SinkSignal>,
    shutting_down: AtomicBool,
    /// Why the apiserver cannot be reached, while it cannot (names its address).
    apiserver: Mutex<Option<String>>,
    /// Per stream: why its checkpoint is stalled, while it is.
    stalls: Mutex<Vec<Option<String>>>,
    /// Why this process does not run its streams (`[coordination]`: another holds the lease).
    standby: Mutex<Option<String>>,
    /// Why the Lease cannot be read or taken (forbidden, apiserver errors), while it cannot: a
    /// standby that could never take over is not ready, so that a rollout shows it.
    lease: Mutex<Option<String>>,
    /// `[coordination] shards`: the shards this process runs, each with its streams' health.
    shards: Mutex<BTreeMap<Shard, Arc<Health>>>,
    /// Exactly-once: whether the transactional producer, which sends the events, reaches its
    /// brokers. It is the sink's connection then: the sink's own producer stays idle.
    transaction: Mutex<Option<Arc<AtomicBool>>>,
    /// Destinations that refuse every event (a set-up mistake), held by the delivery queue.
    refusals: Arc<Refusals>,
    /// Destinations looked up at start that are missing or refused, until they are not.
    destinations: Mutex<Vec<String>>,
    /// Why the state store cannot be used, while it cannot: opening it is refused for a set-up
    /// reason (a missing ACL), or (exactly-once) no commit succeeded for too long (the events
    /// sent meanwhile are invisible to `read_committed` consumers).
    state: Mutex<Option<String>>,
}

impl Health {
    /// The health of `stream_names`, whose sink is not open yet ([`Self::set_sink`]).
    pub fn new(stream_names: Vec<String>) -> Arc<Self> {
        Self::with_sink(stream_names, SinkSignal::Opening)
    }

    /// A sharded process's: no streams or sink of its own, its shards' health under it.
    pub fn sharded() -> Arc<Self> {
        Self::with_sink(Vec::new(), SinkSignal::PerShard)
    }

    fn with_sink(stream_names: Vec<String>, sink: SinkSignal) -> Arc<Self> {
        let stalls = Mutex::new(vec![None; stream_names.len()]);
        Arc::new(Self {
            stalls,
            streams: stream_names.into_iter().map(|n| (n, AtomicU8::new(StreamPhase::Starting as u8))).collect(),
            sink: Mutex::new(sink),
            shutting_down: AtomicBool::new(false),
            apiserver: Mutex::new(None),
            standby: Mutex::new(None),
            lease: Mutex::new(None),
            shards: Mutex::new(BTreeMap::new()),
            refusals: Arc::default(),
            transaction: Mutex::new(None),
            state: Mutex::new(None),
            destinations: Mutex::new(Vec::new()),
        })
    }

    /// The sink is open: `connected` says whether its broker is reachable, `cause` why not.
    pub fn set_sink(&self, connected: Arc<AtomicBool>, cause: Arc<Mutex<Option<String>>>) {
        *self.sink.lock().expect("health lock") = SinkSignal::Open { connected, cause };
    }

    /// Exactly-once: the transactional producer sends the events; `connected` says whether it
    /// reaches its brokers. Readiness and `kubecast_sink_connected` follow it from now on,
    /// not the sink's own producer, which sends nothing then (and whose idle connection
    /// librdkafka may leave down after an outage, failing every probe while the events flow).
    pub fn set_transaction_connection(&self, connected: Arc<AtomicBool>) {
        *self.transaction.lock().expect("health lock") = Some(connected);
    }

    /// The transactional producer's connection, with exactly-once.
    fn transaction_connected(&self) -> Option<bool> {
        self.transaction.lock().expect("health lock").as_ref().map(|c| c.load(Ordering::Relaxed))
    }

    /// `Some(reason)` while the state store cannot be used (its opening refused; exactly-once:
    /// no commit succeeded for too long); `None` once it can.
    pub fn set_state_problem(&self, reason: Option<String>) {
        *self.state.lock().expect("health lock") = reason;
    }

    /// The destinations looked up at start that are missing or refused (empty: none).
    pub fn set_destination_problems(&self, problems: Vec<String>) {
        *self.destinations.lock().expect("health lock") = problems;
    }

    /// Why the state store cannot be used, if it cannot.
    pub fn state_problem(&self) -> Option<String> {
        self.state.lock().expect("health lock").clone()
    }

    /// Where the delivery queue reports destinations that refuse every event.
    pub fn refusals(&self) -> Arc<Refusals> {
        self.refusals.clone()
    }

    /// `[coordination] shards`: this process runs `shard`, whose streams report to `health`
    /// (`None`: it no longer does).
    pub fn set_shard(&self, shard: Shard, health: Option<Arc<Health>>) {
        let mut shards = self.shards.lock().expect("health lock");
        match health {
            Some(h) => shards.insert(shard, h),
            None => shards.remove(&shard),
        };
    }

    /// The shards this process runs, in order.
    pub fn shards(&self) -> Vec<Shard> {
        self.shards.lock().expect("health lock").keys().copied().collect()
    }

    /// `Some(reason)`: a standby, not running its streams; `None`: the active process.
    pub fn set_standby(&self, reason: Option<String>) {
        *self.standby.lock().expect("health lock") = reason;
    }

    /// `Some(reason)`: the Lease cannot be read or taken; `None`: it can.
    pub fn set_lease_problem(&self, reason: Option<String>) {
        *self.lease.lock().expect("health lock") = reason;
    }

    /// Why this process stands by, if it does.
    pub fn standby(&self) -> Option<String> {
        self.standby.lock().expect("health lock").clone()
    }

    /// `Some(reason)`: the stream's checkpoint is stalled; `None`: it moves.
    pub fn set_stalled(&self, stream: usize, reason: Option<String>) {
        self.stalls.lock().expect("health lock")[stream] = reason;
    }

    /// `Some(reason)`: the apiserver cannot be reached; `None`: it answers.
    pub fn set_apiserver_unreachable(&self, reason: Option<String>) {
        *self.apiserver.lock().expect("health lock") = reason;
    }

    pub fn set_phase(&self, stream: usize, phase: StreamPhase) {
        self.streams[stream].1.store(phase as u8, Ordering::Relaxed);
    }

    /// Whether the sink's destination is reachable (stdout and file: always; not before the
    /// sink is open; sharded: every held shard's).
    pub fn sink_connected(&self) -> bool {
        match &*self.sink.lock().expect("health lock") {
            SinkSignal::Opening => false,
            SinkSignal::Open { connected, .. } => {
                self.transaction_connected().unwrap_or_else(|| connected.load(Ordering::Relaxed))
            }
            SinkSignal::PerShard => {
                self.shards.lock().expect("health lock").values().all(|shard| shard.sink_connected())
            }
        }
    }

    pub fn set_shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// Empty when ready; otherwise why not, one reason per line.
    pub fn not_ready(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.shutting_down.load(Ordering::Relaxed) {
            out.push("shutting down".to_string());
        }
        if let Some(reason) = self.lease.lock().expect("health lock").as_ref() {
            out.push(reason.clone());
        }
        if self.standby().is_some() {
            // A standby is ready (its pod must not hold up rollouts, drains or its host's
            // endpoints); `/readyz` says it stands by, `kubecast_leader` is 0.
            return out;
        }
        for (name, phase) in &self.streams {
            match phase.load(Ordering::Relaxed) {
                p if p == StreamPhase::WaitingForKind as u8 => {
                    out.push(format!("stream {name}: waiting for its kind to be served"))
                }
                p if p == StreamPhase::Starting as u8 => out.push(format!("stream {name}: initial sync not done")),
                _ => {}
            }
        }
        out.extend(self.refusals.describe());
        out.extend(self.destinations.lock().expect("health lock").iter().cloned());
        out.extend(self.state.lock().expect("health lock").clone());
        out.extend(self.stalls.lock().expect("health lock").iter().flatten().cloned());
        for (shard, health) in self.shards.lock().expect("health lock").iter() {
            out.extend(health.not_ready().into_iter().map(|r| format!("shard {}: {r}", shard.label())));
        }
        if let Some(reason) = self.apiserver.lock().expect("health lock").as_ref() {
            out.push(reason.clone());
        }
        match &*self.sink.lock().expect("health lock") {
            SinkSignal::Opening => out.push("sink: not open yet".to_string()),
            SinkSignal::Open { .. } if self.transaction_connected() == Some(false) => {
                out.push("sink: broker not reachable by the transactional producer (exactly-once)".to_string())
            }
            SinkSignal::Open { .. } if self.transaction_connected().is_some() => {}
            SinkSignal::Open { connected, cause } if !connected.load(Ordering::Relaxed) => {
                match cause.lock().expect("health lock").as_deref() {
                    Some(cause) => out.push(format!("sink: broker not reachable: {cause}")),
                    None => out.push("sink: broker not reachable".to_string()),
                }
            }
            // Each shard's sink is among its reasons above.
            SinkSignal::Open { .. } | SinkSignal::PerShard => {}
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(streams: &[&str]) -> Arc<Health> {
        let h = Health::new(streams.iter().map(|s| s.to_string()).collect());
        h.set_sink(Arc::new(AtomicBool::new(true)), Default::default());
        h
    }

    #[test]
    fn a_held_shard_s_streams_count_for_readiness_with_the_shard_named() {
        let process = Health::sharded();
        let shard = Shard::new(1, 4).unwrap();
        let streams = health(&["v1 ConfigMap (cluster-wide) [shard 1-of-4]"]);
        process.set_shard(shard, Some(streams.clone()));
        assert_eq!(process.shards(), [shard]);
        assert_eq!(
            process.not_ready(),
            ["shard 1-of-4: stream v1 ConfigMap (cluster-wide) [shard 1-of-4]: initial sync not done"]
        );
        streams.set_phase(0, StreamPhase::Synced);
        assert!(process.not_ready().is_empty());
        process.set_shard(shard, None);
        assert!(process.shards().is_empty());
    }

    #[test]
    fn a_standby_is_ready_unless_the_lease_cannot_be_read_or_taken() {
        let h = health(&["v1 ConfigMap"]);
        h.set_standby(Some("standby: lease ns/l held by other".into()));
        assert!(h.not_ready().is_empty(), "a standby does not hold up rollouts");
        h.set_lease_problem(Some("the lease cannot be read or taken: forbidden".into()));
        assert_eq!(h.not_ready(), ["the lease cannot be read or taken: forbidden"]);
        h.set_lease_problem(None);
        assert!(h.not_ready().is_empty());
    }

    #[test]
    fn the_sink_is_not_ready_until_open_and_while_its_broker_is_not_reachable() {
        let h = Health::new(Vec::new());
        assert!(!h.sink_connected());
        assert_eq!(h.not_ready(), ["sink: not open yet"]);
        let (connected, cause) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(None)));
        h.set_sink(connected.clone(), cause.clone());
        assert_eq!(h.not_ready(), ["sink: broker not reachable"]);
        *cause.lock().unwrap() = Some("connection refused".into());
        assert_eq!(h.not_ready(), ["sink: broker not reachable: connection refused"]);
        connected.store(true, Ordering::Relaxed);
        assert!(h.sink_connected() && h.not_ready().is_empty());
    }

    #[test]
    fn with_exactly_once_the_transactional_producer_s_connection_is_the_sink_s() {
        let (h, sink) = (Health::new(Vec::new()), Arc::new(AtomicBool::new(true)));
        h.set_sink(sink.clone(), Default::default());
        let txn = Arc::new(AtomicBool::new(true));
        h.set_transaction_connection(txn.clone());
        assert!(h.sink_connected() && h.not_ready().is_empty());
        sink.store(false, Ordering::Relaxed);
        assert!(h.sink_connected() && h.not_ready().is_empty(), "the idle producer does not count");
        txn.store(false, Ordering::Relaxed);
        assert!(!h.sink_connected());
        assert_eq!(h.not_ready(), ["sink: broker not reachable by the transactional producer (exactly-once)"]);
        txn.store(true, Ordering::Relaxed);
        assert!(h.sink_connected() && h.not_ready().is_empty());
    }

    #[test]
    fn a_destination_that_refuses_every_event_makes_the_process_not_ready_while_it_does() {
        let h = health(&[]);
        let hold = h.refusals().hold("Kafka topic t", crate::model::Refusal::MissingTopic, "Unknown topic");
        let reasons = h.not_ready();
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(reasons[0].starts_with("sink: Kafka topic t refuses every event"), "{reasons:?}");
        drop(hold);
        assert!(h.not_ready().is_empty());
    }

    #[test]
    fn commits_failing_for_too_long_make_the_process_not_ready_until_one_succeeds() {
        let h = health(&[]);
        h.set_state_problem(Some("state: no commit succeeded for 31 s".into()));
        assert_eq!(h.not_ready(), ["state: no commit succeeded for 31 s"]);
        h.set_state_problem(None);
        assert!(h.not_ready().is_empty());
    }

    #[test]
    fn a_sharded_process_s_sink_is_connected_when_every_held_shard_s_is() {
        let process = Health::sharded();
        assert!(process.sink_connected(), "holding no shard: nothing disconnected");
        let (one, two) = (health(&[]), Health::new(Vec::new()));
        process.set_shard(Shard::new(0, 2).unwrap(), Some(one));
        assert!(process.sink_connected());
        let connected = Arc::new(AtomicBool::new(false));
        two.set_sink(connected.clone(), Default::default());
        process.set_shard(Shard::new(1, 2).unwrap(), Some(two));
        assert!(!process.sink_connected(), "one shard's broker not reachable");
        assert_eq!(process.not_ready(), ["shard 1-of-2: sink: broker not reachable"]);
        connected.store(true, Ordering::Relaxed);
        assert!(process.sink_connected() && process.not_ready().is_empty());
    }
}
