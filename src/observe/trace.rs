//! OpenTelemetry traces, one trace per event (`[telemetry]`, and the standard `OTEL_*`
//! variables): OTLP over HTTP/protobuf with the blocking client (no async HTTP client on the
//! exporter's thread).
//!
//! Spans of one event: `{Kind} {verb}` (INTERNAL, the root: from the shaping stage receiving
//! the change until its acknowledgement), with children `shape`, `queue` (waiting in the
//! outbound queue and the rate limiter) and `send {destination}` (PRODUCER, first attempt to
//! the broker's acknowledgement, with the OpenTelemetry messaging attributes and the retry
//! count). The root span's W3C context goes into the CloudEvent `traceparent` (and
//! `tracestate`) extension and into plain `traceparent` / `tracestate` message headers, so
//! consumers continue the trace.
//!
//! Off by default, and then nothing is created per event.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use crate::model::Problem;
use opentelemetry::trace::{Span, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, global};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use serde::{Deserialize, Serialize};

static ENABLED: AtomicBool = AtomicBool::new(false);
const TRACER: &str = "kubecast";

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
    let ratio =
        std::env::var("OTEL_TRACES_SAMPLER_ARG").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(cfg.sampling_ratio);
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| cfg.service_name.clone());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        )
        .build();
    global::set_tracer_provider(provider.clone());
    ENABLED.store(true, Ordering::Relaxed);
    tracing::info!(sampling_ratio = ratio, "OpenTelemetry traces on (OTLP/HTTP)");
    Ok(Some(Guard(provider)))
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
    ENABLED.load(Ordering::Relaxed)
}

/// The trace of one event (its root span's context). `None` everywhere when traces are off.
#[derive(Debug, Clone)]
pub struct EventTrace {
    cx: Context,
    /// When the event left the shaping stage (start of its `queue` span).
    queued_at: SystemTime,
}

impl EventTrace {
    /// Starts the root span of a change: `{Kind} {verb}`.
    pub fn start(kind: &str, verb: &str, namespace: &str, name: &str) -> Option<EventTrace> {
        if !enabled() {
            return None;
        }
        let tracer = global::tracer(TRACER);
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
            .with_attributes(attrs)
            .start(&tracer);
        Some(EventTrace { cx: Context::new().with_span(span), queued_at: SystemTime::now() })
    }

    /// A finished child span from `start` to now.
    pub fn child(&self, name: &'static str, start: SystemTime, attrs: Vec<KeyValue>) {
        let tracer = global::tracer(TRACER);
        let mut span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attrs)
            .start_with_context(&tracer, &self.cx);
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

    /// W3C `traceparent` of the root span (and `tracestate`, when not empty).
    pub fn w3c(&self) -> (String, Option<String>) {
        let sc = self.cx.span().span_context().clone();
        let parent = format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8());
        let state = sc.trace_state().header();
        (parent, (!state.is_empty()).then_some(state))
    }

    /// Starts the PRODUCER span of the publish.
    pub fn send_span(
        &self,
        system: &'static str,
        destination: &str,
        message_id: &str,
    ) -> opentelemetry::global::BoxedSpan {
        let tracer = global::tracer(TRACER);
        tracer
            .span_builder(format!("send {destination}"))
            .with_kind(SpanKind::Producer)
            .with_attributes(vec![
                KeyValue::new("messaging.system", system),
                KeyValue::new("messaging.destination.name", destination.to_string()),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.operation.name", "send"),
                KeyValue::new("messaging.message.id", message_id.to_string()),
            ])
            .start_with_context(&tracer, &self.cx)
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

/// Ends a PRODUCER span with the retry count and the result.
pub fn end_send(mut span: opentelemetry::global::BoxedSpan, retries: u32, error: Option<String>) {
    span.set_attribute(KeyValue::new("messaging.kubecast.retry_count", i64::from(retries)));
    if let Some(e) = error {
        span.set_status(Status::error(e));
    }
    span.end();
}
