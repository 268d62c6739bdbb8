//! The CloudEvents HTTP binding: binary mode (the data as the body, `ce-*` headers with
//! percent-encoded values, `Content-Type` from `datacontenttype`) or structured mode (the JSON
//! event, `Content-Type: application/cloudevents+json`). W3C trace context as plain
//! `traceparent` / `tracestate` headers too, so the receiver continues the event's trace.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::config::Mode;
use crate::model::{AttributeValue, CloudEvent};
use crate::sink::header_value;

pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=utf-8";

/// `ce-<name>` without an allocation for the attributes and extensions kubecast sets.
fn ce_header(name: &str) -> HeaderName {
    match name {
        "specversion" => HeaderName::from_static("ce-specversion"),
        "id" => HeaderName::from_static("ce-id"),
        "type" => HeaderName::from_static("ce-type"),
        "source" => HeaderName::from_static("ce-source"),
        "subject" => HeaderName::from_static("ce-subject"),
        "time" => HeaderName::from_static("ce-time"),
        "partitionkey" => HeaderName::from_static("ce-partitionkey"),
        "resourceversion" => HeaderName::from_static("ce-resourceversion"),
        "origin" => HeaderName::from_static("ce-origin"),
        // Extension names are lowercase letters and digits: always a valid header name.
        other => HeaderName::from_bytes(format!("ce-{other}").as_bytes()).expect("an extension name is a header name"),
    }
}

/// The request headers and body of `event` in `mode` (besides the configured headers).
pub fn encode(event: &CloudEvent, mode: Mode) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::with_capacity(14);
    for name in ["traceparent", "tracestate"] {
        if let Some(AttributeValue::Str(v)) = event.attributes.extension(name)
            && let Ok(v) = HeaderValue::from_str(v)
        {
            headers.insert(name, v);
        }
    }
    match mode {
        Mode::Structured => {
            headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(STRUCTURED_CONTENT_TYPE));
            (headers, event.structured_bytes())
        }
        Mode::Binary => {
            for (name, value) in event.attributes.all() {
                let text = match value {
                    AttributeValue::Str(s) => header_value(s),
                    other => other.text().into_owned(),
                };
                // Percent-encoded: visible ASCII only, always a valid value.
                let v = HeaderValue::from_str(&text).expect("a percent-encoded value is a header value");
                if name == "datacontenttype" {
                    headers.insert(http::header::CONTENT_TYPE, v);
                } else {
                    headers.insert(ce_header(name), v);
                }
            }
            (headers, event.data.as_bytes().clone())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::api::{ApiResource, GroupVersionKind};

    use super::*;
    use crate::model::{Change, EventSource, Origin, RawObject, Verb};

    fn event() -> CloudEvent {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "ConfigMap"), "configmaps");
        let object: RawObject = serde_json::from_str(
            r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a b","namespace":"n","uid":"u","resourceVersion":"9"}}"#,
        )
        .unwrap();
        let mut e =
            Change { verb: Verb::Added, origin: Origin::Watch, object, source: Arc::new(EventSource::new("c", &ar)) }
                .into_cloudevent()
                .unwrap();
        e.attributes.set_extension("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        e
    }

    #[test]
    fn binary_mode_headers_and_body() {
        let e = event();
        let (h, body) = encode(&e, Mode::Binary);
        assert_eq!(body.as_ptr(), e.data.as_bytes().as_ptr(), "the data is shared, not copied");
        assert_eq!(h["content-type"], "application/json");
        assert_eq!(h["ce-specversion"], "1.0");
        assert_eq!(h["ce-id"], e.id());
        assert_eq!(h["ce-subject"], "n/a%20b", "percent-encoded");
        assert_eq!(h["ce-partitionkey"], "u");
        assert_eq!(h["traceparent"], "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        assert!(!h.contains_key("ce-datacontenttype"));
    }

    #[test]
    fn structured_mode_is_the_whole_event() {
        let e = event();
        let (h, body) = encode(&e, Mode::Structured);
        assert_eq!(h["content-type"], STRUCTURED_CONTENT_TYPE);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["id"], e.id());
        assert_eq!(v["data"]["metadata"]["name"], "a b");
        assert!(h.keys().all(|k| !k.as_str().starts_with("ce-")));
    }
}
