//! Test kit of the delivery tests: events and jobs made as the pipeline makes them (a
//! `RawObject` from JSON, `Change` -> `CloudEvent`, `Effect::Watched`), and a queue around the
//! stub sink with a stream's real `StreamCheckpoint` on a temporary `FileStore`.

use std::path::PathBuf;
use std::sync::Arc;

use kube::api::{ApiResource, GroupVersionKind};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::config::{DeadLetterConfig, DeadLetterType, DeliveryConfig};
use super::dead_letter::DeadLetter;
use super::queue::{DeliveryError, Job, Queue};
use super::retry::RetryPolicy;
use crate::model::{
    Budget, Change, Effect, EventSource, Fields, IndexEntry, IndexOp, Origin, Position, RawObject, Verb,
};
use crate::observe::metrics::StreamMetrics;
use crate::observe::refusals::Refusals;
use crate::sink::Outbound;
use crate::sink::Sink;
use crate::sink::stub::StubSink;
use crate::state::store::file::FileStore;
use crate::state::store::{Owner, StreamKey};
use crate::state::watermark::StreamCheckpoint;

/// The namespace of every test object.
pub const NAMESPACE: &str = "n";

fn source() -> Arc<EventSource> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "ConfigMap"), "configmaps");
    Arc::new(EventSource::new("test", &ar))
}

/// The event of a change of ConfigMap `uid` (named after it) to resourceVersion `rv`.
pub fn outbound(uid: &str, rv: u64) -> Outbound {
    let object: RawObject = serde_json::from_str(&format!(
        r#"{{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"{uid}","namespace":"{NAMESPACE}","uid":"{uid}","resourceVersion":"{rv}"}},"data":{{"k":"v{rv}"}}}}"#
    ))
    .expect("a test object");
    let source = source();
    let fields = Fields { of_type: source.type_fields(), namespace: NAMESPACE.into(), verb: Verb::Modified.as_str() };
    let change = Change { verb: Verb::Modified, origin: Origin::Watch, object, source };
    Outbound { event: change.into_cloudevent().expect("an event"), fields, route: None, trace: None }
}

/// The id of [`outbound`]`(uid, rv)`'s event.
pub fn id(uid: &str, rv: u64) -> String {
    outbound(uid, rv).event.id().to_string()
}

/// Item `seq` of stream 0: the change of `uid` to `rv`, as a live watch event.
pub fn job(seq: u64, uid: &str, rv: u64) -> Job {
    let entry = IndexEntry { namespace: Some(NAMESPACE.into()), name: uid.into(), resource_version: rv.to_string() };
    Job {
        stream: 0,
        seq,
        effect: Effect::Watched { op: IndexOp::Upsert(uid.into(), entry), rv: rv.to_string() },
        msg: Some(Box::new(outbound(uid, rv))),
        limiter: None,
        verb: Verb::Modified,
    }
}

/// Item `seq` of stream 0 without an event: a bookmark at `rv`.
pub fn bookmark(seq: u64, rv: u64) -> Job {
    Job { stream: 0, seq, effect: Effect::Bookmark(rv.to_string()), msg: None, limiter: None, verb: Verb::Modified }
}

/// `[delivery]` for the tests: `queue_capacity`, `max_in_flight`, backoff 100 ms .. 1 s,
/// retries forever, the dead letter a file in the temporary directory.
pub fn config(queue_capacity: usize, max_in_flight: usize) -> DeliveryConfig {
    DeliveryConfig { queue_capacity, max_in_flight, backoff_min_ms: 100, backoff_max_ms: 1000, ..Default::default() }
}

/// A queue around a stub sink, with one stream whose checkpoint is stored in a temporary
/// directory.
pub struct Harness {
    pub queue: Arc<Queue>,
    pub stub: StubSink,
    pub checkpoint: Arc<StreamCheckpoint>,
    pub store: FileStore,
    pub key: StreamKey,
    /// The stream's counters; labelled with the test's own kind, so no other test counts in them.
    pub metrics: Arc<StreamMetrics>,
    /// Where the file dead letter writes.
    pub dead_letter: PathBuf,
    /// Where the queue reports destinations that refuse every event.
    pub refusals: Arc<Refusals>,
    /// Removed when the harness is dropped.
    _dir: tempfile::TempDir,
}

impl Harness {
    /// `kind`: a name of the test's own (the metrics' label).
    pub fn new(cfg: &DeliveryConfig, kind: &str) -> Self {
        Self::sharing(cfg, kind, &Budget::new(cfg.queue_capacity), &Budget::new(cfg.max_in_flight))
    }

    /// As [`Harness::new`], its queue taking a part of `capacity` and `in_flight` (the bounds
    /// of a process, shared by its shards' queues) instead of `cfg`'s.
    pub fn sharing(cfg: &DeliveryConfig, kind: &str, capacity: &Arc<Budget>, in_flight: &Arc<Budget>) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = FileStore::open(dir.path(), Owner::default()).expect("a checkpoint store");
        let key = StreamKey {
            cluster: "test".into(),
            group: "".into(),
            version: "v1".into(),
            kind: kind.into(),
            namespace: Some(NAMESPACE.into()),
            label_selector: "".into(),
            field_selector: "".into(),
            shard: None,
        };
        assert!(store.load(&key).expect("a checkpoint").is_none(), "a new store");
        let checkpoint = Arc::new(StreamCheckpoint::new(key.clone(), None));
        let metrics = Arc::new(StreamMetrics::new("delivery-test", kind, kind));
        let stub = StubSink::new();
        let retry = RetryPolicy::new(cfg);
        let dead_letter = dir.path().join("dead-letter.jsonl");
        let refusals = Arc::new(Refusals::default());
        let queue = Arc::new(Queue {
            sink: Arc::new(Sink::Stub(stub.clone())),
            limiter: None,
            retry,
            dead_letter: Arc::new(DeadLetter::new(&cfg.dead_letter, dir.path(), retry)),
            in_flight: in_flight.part(),
            capacity: capacity.part(),
            checkpoints: vec![checkpoint.clone()],
            metrics: vec![metrics.clone()],
            gate: None,
            refusals: refusals.clone(),
        });
        Self { queue, stub, checkpoint, store, key, metrics, dead_letter, refusals, _dir: dir }
    }

    /// Runs the queue as a task, fed by a channel of `channel` places.
    pub fn start(&self, channel: usize) -> (mpsc::Sender<Job>, JoinHandle<Result<(), DeliveryError>>) {
        let (tx, rx) = mpsc::channel(channel);
        let queue = self.queue.clone();
        (tx, tokio::spawn(async move { queue.run(rx).await }))
    }

    /// Writes what changed, as the persister does; `false` when nothing had.
    pub fn persist(&self) -> bool {
        match self.checkpoint.take(self.store.wants_full(&self.key)) {
            Some(d) => {
                self.store.write(&self.key, &d).expect("checkpoint written");
                true
            }
            None => false,
        }
    }

    /// The committed position (what the persister would write).
    pub fn committed(&self) -> Position {
        self.checkpoint.committed()
    }

    /// Jobs with an event acknowledged (each counted once per acknowledgement).
    pub fn acked_events(&self) -> u64 {
        self.metrics.acked[Verb::Modified.index()].get()
    }

    /// The dead letter's lines, parsed.
    pub fn dead_letters(&self) -> Vec<serde_json::Value> {
        read_json_lines(&self.dead_letter)
    }
}

/// A `[delivery.dead_letter]` of type `kind` (a file at `path`, if given).
pub fn dead_letter_config(kind: DeadLetterType, path: Option<PathBuf>) -> DeadLetterConfig {
    DeadLetterConfig { kind, path, destination: None }
}

/// Each line of `path` as JSON (none if there is no file).
pub fn read_json_lines(path: &std::path::Path) -> Vec<serde_json::Value> {
    let Ok(text) = std::fs::read_to_string(path) else { return Vec::new() };
    text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect()
}

/// Lets every task run until all wait (for the stub, a channel or a timer), then a second of
/// tokio time more (paused: no wall time).
pub async fn settle() {
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}
