//! librdkafka's log lines and errors, as kubecast's (target `kubecast::kafka`), for every
//! Kafka client context (the sink's producer, the transactional one, the state store's
//! consumers and admin client).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tracing::{debug, error, warn};

/// How long repeats of one warning or error are counted rather than logged.
const REPEAT_WINDOW: Duration = Duration::from_secs(30);

/// The warnings and errors logged lately, by shape (digits left out), with when each was last
/// logged and how often it came since. librdkafka reports an unreachable broker at every
/// reconnect attempt, from every client, through its log and its error callbacks alike:
/// thousands of lines a minute saying one thing.
static RECENT: Mutex<Option<HashMap<String, (Instant, u64)>>> = Mutex::new(None);

/// Whether `msg` is to be logged now, and how many like it were left out since the last one
/// logged: once per shape per [`REPEAT_WINDOW`].
fn first_in_window(msg: &str) -> Option<u64> {
    let mut shape = String::with_capacity(msg.len());
    for c in msg.chars() {
        if !(c.is_ascii_digit() && shape.ends_with('#')) {
            shape.push(if c.is_ascii_digit() { '#' } else { c });
        }
    }
    let mut recent = RECENT.lock().expect("log repeats lock");
    let recent = recent.get_or_insert_with(HashMap::new);
    let now = Instant::now();
    if recent.len() > 1000 {
        recent.retain(|_, (at, _)| now.duration_since(*at) < REPEAT_WINDOW);
    }
    match recent.get_mut(&shape) {
        Some((at, left_out)) if now.duration_since(*at) < REPEAT_WINDOW => {
            *left_out += 1;
            None
        }
        Some((at, left_out)) => {
            let n = *left_out;
            (*at, *left_out) = (now, 0);
            Some(n)
        }
        None => {
            recent.insert(shape, (now, 0));
            Some(0)
        }
    }
}

/// What a logged line says of the `n` like it left out before it (nothing when none were).
fn left_out(n: u64) -> String {
    if n == 0 { String::new() } else { format!(" (and {n} more like it in the last {} s)", REPEAT_WINDOW.as_secs()) }
}

/// The fix of a failure to reach a broker at all.
fn reach_fix(msg: &str) -> Option<&'static str> {
    const UNREACHABLE: [&str; 5] =
        ["Connection refused", "brokers are down", "Failed to resolve", "Connect to ", "Name or service not known"];
    UNREACHABLE.iter().any(|m| msg.contains(m)).then_some(
        "check the brokers' addresses (sink.kafka.brokers, or checkpoint.kafka.brokers for a state store of its own) and that they are reachable from here",
    )
}

/// A librdkafka log line; a TLS or SASL failure gets a `fix` field (see `security::fix_for`),
/// so does a broker that cannot be reached. Warnings and errors that repeat are logged once
/// per [`REPEAT_WINDOW`], with the count of those left out.
pub(super) fn log(level: RDKafkaLogLevel, fac: &str, msg: &str) {
    log_for(None, level, fac, msg);
}

/// [`log`] with a `client` field naming the client the line is from (a transactional
/// producer's `transactional.id`): librdkafka's lines do not say which of the process's
/// clients wrote them, and each shard has its own transactional producer.
pub(super) fn log_for(client: Option<&str>, level: RDKafkaLogLevel, fac: &str, msg: &str) {
    let fix = super::security::fix_for(msg).or_else(|| reach_fix(msg));
    let serious = matches!(
        level,
        RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error
            | RDKafkaLogLevel::Warning
    );
    let repeats = if serious {
        match first_in_window(msg) {
            Some(n) => n,
            None => return,
        }
    } else {
        0
    };
    let msg = format!("{msg}{}", left_out(repeats));
    match (level, fix) {
        (
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error,
            Some(fix),
        ) => {
            error!(target: "kubecast::kafka", client, facility = fac, fix, "{msg}")
        }
        (
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error,
            None,
        ) => {
            error!(target: "kubecast::kafka", client, facility = fac, "{msg}")
        }
        (RDKafkaLogLevel::Warning, Some(fix)) => warn!(target: "kubecast::kafka", client, facility = fac, fix, "{msg}"),
        (RDKafkaLogLevel::Warning, None) => warn!(target: "kubecast::kafka", client, facility = fac, "{msg}"),
        _ => debug!(target: "kubecast::kafka", client, facility = fac, "{msg}"),
    }
}

/// The level librdkafka logs at for `cc`: warnings and errors, or everything when the
/// properties set librdkafka's `debug` contexts (e.g. `"eos,broker"`: its debug lines then
/// come at kubecast's DEBUG level, target `kubecast::kafka`).
pub fn log_level(cc: &ClientConfig) -> RDKafkaLogLevel {
    if cc.get("debug").is_some_and(|d| !d.is_empty()) { RDKafkaLogLevel::Debug } else { RDKafkaLogLevel::Warning }
}

/// A client error (librdkafka's error callback) at ERROR, with a `fix` for TLS and SASL
/// failures and unreachable brokers; repeats as in [`log`].
pub(super) fn client_error(error: &KafkaError, reason: &str) {
    let Some(repeats) = first_in_window(&format!("client error: {reason}")) else { return };
    let more = left_out(repeats);
    match super::security::fix_for(reason).or_else(|| reach_fix(reason)) {
        Some(fix) => error!(target: "kubecast::kafka", error = %error, fix, "Kafka client error: {reason}{more}"),
        None => error!(target: "kubecast::kafka", error = %error, "Kafka client error: {reason}{more}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_of_one_shape_are_counted_within_the_window() {
        let a = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT) test-shape";
        let b = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 12ms in state CONNECT) test-shape";
        assert_eq!(first_in_window(a), Some(0));
        assert_eq!(first_in_window(b), None, "only the numbers differ");
        assert_eq!(first_in_window(a), None);
        assert_eq!(first_in_window("another message test-shape"), Some(0));
        // Once the window has passed, the next is logged with the count left out.
        RECENT.lock().unwrap().as_mut().unwrap().values_mut().for_each(|(at, _)| *at -= REPEAT_WINDOW);
        assert_eq!(first_in_window(b), Some(2));
    }

    #[test]
    fn an_unreachable_broker_gets_a_fix_naming_the_key() {
        assert!(reach_fix("1/1 brokers are down").unwrap().contains("sink.kafka.brokers"));
        assert!(reach_fix("Connect to ipv4#127.0.0.1:1 failed: Connection refused").is_some());
        assert!(reach_fix("Message too large").is_none());
    }
}
