//! OpenTelemetry traces: a test-local OTLP receiver (real OTLP/HTTP protobuf) gets the spans of
//! a delivery to the real NATS JetStream, and the message carries the same trace id.

use kubecast_kit as common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::{Kubecast, TestNamespace, client, create_cm};
use futures::StreamExt;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

type Spans = Arc<Mutex<Vec<Span>>>;

/// An OTLP/HTTP receiver on a free port: `POST /v1/traces` with protobuf bodies.
async fn receiver() -> (String, Spans) {
    let spans: Spans = Arc::default();
    async fn traces(
        State(spans): State<Spans>,
        body: Bytes,
    ) -> ([(axum::http::header::HeaderName, &'static str); 1], Vec<u8>) {
        let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf trace export");
        let mut all = spans.lock().unwrap();
        for rs in req.resource_spans {
            for ss in rs.scope_spans {
                all.extend(ss.spans);
            }
        }
        ([(axum::http::header::CONTENT_TYPE, "application/x-protobuf")], Vec::new())
    }
    let app = Router::new().route("/v1/traces", post(traces)).with_state(spans.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), spans)
}

fn attr<'a>(span: &'a Span, key: &str) -> Option<&'a AnyValue> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()).and_then(|v| v.value.as_ref())
}

fn attr_str<'a>(span: &'a Span, key: &str) -> &'a str {
    match attr(span, key) {
        Some(AnyValue::StringValue(s)) => s,
        other => panic!("span {:?}: attribute {key} is {other:?}", span.name),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[tokio::test]
async fn one_trace_per_event_reaches_the_receiver_and_the_consumer() {
    let (endpoint, spans) = receiver().await;
    let client = client().await;
    let ns = TestNamespace::new(&client, "otel").await;
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
    let sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{subject}\"\nmode = \"binary\"\n[telemetry]\ntraces = true\nendpoint = \"{endpoint}\"\n",
        common::env_var("NATS_URL")
    );
    let mut k =
        Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, "", &[("OTEL_BSP_SCHEDULE_DELAY", "200")]);
    k.wait_ready(200).await;
    let cm = create_cm(&client, &ns.name, "traced", json!({}), json!({"k": "v"})).await;
    let id = format!("{}:{}:added", cm.metadata.uid.unwrap(), cm.metadata.resource_version.unwrap());

    // The consumer's side: the message's headers carry the trace.
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
    let deadline = Instant::now() + Duration::from_secs(60);
    let msg = loop {
        let mut batch = consumer.fetch().max_messages(1).expires(Duration::from_secs(1)).messages().await.unwrap();
        if let Some(m) = batch.next().await {
            break m.unwrap();
        }
        assert!(Instant::now() < deadline, "no message");
    };
    let headers = msg.headers.clone().expect("headers");
    assert_eq!(headers.get("ce-id").map(|v| v.as_str()), Some(id.as_str()));
    let traceparent = headers.get("ce-traceparent").expect("the CloudEvent traceparent extension").as_str().to_string();
    let plain = headers.get("traceparent").expect("a plain W3C traceparent header").as_str().to_string();
    assert_eq!(plain, traceparent);
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!((parts.len(), parts[0], parts[3]), (4, "00", "01"), "sampled W3C traceparent: {traceparent}");
    let trace_id = parts[1].to_string();

    // The receiver's side: the spans of that trace.
    let deadline = Instant::now() + Duration::from_secs(60);
    let trace: Vec<Span> = loop {
        let t: Vec<Span> = spans.lock().unwrap().iter().filter(|s| hex(&s.trace_id) == trace_id).cloned().collect();
        if t.iter().any(|s| s.name.starts_with("send ")) && t.iter().any(|s| s.name == "ConfigMap added") {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "spans of trace {trace_id} never arrived; got {:?}",
            spans.lock().unwrap().iter().map(|s| s.name.clone()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let root = trace.iter().find(|s| s.name == "ConfigMap added").unwrap();
    assert_eq!(hex(&root.span_id), parts[2], "the traceparent is the event's root span");
    assert_eq!(attr_str(root, "cloudevents.event_id"), id);
    assert_eq!(attr_str(root, "k8s.namespace.name"), ns.name);
    assert_eq!(attr_str(root, "kubecast.outcome"), "delivered");
    let send = trace.iter().find(|s| s.name.starts_with("send ")).unwrap();
    assert_eq!(send.name, format!("send {subject}"));
    assert_eq!(send.kind, 4, "SPAN_KIND_PRODUCER");
    assert_eq!(send.parent_span_id, root.span_id);
    assert_eq!(attr_str(send, "messaging.system"), "nats");
    assert_eq!(attr_str(send, "messaging.destination.name"), subject);
    assert_eq!(attr_str(send, "messaging.operation.type"), "send");
    assert_eq!(attr_str(send, "messaging.message.id"), id);
    assert!(matches!(attr(send, "messaging.kubecast.retry_count"), Some(AnyValue::IntValue(0))));
    for child in ["shape", "queue"] {
        let c = trace.iter().find(|s| s.name == child).unwrap_or_else(|| panic!("no {child} span"));
        assert_eq!(c.parent_span_id, root.span_id);
    }
    assert!(send.end_time_unix_nano >= send.start_time_unix_nano);
    assert_eq!(k.stop().code(), Some(0), "{}", k.log());
    js.delete_stream(&stream_name).await.unwrap();
}
