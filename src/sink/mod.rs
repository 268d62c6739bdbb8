//! Sinks: where CloudEvents leave kubecast. Each sink has one `send` for one event, callable
//! concurrently; the outbound queue (`src/delivery`) adds ordering, rate limiting, retries and
//! the dead letter around it. A sink *accepts* an event when `send` returns `Ok`: stdout and
//! file after write + flush, Kafka after the broker's acknowledgement, NATS JetStream after
//! the PubAck (core NATS: after the write, at-most-once), HTTP after a 2xx response. Only accepted events
//! may advance a checkpoint.

mod config;
mod file;
mod header_value;
pub mod http;
pub mod kafka;
pub mod nats;
mod outbound;
pub(crate) mod secret;
mod stdout;
#[cfg(test)]
pub mod stub;
pub mod template;

use std::sync::Arc;
use std::time::Duration;

pub use config::{SinkConfig, SinkType};
pub use file::FileSink;
pub use header_value::header_value;
pub use http::HttpSink;
pub use kafka::KafkaSink;
pub use nats::NatsSink;
pub use outbound::{Outbound, SendError, SinkError, structured_line};
pub use stdout::StdoutSink;

/// The configured sink (enum dispatch: one variant per sink type). One per process, in an Arc.
#[allow(clippy::large_enum_variant)]
pub enum Sink {
    Stdout(StdoutSink),
    File(Arc<FileSink>),
    Kafka(KafkaSink),
    Nats(NatsSink),
    Http(HttpSink),
    /// Tests only: a scripted sink (`stub.rs`); absent from the production build.
    #[cfg(test)]
    Stub(stub::StubSink),
}

impl Sink {
    /// Opens the configured sink. `max_in_flight` bounds the NATS PubAcks awaited at once.
    pub async fn open(cfg: &SinkConfig, max_in_flight: usize) -> Result<Sink, SinkError> {
        match cfg.kind {
            SinkType::Stdout => Ok(Sink::Stdout(StdoutSink::new())),
            SinkType::File => {
                Ok(Sink::File(FileSink::shared(cfg.path.clone().unwrap_or_default(), "sink.path").await?))
            }
            SinkType::Kafka => {
                let kc = cfg.kafka.clone().ok_or_else(|| SinkError::Config("[sink.kafka] is missing".into()))?;
                // librdkafka starts its threads and reads certificate files: off the worker.
                let sink = tokio::task::spawn_blocking(move || KafkaSink::new(&kc)).await.expect("Kafka sink task")?;
                Ok(Sink::Kafka(sink))
            }
            SinkType::Nats => {
                let nc = cfg.nats.as_ref().ok_or_else(|| SinkError::Config("[sink.nats] is missing".into()))?;
                Ok(Sink::Nats(NatsSink::open(nc, max_in_flight, Duration::from_secs(10)).await?))
            }
            SinkType::Http => {
                let hc = cfg.http.clone().unwrap_or_default();
                Ok(Sink::Http(HttpSink::open(&hc, max_in_flight)?))
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
            Sink::Http(s) => Box::pin(s.send(msg)).await,
            #[cfg(test)]
            Sink::Stub(s) => Box::pin(s.send(msg)).await,
        }
    }

    /// Whether the sink sends events in structured mode (the pipeline then builds that form
    /// once, when the event is made: [`CloudEvent::seal_structured`]).
    pub fn sends_structured(&self) -> bool {
        match self {
            Sink::Stdout(_) | Sink::File(_) => false,
            Sink::Kafka(s) => s.mode() == kafka::Mode::Structured,
            Sink::Nats(s) => s.mode() == nats::Mode::Structured,
            Sink::Http(s) => s.mode() == http::Mode::Structured,
            #[cfg(test)]
            Sink::Stub(_) => false,
        }
    }

    /// `messaging.system` of traces.
    pub fn system(&self) -> &'static str {
        match self {
            Sink::Stdout(_) => "stdout",
            Sink::File(_) => "file",
            Sink::Kafka(_) => "kafka",
            Sink::Nats(_) => "nats",
            Sink::Http(_) => "http",
            #[cfg(test)]
            Sink::Stub(_) => "stub",
        }
    }

    /// The send span's attributes known before the send (`server.*`, the Kafka record key).
    pub fn trace_attributes(&self, msg: &Outbound) -> Vec<opentelemetry::KeyValue> {
        match self {
            Sink::Kafka(s) => s.trace_attributes(msg),
            Sink::Nats(s) => s.trace_attributes(),
            Sink::Http(s) => s.trace_attributes(),
            _ => Vec::new(),
        }
    }

    /// Where `msg` goes (for logs and dead letters).
    pub fn destination(&self, msg: &Outbound) -> String {
        match self {
            Sink::Stdout(_) => "stdout".into(),
            Sink::File(s) => s.path().display().to_string(),
            Sink::Kafka(s) => s.destination(msg),
            Sink::Nats(s) => s.destination(msg),
            Sink::Http(s) => s.destination().to_string(),
            #[cfg(test)]
            Sink::Stub(_) => "stub".into(),
        }
    }

    /// Hands everything still buffered to the destination (at shutdown).
    pub fn flush(&self, timeout: Duration) -> Result<(), SinkError> {
        match self {
            Sink::Kafka(s) => s.flush(timeout),
            // stdout and file flush after every event; NATS waits for each PubAck (JetStream)
            // or flushes after each publish (core); HTTP for each response.
            Sink::Stdout(_) | Sink::File(_) | Sink::Nats(_) | Sink::Http(_) => Ok(()),
            #[cfg(test)]
            Sink::Stub(_) => Ok(()),
        }
    }

    /// Why the destination is not reachable, when the sink knows (Kafka: a TLS or SASL failure).
    pub fn unreachable_cause(&self) -> Arc<std::sync::Mutex<Option<String>>> {
        match self {
            Sink::Kafka(k) => k.unreachable_cause(),
            Sink::Http(h) => h.unreachable_cause(),
            _ => Arc::default(),
        }
    }

    /// Whether the destination is reachable, for readiness (stdout and file: always).
    pub fn connected(&self) -> Arc<std::sync::atomic::AtomicBool> {
        match self {
            Sink::Kafka(k) => k.connected(),
            Sink::Nats(n) => n.connected(),
            Sink::Http(h) => h.connected(),
            Sink::Stdout(_) | Sink::File(_) => Arc::new(std::sync::atomic::AtomicBool::new(true)),
            #[cfg(test)]
            Sink::Stub(_) => Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    pub fn kafka(&self) -> Option<&KafkaSink> {
        match self {
            Sink::Kafka(k) => Some(k),
            _ => None,
        }
    }

    pub fn http(&self) -> Option<&HttpSink> {
        match self {
            Sink::Http(h) => Some(h),
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::api::{ApiResource, GroupVersionKind};

    use super::{kafka, nats};
    use crate::model::{Change, EventSource, Origin, RawObject, Verb};

    #[test]
    fn data_is_the_objects_text_without_a_copy() {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
        let src = Arc::new(EventSource::new("c", &ar));
        let obj: RawObject = serde_json::from_str(
            r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"1"}}"#,
        )
        .unwrap();
        let text = obj.text().as_ptr();
        let ev =
            Change { verb: Verb::Added, origin: Origin::Watch, object: obj, source: src }.into_cloudevent().unwrap();
        assert_eq!(ev.data.as_ptr(), text);
        let (payload, _) = nats::encode(&ev, nats::Mode::Binary);
        assert_eq!(payload.as_ptr(), text, "NATS binary mode shares the bytes");
        let (value, _) = kafka::encode(&ev, kafka::Mode::Binary);
        assert_eq!(value.as_ptr(), text, "Kafka binary mode borrows them");
    }
}
