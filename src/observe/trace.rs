//! OpenTelemetry traces, one trace per event (`[telemetry]`, and the standard `OTEL_*`
//! variables): OTLP over HTTP/protobuf with the blocking client (no async HTTP client on the
//! exporter's thread).
//!
//! Spans of one event: `{Kind} {verb}` (INTERNAL, the root: from the shaping stage receiving
//! the change until its acknowledgement), with children `shape`, `queue` (waiting in the
//! outbound queue and the rate limiter) and `send {destination}` (PRODUCER, first attempt to
//! the broker's acknowledgement, with the OpenTelemetry messaging attributes and the retry
//! count). The send span's W3C context goes into the CloudEvent `traceparent` (and
//! `tracestate`) extension and into plain `traceparent` / `tracestate` message headers, so a
//! consumer's span becomes a child of the send span (messaging semantic conventions: the
//! PRODUCER span whose context is propagated).
//!
//! The message is made (and its structured form sealed) in the shaping stage, before the send
//! span starts: the send span's id is reserved then ([`EventTrace::start`]) and given to the
//! span when it starts, by the provider's id generator ([`ReservedIds`]).
//!
//! Off by default, and then nothing is created per event.

use std::borrow::Cow;
use std::cell::Cell;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;

use crate::model::Problem;
use opentelemetry::trace::{Span as _, SpanId, SpanKind, Status, TraceContextExt, Tracer, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{
    IdGenerator, RandomIdGenerator, Sampler, SdkTracer, SdkTracerProvider, Span, TracerProviderBuilder,
};
use serde::{Deserialize, Serialize};

/// The tracer, once [`init`] installed the provider (traces on).
static TRACER: OnceLock<SdkTracer> = OnceLock::new();
const TRACER_NAME: &str = "kubecast";

/// `[telemetry]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// Export traces (also on when `OTEL_TRACES_EXPORTER=otlp`).
    #[serde(default)]
    pub traces: bool,
    /// OTLP/HTTP base URL, e.g. `http://otel-collector:4318` (`/v1/traces` is appended).
    /// Default: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`, else
    /// `http://localhost:4318`.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Share of events traced, 0.0 to 1.0 (`OTEL_TRACES_SAMPLER_ARG` overrides). Default 1.0.
    #[serde(default = "one")]
    pub sampling_ratio: f64,
    /// `service.name` (`OTEL_SERVICE_NAME` overrides). Default "kubecast".
    #[serde(default = "service")]
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self { traces: false, endpoint: None, sampling_ratio: 1.0, service_name: service() }
    }
}

fn one() -> f64 {
    1.0
}
fn service() -> String {
    "kubecast".into()
}

impl TelemetryConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            out.push(Problem::new(
                "telemetry.sampling_ratio",
                format!("{} is not between 0 and 1", self.sampling_ratio),
                "e.g. 1.0 (all events) or 0.01",
            ));
        }
        // The standard variable overrides sampling_ratio: checked as strictly (it was ignored
        // when unreadable, and used as given when out of range).
        if let Ok(v) = std::env::var("OTEL_TRACES_SAMPLER_ARG")
            && self.wanted()
            && !v.trim().parse::<f64>().is_ok_and(|r| (0.0..=1.0).contains(&r))
        {
            out.push(Problem::new(
                "telemetry.sampling_ratio",
                format!("the environment variable OTEL_TRACES_SAMPLER_ARG={v:?}, which overrides it, is not a number between 0 and 1"),
                "e.g. OTEL_TRACES_SAMPLER_ARG=0.01, or unset it",
            ));
        }
        if let Some(e) = &self.endpoint
            && url::Url::parse(e).map(|u| !matches!(u.scheme(), "http" | "https")).unwrap_or(true)
        {
            out.push(Problem::new(
                "telemetry.endpoint",
                format!("{e:?} is not an http(s) URL"),
                "e.g. \"http://otel-collector:4318\"",
            ));
        }
        out
    }

    fn wanted(&self) -> bool {
        self.traces || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v == "otlp")
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "telemetry: cannot create the OTLP exporter: {0} (fix: check [telemetry] endpoint and the OTEL_EXPORTER_OTLP_* variables)"
)]
pub struct TelemetryError(String);

/// Installs the tracer provider when traces are wanted; keep the guard until exit (it flushes
/// the spans still buffered when dropped).
pub fn init(cfg: &TelemetryConfig) -> Result<Option<Guard>, TelemetryError> {
    if !cfg.wanted() {
        return Ok(None);
    }
    let mut builder = opentelemetry_otlp::SpanExporter::builder().with_http();
    if let Some(e) = &cfg.endpoint {
        builder = builder.with_endpoint(format!("{}/v1/traces", e.trim_end_matches('/')));
    }
    let exporter = builder.build().map_err(|e| TelemetryError(e.to_string()))?;
    let ratio = std::env::var("OTEL_TRACES_SAMPLER_ARG")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(cfg.sampling_ratio);
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| cfg.service_name.clone());
    let provider = provider_builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        )
        .build();
    if TRACER.set(provider.tracer(TRACER_NAME)).is_err() {
        tracing::warn!("OpenTelemetry traces were already set up; the first setup stays");
    }
    tracing::info!(sampling_ratio = ratio, "OpenTelemetry traces on (OTLP/HTTP)");
    Ok(Some(Guard(provider)))
}

/// A tracer provider with kubecast's id generator ([`ReservedIds`]).
fn provider_builder() -> TracerProviderBuilder {
    SdkTracerProvider::builder().with_id_generator(ReservedIds::default())
}

thread_local! {
    /// The span id the next span started on this thread gets (see [`ReservedIds`]).
    static RESERVED: Cell<Option<SpanId>> = const { Cell::new(None) };
}

/// Random ids, except for a span started by [`EventTrace::start_send`]: that one gets the id
/// reserved for it when the event was made (its traceparent was written into the event then).
/// A span starts synchronously on the calling thread, so the reservation is a thread-local
/// set just around that call.
#[derive(Debug, Default)]
struct ReservedIds(RandomIdGenerator);

impl IdGenerator for ReservedIds {
    fn new_trace_id(&self) -> opentelemetry::trace::TraceId {
        self.0.new_trace_id()
    }

    fn new_span_id(&self) -> SpanId {
        RESERVED.with(Cell::take).unwrap_or_else(|| self.0.new_span_id())
    }
}

/// Flushes and shuts the exporter down when dropped.
pub struct Guard(SdkTracerProvider);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.force_flush();
        let _ = self.0.shutdown();
    }
}

pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The trace of one event (its root span's context, and its send span once started). `None`
/// everywhere when traces are off.
#[derive(Debug, Clone)]
pub struct EventTrace {
    tracer: SdkTracer,
    cx: Context,
    /// The id of the `send` span, reserved when the event is made: the event's traceparent.
    send_id: SpanId,
    /// The `send` span, from the first attempt to the acknowledgement (the sink adds what the
    /// broker answered).
    send: Arc<Mutex<Option<Span>>>,
    /// When the event left the shaping stage (start of its `queue` span).
    queued_at: SystemTime,
}

impl EventTrace {
    /// Starts the root span of a change, `{Kind} {verb}`, at `started` (when the shaping stage
    /// took the change: its `shape` child starts then too, never before its parent).
    pub fn start(kind: &str, verb: &str, namespace: &str, name: &str, started: SystemTime) -> Option<EventTrace> {
        TRACER.get().map(|tracer| Self::start_with(tracer, kind, verb, namespace, name, started))
    }

    fn start_with(
        tracer: &SdkTracer,
        kind: &str,
        verb: &str,
        namespace: &str,
        name: &str,
        started: SystemTime,
    ) -> EventTrace {
        let mut attrs = vec![
            KeyValue::new("k8s.object.kind", kind.to_string()),
            KeyValue::new("k8s.object.name", name.to_string()),
            KeyValue::new("kubecast.verb", verb.to_string()),
        ];
        if !namespace.is_empty() {
            attrs.push(KeyValue::new("k8s.namespace.name", namespace.to_string()));
        }
        let span = tracer
            .span_builder(format!("{kind} {verb}"))
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_attributes(attrs)
            .start(tracer);
        EventTrace {
            tracer: tracer.clone(),
            cx: Context::new().with_span(span),
            send_id: RandomIdGenerator::default().new_span_id(),
            send: Arc::default(),
            queued_at: started,
        }
    }

    /// A finished child span from `start` to now.
    pub fn child(&self, name: &'static str, start: SystemTime, attrs: Vec<KeyValue>) {
        let mut span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attrs)
            .start_with_context(&self.tracer, &self.cx);
        span.end();
    }

    /// Adds attributes to the root span (e.g. the event id once the CloudEvent exists).
    pub fn annotate(&self, attrs: Vec<KeyValue>) {
        self.cx.span().set_attributes(attrs);
    }

    pub fn mark_queued(&mut self) {
        self.queued_at = SystemTime::now();
    }

    pub fn queued_at(&self) -> SystemTime {
        self.queued_at
    }

    /// The trace id (hex), for log lines about this event.
    pub fn trace_id(&self) -> String {
        self.cx.span().span_context().trace_id().to_string()
    }

    /// W3C `traceparent` of the event's send span (PRODUCER; reserved, it may not have started
    /// yet), and `tracestate` when not empty: what consumers continue.
    pub fn w3c(&self) -> (String, Option<String>) {
        let sc = self.cx.span().span_context().clone();
        let parent = format!("00-{}-{}-{:02x}", sc.trace_id(), self.send_id, sc.trace_flags().to_u8());
        let state = sc.trace_state().header();
        (parent, (!state.is_empty()).then_some(state))
    }

    /// Starts the PRODUCER span of the publish, `send {destination}`, with the id reserved for
    /// it (the one in the event's traceparent). Once per event: retries are in the same span.
    /// `attrs`: the sink's own (`server.*`, the record key).
    pub fn start_send(
        &self,
        system: &'static str,
        destination: &str,
        event_id: &str,
        event_source: &str,
        attrs: Vec<KeyValue>,
    ) {
        let mut send = self.send.lock().unwrap_or_else(|e| e.into_inner());
        if send.is_some() {
            return;
        }
        let builder =
            self.tracer.span_builder(format!("send {destination}")).with_kind(SpanKind::Producer).with_attributes(
                vec![
                    KeyValue::new("messaging.system", system),
                    KeyValue::new("messaging.destination.name", destination.to_string()),
                    KeyValue::new("messaging.operation.type", "send"),
                    KeyValue::new("messaging.operation.name", "send"),
                    KeyValue::new("messaging.message.id", event_id.to_string()),
                    KeyValue::new("cloudevents.event_id", event_id.to_string()),
                    KeyValue::new("cloudevents.event_source", event_source.to_string()),
                ]
                .into_iter()
                .chain(attrs)
                .collect::<Vec<_>>(),
            );
        RESERVED.with(|r| r.set(Some(self.send_id)));
        let span = builder.start_with_context(&self.tracer, &self.cx);
        // Not taken when the provider was shut down (no id was generated).
        RESERVED.with(|r| r.set(None));
        *send = Some(span);
    }

    /// Adds attributes to the send span (what the broker answered: partition, offset, stream
    /// sequence...). Nothing when it has not started.
    pub fn record_send(&self, attrs: Vec<KeyValue>) {
        if let Some(span) = self.send.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            span.set_attributes(attrs);
        }
    }

    /// Ends the send span with the retry count and the result.
    pub fn end_send(&self, retries: u32, error: Option<String>) {
        if let Some(mut span) = self.send.lock().unwrap_or_else(|e| e.into_inner()).take() {
            span.set_attribute(KeyValue::new("kubecast.retry_count", i64::from(retries)));
            if let Some(e) = error {
                span.set_status(Status::error(e));
            }
            span.end();
        }
    }

    /// Ends the root span (`outcome`: delivered, dead_lettered, filtered reason...).
    pub fn end(&self, outcome: Cow<'static, str>, error: Option<String>) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("kubecast.outcome", outcome));
        if let Some(e) = error {
            span.set_status(Status::error(e));
        }
        span.end();
    }
}

/// The trace id of an event's trace for its log lines ("" when traces are off).
pub fn trace_id(trace: Option<&EventTrace>) -> String {
    trace.map(EventTrace::trace_id).unwrap_or_default()
}

/// `server.address` and `server.port` of the first server of a configured list (Kafka's
/// `brokers`, NATS's `url`): `host:port` entries, comma separated, each maybe with a scheme
/// (`nats://`, `SASL_SSL://`) and user info; `default_port` when an entry names none.
pub fn server_attributes(servers: &str, default_port: u16) -> Vec<KeyValue> {
    let Some(first) = servers.split(',').map(str::trim).find(|s| !s.is_empty()) else {
        return Vec::new();
    };
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let rest = rest.split('/').next().unwrap_or(rest);
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        match v6.split_once(']') {
            Some((host, after)) => (host, after.strip_prefix(':').and_then(|p| p.parse().ok())),
            None => (v6, None),
        }
    } else {
        match rest.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host, port.parse().ok()),
            _ => (rest, None),
        }
    };
    if host.is_empty() {
        return Vec::new();
    }
    vec![
        KeyValue::new("server.address", host.to_string()),
        KeyValue::new("server.port", i64::from(port.unwrap_or(default_port))),
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime};

    use opentelemetry::trace::{SpanKind, TracerProvider as _};
    use opentelemetry::{KeyValue, Value};
    use opentelemetry_sdk::error::OTelSdkResult;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};

    use super::{EventTrace, provider_builder, server_attributes};

    /// Keeps the exported spans in memory.
    #[derive(Debug, Clone, Default)]
    struct Spans(Arc<Mutex<Vec<SpanData>>>);

    impl SpanExporter for Spans {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.0.lock().unwrap().extend(batch);
            Ok(())
        }
    }

    impl Spans {
        fn named(&self, name: &str) -> SpanData {
            let all = self.0.lock().unwrap();
            let found: Vec<&SpanData> = all.iter().filter(|s| s.name == name).collect();
            assert_eq!(found.len(), 1, "one span {name:?}, got {:?}", all.iter().map(|s| &s.name).collect::<Vec<_>>());
            found[0].clone()
        }
    }

    fn provider(sampler: Sampler) -> (SdkTracerProvider, Spans) {
        let spans = Spans::default();
        (provider_builder().with_simple_exporter(spans.clone()).with_sampler(sampler).build(), spans)
    }

    fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
        span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| &kv.value)
    }

    /// What the shaping stage does: the root starts when the stage took the change, `shape`
    /// from then to now; the shape span never starts before its parent.
    #[test]
    fn the_shape_span_starts_with_its_root_not_before() {
        let (provider, spans) = provider(Sampler::AlwaysOn);
        let tracer = provider.tracer("test");
        let started = SystemTime::now();
        std::thread::sleep(Duration::from_millis(2));
        let trace = EventTrace::start_with(&tracer, "ConfigMap", "added", "ns", "a", started);
        trace.child("shape", started, vec![]);
        trace.end("delivered".into(), None);
        let (root, shape) = (spans.named("ConfigMap added"), spans.named("shape"));
        assert_eq!(root.start_time, started, "the root starts when the stage took the change");
        assert!(shape.start_time >= root.start_time, "shape starts before its root");
        assert!(shape.end_time <= root.end_time);
        assert_eq!(shape.parent_span_id, root.span_context.span_id());
        assert_eq!(trace.queued_at(), started);
    }

    /// The traceparent written into the event names the PRODUCER send span, which starts later
    /// (after the queue) with exactly that id, as a child of the root.
    #[test]
    fn the_traceparent_is_the_send_span_reserved_before_it_starts() {
        let (provider, spans) = provider(Sampler::AlwaysOn);
        let tracer = provider.tracer("test");
        let trace = EventTrace::start_with(&tracer, "ConfigMap", "added", "", "a", SystemTime::now());
        let (traceparent, state) = trace.w3c();
        assert_eq!(state, None);
        // Other spans started in between (other events, on this thread) take other ids.
        trace.child("queue", SystemTime::now(), vec![]);
        trace.start_send("kafka", "topic-a", "u:1:added", "k8s://c/api/v1/configmaps", vec![KeyValue::new("k", "v")]);
        trace.start_send("kafka", "topic-a", "u:1:added", "k8s://c/api/v1/configmaps", vec![]);
        trace.record_send(vec![KeyValue::new("messaging.kafka.offset", 7i64)]);
        trace.end_send(2, None);
        trace.end_send(3, Some("twice".into()));
        trace.end("delivered".into(), None);

        let root = spans.named("ConfigMap added");
        let send = spans.named("send topic-a");
        let queue = spans.named("queue");
        assert_eq!(traceparent, format!("00-{}-{}-01", root.span_context.trace_id(), send.span_context.span_id()));
        assert_ne!(send.span_context.span_id(), root.span_context.span_id());
        assert_ne!(queue.span_context.span_id(), send.span_context.span_id());
        assert_eq!(send.span_kind, SpanKind::Producer);
        assert_eq!(send.parent_span_id, root.span_context.span_id());
        assert_eq!(send.span_context.trace_id(), root.span_context.trace_id());
        assert_eq!(attr(&send, "messaging.system"), Some(&Value::from("kafka")));
        assert_eq!(attr(&send, "messaging.destination.name"), Some(&Value::from("topic-a")));
        assert_eq!(attr(&send, "messaging.message.id"), Some(&Value::from("u:1:added")));
        assert_eq!(attr(&send, "cloudevents.event_source"), Some(&Value::from("k8s://c/api/v1/configmaps")));
        assert_eq!(attr(&send, "messaging.kafka.offset"), Some(&Value::I64(7)));
        assert_eq!(attr(&send, "k"), Some(&Value::from("v")), "the sink's own attributes");
        assert_eq!(attr(&send, "kubecast.retry_count"), Some(&Value::I64(2)), "the first end_send counts");
        assert_eq!(attr(&send, "messaging.kubecast.retry_count"), None);
        assert_eq!(root.span_kind, SpanKind::Internal);
    }

    /// Not sampled: nothing exported, and the traceparent says so (flags 00) while still
    /// naming the send span's id.
    #[test]
    fn an_unsampled_event_propagates_an_unsampled_traceparent() {
        let (provider, spans) = provider(Sampler::ParentBased(Box::new(Sampler::AlwaysOff)));
        let tracer = provider.tracer("test");
        let trace = EventTrace::start_with(&tracer, "ConfigMap", "added", "", "a", SystemTime::now());
        let (traceparent, _) = trace.w3c();
        trace.start_send("nats", "s", "id", "src", vec![]);
        let send_id = trace.send.lock().unwrap().as_ref().map(|s| {
            use opentelemetry::trace::Span as _;
            s.span_context().span_id()
        });
        trace.end_send(0, None);
        trace.end("delivered".into(), None);
        assert!(traceparent.ends_with("-00"), "{traceparent}");
        assert_eq!(traceparent.split('-').nth(2), send_id.map(|id| id.to_string()).as_deref());
        assert!(spans.0.lock().unwrap().is_empty());
    }

    #[test]
    fn server_attributes_name_the_first_configured_server() {
        let pair = |s: &str, port: u16| {
            let kv = server_attributes(s, port);
            (kv.first().map(|k| k.value.to_string()), kv.get(1).map(|k| k.value.to_string()))
        };
        let some = |h: &str, p: &str| (Some(h.to_string()), Some(p.to_string()));
        assert_eq!(pair("127.0.0.1:19092", 9092), some("127.0.0.1", "19092"));
        assert_eq!(pair(" kafka-0.kafka:9093 , kafka-1:9093", 9092), some("kafka-0.kafka", "9093"));
        assert_eq!(pair("SASL_SSL://broker:9094", 9092), some("broker", "9094"));
        assert_eq!(pair("broker", 9092), some("broker", "9092"));
        assert_eq!(pair("nats://user:pw@nats.example:4333,nats://b:4222", 4222), some("nats.example", "4333"));
        assert_eq!(pair("tls://nats", 4222), some("nats", "4222"));
        assert_eq!(pair("[::1]:4222", 4222), some("::1", "4222"));
        assert_eq!(pair("", 4222), (None, None));
    }
}
