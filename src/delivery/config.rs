//! `[delivery]` and `[delivery.dead_letter]`.

use std::path::PathBuf;

use crate::model::Problem;
use serde::{Deserialize, Serialize};

/// `[delivery]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeliveryConfig {
    /// Events held in the queue (waiting or in flight). When full, kubecast stops reading the
    /// watches (backpressure) instead of buffering more.
    #[serde(default = "d_queue_capacity")]
    pub queue_capacity: usize,
    /// Events sent and not yet acknowledged at once (never two of the same object).
    #[serde(default = "d_max_in_flight")]
    pub max_in_flight: usize,
    /// Events per second to the sink, all resources together; 0 = unlimited.
    #[serde(default)]
    pub rate_per_second: u32,
    /// Events that may go at once above the rate; 0 = same as rate_per_second.
    #[serde(default)]
    pub burst: u32,
    /// Attempts per event before it goes to the dead letter; 0 = retry forever.
    #[serde(default)]
    pub max_attempts: u32,
    /// An event not delivered this many seconds after kubecast observed it goes to the dead
    /// letter (checked between retries); 0 = no limit.
    #[serde(default)]
    pub max_event_age_seconds: u64,
    /// A stream whose checkpoint has not moved for this long while it has events pending is
    /// reported as stalled (`/readyz`, `kubecast_stream_stalled`, a log line); 0 = never.
    #[serde(default = "d_stall_after")]
    pub stall_after_seconds: u64,
    /// Backoff between attempts: jittered exponential from this ...
    #[serde(default = "d_backoff_min_ms")]
    pub backoff_min_ms: u64,
    /// ... up to this.
    #[serde(default = "d_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// At shutdown, how long to keep delivering what is queued.
    #[serde(default = "d_shutdown_timeout")]
    pub shutdown_timeout_seconds: u64,
    #[serde(default)]
    pub dead_letter: DeadLetterConfig,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        Self {
            queue_capacity: d_queue_capacity(),
            max_in_flight: d_max_in_flight(),
            rate_per_second: 0,
            burst: 0,
            max_attempts: 0,
            max_event_age_seconds: 0,
            stall_after_seconds: d_stall_after(),
            backoff_min_ms: d_backoff_min_ms(),
            backoff_max_ms: d_backoff_max_ms(),
            shutdown_timeout_seconds: d_shutdown_timeout(),
            dead_letter: DeadLetterConfig::default(),
        }
    }
}

fn d_queue_capacity() -> usize {
    10_000
}
fn d_max_in_flight() -> usize {
    1000
}
fn d_stall_after() -> u64 {
    60
}
fn d_backoff_min_ms() -> u64 {
    100
}
fn d_backoff_max_ms() -> u64 {
    30_000
}
fn d_shutdown_timeout() -> u64 {
    30
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterType {
    /// JSON lines (reason + the whole event) appended to `path`.
    #[default]
    File,
    /// A topic (Kafka) or subject (NATS) on the sink's own broker (`destination`), with the
    /// reason in headers.
    Broker,
    /// No dead letter: a permanent failure stops kubecast (nothing is skipped).
    Stop,
}

/// `[delivery.dead_letter]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    #[serde(rename = "type", default)]
    pub kind: DeadLetterType,
    /// For `type = "file"`; default: `dead-letter.jsonl` in the checkpoint directory.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// For `type = "broker"`: the Kafka topic or NATS subject.
    #[serde(default)]
    pub destination: Option<String>,
}

/// The longest `shutdown_timeout_seconds` accepted: an hour (a far larger value overflowed the
/// deadline's clock arithmetic at the first SIGTERM).
const MAX_SHUTDOWN_SECONDS: u64 = 3600;

impl DeliveryConfig {
    pub fn problems(&self, sink_is_broker: bool) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut p = |k: &str, m: String, f: &str| out.push(Problem::new(format!("delivery.{k}"), m, f));
        if self.queue_capacity == 0 {
            p("queue_capacity", "must be at least 1".into(), "e.g. 10000");
        }
        if self.max_in_flight == 0 {
            p("max_in_flight", "must be at least 1".into(), "e.g. 1000");
        }
        if self.shutdown_timeout_seconds > MAX_SHUTDOWN_SECONDS {
            p(
                "shutdown_timeout_seconds",
                format!("is {}; at most {MAX_SHUTDOWN_SECONDS}", self.shutdown_timeout_seconds),
                "e.g. 30 (the default); a pod's grace period must be longer still",
            );
        }
        if self.backoff_min_ms == 0 || self.backoff_min_ms > self.backoff_max_ms {
            p("backoff_min_ms", "must be at least 1 and at most backoff_max_ms".into(), "e.g. 100 and 30000");
        }
        match self.dead_letter.kind {
            DeadLetterType::Broker if !sink_is_broker => p(
                "dead_letter.type",
                "\"broker\" needs a broker or HTTP sink (kafka, nats or http)".into(),
                "use type = \"file\" or \"stop\"",
            ),
            DeadLetterType::Broker if self.dead_letter.destination.as_deref().is_none_or(str::is_empty) => p(
                "dead_letter.destination",
                "is required for type = \"broker\"".into(),
                "set destination = \"kubecast.dead-letter\"",
            ),
            _ => {}
        }
        // A setting of another dead-letter type: silently unused otherwise.
        let kind = self.dead_letter.kind;
        if self.dead_letter.destination.is_some() && !matches!(kind, DeadLetterType::Broker) {
            p(
                "dead_letter.destination",
                "is only used with type = \"broker\"".into(),
                "remove it, or set type = \"broker\"",
            );
        }
        if self.dead_letter.path.is_some() && !matches!(kind, DeadLetterType::File) {
            p("dead_letter.path", "is only used with type = \"file\"".into(), "remove it, or set type = \"file\"");
        }
        out
    }
}
