//! The transactional producer's context: librdkafka's log and errors, and the first record
//! rejected for good (read by the next commit to name it).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Message};
use rdkafka::producer::ProducerContext;
use tracing::error;

/// The first record of a transaction rejected for good, and why.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// A set-up mistake (a missing topic, a permission not granted): the destination refuses
    /// every record, not this one; `None`: this record can never be delivered (too large).
    pub refusal: Option<crate::model::Refusal>,
    /// The record's topic.
    pub topic: String,
    pub text: String,
}

/// Logs librdkafka's messages and keeps the first record rejected for good.
pub struct TxnContext {
    /// The `transactional.id`, on librdkafka's log lines.
    pub(super) id: String,
    pub(super) connected: Arc<AtomicBool>,
    pub(super) poison: Arc<Mutex<Option<Rejected>>>,
    /// librdkafka's last statistics listed a broker to talk to (one learned from metadata or
    /// configured): false when it dropped every one (see `rebootstrap.rs`). True until the
    /// first statistics.
    pub(super) knows_a_broker: AtomicBool,
}

impl TxnContext {
    pub(super) fn new(id: String, connected: Arc<AtomicBool>, poison: Arc<Mutex<Option<Rejected>>>) -> Self {
        Self { id, connected, poison, knows_a_broker: AtomicBool::new(true) }
    }

    /// Whether librdkafka still knows a broker to talk to.
    pub(super) fn knows_a_broker(&self) -> bool {
        self.knows_a_broker.load(Ordering::Relaxed)
    }
}

impl ClientContext for TxnContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        super::super::logging::log_for(Some(&self.id), level, fac, msg);
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        let known = statistics.brokers.values().any(|b| matches!(b.source.as_str(), "learned" | "configured"));
        self.knows_a_broker.store(known, Ordering::Relaxed);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::AllBrokersDown)) {
            self.connected.store(false, Ordering::Relaxed);
        }
        match super::super::security::fix_for(reason) {
            Some(fix) => {
                error!(target: "kubecast::kafka", error = %error, fix, "Kafka transactional producer: {reason}")
            }
            None => error!(target: "kubecast::kafka", error = %error, "Kafka transactional producer: {reason}"),
        }
    }
}

impl ProducerContext for TxnContext {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(_) => self.connected.store(true, Ordering::Relaxed),
            Err((e, m)) => {
                // A record no retry delivers, or a set-up mistake (a missing topic or ACL): the
                // transaction would fail the same way at every retry.
                let refusal = super::super::rejected::refusal(e);
                if super::super::rejected::rejected_for_good(e) || refusal.is_some() {
                    let mut p = self.poison.lock().expect("poison lock");
                    if p.is_none() {
                        let text = format!("a record for topic {} was rejected: {e}", m.topic());
                        *p = Some(Rejected { refusal, topic: m.topic().to_string(), text });
                    }
                }
            }
        }
    }
}
