//! The Kafka store: a compacted state topic (`[checkpoint.kafka] topic`) holding the records of
//! `record.rs`, written in producer transactions.
//!
//! The producer's `transactional.id` names the deployment (see `app`): a process that opens
//! the store calls `init_transactions`, which aborts whatever a predecessor left open and
//! fences it: the old producer's next commit fails with a fatal error, so a paused or
//! partitioned old leader can never move the state again. Then the topic is read to its end
//! with `read_committed`, so only committed writes count. Each write (all streams' deltas of
//! one flush) is one transaction: the position and the index changes of a flush are visible
//! together or not at all. With `[sink.kafka] exactly_once` the sink's events are in that
//! transaction too (`sink/kafka/transaction.rs`): the transaction stays open between writes,
//! and each write commits the events sent since the last one with the state that covers them.
//!
//! librdkafka's transactional calls block: they run on the blocking pool.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tracing::{info, warn};

use super::error::CheckpointError;
use super::record::{Loader, PositionRecord, encode_object, object_key, position_key};
use super::stream::{Delta, Owner, StreamKey};
use crate::model::Position;
use crate::sink::kafka::LogContext;
use crate::sink::kafka::off_worker::OffWorker;
use crate::sink::kafka::properties::describe;
use crate::sink::kafka::roles::{for_consumer, for_producer};
use crate::sink::kafka::transaction::{Record, TIMEOUT, Transaction, TxnError};

/// What the Kafka store is opened with (built by `app` from `[checkpoint.kafka]` and the
/// sink's connection).
#[derive(Clone)]
pub struct KafkaStoreConfig {
    /// `bootstrap.servers` and the connection properties (TLS, SASL).
    pub client: ClientConfig,
    pub topic: String,
    pub create_topic: bool,
    pub transactional_id: String,
    /// The sink's events go into the store's transaction (`[sink.kafka] exactly_once`).
    pub exactly_once: bool,
    /// The created topic's replication factor (default: the smaller of 3 and the brokers).
    pub replication_factor: Option<u16>,
    /// Its `min.insync.replicas` (default: [`default_min_insync`]).
    pub min_insync_replicas: Option<u16>,
}

/// The state topic's replication: `(replication factor, min.insync.replicas)`, each as
/// configured or, by default, the smaller of 3 and `brokers` replicas, and 2 in-sync replicas
/// with 3 replicas or more (one broker may be away), else 1.
pub fn replication(brokers: usize, replication_factor: Option<u16>, min_insync: Option<u16>) -> (u16, u16) {
    let rf = replication_factor.unwrap_or_else(|| u16::try_from(brokers.clamp(1, 3)).unwrap_or(3));
    (rf, min_insync.unwrap_or(default_min_insync(rf)))
}

/// `min.insync.replicas` for `rf` replicas by default: one less than 3 with 3 or more, else 1.
pub fn default_min_insync(rf: u16) -> u16 {
    if rf >= 3 { 2 } else { 1 }
}

pub struct KafkaStore {
    topic: String,
    client: ClientConfig,
    transactional_id: String,
    txn: Arc<Transaction>,
    owner: Owner,
    written: std::sync::atomic::AtomicU64,
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

/// A fenced or otherwise dead producer stops the process, and so does a record no retry can
/// deliver; anything else is retried. Only a fence says that another process owns the state.
fn txn_error(what: &str, e: TxnError) -> CheckpointError {
    let what = what.to_string();
    match e {
        TxnError::Fenced(why) => CheckpointError::Fenced { what, why },
        TxnError::Refused { refusal, reason } => CheckpointError::Refused { what, refusal, why: reason },
        TxnError::Abandoned(_) => CheckpointError::Abandoned { what },
        TxnError::Fatal(why) | TxnError::Poison(why) => CheckpointError::Unusable { what, why },
        TxnError::Retriable(cause) => broker(what, cause),
        TxnError::RecordRefused { refusal, destination, events, reason } => {
            CheckpointError::EventsRefused { what, refusal, destination, events, why: reason }
        }
    }
}

impl KafkaStore {
    /// Checks (or creates) the topic, then takes the `transactional.id` over: from here on, a
    /// process that had it cannot commit.
    pub async fn open(cfg: KafkaStoreConfig, owner: Owner) -> Result<Self, CheckpointError> {
        let started = Instant::now();
        ensure_topic(&cfg).await?;
        tracing::debug!(topic = %cfg.topic, took = ?started.elapsed(), "Kafka state topic checked");
        let what = format!("Kafka state topic {} (transactional.id {})", cfg.topic, cfg.transactional_id);
        let (client, id, eos) = (cfg.client.clone(), cfg.transactional_id.clone(), cfg.exactly_once);
        let w = what.clone();
        let txn = tokio::task::spawn_blocking(move || {
            Transaction::init(&client, &id, eos, Arc::new(AtomicBool::new(true))).map_err(|e| txn_error(&w, e))
        })
        .await
        .expect("init_transactions task")?;
        info!(topic = %cfg.topic, transactional_id = %cfg.transactional_id, exactly_once = cfg.exactly_once, "Kafka state store: transactional producer initialised (an earlier holder is fenced)");
        Ok(Self {
            topic: cfg.topic,
            client: cfg.client,
            transactional_id: cfg.transactional_id,
            txn: Arc::new(txn),
            owner,
            written: Default::default(),
        })
    }

    pub fn transactional_id(&self) -> &str {
        &self.transactional_id
    }

    /// The transaction (exactly-once: the sink sends its events into it).
    pub fn transaction(&self) -> &Arc<Transaction> {
        &self.txn
    }

    pub fn describe(&self) -> String {
        format!("Kafka topic {}", self.topic)
    }

    /// Bytes of keys and values committed so far.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Exactly-once: aborts the open transaction for good (an event sent into it was not
    /// acknowledged); nothing more is committed by this process.
    pub async fn abandon(&self) {
        let txn = self.txn.clone();
        tokio::task::spawn_blocking(move || txn.abandon()).await.expect("transaction abort task");
    }

    /// Reads the topic to its end (committed records only) and folds it.
    pub async fn load(&self, keys: &[StreamKey]) -> Result<Vec<Option<Position>>, CheckpointError> {
        let (client, topic, keys, owner) = (self.client.clone(), self.topic.clone(), keys.to_vec(), self.owner.clone());
        tokio::task::spawn_blocking(move || load(&client, &topic, &keys, &owner)).await.expect("state load task")
    }

    /// One transaction with every record of `deltas` (exactly-once: and the events sent since
    /// the last write).
    pub async fn write(&self, deltas: &[(StreamKey, Delta)]) -> Result<(), CheckpointError> {
        let record =
            |key: String, payload: Option<Vec<u8>>| Record { topic: self.topic.clone(), key, payload, headers: None };
        let mut records = Vec::new();
        for (key, d) in deltas {
            let id = key.id();
            for (uid, e) in d.upserts.iter() {
                records.push(record(object_key(&id, &uid.to_string()), Some(encode_object(e))));
            }
            for uid in &d.removes {
                records.push(record(object_key(&id, uid), None));
            }
            let p = PositionRecord::new(key, &self.owner, d.resource_version.as_deref(), &d.acked_ahead)
                .with_snapshot(d.snapshot)
                .with_floors(&d.floors);
            records.push(record(position_key(&id), Some(p.encode())));
        }
        let bytes: usize = records.iter().map(|r| r.key.len() + r.payload.as_ref().map_or(0, Vec::len)).sum();
        let txn = self.txn.clone();
        let what = format!("Kafka state topic {}", self.topic);
        tokio::task::spawn_blocking(move || txn.commit(&records).map_err(|e| txn_error(&what, e)))
            .await
            .expect("state write task")?;
        self.written.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// The topic exists (or is created) and is compacted without deletion by age or size.
async fn ensure_topic(cfg: &KafkaStoreConfig) -> Result<(), CheckpointError> {
    let what = format!("Kafka state topic {}", cfg.topic);
    let layout = topic_layout(cfg, &what).await?;
    if let Some(replicas) = layout.replicas
        && replicas < 2
        && layout.brokers > 1
    {
        warn!(
            topic = %cfg.topic,
            replicas,
            brokers = layout.brokers,
            "the Kafka state topic has a replication factor of 1 on a cluster of several brokers: losing that one broker's disk loses every stream's position (fix: raise its replication factor with kafka-reassign-partitions.sh, and set min.insync.replicas)"
        );
    }
    if layout.replicas.is_none() {
        if !cfg.create_topic {
            return Err(broker(
                &what,
                "does not exist (fix: create it with cleanup.policy=compact, or set [checkpoint.kafka] create_topic = true)",
            ));
        }
        let admin = admin_client(cfg, &what)?;
        let opts = AdminOptions::new().request_timeout(Some(TIMEOUT)).operation_timeout(Some(TIMEOUT));
        let (rf, isr) = replication(layout.brokers, cfg.replication_factor, cfg.min_insync_replicas);
        let isr_text = isr.to_string();
        let topic = NewTopic::new(&cfg.topic, 1, TopicReplication::Fixed(i32::from(rf)))
            .set("cleanup.policy", "compact")
            .set("min.cleanable.dirty.ratio", "0.1")
            .set("min.insync.replicas", &isr_text);
        let created = admin.create_topics(&[topic], &opts).await.map_err(|e| broker(&what, e))?;
        match created.into_iter().next() {
            Some(Ok(_)) => info!(
                topic = %cfg.topic,
                replication_factor = rf,
                min_insync_replicas = isr,
                brokers = layout.brokers,
                "Kafka state topic created (compacted, 1 partition; [checkpoint.kafka] replication_factor and min_insync_replicas set others)"
            ),
            Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) | None => {}
            Some(Err((_, RDKafkaErrorCode::InvalidReplicationFactor))) => {
                return Err(CheckpointError::Unusable {
                    what,
                    why: format!(
                        "cannot be created with replication factor {rf}: the cluster has {} broker(s) (fix: set [checkpoint.kafka] replication_factor to at most that, or create the topic compacted yourself)",
                        layout.brokers
                    ),
                });
            }
            Some(Err((_, code))) => {
                return Err(broker(
                    &what,
                    format!("cannot be created: {code} (fix: create it compacted, or grant CreateTopics)"),
                ));
            }
        }
    }
    let admin = admin_client(cfg, &what)?;
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

/// An admin client (librdkafka runs it as a producer: the producer's properties), dropped off
/// the worker.
fn admin_client(cfg: &KafkaStoreConfig, what: &str) -> Result<OffWorker<AdminClient<LogContext>>, CheckpointError> {
    for_producer(&cfg.client)
        .create_with_context(LogContext)
        .map(OffWorker::new)
        .map_err(|e| broker(what, format!("admin client: {}", describe(&e))))
}

/// A consumer of `client`'s connection that reads by partition: assigned its partitions from
/// their beginning, committing nothing, so it needs no permission on its consumer group
/// `group` (librdkafka needs a group to assign partitions, and asks for the group's coordinator
/// anyway: a refusal of that is expected and ignored, see [`ReaderContext`]).
fn reader_consumer(client: &ClientConfig, group: &str) -> ClientConfig {
    let mut cc = for_consumer(client);
    cc.set("group.id", group);
    cc.remove("group.instance.id");
    cc
}

/// The state readers' context: librdkafka's messages logged as by the sink's clients, except
/// a refused group coordinator, which the readers do not need.
struct ReaderContext;

impl rdkafka::client::ClientContext for ReaderContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, msg: &str) {
        LogContext.log(level, fac, msg);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::GroupAuthorizationFailed) {
            tracing::debug!(error = %error, "Kafka state reader: {reason} (no group permission is needed: it reads by partition)");
        } else {
            LogContext.error(error, reason);
        }
    }
}

impl rdkafka::consumer::ConsumerContext for ReaderContext {}

/// What the cluster says of the state topic (a metadata request that never creates topics).
struct Layout {
    /// The topic's replication factor (its first partition's replicas); `None`: no such topic.
    replicas: Option<usize>,
    /// The brokers of the cluster.
    brokers: usize,
}

async fn topic_layout(cfg: &KafkaStoreConfig, what: &str) -> Result<Layout, CheckpointError> {
    let mut cc = reader_consumer(&cfg.client, "kubecast-state-check");
    cc.set("allow.auto.create.topics", "false");
    let consumer: BaseConsumer<ReaderContext> =
        cc.create_with_context(ReaderContext).map_err(|e| broker(what, format!("client: {}", describe(&e))))?;
    let topic = cfg.topic.clone();
    let what = what.to_string();
    tokio::task::spawn_blocking(move || {
        let md = consumer.fetch_metadata(Some(&topic), TIMEOUT).map_err(|e| broker(&what, format!("metadata: {e}")))?;
        let replicas = md
            .topics()
            .iter()
            .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
            .map(|t| t.partitions()[0].replicas().len());
        Ok(Layout { replicas, brokers: md.brokers().len() })
    })
    .await
    .expect("metadata task")
}

/// Reads `topic` from its beginning to its end, committed records only, calling `each` with
/// every keyed record; the records read. A consumer that reads by partition (the principal
/// needs no permission on its group `group`), no producer: nobody is fenced. `missing`: what
/// to say when the topic has no partitions.
///
/// The end is each partition's high watermark when the read starts, not the end of partition
/// librdkafka reports: reading committed records, that comes at the last stable offset, the
/// start of the oldest transaction still open, from any writer (another shard, another
/// deployment sharing the topic). This stream's records committed after it would be missed,
/// and the stream would resume from an older position. So the read waits for such a
/// transaction to end (it commits within the commit interval, or the broker aborts it after
/// its transaction timeout). A broker that is briefly unreachable meanwhile is waited for too.
fn read_to_end(
    client: &ClientConfig,
    topic: &str,
    group: &str,
    missing: &str,
    mut each: impl FnMut(&str, &rdkafka::message::BorrowedMessage<'_>) -> Result<(), CheckpointError>,
) -> Result<u64, CheckpointError> {
    let what = format!("Kafka state topic {topic}");
    let mut cc = reader_consumer(client, group);
    cc.set("allow.auto.create.topics", "false")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        // At the end, the broker answers a fetch at once instead of waiting 500 ms (the
        // default) for records that will not come: the end is known sooner, and a new leader
        // starts sooner.
        .set("fetch.wait.max.ms", "10")
        .set("auto.offset.reset", "earliest");
    let consumer: BaseConsumer<ReaderContext> =
        cc.create_with_context(ReaderContext).map_err(|e| broker(&what, format!("consumer: {}", describe(&e))))?;
    let md = consumer.fetch_metadata(Some(topic), TIMEOUT).map_err(|e| broker(&what, format!("metadata: {e}")))?;
    let partitions: Vec<i32> = md
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if partitions.is_empty() {
        return Err(broker(&what, missing));
    }
    let mut tpl = TopicPartitionList::new();
    // Partition -> the offset after its last record when the read starts. Asked by a consumer
    // that reads uncommitted records: the reading consumer would be told the last stable offset.
    let mut uncommitted = reader_consumer(client, group);
    uncommitted.set("isolation.level", "read_uncommitted");
    let ends: BaseConsumer<ReaderContext> = uncommitted
        .create_with_context(ReaderContext)
        .map_err(|e| broker(&what, format!("consumer: {}", describe(&e))))?;
    let mut open = std::collections::HashMap::new();
    for p in &partitions {
        tpl.add_partition_offset(topic, *p, Offset::Beginning).map_err(|e| broker(&what, e))?;
        let (_, high) = ends
            .fetch_watermarks(topic, *p, TIMEOUT)
            .map_err(|e| broker(&what, format!("the end of partition {p}: {e}")))?;
        if high > 0 {
            open.insert(*p, high);
        }
    }
    consumer.assign(&tpl).map_err(|e| broker(&what, format!("assign: {e}")))?;
    let mut records = 0u64;
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut last_error = None::<String>;
    while !open.is_empty() {
        if Instant::now() > deadline {
            let ends: Vec<String> = open.iter().map(|(p, end)| format!("partition {p} to offset {end}")).collect();
            let why = match &last_error {
                Some(e) => format!("; last error: {e}"),
                None => "; a transaction another writer keeps open on the topic holds committed records back".into(),
            };
            return Err(broker(&what, format!("not read to its end within 300 s ({}){why}", ends.join(", "))));
        }
        // Whether to look at the positions after this poll: at an end or a pause, and every
        // few hundred records (other writers may keep committing after the end asked for).
        let mut look = true;
        match consumer.poll(Duration::from_millis(500)) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {}
            Some(Err(KafkaError::MessageConsumption(code))) if is_transient(code) => {
                last_error = Some(code.to_string());
            }
            // The group's coordinator, which this reader does not use (see `reader_consumer`).
            Some(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::GroupAuthorizationFailed))) => {}
            Some(Err(e)) => return Err(broker(&what, format!("reading it: {e}"))),
            Some(Ok(m)) => {
                records += 1;
                look = records.is_multiple_of(256);
                let Some(key) = m.key() else { continue };
                let key = std::str::from_utf8(key)
                    .map_err(|e| broker(&what, format!("a key that is not UTF-8 at offset {}: {e}", m.offset())))?;
                each(key, &m)?;
            }
        }
        if !look {
            continue;
        }
        // The position passes transaction markers and aborted records, which are not delivered.
        let positions = consumer.position().map_err(|e| broker(&what, format!("position: {e}")))?;
        open.retain(|p, end| {
            !matches!(positions.find_partition(topic, *p).map(|e| e.offset()), Some(Offset::Offset(o)) if o >= *end)
        });
    }
    Ok(records)
}

/// Errors librdkafka recovers from by itself (it reconnects and fetches again).
fn is_transient(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::RequestTimedOut
            | RDKafkaErrorCode::OperationTimedOut
            | RDKafkaErrorCode::NetworkException
            | RDKafkaErrorCode::NotLeaderForPartition
            | RDKafkaErrorCode::LeaderNotAvailable
            | RDKafkaErrorCode::BrokerNotAvailable
    )
}

fn load(
    client: &ClientConfig,
    topic: &str,
    keys: &[StreamKey],
    owner: &Owner,
) -> Result<Vec<Option<Position>>, CheckpointError> {
    let started = Instant::now();
    let mut loader = Loader::new(format!("Kafka topic {topic}"), keys, owner);
    let records = read_to_end(client, topic, "kubecast-state-loader", "has no partitions", |key, m| {
        loader.apply(key, m.payload(), u64::try_from(m.offset()).unwrap_or_default())
    })?;
    info!(topic, records, took = ?started.elapsed(), "Kafka state topic read");
    loader.finish()
}

/// Every stream in the state topic, read to its end (committed records only) by a plain
/// consumer: no producer, so nobody is fenced (for `kubecast state`). Each stream's time is
/// its position record's Kafka timestamp.
pub async fn scan(client: &ClientConfig, topic: &str) -> Result<Vec<super::record::ScannedStream>, CheckpointError> {
    let (client, topic) = (client.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let mut latest = super::record::Latest::new();
        read_to_end(
            &client,
            &topic,
            "kubecast-state-cli",
            "does not exist (no kubecast wrote state there yet?)",
            |key, m| {
                latest.insert(key.to_string(), (m.payload().map(<[u8]>::to_vec), m.timestamp().to_millis()));
                Ok(())
            },
        )?;
        super::record::fold_all(&format!("Kafka topic {topic}"), &latest)
    })
    .await
    .expect("state scan task")
}

#[cfg(test)]
mod replication_tests {
    use super::replication;

    #[test]
    fn the_state_topic_is_replicated_as_the_cluster_allows_unless_set() {
        assert_eq!(replication(1, None, None), (1, 1), "one broker: one replica");
        assert_eq!(replication(2, None, None), (2, 1));
        assert_eq!(replication(3, None, None), (3, 2), "one broker may be away");
        assert_eq!(replication(6, None, None), (3, 2));
        assert_eq!(replication(6, Some(5), None), (5, 2));
        assert_eq!(replication(6, Some(5), Some(3)), (5, 3));
        assert_eq!(replication(0, None, None), (1, 1), "no broker listed: one");
    }
}
