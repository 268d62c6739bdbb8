//! The Kafka store: a compacted state topic (`[checkpoint.kafka] topic`) holding the records of
//! `record.rs`, written in producer transactions.
//!
//! The producer's `transactional.id` names the deployment (see `app`): a process that opens
//! the store calls `init_transactions`, which aborts whatever a predecessor left open and
//! fences it: the old producer's next commit fails with a fatal error, so a paused or
//! partitioned old leader can never move the state again. Then the topic is read to its end
//! with `read_committed`, so only committed writes count. Each write (all streams' deltas of
//! one flush) is one transaction: the position and the index changes of a flush are visible
//! together or not at all. The next issue (exactly-once) adds the events to that transaction.
//!
//! librdkafka's transactional calls block: they run on the blocking pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};
use tracing::{info, warn};

use super::error::CheckpointError;
use super::record::{Loader, PositionRecord, encode_object, object_key, position_key};
use super::stream::{Delta, Owner, StreamKey};
use crate::model::Position;

/// How long one transactional call, the topic check or the load may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// What the Kafka store is opened with (built by `app` from `[checkpoint.kafka]` and the
/// sink's connection).
#[derive(Clone)]
pub struct KafkaStoreConfig {
    /// `bootstrap.servers` and the connection properties (TLS, SASL).
    pub client: ClientConfig,
    pub topic: String,
    pub create_topic: bool,
    pub transactional_id: String,
}

pub struct KafkaStore {
    topic: String,
    client: ClientConfig,
    transactional_id: String,
    producer: Arc<ThreadedProducer<DefaultProducerContext>>,
    owner: Owner,
    written: std::sync::atomic::AtomicU64,
    /// A failed transaction whose abort did not complete (broker unreachable): aborted first
    /// at the next write.
    abort_pending: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for KafkaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaStore")
            .field("topic", &self.topic)
            .field("transactional_id", &self.transactional_id)
            .finish()
    }
}

fn broker(what: impl Into<String>, cause: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Broker { what: what.into(), cause: cause.to_string() }
}

/// A fenced or otherwise dead producer stops the process; anything else is retried.
fn classify(what: &str, e: &KafkaError) -> CheckpointError {
    let code = e.rdkafka_error_code();
    let fatal = matches!(e, KafkaError::Transaction(t) if t.is_fatal());
    if fatal
        || matches!(
            code,
            Some(RDKafkaErrorCode::Fenced | RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch)
        )
    {
        return CheckpointError::Fenced { what: what.to_string(), why: e.to_string() };
    }
    broker(what, e)
}

impl KafkaStore {
    /// Checks (or creates) the topic, then takes the `transactional.id` over: from here on, a
    /// process that had it cannot commit.
    pub async fn open(cfg: KafkaStoreConfig, owner: Owner) -> Result<Self, CheckpointError> {
        ensure_topic(&cfg).await?;
        let what = format!("Kafka state topic {} (transactional.id {})", cfg.topic, cfg.transactional_id);
        let mut pc = cfg.client.clone();
        pc.set("transactional.id", &cfg.transactional_id)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("transaction.timeout.ms", "60000");
        let producer: ThreadedProducer<DefaultProducerContext> =
            pc.create().map_err(|e| broker(&what, format!("producer: {e}")))?;
        let producer = Arc::new(producer);
        let p = producer.clone();
        let w = what.clone();
        tokio::task::spawn_blocking(move || p.init_transactions(TIMEOUT).map_err(|e| classify(&w, &e)))
            .await
            .expect("init_transactions task")?;
        info!(topic = %cfg.topic, transactional_id = %cfg.transactional_id, "Kafka state store: transactional producer initialised (an earlier holder is fenced)");
        Ok(Self {
            topic: cfg.topic,
            client: cfg.client,
            transactional_id: cfg.transactional_id,
            producer,
            owner,
            written: Default::default(),
            abort_pending: Default::default(),
        })
    }

    pub fn describe(&self) -> String {
        format!("Kafka topic {}", self.topic)
    }

    /// Bytes of keys and values committed so far.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the topic to its end (committed records only) and folds it.
    pub async fn load(&self, keys: &[StreamKey]) -> Result<Vec<Option<Position>>, CheckpointError> {
        let (client, topic, keys, owner) = (self.client.clone(), self.topic.clone(), keys.to_vec(), self.owner.clone());
        tokio::task::spawn_blocking(move || load(&client, &topic, &keys, &owner)).await.expect("state load task")
    }

    /// One transaction with every record of `deltas`.
    pub async fn write(&self, deltas: &[(StreamKey, Delta)]) -> Result<(), CheckpointError> {
        let mut records: Vec<(String, Option<Vec<u8>>)> = Vec::new();
        for (key, d) in deltas {
            let id = key.id();
            for (uid, e) in d.upserts.iter() {
                records.push((object_key(&id, &uid.to_string()), Some(encode_object(e))));
            }
            for uid in &d.removes {
                records.push((object_key(&id, uid), None));
            }
            let p = PositionRecord::new(key, &self.owner, d.resource_version.as_deref(), &d.acked_ahead);
            records.push((position_key(&id), Some(p.encode())));
        }
        let bytes: usize = records.iter().map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len)).sum();
        let (producer, topic, pending) = (self.producer.clone(), self.topic.clone(), self.abort_pending.clone());
        let what = format!("Kafka state topic {}", self.topic);
        tokio::task::spawn_blocking(move || transact(&producer, &topic, &records, &what, &pending))
            .await
            .expect("state write task")?;
        self.written.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

fn transact(
    producer: &ThreadedProducer<DefaultProducerContext>,
    topic: &str,
    records: &[(String, Option<Vec<u8>>)],
    what: &str,
    abort_pending: &std::sync::atomic::AtomicBool,
) -> Result<(), CheckpointError> {
    use std::sync::atomic::Ordering::SeqCst;
    if abort_pending.load(SeqCst) {
        producer.abort_transaction(TIMEOUT).map_err(|e| classify(what, &e))?;
        abort_pending.store(false, SeqCst);
    }
    producer.begin_transaction().map_err(|e| classify(what, &e))?;
    let sent = (|| {
        for (key, value) in records {
            let mut record = BaseRecord::<String, Vec<u8>>::to(topic).key(key);
            if let Some(v) = value {
                record = record.payload(v);
            }
            let deadline = Instant::now() + TIMEOUT;
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r))
                        if Instant::now() < deadline =>
                    {
                        record = r;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err((e, _)) => return Err(e),
                }
            }
        }
        producer.commit_transaction(TIMEOUT)
    })();
    match sent {
        Ok(()) => Ok(()),
        Err(e) => {
            let err = classify(what, &e);
            if !err.is_fatal() {
                // Nothing of it counts; the deltas are written again at the next flush.
                if let Err(abort) = producer.abort_transaction(TIMEOUT) {
                    warn!(error = %abort, "state transaction not aborted yet; aborted before the next write");
                    let abort = classify(what, &abort);
                    if !abort.is_fatal() {
                        abort_pending.store(true, SeqCst);
                    }
                    return Err(abort);
                }
            }
            Err(err)
        }
    }
}

/// The topic exists (or is created) and is compacted without deletion by age or size.
async fn ensure_topic(cfg: &KafkaStoreConfig) -> Result<(), CheckpointError> {
    let what = format!("Kafka state topic {}", cfg.topic);
    if !topic_exists(cfg, &what).await? {
        if !cfg.create_topic {
            return Err(broker(
                &what,
                "does not exist (fix: create it with cleanup.policy=compact, or set [checkpoint.kafka] create_topic = true)",
            ));
        }
        let admin: AdminClient<DefaultClientContext> =
            cfg.client.create().map_err(|e| broker(&what, format!("admin client: {e}")))?;
        let opts = AdminOptions::new().request_timeout(Some(TIMEOUT)).operation_timeout(Some(TIMEOUT));
        let topic = NewTopic::new(&cfg.topic, 1, TopicReplication::Fixed(-1))
            .set("cleanup.policy", "compact")
            .set("min.cleanable.dirty.ratio", "0.1");
        let created = admin.create_topics(&[topic], &opts).await.map_err(|e| broker(&what, e))?;
        match created.into_iter().next() {
            Some(Ok(_)) => info!(topic = %cfg.topic, "Kafka state topic created (compacted, 1 partition)"),
            Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => {}
            Some(Err((_, code))) => {
                return Err(broker(
                    &what,
                    format!("cannot be created: {code} (fix: create it compacted, or grant CreateTopics)"),
                ));
            }
        }
    }
    let admin: AdminClient<DefaultClientContext> =
        cfg.client.create().map_err(|e| broker(&what, format!("admin client: {e}")))?;
    let opts = AdminOptions::new().request_timeout(Some(TIMEOUT));
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let described = admin
            .describe_configs(&[ResourceSpecifier::Topic(&cfg.topic)], &opts)
            .await
            .map_err(|e| broker(&what, format!("cannot describe it: {e}")))?;
        let policy = match described.into_iter().next() {
            Some(Ok(resource)) => resource.get("cleanup.policy").and_then(|e| e.value.clone()),
            Some(Err(code)) => return Err(broker(&what, format!("cannot describe it: {code}"))),
            None => None,
        };
        match policy {
            Some(policy) => {
                let has = |p: &str| policy.split(',').any(|x| x.trim() == p);
                if !has("compact") || has("delete") {
                    return Err(CheckpointError::Unusable {
                        what,
                        why: format!(
                            "it has cleanup.policy={policy}: its position records would expire (fix: kafka-configs --alter --entity-type topics --entity-name {} --add-config cleanup.policy=compact)",
                            cfg.topic
                        ),
                    });
                }
                return Ok(());
            }
            // Just created: its configs are not there yet.
            None if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            None => return Err(broker(&what, "its cleanup.policy cannot be read")),
        }
    }
}

/// Whether the topic exists (a metadata request that never creates topics).
async fn topic_exists(cfg: &KafkaStoreConfig, what: &str) -> Result<bool, CheckpointError> {
    let mut cc = cfg.client.clone();
    cc.set("allow.auto.create.topics", "false").set("group.id", "kubecast-state-check");
    let consumer: BaseConsumer = cc.create().map_err(|e| broker(what, format!("client: {e}")))?;
    let topic = cfg.topic.clone();
    let what = what.to_string();
    tokio::task::spawn_blocking(move || {
        let md = consumer.fetch_metadata(Some(&topic), TIMEOUT).map_err(|e| broker(&what, format!("metadata: {e}")))?;
        Ok(md.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()))
    })
    .await
    .expect("metadata task")
}

fn load(
    client: &ClientConfig,
    topic: &str,
    keys: &[StreamKey],
    owner: &Owner,
) -> Result<Vec<Option<Position>>, CheckpointError> {
    let what = format!("Kafka state topic {topic}");
    let mut cc = client.clone();
    cc.set("group.id", "kubecast-state-loader")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer = cc.create().map_err(|e| broker(&what, format!("consumer: {e}")))?;
    let md = consumer.fetch_metadata(Some(topic), TIMEOUT).map_err(|e| broker(&what, format!("metadata: {e}")))?;
    let partitions: Vec<i32> =
        md.topics().iter().filter(|t| t.name() == topic).flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
    if partitions.is_empty() {
        return Err(broker(&what, "has no partitions"));
    }
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Beginning).map_err(|e| broker(&what, e))?;
    }
    consumer.assign(&tpl).map_err(|e| broker(&what, format!("assign: {e}")))?;
    let mut loader = Loader::new(format!("Kafka topic {topic}"), keys, owner);
    let mut open: std::collections::HashSet<i32> = partitions.into_iter().collect();
    let (started, mut records) = (Instant::now(), 0u64);
    let deadline = started + Duration::from_secs(300);
    while !open.is_empty() {
        if Instant::now() > deadline {
            return Err(broker(&what, "not read to its end within 300 s"));
        }
        match consumer.poll(Duration::from_millis(500)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(e)) => return Err(broker(&what, format!("reading it: {e}"))),
            Some(Ok(m)) => {
                records += 1;
                let Some(key) = m.key() else { continue };
                let key = std::str::from_utf8(key)
                    .map_err(|e| broker(&what, format!("a key that is not UTF-8 at offset {}: {e}", m.offset())))?;
                loader.apply(key, m.payload())?;
            }
        }
    }
    info!(topic, records, took = ?started.elapsed(), "Kafka state topic read");
    loader.finish()
}
