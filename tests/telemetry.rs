//! OpenTelemetry traces through a real OpenTelemetry Collector (`otelcol` from tests/env: the
//! OTLP/HTTP receiver and the file exporter), for the Kafka and the NATS JetStream sink: one
//! trace per delivered event with its spans, kinds, parents and attributes; the message's
//! `traceparent` header and CloudEvent extension naming the PRODUCER send span; and a consumer
//! (this test, with the OpenTelemetry propagator) that extracts the header and whose span,
//! exported to the same collector, joins the producer's trace as the send span's child.

use kubecast_kit as common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, create_cm};
use futures::StreamExt;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);
/// Events (ConfigMaps) per test.
const EVENTS: usize = 3;
const CONSUMER_SERVICE: &str = "kubecast-test-consumer";

// ------------------------------------------------------------------ the collector

/// An `otelcol` process (tests/env/tools otelcol): OTLP/HTTP on a free port, every span
/// written to a JSON-lines file (OTLP JSON), killed when dropped.
struct Collector {
    child: Child,
    dir: tempfile::TempDir,
    endpoint: String,
}

impl Collector {
    async fn start() -> Self {
        let bin = common::env().get("OTELCOL").cloned().unwrap_or_else(|| {
            panic!("OTELCOL is not in the test environment file: build the collector with `tests/env/tools otelcol` (tests/run does)")
        });
        // The free port may be taken before the collector binds it: then another one.
        for attempt in 1.. {
            let dir = tempfile::Builder::new().prefix("otelcol-").tempdir().unwrap();
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let config = format!(
                r#"receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{port}
exporters:
  file:
    path: {spans}
    flush_interval: 100ms
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
"#,
                spans = dir.path().join("spans.jsonl").display()
            );
            std::fs::write(dir.path().join("config.yaml"), config).unwrap();
            let log = std::fs::File::create(dir.path().join("otelcol.log")).unwrap();
            let child = Command::new(&bin)
                .arg("--config")
                .arg(dir.path().join("config.yaml"))
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
            let mut c = Collector { child, dir, endpoint: format!("http://127.0.0.1:{port}") };
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                if c.log().contains("Everything is ready") {
                    return c;
                }
                if let Ok(Some(status)) = c.child.try_wait() {
                    assert!(attempt < 3, "otelcol exited ({status}):\n{}", c.log());
                    break;
                }
                assert!(Instant::now() < deadline, "otelcol not ready in 30 s:\n{}", c.log());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        unreachable!()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("otelcol.log")).unwrap_or_default()
    }

    fn spans_path(&self) -> PathBuf {
        self.dir.path().join("spans.jsonl")
    }

    /// Every span the file exporter wrote so far.
    fn spans(&self) -> Vec<SpanRec> {
        let text = std::fs::read_to_string(self.spans_path()).unwrap_or_default();
        let mut out = Vec::new();
        // A line being written may be cut: only whole lines count.
        for line in text.lines().filter(|l| l.ends_with('}')) {
            let Ok(batch) = serde_json::from_str::<Value>(line) else { continue };
            for rs in batch["resourceSpans"].as_array().into_iter().flatten() {
                let service = attributes(&rs["resource"]["attributes"]).get("service.name").cloned();
                let service = service.and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default();
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for s in ss["spans"].as_array().into_iter().flatten() {
                        out.push(SpanRec::from_otlp_json(s, &service));
                    }
                }
            }
        }
        out
    }

    /// Waits until `done` holds for the spans written so far.
    async fn wait_spans(&self, what: &str, done: impl Fn(&[SpanRec]) -> bool) -> Vec<SpanRec> {
        let deadline = Instant::now() + WAIT;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "the collector never got {what}; it has {:?}\ncollector log:\n{}",
                spans.iter().map(|s| (&s.service, &s.name, &s.trace_id)).collect::<Vec<_>>(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One span as the file exporter wrote it (OTLP JSON: hex ids, kind as a number).
#[derive(Debug, Clone)]
struct SpanRec {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i64,
    start: u128,
    end: u128,
    attrs: BTreeMap<String, Value>,
}

const INTERNAL: i64 = 1;
const PRODUCER: i64 = 4;
const CONSUMER: i64 = 5;

impl SpanRec {
    fn from_otlp_json(s: &Value, service: &str) -> SpanRec {
        let text = |k: &str| s[k].as_str().unwrap_or_default().to_string();
        let nanos = |k: &str| s[k].as_str().and_then(|t| t.parse().ok()).unwrap_or(0);
        SpanRec {
            service: service.to_string(),
            trace_id: text("traceId"),
            span_id: text("spanId"),
            parent: text("parentSpanId"),
            name: text("name"),
            kind: s["kind"].as_i64().unwrap_or(0),
            start: nanos("startTimeUnixNano"),
            end: nanos("endTimeUnixNano"),
            attrs: attributes(&s["attributes"]),
        }
    }

    fn attr(&self, key: &str) -> &Value {
        self.attrs.get(key).unwrap_or_else(|| panic!("span {:?} has no attribute {key}: {:?}", self.name, self.attrs))
    }

    fn str(&self, key: &str) -> &str {
        self.attr(key).as_str().unwrap_or_else(|| panic!("span {:?}: {key} is not a string", self.name))
    }

    fn int(&self, key: &str) -> i64 {
        self.attr(key).as_i64().unwrap_or_else(|| panic!("span {:?}: {key} is not an int", self.name))
    }
}

/// OTLP JSON attributes as plain JSON values (ints are strings in OTLP JSON).
fn attributes(list: &Value) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for kv in list.as_array().into_iter().flatten() {
        let v = &kv["value"];
        let value = if let Some(s) = v["stringValue"].as_str() {
            json!(s)
        } else if let Some(i) = v["intValue"].as_str().and_then(|i| i.parse::<i64>().ok()) {
            json!(i)
        } else if let Some(b) = v["boolValue"].as_bool() {
            json!(b)
        } else {
            v.clone()
        };
        out.insert(kv["key"].as_str().unwrap_or_default().to_string(), value);
    }
    out
}

// ------------------------------------------------------------------ the consumer's side

/// A message as a consumer got it: its headers, payload and where the broker put it.
#[derive(Debug)]
struct Received {
    headers: BTreeMap<String, String>,
    payload: Vec<u8>,
    /// Kafka: partition and offset; NATS JetStream: 0 and the stream sequence.
    partition: i32,
    offset: i64,
}

struct HeaderMapExtractor<'a>(&'a BTreeMap<String, String>);

impl Extractor for HeaderMapExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)).map(|(_, v)| v.as_str())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// What a consumer instrumented with OpenTelemetry does: extracts the W3C context from each
/// message's headers and makes its `process {destination}` span (CONSUMER) a child of it,
/// exported over OTLP/HTTP to `endpoint`. Blocking (the OTLP client is), so on its own thread.
async fn consume_traced(endpoint: &str, destination: &str, messages: Vec<BTreeMap<String, String>>) {
    let (endpoint, destination) = (endpoint.to_string(), destination.to_string());
    tokio::task::spawn_blocking(move || {
        // The exporter's HTTP client has no TLS crypto of its own (kubecast's build).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!("{endpoint}/v1/traces"))
            .build()
            .unwrap();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(CONSUMER_SERVICE).build())
            .build();
        let tracer = provider.tracer("kubecast-tests");
        for headers in &messages {
            let parent: Context = TraceContextPropagator::new().extract(&HeaderMapExtractor(headers));
            let mut span = tracer
                .span_builder(format!("process {destination}"))
                .with_kind(SpanKind::Consumer)
                .with_attributes(vec![
                    KeyValue::new("messaging.operation.type", "process"),
                    KeyValue::new("messaging.destination.name", destination.clone()),
                ])
                .start_with_context(&tracer, &parent);
            span.end();
        }
        provider.force_flush().expect("consumer spans exported");
        provider.shutdown().expect("consumer tracer shut down");
    })
    .await
    .unwrap();
}

// ------------------------------------------------------------------ the checks

/// What was sent: per event id, the message and the CloudEvent's `traceparent` extension
/// (a `ce_` / `ce-` header in binary mode, a payload field in structured mode).
struct Sent {
    id: String,
    uid: String,
    message: Received,
    extension: String,
}

/// One trace per delivered event, with the spans, kinds, parents and attributes of
/// README's Traces paragraph; the traceparent names the send span; the consumer joined.
/// Returns the send spans by event id for the sink-specific checks.
fn check_traces(
    spans: &[SpanRec],
    sent: &[Sent],
    system: &str,
    destination: &str,
    source: &str,
    server_port: i64,
) -> HashMap<String, SpanRec> {
    let ours: Vec<&SpanRec> = spans.iter().filter(|s| s.service == "kubecast").collect();
    let traces: HashSet<&str> = ours.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(traces.len(), sent.len(), "one trace per delivered event: {ours:#?}");
    let mut sends = HashMap::new();
    for m in sent {
        let traceparent = m.message.headers.get("traceparent").expect("a plain W3C traceparent header");
        assert_eq!(&m.extension, traceparent, "the header and the CloudEvent extension agree");
        let parts: Vec<&str> = traceparent.split('-').collect();
        assert_eq!((parts.len(), parts[0], parts[3]), (4, "00", "01"), "a sampled W3C traceparent: {traceparent}");
        let (trace_id, parent_id) = (parts[1], parts[2]);
        let of_trace: Vec<&SpanRec> = ours.iter().copied().filter(|s| s.trace_id == trace_id).collect();
        let one = |pred: &dyn Fn(&SpanRec) -> bool, what: &str| -> SpanRec {
            let found: Vec<&&SpanRec> = of_trace.iter().filter(|s| pred(s)).collect();
            assert_eq!(found.len(), 1, "one {what} span in trace {trace_id}: {of_trace:#?}");
            (*found[0]).clone()
        };
        let root = one(&|s| s.name == "ConfigMap added", "root");
        let shape = one(&|s| s.name == "shape", "shape");
        let queue = one(&|s| s.name == "queue", "queue");
        let send = one(&|s| s.name.starts_with("send "), "send");
        assert_eq!(of_trace.len(), 4, "root, shape, queue, send: {of_trace:#?}");

        assert_eq!((root.parent.as_str(), root.kind), ("", INTERNAL), "the root: {root:?}");
        assert_eq!(root.str("cloudevents.event_id"), m.id);
        assert_eq!(root.str("cloudevents.event_source"), source);
        assert_eq!(root.str("kubecast.outcome"), "delivered");
        for child in [&shape, &queue, &send] {
            assert_eq!(child.parent, root.span_id, "{} is a child of the root", child.name);
            assert!(
                child.start >= root.start,
                "{} starts before its root: {} < {}",
                child.name,
                child.start,
                root.start
            );
            assert!(child.end <= root.end, "{} ends after its root", child.name);
        }
        assert_eq!(shape.kind, INTERNAL);
        assert!(queue.start >= shape.start && send.start >= queue.start, "shape, queue, send in that order");

        assert_eq!(parent_id, send.span_id, "the traceparent is the PRODUCER send span's, not the root's");
        assert_eq!(send.name, format!("send {destination}"));
        assert_eq!(send.kind, PRODUCER);
        assert_eq!(send.str("messaging.system"), system);
        assert_eq!(send.str("messaging.destination.name"), destination);
        assert_eq!(send.str("messaging.operation.type"), "send");
        assert_eq!(send.str("messaging.operation.name"), "send");
        assert_eq!(send.str("messaging.message.id"), m.id);
        assert_eq!(send.str("cloudevents.event_id"), m.id);
        assert_eq!(send.str("cloudevents.event_source"), source);
        assert_eq!(send.str("server.address"), "127.0.0.1");
        assert_eq!(send.int("server.port"), server_port);
        assert_eq!(send.int("kubecast.retry_count"), 0);
        assert!(
            !send.attrs.keys().any(|k| k.starts_with("messaging.kubecast")),
            "messaging.* is the conventions' namespace: {:?}",
            send.attrs
        );

        // The consumer that extracted the header joined the producer's trace under the send span.
        let consumers: Vec<&SpanRec> =
            spans.iter().filter(|s| s.service == CONSUMER_SERVICE && s.trace_id == trace_id).collect();
        assert_eq!(consumers.len(), 1, "the consumer's span in trace {trace_id}: {spans:#?}");
        assert_eq!(consumers[0].parent, send.span_id, "the consumer is the send span's child");
        assert_eq!(consumers[0].kind, CONSUMER);
        sends.insert(m.id.clone(), send);
    }
    sends
}

/// Waits for every kubecast span of `n` events (4 each) and `n` consumer spans.
fn complete(n: usize) -> impl Fn(&[SpanRec]) -> bool {
    move |spans| {
        let kubecast = spans.iter().filter(|s| s.service == "kubecast").count();
        let consumers = spans.iter().filter(|s| s.service == CONSUMER_SERVICE).count();
        kubecast >= 4 * n && consumers >= n
    }
}

fn event_id(cm: &k8s_openapi::api::core::v1::ConfigMap) -> (String, String) {
    let uid = cm.metadata.uid.clone().unwrap();
    (format!("{uid}:{}:added", cm.metadata.resource_version.clone().unwrap()), uid)
}

/// The port of the test server's address (`host:port` or `scheme://host:port`).
fn port_of(address: &str) -> i64 {
    address.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or_else(|| panic!("no port in {address}"))
}

fn telemetry_toml(collector: &Collector) -> String {
    format!("[telemetry]\ntraces = true\nendpoint = \"{}\"\n", collector.endpoint)
}

// ------------------------------------------------------------------ Kafka

/// Reads `topic` (all partitions, from the beginning) until `n` records arrived.
async fn read_kafka(topic: &str, n: usize) -> Vec<Received> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
        .set("group.id", common::unique("verify"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let deadline = Instant::now() + WAIT;
    let partitions = loop {
        if let Ok(md) = consumer.fetch_metadata(Some(topic), Duration::from_secs(2))
            && let Some(t) =
                md.topics().iter().find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
        {
            break t.partitions().len() as i32;
        }
        assert!(Instant::now() < deadline, "topic {topic} never appeared");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let mut stream = consumer.stream();
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "{} of {n} records on {topic}", out.len());
        if let Ok(Some(Ok(m))) = tokio::time::timeout(left.min(Duration::from_secs(2)), stream.next()).await {
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned()))
                        .collect()
                })
                .unwrap_or_default();
            out.push(Received {
                headers,
                payload: m.payload().unwrap_or_default().to_vec(),
                partition: m.partition(),
                offset: m.offset(),
            });
        }
    }
    out
}

#[tokio::test]
async fn kafka_one_trace_per_event_continued_by_the_consumer() {
    let collector = Collector::start().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "otel-kafka").await;
    let topic = common::unique("otel");
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n{}",
        common::env_var("KAFKA_BROKERS"),
        telemetry_toml(&collector)
    );
    let mut k =
        Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, "", &[("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    k.wait_ready(200).await;
    let mut ids = HashMap::new();
    for i in 0..EVENTS {
        let cm = create_cm(&client, &ns.name, &format!("traced-{i}"), json!({}), json!({"k": "v"})).await;
        let (id, uid) = event_id(&cm);
        ids.insert(id, uid);
    }

    // The consumer's side: binary mode, the CloudEvent extension is the `ce_traceparent` header.
    let records = read_kafka(&topic, EVENTS).await;
    let mut sent = Vec::new();
    for r in records {
        let id = r.headers.get("ce_id").expect("ce_id").clone();
        let uid = ids.get(&id).unwrap_or_else(|| panic!("unexpected event {id}")).clone();
        let extension = r.headers.get("ce_traceparent").expect("the CloudEvent traceparent extension").clone();
        sent.push(Sent { id, uid, message: r, extension });
    }
    consume_traced(&collector.endpoint, &topic, sent.iter().map(|s| s.message.headers.clone()).collect()).await;

    let spans = collector.wait_spans("the spans of every event and consumer", complete(EVENTS)).await;
    let sends = check_traces(
        &spans,
        &sent,
        "kafka",
        &topic,
        "k8s://e2e/api/v1/configmaps",
        port_of(&common::env_var("KAFKA_BROKERS")),
    );
    for m in &sent {
        let send = &sends[&m.id];
        assert_eq!(send.str("messaging.kafka.message.key"), m.uid, "the record key");
        assert_eq!(send.str("messaging.destination.partition.id"), m.message.partition.to_string());
        assert_eq!(send.int("messaging.kafka.offset"), m.message.offset, "the record's offset");
    }
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
}

// ------------------------------------------------------------------ NATS

#[tokio::test]
async fn nats_one_trace_per_event_continued_by_the_consumer() {
    let collector = Collector::start().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "otel-nats").await;
    let js = async_nats::jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("otel").replace('-', "_");
    let stream_name = prefix.to_uppercase();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream_name.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .unwrap();
    let subject = format!("{prefix}.cms");
    // Structured mode (the default): the extension is a member of the event JSON.
    let sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{subject}\"\n{}",
        common::env_var("NATS_URL"),
        telemetry_toml(&collector)
    );
    let mut k =
        Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, "", &[("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    k.wait_ready(200).await;
    let mut ids = HashMap::new();
    for i in 0..EVENTS {
        let cm = create_cm(&client, &ns.name, &format!("traced-{i}"), json!({}), json!({"k": "v"})).await;
        let (id, uid) = event_id(&cm);
        ids.insert(id, uid);
    }

    let consumer = js
        .get_stream(&stream_name)
        .await
        .unwrap()
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    let mut sent = Vec::new();
    while sent.len() < EVENTS {
        assert!(Instant::now() < deadline, "{} of {EVENTS} messages on {subject}", sent.len());
        let mut batch = consumer.fetch().max_messages(EVENTS).expires(Duration::from_secs(1)).messages().await.unwrap();
        while let Some(msg) = batch.next().await {
            let msg = msg.unwrap();
            let info = msg.info().unwrap();
            let sequence = info.stream_sequence as i64;
            let headers: BTreeMap<String, String> = msg
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .filter_map(|(k, v)| v.first().map(|v| (k.to_string(), v.as_str().to_string())))
                .collect();
            let event: Value = serde_json::from_slice(&msg.payload).expect("a structured CloudEvent");
            let id = event["id"].as_str().unwrap().to_string();
            let uid = ids.get(&id).unwrap_or_else(|| panic!("unexpected event {id}")).clone();
            let extension = event["traceparent"].as_str().expect("the CloudEvent traceparent extension").to_string();
            sent.push(Sent {
                id,
                uid,
                message: Received { headers, payload: msg.payload.to_vec(), partition: 0, offset: sequence },
                extension,
            });
        }
    }
    consume_traced(&collector.endpoint, &subject, sent.iter().map(|s| s.message.headers.clone()).collect()).await;

    let spans = collector.wait_spans("the spans of every event and consumer", complete(EVENTS)).await;
    let sends = check_traces(
        &spans,
        &sent,
        "nats",
        &subject,
        "k8s://e2e/api/v1/configmaps",
        port_of(&common::env_var("NATS_URL")),
    );
    for m in &sent {
        let send = &sends[&m.id];
        assert_eq!(send.str("kubecast.jetstream.stream"), stream_name);
        assert_eq!(send.int("kubecast.jetstream.sequence"), m.message.offset, "the message's stream sequence");
        assert_eq!(send.attr("kubecast.jetstream.duplicate"), &json!(false));
        assert!(!m.message.payload.is_empty());
    }
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    js.delete_stream(&stream_name).await.unwrap();
}

// ------------------------------------------------------------------ HTTP

/// Into a CloudEvents HTTP receiver (the SDK example), binary mode: each request carries the
/// send span's `traceparent` as a plain header and as the CloudEvent extension.
#[tokio::test]
async fn http_one_trace_per_event_continued_by_the_receiver() {
    let collector = Collector::start().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "otel-http").await;
    let receiver = common::receiver::Receiver::start(&[]);
    let url = receiver.url();
    let sink = format!("[sink]\ntype = \"http\"\n[sink.http]\nurl = \"{url}\"\n{}", telemetry_toml(&collector));
    let mut k =
        Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, "", &[("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    k.wait_ready(200).await;
    let mut ids = HashMap::new();
    for i in 0..EVENTS {
        let cm = create_cm(&client, &ns.name, &format!("traced-{i}"), json!({}), json!({"k": "v"})).await;
        let (id, uid) = event_id(&cm);
        ids.insert(id, uid);
    }
    let got = receiver.wait_accepted(EVENTS, &mut k).await;
    let sent: Vec<Sent> = got
        .iter()
        .map(|e| {
            let id = e["attributes"]["id"].as_str().unwrap().to_string();
            let uid = ids.get(&id).unwrap_or_else(|| panic!("unexpected event {id}")).clone();
            let header = e["traceparent"].as_str().expect("a traceparent header on the request").to_string();
            let extension = e["attributes"]["traceparent"].as_str().expect("the CloudEvent extension").to_string();
            let headers = BTreeMap::from([("traceparent".to_string(), header)]);
            Sent { id, uid, message: Received { headers, payload: Vec::new(), partition: 0, offset: 0 }, extension }
        })
        .collect();
    consume_traced(&collector.endpoint, &url, sent.iter().map(|s| s.message.headers.clone()).collect()).await;
    let spans = collector.wait_spans("the spans of every event and receiver", complete(EVENTS)).await;
    let port = url.trim_end_matches('/').rsplit(':').next().unwrap().parse().unwrap();
    check_traces(&spans, &sent, "http", &url, "k8s://e2e/api/v1/configmaps", port);
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
}

// ------------------------------------------------------------------ traces off

/// Without `[telemetry] traces`, nothing: no trace headers or extension on the record, and no
/// span reaches the collector that the standard OTLP variable names.
#[tokio::test]
async fn no_trace_when_traces_are_off() {
    let collector = Collector::start().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "otel-off").await;
    let topic = common::unique("otel-off");
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n",
        common::env_var("KAFKA_BROKERS")
    );
    let mut k = Kubecast::start_with_sink(
        &common::cm_config(&ns.name, ""),
        &sink,
        "",
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()), ("OTEL_BSP_SCHEDULE_DELAY", "200")],
    );
    k.wait_ready(200).await;
    create_cm(&client, &ns.name, "untraced", json!({}), json!({"k": "v"})).await;
    let records = read_kafka(&topic, 1).await;
    let trace_headers: Vec<&String> = records[0].headers.keys().filter(|h| h.contains("trace")).collect();
    assert!(trace_headers.is_empty(), "trace headers with traces off: {:?}", records[0].headers);
    assert!(records[0].headers.contains_key("ce_id"), "a CloudEvent record: {:?}", records[0].headers);
    // At exit a tracer would flush what it buffered.
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(collector.spans().is_empty(), "spans with traces off: {:?}", collector.spans());
    assert!(!k.log().contains("OpenTelemetry traces on"), "{}", k.log());
}
