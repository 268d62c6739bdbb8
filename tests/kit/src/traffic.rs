//! A steady load of changes and an independent consumer that judges what a kubecast published:
//! nothing lost, each object's changes in apiserver order, the rebuilt view equal to the
//! apiserver's list; duplicates counted (at least once) or refused (exactly once).
//!
//! The load creates, updates and deletes ConfigMaps of one namespace at a fixed rate and
//! remembers every resourceVersion it was given; the reader reads the sink's topic (Kafka, every
//! partition from the beginning) or stream (NATS JetStream) from its own connection.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};

/// One event as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub id: String,
    pub uid: String,
    pub verb: String,
    pub name: String,
    pub rv: u64,
    /// `snapshot`, `watch` or `resync` (the `origin` extension).
    pub origin: String,
    /// When the consumer read it.
    pub at: Instant,
}

impl Seen {
    /// From a structured event (the JSON envelope), or from a binary one (`ce_*` / `ce-*`
    /// headers and the object as the body).
    fn parse(body: &[u8], header: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let (id, ty, origin, data) = match header("id") {
            Some(id) => (id, header("type")?, header("origin")?, serde_json::from_slice::<Value>(body).ok()?),
            None => {
                let e: Value = serde_json::from_slice(body).ok()?;
                let text = |k: &str| Some(e[k].as_str()?.to_string());
                (text("id")?, text("type")?, text("origin")?, e["data"].clone())
            }
        };
        let meta = &data["metadata"];
        Some(Self {
            id,
            uid: meta["uid"].as_str()?.to_string(),
            verb: ty.rsplit('.').next()?.to_string(),
            name: meta["name"].as_str()?.to_string(),
            rv: meta["resourceVersion"].as_str()?.parse().ok()?,
            origin,
            at: Instant::now(),
        })
    }
}

/// Where the consumer reads.
#[derive(Clone, Debug)]
pub enum Source {
    /// A Kafka topic, every partition from the beginning; `read_committed` hides aborted
    /// transactions (what an exactly-once consumer does).
    Kafka { brokers: String, topic: String, read_committed: bool },
    /// A JetStream stream, from its first message.
    Nats { url: String, stream: String },
    /// The log of the HTTP receiver example (`examples/receivers/http`): a JSON line per
    /// accepted request, `{"attributes": {...}, "data": ...}`, from its first line.
    HttpLog { path: std::path::PathBuf },
}

/// What the load wrote: per uid, the resourceVersions of its creates and updates, and
/// whether it was deleted.
#[derive(Default, Debug, Clone)]
pub struct Written {
    pub changes: BTreeMap<String, Vec<u64>>,
    pub deleted: Vec<String>,
}

impl Written {
    pub fn count(&self) -> usize {
        self.changes.values().map(Vec::len).sum::<usize>() + self.deleted.len()
    }
}

/// Creates, updates and deletes ConfigMaps named `cm-0` .. `cm-<names-1>` at about
/// `per_second`, until `stop`; each created with a key `pad` of `pad` bytes (kept by the
/// updates: every event carries it).
pub async fn load(
    api: Api<ConfigMap>,
    names: usize,
    per_second: u64,
    pad: usize,
    written: Arc<Mutex<Written>>,
    stop: Arc<AtomicBool>,
) {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut live: HashMap<String, String> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / per_second));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        n += 1;
        let name = format!("cm-{}", rnd() % names as u64);
        match live.get(&name).cloned() {
            None => {
                let mut data = json!({"n": n.to_string()});
                if pad > 0 {
                    data["pad"] = json!("p".repeat(pad));
                }
                let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name}, "data": data})).unwrap();
                if let Ok(c) = api.create(&PostParams::default(), &cm).await {
                    let uid = c.metadata.uid.unwrap();
                    let rv = c.metadata.resource_version.unwrap().parse().unwrap();
                    written.lock().unwrap().changes.entry(uid.clone()).or_default().push(rv);
                    live.insert(name, uid);
                }
            }
            Some(uid) if rnd() % 10 < 7 => {
                let patch = json!({"data": {"n": n.to_string()}});
                if let Ok(c) = api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await {
                    let rv = c.metadata.resource_version.unwrap().parse().unwrap();
                    written.lock().unwrap().changes.entry(uid).or_default().push(rv);
                }
            }
            Some(uid) => {
                if api.delete(&name, &DeleteParams::default()).await.is_ok() {
                    written.lock().unwrap().deleted.push(uid);
                    live.remove(&name);
                }
            }
        }
    }
}

/// Reads `source` into `out` until `stop`.
pub fn reader(source: Source, out: Arc<Mutex<Vec<Seen>>>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    match source {
        Source::Kafka { brokers, topic, read_committed } => {
            tokio::spawn(kafka_reader(brokers, topic, read_committed, out, stop))
        }
        Source::Nats { url, stream } => tokio::spawn(nats_reader(url, stream, out, stop)),
        Source::HttpLog { path } => tokio::spawn(http_log_reader(path, out, stop)),
    }
}

/// Follows the receiver's log: every whole line, as it is appended.
async fn http_log_reader(path: std::path::PathBuf, out: Arc<Mutex<Vec<Seen>>>, stop: Arc<AtomicBool>) {
    let mut done = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let text = std::fs::read(&path).unwrap_or_default();
        // Whole lines only: the receiver may be writing the last one.
        let end = text.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if end > done {
            for line in text[done..end].split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                let e: Value = serde_json::from_slice(line).expect("a receiver log line is JSON");
                let body = serde_json::to_vec(&e["data"]).unwrap();
                let attr = |k: &str| e["attributes"][k].as_str().map(str::to_owned);
                let seen = Seen::parse(&body, attr)
                    .unwrap_or_else(|| panic!("not an event: {}", String::from_utf8_lossy(line)));
                out.lock().unwrap().push(seen);
            }
            done = end;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn kafka_reader(brokers: String, topic: String, read_committed: bool, out: Arc<Mutex<Vec<Seen>>>, stop: Arc<AtomicBool>) {
    let new_consumer = || -> StreamConsumer {
        ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", crate::unique("traffic"))
            .set("isolation.level", if read_committed { "read_committed" } else { "read_uncommitted" })
            .set("enable.auto.commit", "false")
            .set("topic.metadata.refresh.interval.ms", "500")
            .create()
            .expect("a Kafka consumer")
    };
    let mut consumer = new_consumer();
    if !assign_from_beginning(&consumer, &topic, &stop).await {
        return;
    }
    // The next offset per partition, to continue with a new consumer: after a broker pause, a
    // librdkafka consumer that reported all brokers down sometimes fetches nothing more for
    // minutes while a new one reads on (seen with librdkafka 2.12 and a SIGSTOPped broker).
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    let mut failed_at: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let m = match tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await {
            Ok(Ok(m)) => Some(m),
            Ok(Err(e)) => {
                if failed_at.is_none() {
                    eprintln!("[traffic] the test's Kafka reader of {topic}: {e}");
                    failed_at = Some(Instant::now());
                }
                None
            }
            Err(_) => None,
        };
        let Some(m) = m else {
            if failed_at.is_some_and(|at| at.elapsed() > Duration::from_secs(10)) {
                eprintln!("[traffic] the test's Kafka reader of {topic}: nothing for 10 s after an error; a new consumer continues at {next:?}");
                consumer = new_consumer();
                let mut tpl = TopicPartitionList::new();
                let partitions = consumer
                    .fetch_metadata(Some(&topic), Duration::from_secs(5))
                    .ok()
                    .and_then(|md| md.topics().first().map(|t| t.partitions().len() as i32))
                    .unwrap_or(1);
                for p in 0..partitions {
                    let at = next.get(&p).map_or(Offset::Beginning, |o| Offset::Offset(*o));
                    tpl.add_partition_offset(&topic, p, at).unwrap();
                }
                consumer.assign(&tpl).unwrap();
                failed_at = None;
            }
            continue;
        };
        failed_at = None;
        next.insert(m.partition(), m.offset() + 1);
        let Some(body) = m.payload() else { continue }; // a tombstone
        let header = |k: &str| {
            let want = format!("ce_{k}");
            m.headers()?.iter().find(|h| h.key == want).and_then(|h| h.value).map(|v| String::from_utf8_lossy(v).into())
        };
        let seen = Seen::parse(body, header).unwrap_or_else(|| panic!("not an event: {}", String::from_utf8_lossy(body)));
        out.lock().unwrap().push(seen);
    }
}

/// Assigns every partition of `topic` to `consumer`, from the beginning, once the topic
/// exists; false when `stop` was set first.
pub async fn assign_from_beginning(consumer: &StreamConsumer, topic: &str, stop: &AtomicBool) -> bool {
    let partitions = loop {
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        if let Ok(md) = consumer.fetch_metadata(Some(topic), Duration::from_secs(2))
            && let Some(t) =
                md.topics().iter().find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
        {
            break t.partitions().len() as i32;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    true
}

async fn nats_reader(url: String, stream: String, out: Arc<Mutex<Vec<Seen>>>, stop: Arc<AtomicBool>) {
    use async_nats::jetstream::consumer::{DeliverPolicy, pull};
    let client = async_nats::connect(&url).await.expect("a NATS connection");
    let js = async_nats::jetstream::new(client);
    let st = loop {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(s) = js.get_stream(&stream).await {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let consumer = st
        .create_consumer(pull::Config { deliver_policy: DeliverPolicy::All, ..Default::default() })
        .await
        .expect("an ephemeral consumer");
    let mut messages = consumer.messages().await.expect("messages");
    while !stop.load(Ordering::Relaxed) {
        let Ok(Some(Ok(m))) = tokio::time::timeout(Duration::from_millis(500), messages.next()).await else {
            continue;
        };
        let header = |k: &str| Some(m.headers.as_ref()?.get(format!("ce-{k}").as_str())?.as_str().to_string());
        let seen = Seen::parse(&m.payload, header)
            .unwrap_or_else(|| panic!("not an event: {}", String::from_utf8_lossy(&m.payload)));
        out.lock().unwrap().push(seen);
        let _ = m.ack().await;
    }
}

/// How strictly duplicates are judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Every change at least once: duplicates (the same id again) are counted, then dropped.
    AtLeastOnce,
    /// Every change exactly once: any id seen twice fails.
    ExactlyOnce,
}

/// What a finished [`Traffic`] found.
#[derive(Debug)]
pub struct Verdict {
    /// What the load wrote.
    pub written: Written,
    pub seen: usize,
    pub duplicates: usize,
    /// Events of a relist after 410 Gone (`origin = resync`).
    pub resyncs: usize,
    /// Every event read, in the order read.
    pub events: Vec<Seen>,
}

/// Checks `seen` against `written` and the apiserver's list `now`; panics naming what is wrong.
pub fn judge(seen: &[Seen], written: Written, now: &BTreeMap<String, u64>, delivery: Delivery) -> Verdict {
    // A load that wrote nothing, or a reader that read nothing, would pass every check below.
    assert!(written.count() > 0, "the load wrote nothing (every apiserver write failed): nothing was tested");
    assert!(!seen.is_empty(), "the reader saw nothing of the {} changes written", written.count());
    let mut first: HashMap<&str, usize> = HashMap::new();
    let mut unique = Vec::with_capacity(seen.len());
    for s in seen {
        let n = first.entry(&s.id).or_default();
        *n += 1;
        if *n == 1 {
            unique.push(s);
        }
    }
    let duplicates = seen.len() - unique.len();
    if delivery == Delivery::ExactlyOnce {
        let dups: Vec<_> = first.iter().filter(|(_, n)| **n > 1).take(10).collect();
        assert!(dups.is_empty(), "{duplicates} events seen more than once (of {}): {dups:?}", seen.len());
    }
    // Per object: its creates and updates, in the order written, then its delete.
    let mut per_uid: BTreeMap<&str, Vec<&Seen>> = BTreeMap::new();
    for s in &unique {
        per_uid.entry(&s.uid).or_default().push(s);
    }
    for (uid, rvs) in &written.changes {
        let got: Vec<u64> =
            per_uid.get(uid.as_str()).into_iter().flatten().filter(|s| s.verb != "deleted").map(|s| s.rv).collect();
        // After a relist (410 Gone: the watch history expired) an object's latest state comes as
        // one `resync` event: the versions before it were never visible to anyone (documented in
        // docs/guarantees.md). Only those may be missing.
        let resynced = per_uid
            .get(uid.as_str())
            .into_iter()
            .flatten()
            .filter(|s| s.origin == "resync")
            .map(|s| s.rv)
            .max()
            .unwrap_or(0);
        let want: Vec<u64> = rvs.iter().copied().filter(|rv| *rv >= resynced || got.contains(rv)).collect();
        if got != want {
            // What a failure needs: each event's origin and version, and where the initial list
            // of the stream was (a change before it may be invisible: see `Traffic::start_after`).
            let events: Vec<_> =
                per_uid.get(uid.as_str()).into_iter().flatten().map(|s| (s.verb.as_str(), s.origin.as_str(), s.rv)).collect();
            let listed_at = unique.iter().filter(|s| s.origin == "snapshot").map(|s| s.rv).max();
            panic!(
                "object {uid}: every change written, in apiserver order (resync at {resynced})\n  got:  {got:?}\n  want: {want:?}\n  its events (verb, origin, rv): {events:?}\n  latest snapshot event of any object at rv {listed_at:?}"
            );
        }
        let deletes = per_uid.get(uid.as_str()).into_iter().flatten().filter(|s| s.verb == "deleted").count();
        let deleted = written.deleted.contains(uid);
        assert_eq!(deletes, usize::from(deleted), "object {uid}: deleted {deleted}, delete events {deletes}");
        if deleted {
            assert_eq!(per_uid[uid.as_str()].last().unwrap().verb, "deleted", "object {uid}: the delete comes last");
        }
    }
    // Other objects (made before the load, e.g. to check a resumed process lists nothing
    // again) must be in the apiserver's list: the view check below covers their content.
    let strays: Vec<_> = unique
        .iter()
        .filter(|s| !written.changes.contains_key(&s.uid) && !now.contains_key(&s.name))
        .map(|s| (&s.name, &s.verb))
        .take(10)
        .collect();
    assert!(strays.is_empty(), "events of objects the load did not write and the apiserver does not list: {strays:?}");
    // The view a consumer builds equals the apiserver's list (kept per uid: a name deleted and
    // created again has two uids, whose events may sit in two partitions).
    let mut last: HashMap<&str, &Seen> = HashMap::new();
    for s in &unique {
        last.insert(&s.uid, s);
    }
    let view: BTreeMap<String, u64> =
        last.values().filter(|s| s.verb != "deleted").map(|s| (s.name.clone(), s.rv)).collect();
    assert_eq!(&view, now, "the view rebuilt from the events is the apiserver's list");
    let resyncs = unique.iter().filter(|s| s.origin == "resync").count();
    Verdict { written, seen: seen.len(), duplicates, resyncs, events: seen.to_vec() }
}

/// How many of the changes `written` no event in `seen` carries yet (a resync event of an
/// object stands for its versions before it).
fn missing(seen: &[Seen], written: &Written) -> usize {
    let mut have: HashMap<&str, (std::collections::HashSet<u64>, u64, bool)> = HashMap::new();
    for s in seen {
        let e = have.entry(&s.uid).or_default();
        if s.verb == "deleted" {
            e.2 = true;
        } else {
            e.0.insert(s.rv);
            if s.origin == "resync" {
                e.1 = e.1.max(s.rv);
            }
        }
    }
    let empty = Default::default();
    let changes: usize = written
        .changes
        .iter()
        .map(|(uid, rvs)| {
            let (got, resynced, _) = have.get(uid.as_str()).unwrap_or(&empty);
            rvs.iter().filter(|rv| **rv >= *resynced && !got.contains(rv)).count()
        })
        .sum();
    changes + written.deleted.iter().filter(|uid| !have.get(uid.as_str()).is_some_and(|e| e.2)).count()
}

/// The ConfigMaps of `api`'s namespace: name -> resourceVersion.
pub async fn listed(api: &Api<ConfigMap>) -> BTreeMap<String, u64> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|c| (c.metadata.name.unwrap(), c.metadata.resource_version.unwrap().parse().unwrap()))
        .collect()
}

/// A reader of the sink and a load on `api`'s ConfigMaps, running until [`Traffic::finish`].
pub struct Traffic {
    api: Api<ConfigMap>,
    stop: Arc<AtomicBool>,
    load_stop: Arc<AtomicBool>,
    written: Arc<Mutex<Written>>,
    seen: Arc<Mutex<Vec<Seen>>>,
    loader: Option<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    /// `per_second` changes on `names` ConfigMaps, read back from `source`.
    pub fn start(api: &Api<ConfigMap>, source: Source, names: usize, per_second: u64) -> Self {
        Self::start_padded(api, source, names, per_second, 0)
    }

    /// As [`Traffic::start`], each ConfigMap carrying `pad` bytes more (larger events).
    pub fn start_padded(api: &Api<ConfigMap>, source: Source, names: usize, per_second: u64, pad: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let load_stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(Mutex::new(Written::default()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        reader(source, seen.clone(), stop.clone());
        let loader = Some(tokio::spawn(load(api.clone(), names, per_second, pad, written.clone(), load_stop.clone())));
        Self { api: api.clone(), stop, load_stop, written, seen, loader }
    }

    /// As [`Traffic::start`], but the load starts only once the reader saw `first` events (the
    /// objects that exist before: kubecast's initial list of them). A change made before that
    /// list may be invisible to everyone (an object created and deleted before it, or changed
    /// twice: the list shows the state, not the history), so the load waits for it.
    pub async fn start_after(
        api: &Api<ConfigMap>,
        source: Source,
        names: usize,
        per_second: u64,
        first: usize,
        timeout: Duration,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        reader(source.clone(), seen.clone(), stop.clone());
        let deadline = Instant::now() + timeout;
        while seen.lock().unwrap().len() < first {
            assert!(
                Instant::now() < deadline,
                "the reader of {source:?} saw {} of the {first} events of the initial list within {timeout:?}",
                seen.lock().unwrap().len()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let load_stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(Mutex::new(Written::default()));
        let loader = Some(tokio::spawn(load(api.clone(), names, per_second, 0, written.clone(), load_stop.clone())));
        Self { api: api.clone(), stop, load_stop, written, seen, loader }
    }

    /// What the load wrote so far.
    pub fn written(&self) -> Written {
        self.written.lock().unwrap().clone()
    }

    /// Events read so far.
    pub fn seen(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// A copy of the events read so far.
    pub fn events(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until at least `n` more events than now were read (or `timeout`); whether they were.
    pub async fn flowing(&self, n: usize, timeout: Duration) -> bool {
        let want = self.seen() + n;
        let deadline = Instant::now() + timeout;
        while self.seen() < want {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        true
    }

    /// Stops the load, waits (up to `wait`) until the reader saw every change, then 3 s for
    /// anything beyond them, and judges.
    pub async fn finish(mut self, delivery: Delivery, wait: Duration) -> Verdict {
        self.load_stop.store(true, Ordering::Relaxed);
        self.loader.take().expect("the load").await.unwrap();
        let deadline = Instant::now() + wait;
        loop {
            let left = missing(&self.seen.lock().unwrap(), &self.written.lock().unwrap());
            if left == 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = listed(&self.api).await;
        self.stop.store(true, Ordering::Relaxed);
        let seen = self.seen.lock().unwrap().clone();
        let written = std::mem::take(&mut *self.written.lock().unwrap());
        judge(&seen, written, &now, delivery)
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.load_stop.store(true, Ordering::Relaxed);
    }
}
