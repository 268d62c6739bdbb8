//! The idempotent producer: delivery reports as acceptance, which errors are retriable,
//! reachability for readiness.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use tracing::{debug, info, warn};

use super::config::clean_topic_part;
use super::config::{KafkaConfig, Mode, REQUIRED};
use super::encode::encode;
use super::off_worker::OffWorker;
use super::producer::Producer;
use super::rejected::{refusal, rejected_for_good};
use super::transaction::{Record, Transaction, Uncommitted};
use crate::sink::outbound::{Outbound, SendError, SinkError};
use crate::sink::secret;
use crate::sink::template::Template;

/// Logs librdkafka's errors and tracks whether the brokers are reachable, and if not, why
/// (a TLS or SASL failure's fix, for `/readyz`).
pub struct KafkaContext {
    connected: Arc<AtomicBool>,
    cause: Arc<Mutex<Option<String>>>,
}

impl ClientContext for KafkaContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        super::logging::log(level, fac, msg);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::AllBrokersDown
                    | RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SaslAuthenticationFailed
            )
        ) {
            self.connected.store(false, Ordering::Relaxed);
        }
        if let Some(fix) = super::security::fix_for(reason) {
            self.connected.store(false, Ordering::Relaxed);
            *self.cause.lock().expect("cause lock") = Some(fix.to_string());
        }
        super::logging::client_error(&error, reason);
    }
}

pub struct KafkaSink {
    /// Dropped off the worker, as the other clients (see [`OffWorker`]).
    producer: Arc<OffWorker<Producer<KafkaContext>>>,
    /// The same configuration, one record per request: a record rejected as too large is sent
    /// again through it alone, because the broker rejects a whole batch when one record in it
    /// is too large, and the others must not be dead-lettered for that.
    solo: std::sync::OnceLock<OffWorker<Producer<KafkaContext>>>,
    config: ClientConfig,
    topic: Template,
    mode: Mode,
    tombstones: bool,
    connected: Arc<AtomicBool>,
    /// Why the brokers are not reachable (a TLS or SASL failure's fix), until they are.
    cause: Arc<Mutex<Option<String>>>,
    exactly_once: bool,
    /// Exactly-once: the state store's transaction, set once the store is open (no event is
    /// sent before).
    transaction: std::sync::OnceLock<Arc<Transaction>>,
}

impl KafkaSink {
    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn new(cfg: &KafkaConfig) -> Result<Self, SinkError> {
        let mut cc = ClientConfig::new();
        cc.set("bootstrap.servers", &cfg.brokers);
        for (k, v) in &cfg.properties {
            cc.set(
                k,
                secret::resolve(v).map_err(|e| SinkError::Config(format!("sink.kafka.properties.\"{k}\": {e}")))?,
            );
        }
        for (k, v, _) in REQUIRED {
            cc.set(k, v);
        }
        super::security::set_system_ca(&mut cc);
        cc.set_log_level(super::logging::log_level(&cc));
        let connected = Arc::new(AtomicBool::new(true));
        let cause = Arc::new(Mutex::new(None));
        let producer = Producer::create(
            &super::roles::for_producer(&cc),
            KafkaContext { connected: connected.clone(), cause: cause.clone() },
        )
        // The error names the property, never its value.
        .map_err(|e| {
            let e = super::properties::describe(&e);
            match super::security::fix_for(&e) {
                Some(fix) => SinkError::Config(format!("Kafka producer: {e} (fix: {fix})")),
                None => SinkError::Config(format!("Kafka producer: {e}")),
            }
        })?;
        let keys: Vec<&String> = cfg.properties.keys().collect();
        info!(brokers = %cfg.brokers, topic = %cfg.topic, mode = ?cfg.mode, properties = ?keys, "Kafka producer created");
        Ok(Self {
            producer: Arc::new(OffWorker::new(producer)),
            solo: std::sync::OnceLock::new(),
            config: cc,
            topic: Template::parse(&cfg.topic).map_err(|e| SinkError::Config(format!("sink.kafka.topic: {e}")))?,
            mode: cfg.mode,
            tombstones: cfg.tombstones,
            connected,
            cause,
            exactly_once: cfg.exactly_once,
            transaction: std::sync::OnceLock::new(),
        })
    }

    /// The connection settings (brokers, properties with secrets resolved): the Kafka state
    /// store connects with them too.
    pub fn client_config(&self) -> &ClientConfig {
        &self.config
    }

    /// The topic of an event with `fields` (`route`: its resource's own template).
    pub fn topic_for(&self, route: Option<&Template>, fields: &crate::model::Fields) -> String {
        route.unwrap_or(&self.topic).render(fields, clean_topic_part)
    }

    /// Whether this producer lets a broker that creates topics on first use create a missing
    /// one (librdkafka's `allow.auto.create.topics`, true for a producer unless set false).
    pub fn may_auto_create(&self) -> bool {
        self.config.get("allow.auto.create.topics").is_none_or(|v| v == "true")
    }

    /// ` as User:<name>` with SASL (the principal an ACL names), else nothing.
    pub fn principal_words(&self) -> String {
        self.principal()
    }

    /// `[sink.kafka] exactly_once`.
    pub fn exactly_once(&self) -> bool {
        self.exactly_once
    }

    /// Exactly-once: from now on, events go into `txn` (the state store's), as many of them
    /// uncommitted as `limits` (its part of the process's `max_uncommitted_events` /
    /// `max_uncommitted_bytes`) allows.
    pub fn attach(&self, txn: Arc<Transaction>, limits: Uncommitted) {
        txn.limit(limits);
        if self.transaction.set(txn).is_err() {
            warn!("the Kafka sink's transaction was already set; keeping the first");
        }
    }

    /// Whether the brokers are reachable (set by errors, deliveries and [`KafkaSink::probe`]).
    pub fn connected(&self) -> Arc<AtomicBool> {
        self.connected.clone()
    }

    /// Why the brokers are not reachable, when kubecast knows (a TLS or SASL failure's fix).
    pub fn unreachable_cause(&self) -> Arc<Mutex<Option<String>>> {
        self.cause.clone()
    }

    fn set_connected(&self, ok: bool) {
        self.connected.store(ok, Ordering::Relaxed);
        if ok {
            *self.cause.lock().expect("cause lock") = None;
        }
    }

    /// Asks the cluster for metadata (blocking, up to `timeout`) and records whether it
    /// answered.
    pub fn probe(&self, timeout: Duration) -> bool {
        let answer = self.producer.client().fetch_metadata(None, timeout);
        if let Err(e) = &answer {
            tracing::debug!(error = %e, "Kafka sink: the brokers did not answer a metadata request");
        }
        self.set_connected(answer.is_ok());
        answer.is_ok()
    }

    pub fn destination(&self, msg: &Outbound) -> String {
        msg.route.as_deref().unwrap_or(&self.topic).render(&msg.fields, clean_topic_part)
    }

    /// The send span's attributes known before the send: the (first) bootstrap broker, the
    /// record key.
    pub fn trace_attributes(&self, msg: &Outbound) -> Vec<opentelemetry::KeyValue> {
        let brokers = self.config.get("bootstrap.servers").unwrap_or_default();
        let mut attrs = crate::observe::trace::server_attributes(brokers, 9092);
        attrs.push(opentelemetry::KeyValue::new("messaging.kafka.message.key", msg.key().to_string()));
        attrs
    }

    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        let topic = self.destination(msg);
        let (payload, headers) = encode(&msg.event, self.mode);
        if self.exactly_once {
            // The event and its tombstone go into the transaction together (a commit never
            // takes one without the other).
            let mut records = vec![Record {
                topic: topic.clone(),
                key: msg.key().to_string(),
                payload: Some(payload.into_owned()),
                headers: Some(headers),
            }];
            if self.tombstones && msg.fields.verb == "deleted" {
                records.push(Record {
                    topic,
                    key: msg.key().to_string(),
                    payload: None,
                    headers: Some(OwnedHeaders::new()),
                });
            }
            return self.send_transactional(records).await;
        }
        let delivered = self.produce(&topic, msg.key(), Some(&payload), headers).await?;
        if let (Some(t), Some((partition, offset))) = (&msg.trace, delivered) {
            t.record_send(vec![
                opentelemetry::KeyValue::new("messaging.destination.partition.id", partition.to_string()),
                opentelemetry::KeyValue::new("messaging.kafka.offset", offset),
            ]);
        }
        if self.tombstones && msg.fields.verb == "deleted" {
            self.produce(&topic, msg.key(), None, OwnedHeaders::new()).await?;
        }
        Ok(())
    }

    /// Sends a record with extra headers (the dead-letter destination).
    pub async fn send_raw(
        &self,
        topic: &str,
        key: &str,
        payload: &[u8],
        headers: OwnedHeaders,
    ) -> Result<(), SendError> {
        self.produce(topic, key, Some(payload), headers).await.map(|_| ())
    }

    async fn produce(
        &self,
        topic: &str,
        key: &str,
        payload: Option<&[u8]>,
        headers: OwnedHeaders,
    ) -> Result<Option<(i32, i64)>, SendError> {
        if self.exactly_once {
            let record = Record {
                topic: topic.to_string(),
                key: key.to_string(),
                payload: payload.map(<[u8]>::to_vec),
                headers: Some(headers),
            };
            return self.send_transactional(vec![record]).await.map(|()| None);
        }
        let mut result = self.producer.send(topic, key, payload, Some(headers)).await;
        if let Err((e, returned)) = &mut result
            && e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge)
        {
            debug!(topic, "record rejected as too large; sending it again alone");
            // The headers come back with the rejected record (not copied for every send).
            let headers = returned.detach_headers();
            result = self.solo()?.send(topic, key, payload, headers).await;
        }
        match result {
            Ok(delivered) => {
                self.set_connected(true);
                Ok(Some(delivered))
            }
            Err((e, _)) => Err(self.classify(e, topic)),
        }
    }

    /// Exactly-once: into the open transaction. Its partition and offset are known only to
    /// the broker until it commits.
    async fn send_transactional(&self, records: Vec<Record>) -> Result<(), SendError> {
        // The only retriable failure with exactly-once, and nothing of the event is in a
        // transaction then (the queue relies on it): once a record is in the transaction, the
        // transaction itself produces it again if it must.
        let Some(txn) = self.transaction.get() else {
            return Err(SendError::Retriable("the exactly-once transaction is not open yet".into()));
        };
        let topic = records.first().map(|r| r.topic.clone()).unwrap_or_default();
        txn.send(records).await.map_err(|e| match refusal(&e) {
            Some(refusal) => SendError::Refused { refusal, reason: format!("Kafka topic {topic:?}: {e}") },
            None => SendError::Permanent(super::rejected::with_fix(&e)),
        })
    }

    fn solo(&self) -> Result<&Producer<KafkaContext>, SendError> {
        if let Some(p) = self.solo.get() {
            return Ok(p);
        }
        let mut cc = super::roles::for_producer(&self.config);
        cc.set("batch.num.messages", "1").set("linger.ms", "0");
        let p = Producer::create(&cc, KafkaContext { connected: self.connected.clone(), cause: self.cause.clone() })
            .map_err(|e| SendError::Retriable(format!("second Kafka producer: {e}")))?;
        Ok(self.solo.get_or_init(|| OffWorker::new(p)))
    }

    /// ` as User:<name>` with SASL (the principal an ACL names), else nothing.
    fn principal(&self) -> String {
        self.config.get("sasl.username").map(|u| format!(" as User:{u}")).unwrap_or_default()
    }

    /// Why a record for `topic` failed: the producer is dead (fatal), the set-up refuses every
    /// event (held), the record itself cannot go (dead letter), or it may go later (retried).
    fn classify(&self, e: KafkaError, topic: &str) -> SendError {
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            let fix = refusal(&KafkaError::MessageProduction(code))
                .map(|r| format!(" ({r}; fix: {})", r.fix()))
                .unwrap_or_default();
            return SendError::Fatal(format!("fatal Kafka producer error {code:?}: {reason}{fix}"));
        }
        if let Some(refusal) = refusal(&e) {
            SendError::Refused { refusal, reason: format!("Kafka topic {topic:?}{}: {e}", self.principal()) }
        } else if rejected_for_good(&e) {
            SendError::Permanent(super::rejected::with_fix(&e))
        } else {
            SendError::Retriable(e.to_string())
        }
    }

    /// Whether `topic` exists. Asking for it lets a broker with `auto.create.topics.enable`
    /// create it: a topic being created (leader not available yet, no partitions yet) is asked
    /// for again, for up to 10 s; `false` when it still is not there. `Err` when the brokers do
    /// not answer.
    pub async fn topic_exists(&self, topic: &str) -> Result<bool, String> {
        let producer = self.producer.clone();
        let topic = topic.to_string();
        tokio::task::spawn_blocking(move || {
            let until = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let md = producer
                    .client()
                    .fetch_metadata(Some(&topic), Duration::from_secs(10))
                    .map_err(|e| e.to_string())?;
                let there =
                    md.topics().iter().any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty());
                if there {
                    return Ok(true);
                }
                if std::time::Instant::now() >= until {
                    return Ok(false);
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Waits until everything handed to librdkafka is delivered (or `timeout` passes).
    /// Both producers share the one `timeout` (the shutdown's deadline).
    pub fn flush(&self, timeout: Duration) -> Result<(), SinkError> {
        let deadline = std::time::Instant::now() + timeout;
        if let Some(solo) = self.solo.get() {
            solo.flush(timeout).map_err(|e| SinkError::Flush(e.to_string()))?;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        self.producer.flush(left).map_err(|e| SinkError::Flush(e.to_string()))
    }
}
