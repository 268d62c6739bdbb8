//! What every sink shares: the event on its way out (`Outbound`), why a send failed
//! (`SendError`), and why a sink could not be opened (`SinkError`).

use std::sync::Arc;

use super::template::Template;
use crate::model::{CloudEvent, Fields, Refusal};

/// Errors opening or closing a sink (fatal at start).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("cannot open file {path}: {cause} (fix: check {key} and that its directory exists and is writable)")]
    Open { key: &'static str, path: std::path::PathBuf, cause: std::io::Error },
    #[error("sink: {0}")]
    Config(String),
    #[error("flush failed: {0}")]
    Flush(String),
}

/// Why one send failed; decides between retry, dead letter and stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// May succeed later (broker down, timeout, queue full): retried with backoff. Nothing of
    /// the event was written (exactly-once: nothing of it is in the open transaction), so the
    /// queue lets a commit go ahead while it backs off.
    #[error("{0}")]
    Retriable(String),
    /// Like `Retriable`, after at least `after`: the destination said when (HTTP
    /// `Retry-After` on 429 and 503).
    #[error("{reason}")]
    RetryAfter { reason: String, after: std::time::Duration },
    /// Will never succeed for this event (too large, cannot be encoded): sent to the
    /// dead-letter destination.
    #[error("{0}")]
    Permanent(String),
    /// The destination refuses every event, not this one: a mistake in the set-up (a topic or
    /// stream that does not exist, a permission not granted). Nothing of the event was
    /// written. Held: retried with backoff for as long as it lasts, never dead-lettered and
    /// never counted against `max_attempts` or `max_event_age_seconds`; readiness names the
    /// destination, the cause and the fix.
    #[error("{reason} ({refusal}; fix: {})", refusal.fix())]
    Refused { refusal: Refusal, reason: String },
    /// The sink cannot go on (e.g. a fatal idempotent-producer error): kubecast stops; the
    /// checkpoint stays at the last acknowledged event.
    #[error("{0}")]
    Fatal(String),
}

/// One event on its way out.
#[derive(Debug, Clone)]
pub struct Outbound {
    pub event: CloudEvent,
    /// Values for destination templates.
    pub fields: Fields,
    /// The resource's own destination template, overriding the sink's.
    pub route: Option<Arc<Template>>,
    /// The event's trace, when traces are on.
    pub trace: Option<crate::observe::trace::EventTrace>,
}

impl Outbound {
    /// The ordering key (and Kafka record key): `partitionkey`, the object's uid.
    pub fn key(&self) -> &str {
        self.event.attributes.partition_key()
    }
}

/// Structured-mode CloudEvent JSON followed by a newline (one event per line).
pub fn structured_line(event: &CloudEvent) -> Result<Vec<u8>, SendError> {
    let mut line = event.to_structured();
    line.push(b'\n');
    Ok(line)
}

/// I/O errors of the stdout and file sinks: a closed pipe cannot recover, the rest may.
pub(super) fn io_send_error(target: &str, e: std::io::Error) -> SendError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        SendError::Fatal(format!("{target}: {e}"))
    } else {
        SendError::Retriable(format!("{target}: {e}"))
    }
}
