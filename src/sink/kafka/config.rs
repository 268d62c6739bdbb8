//! `[sink.kafka]`: settings and their checks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::limits::Limits;
use crate::model::Problem;
use crate::sink::secret;
use crate::sink::template::Template;

pub const DEFAULT_TOPIC: &str = "kubecast.{cluster}.{group}.{resource}";

/// Kafka topic names allow `[a-zA-Z0-9._-]`: other characters become `_`; an empty field
/// (the namespace of a cluster-scoped object) becomes `_`.
pub fn clean_topic_part(s: &str) -> std::borrow::Cow<'_, str> {
    crate::sink::template::clean_with(s, |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Parses a topic template and checks that it makes Kafka topic names: rendered with sample
/// values (placeholders' values are cleaned to the legal characters at send time), only ASCII
/// letters, digits, `.`, `_` and `-`, at most 249 characters, not `.` or `..`. The broker
/// would refuse any other name at every send.
pub fn topic_template(s: &str) -> Result<Template, String> {
    let t = Template::parse(s)?;
    let sample = crate::model::Fields::sample();
    let rendered = t.render(&sample, clean_topic_part);
    if let Some(problem) = topic_name_problem(&rendered) {
        return Err(format!("{s:?} does not make a Kafka topic name (e.g. {rendered:?}): {problem}"));
    }
    Ok(t)
}

/// Why `name` is not a Kafka topic name, if it is not.
pub fn topic_name_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() || name == "." || name == ".." {
        Some("it must not be empty, \".\" or \"..\"")
    } else if name.len() > 249 {
        Some("at most 249 characters")
    } else if !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')) {
        Some("only ASCII letters, digits, '.', '_' and '-'")
    } else {
        None
    }
}

/// Properties kubecast sets itself, and why: the delivery guarantees depend on them.
pub(super) const REQUIRED: [(&str, &str, &str); 3] = [
    ("enable.idempotence", "true", "no loss, no reordering on retries"),
    ("acks", "all", "no loss, no reordering on retries"),
    // With only errors reported, a record the broker stored is never reported: its event
    // would never count as delivered, and sends would stop once max_in_flight are waiting.
    ("delivery.report.only.error", "false", "the delivery report of each stored record is what acknowledges its event"),
];

/// Properties of the transactional producer (the Kafka state store's, which exactly-once
/// sends the events through) that kubecast sets itself: a `transactional.id` of its own, and
/// the transaction timeout the commit interval's limit is derived from.
const TRANSACTIONAL: [(&str, &str, &str); 2] = [
    (
        "transactional.id",
        "kubecast names its transactional producer itself; on the sink's producer it would make every send outside a transaction fail",
        "remove it (the state store's is checkpoint.kafka.transactional_id)",
    ),
    (
        "transaction.timeout.ms",
        "kubecast sets it to 60000 on its transactional producer: with exactly_once, checkpoint.flush_interval_ms (the commit interval) is checked against it",
        "remove it",
    ),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Binary,
    Structured,
}

/// `[sink.kafka]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`, e.g. `"kafka-0:9092,kafka-1:9092"`.
    pub brokers: String,
    /// Topic template; see `template.rs` for the fields.
    #[serde(default = "default_topic")]
    pub topic: String,
    #[serde(default)]
    pub mode: Mode,
    /// Also write a null-value record (a tombstone for compacted topics) after each `deleted`.
    #[serde(default)]
    pub tombstones: bool,
    /// Events and the state that advances past them in one Kafka transaction (needs
    /// `[checkpoint] store = "kafka"` on this cluster): `read_committed` consumers see each
    /// change once, no dedupe needed.
    #[serde(default)]
    pub exactly_once: bool,
    /// With `exactly_once`: at most this many events (a tombstone counts as one more) wait
    /// for their commit; once reached, sends wait until a commit frees room (backpressure).
    #[serde(default = "default_max_uncommitted_events")]
    pub max_uncommitted_events: usize,
    /// With `exactly_once`: at most this many bytes of events (topic, key, value, plus 64
    /// each) wait for their commit; an event larger than this goes out alone.
    #[serde(default = "default_max_uncommitted_bytes")]
    pub max_uncommitted_bytes: usize,
    /// Passed to librdkafka as they are (TLS, SASL, compression, linger...). A value
    /// `${env:NAME}` or `${file:/path}` is read from that variable or file (secrets).
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

fn default_topic() -> String {
    DEFAULT_TOPIC.to_string()
}

fn default_max_uncommitted_events() -> usize {
    Limits::DEFAULT_EVENTS
}

fn default_max_uncommitted_bytes() -> usize {
    Limits::DEFAULT_BYTES
}

/// At least this many bytes may wait uncommitted.
const MIN_UNCOMMITTED_BYTES: usize = 64 * 1024;

impl KafkaConfig {
    /// Problems with `[sink.kafka]`.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.brokers.trim().is_empty() {
            out.push(Problem::new("sink.kafka.brokers", "is empty", "set the bootstrap servers, e.g. \"kafka:9092\""));
        }
        if self.max_uncommitted_events == 0 {
            out.push(Problem::new(
                "sink.kafka.max_uncommitted_events",
                "is 0: no event could ever be sent",
                format!("set at least 1 (default {})", Limits::DEFAULT_EVENTS),
            ));
        }
        if self.max_uncommitted_bytes < MIN_UNCOMMITTED_BYTES {
            out.push(Problem::new(
                "sink.kafka.max_uncommitted_bytes",
                format!("is {}, below the minimum of {MIN_UNCOMMITTED_BYTES} (64 KiB)", self.max_uncommitted_bytes),
                format!("set at least {MIN_UNCOMMITTED_BYTES} (default {}, 64 MiB)", Limits::DEFAULT_BYTES),
            ));
        }
        if let Err(e) = topic_template(&self.topic) {
            out.push(Problem::new("sink.kafka.topic", e, format!("e.g. {DEFAULT_TOPIC:?}")));
        }
        out.extend(super::security::problems("sink.kafka.properties", &self.properties));
        out.extend(super::properties::problems("sink.kafka.properties", &self.properties));
        for (k, v) in &self.properties {
            if k == "bootstrap.servers" {
                out.push(Problem::new(
                    format!("sink.kafka.properties.\"{k}\""),
                    "duplicates sink.kafka.brokers",
                    "set sink.kafka.brokers instead",
                ));
            }
            if let Some((_, want, why)) = REQUIRED.iter().find(|(rk, ..)| rk == k)
                && v != want
            {
                out.push(Problem::new(
                    format!("sink.kafka.properties.\"{k}\""),
                    format!("kubecast requires {k} = {want} ({why})"),
                    "remove it",
                ));
            }
            if let Some((_, why, fix)) = TRANSACTIONAL.iter().find(|(tk, ..)| tk == k) {
                out.push(Problem::new(format!("sink.kafka.properties.\"{k}\""), *why, *fix));
            }
            if let Err(e) = secret::resolve(v) {
                out.push(Problem::new(
                    format!("sink.kafka.properties.\"{k}\""),
                    e,
                    "set that variable or create that file",
                ));
            }
        }
        out
    }
}
