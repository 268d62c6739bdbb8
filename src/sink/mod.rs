//! Sinks: where CloudEvents leave kubecast. Each sink has one `send` for one event, callable
//! concurrently; the outbound queue (`src/delivery`) adds ordering, rate limiting, retries and
//! the dead letter around it. A sink *accepts* an event when `send` returns `Ok`: stdout and
//! file after write + flush, Kafka after the broker's acknowledgement, NATS JetStream after
//! the PubAck (core NATS: after the write, at-most-once). Only accepted events
//! may advance a checkpoint.

mod file;
pub mod kafka;
pub mod nats;
pub mod secret;
mod stdout;
pub mod template;

use std::sync::Arc;
use std::time::Duration;

pub use file::FileSink;
pub use kafka::KafkaSink;
pub use nats::NatsSink;
pub use stdout::StdoutSink;
use template::{Fields, Template};

use crate::config::{SinkConfig, SinkType};
use crate::event::CloudEvent;

/// Errors opening or closing a sink (fatal at start).
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(
        "cannot open sink file {path}: {cause} (fix: check sink.path and that its directory exists and is writable)"
    )]
    Open { path: std::path::PathBuf, cause: std::io::Error },
    #[error("sink: {0}")]
    Config(String),
    #[error("flush failed: {0}")]
    Flush(String),
}

/// Why one send failed; decides between retry, dead letter and stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// May succeed later (broker down, timeout, queue full): retried with backoff.
    #[error("{0}")]
    Retriable(String),
    /// Will never succeed for this event (too large, not authorized, cannot be encoded): sent
    /// to the dead-letter destination.
    #[error("{0}")]
    Permanent(String),
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
    pub trace: Option<crate::telemetry::EventTrace>,
}

impl Outbound {
    /// The ordering key (and Kafka record key): `partitionkey`, the object's uid.
    pub fn key(&self) -> &str {
        self.event.attributes.partition_key()
    }
}

/// The configured sink (enum dispatch: one variant per sink type). One per process, in an Arc.
#[allow(clippy::large_enum_variant)]
pub enum Sink {
    Stdout(StdoutSink),
    File(FileSink),
    Kafka(KafkaSink),
    Nats(NatsSink),
}

impl Sink {
    /// Opens the configured sink. `max_in_flight` bounds the NATS PubAcks awaited at once.
    pub async fn open(cfg: &SinkConfig, max_in_flight: usize) -> Result<Sink, SinkError> {
        match cfg.kind {
            SinkType::Stdout => Ok(Sink::Stdout(StdoutSink::new())),
            SinkType::File => Ok(Sink::File(FileSink::open(cfg.path.clone().unwrap_or_default()).await?)),
            SinkType::Kafka => {
                let kc = cfg.kafka.as_ref().ok_or_else(|| SinkError::Config("[sink.kafka] is missing".into()))?;
                Ok(Sink::Kafka(KafkaSink::new(kc)?))
            }
            SinkType::Nats => {
                let nc = cfg.nats.as_ref().ok_or_else(|| SinkError::Config("[sink.nats] is missing".into()))?;
                Ok(Sink::Nats(NatsSink::open(nc, max_in_flight, Duration::from_secs(10)).await?))
            }
        }
    }

    /// Sends one event; `Ok` means the sink accepted it.
    /// The future of each in-flight event holds this one: as large as its largest variant.
    /// The NATS send's is small (224 bytes with `size_of_val` when this was written); the
    /// others are boxed (an allocation per event) rather than making every NATS event's future
    /// as large as the Kafka send's (~1.1 KB then).
    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        match self {
            Sink::Stdout(s) => Box::pin(s.write_line(&structured_line(&msg.event)?)).await,
            Sink::File(s) => Box::pin(s.write_line(&structured_line(&msg.event)?)).await,
            Sink::Kafka(s) => Box::pin(s.send(msg)).await,
            Sink::Nats(s) => s.send(msg).await,
        }
    }

    /// Whether the sink sends events in structured mode (the pipeline then builds that form
    /// once, when the event is made: [`CloudEvent::seal_structured`]).
    pub fn sends_structured(&self) -> bool {
        match self {
            Sink::Stdout(_) | Sink::File(_) => false,
            Sink::Kafka(s) => s.mode() == kafka::Mode::Structured,
            Sink::Nats(s) => s.mode() == nats::Mode::Structured,
        }
    }

    /// `messaging.system` of traces.
    pub fn system(&self) -> &'static str {
        match self {
            Sink::Stdout(_) => "stdout",
            Sink::File(_) => "file",
            Sink::Kafka(_) => "kafka",
            Sink::Nats(_) => "nats",
        }
    }

    /// Where `msg` goes (for logs and dead letters).
    pub fn destination(&self, msg: &Outbound) -> String {
        match self {
            Sink::Stdout(_) => "stdout".into(),
            Sink::File(s) => s.path().display().to_string(),
            Sink::Kafka(s) => s.destination(msg),
            Sink::Nats(s) => s.destination(msg),
        }
    }

    /// Hands everything still buffered to the destination (at shutdown).
    pub fn flush(&self, timeout: Duration) -> Result<(), SinkError> {
        match self {
            Sink::Kafka(s) => s.flush(timeout),
            // stdout and file flush after every event; NATS waits for each PubAck (JetStream)
            // or flushes after each publish (core).
            Sink::Stdout(_) | Sink::File(_) | Sink::Nats(_) => Ok(()),
        }
    }

    /// Whether the destination is reachable, for readiness (stdout and file: always).
    pub fn connected(&self) -> Arc<std::sync::atomic::AtomicBool> {
        match self {
            Sink::Kafka(k) => k.connected(),
            Sink::Nats(n) => n.connected(),
            Sink::Stdout(_) | Sink::File(_) => Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    pub fn kafka(&self) -> Option<&KafkaSink> {
        match self {
            Sink::Kafka(k) => Some(k),
            _ => None,
        }
    }

    pub fn nats(&self) -> Option<&NatsSink> {
        match self {
            Sink::Nats(n) => Some(n),
            _ => None,
        }
    }
}

/// Structured-mode CloudEvent JSON followed by a newline (one event per line).
pub fn structured_line(event: &CloudEvent) -> Result<Vec<u8>, SendError> {
    let mut line = event.to_structured();
    line.push(b'\n');
    Ok(line)
}

/// I/O errors of the stdout and file sinks: a closed pipe cannot recover, the rest may.
fn io_send_error(target: &str, e: std::io::Error) -> SendError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        SendError::Fatal(format!("{target}: {e}"))
    } else {
        SendError::Retriable(format!("{target}: {e}"))
    }
}
