//! librdkafka's log lines and errors, as kubecast's (target `kubecast::kafka`), for every
//! Kafka client context (the sink's producer, the transactional one, the state store's
//! consumers and admin client).

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tracing::{debug, error, warn};

/// A librdkafka log line; a TLS or SASL failure gets a `fix` field (see `security::fix_for`).
pub(super) fn log(level: RDKafkaLogLevel, fac: &str, msg: &str) {
    let fix = super::security::fix_for(msg);
    match (level, fix) {
        (
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error,
            Some(fix),
        ) => {
            error!(target: "kubecast::kafka", facility = fac, fix, "{msg}")
        }
        (
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error,
            None,
        ) => {
            error!(target: "kubecast::kafka", facility = fac, "{msg}")
        }
        (RDKafkaLogLevel::Warning, Some(fix)) => warn!(target: "kubecast::kafka", facility = fac, fix, "{msg}"),
        (RDKafkaLogLevel::Warning, None) => warn!(target: "kubecast::kafka", facility = fac, "{msg}"),
        _ => debug!(target: "kubecast::kafka", facility = fac, "{msg}"),
    }
}

/// The level librdkafka logs at for `cc`: warnings and errors, or everything when the
/// properties set librdkafka's `debug` contexts (e.g. `"eos,txn,broker"`: its debug lines then
/// come at kubecast's DEBUG level, target `kubecast::kafka`).
pub fn log_level(cc: &ClientConfig) -> RDKafkaLogLevel {
    if cc.get("debug").is_some_and(|d| !d.is_empty()) { RDKafkaLogLevel::Debug } else { RDKafkaLogLevel::Warning }
}

/// A client error (librdkafka's error callback) at ERROR, with a `fix` for TLS and SASL failures.
pub(super) fn client_error(error: &KafkaError, reason: &str) {
    match super::security::fix_for(reason) {
        Some(fix) => error!(target: "kubecast::kafka", error = %error, fix, "Kafka client error: {reason}"),
        None => error!(target: "kubecast::kafka", error = %error, "Kafka client error: {reason}"),
    }
}

/// Whether a client error is a normal event rather than a failure: the end of a partition
/// (`enable.partition.eof`, how a reader knows it has read a topic to its end, also an
/// empty one).
fn is_normal(error: &KafkaError) -> bool {
    matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::PartitionEOF))
}

/// The context of the clients that only read or administer (the state store's consumers and
/// admin client): librdkafka's log lines and errors go to kubecast's log; the end of a
/// partition is not an error.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogContext;

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        log(level, fac, msg);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if is_normal(&error) {
            debug!(target: "kubecast::kafka", error = %error, "Kafka client: {reason}");
        } else {
            client_error(&error, reason);
        }
    }
}

impl ConsumerContext for LogContext {}
