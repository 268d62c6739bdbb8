//! The CloudEvents NATS binding: structured mode (the JSON event) or binary mode (`data` with
//! `ce-*` headers, percent-encoded values).

use async_nats::{HeaderMap, HeaderName};
use bytes::Bytes;

use super::config::Mode;
use crate::model::{AttributeValue, CloudEvent};
use crate::sink::header_value;

pub(super) const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

/// `ce-<name>` of binary mode, without an allocation for the attributes and extensions
/// kubecast sets.
fn ce_header(name: &str) -> Option<HeaderName> {
    Some(HeaderName::from_static(match name {
        "specversion" => "ce-specversion",
        "id" => "ce-id",
        "type" => "ce-type",
        "source" => "ce-source",
        "datacontenttype" => "ce-datacontenttype",
        "dataschema" => "ce-dataschema",
        "subject" => "ce-subject",
        "time" => "ce-time",
        "partitionkey" => "ce-partitionkey",
        "resourceversion" => "ce-resourceversion",
        "origin" => "ce-origin",
        _ => return None,
    }))
}

/// The payload and headers of `event` in `mode` (without `Nats-Msg-Id`). Binary mode shares
/// the event's data (no copy).
pub fn encode(event: &CloudEvent, mode: Mode) -> (Bytes, HeaderMap) {
    let mut headers = HeaderMap::new();
    // W3C trace context as plain headers too (traces on), so consumers continue the trace.
    for name in ["traceparent", "tracestate"] {
        if let Some(AttributeValue::Str(v)) = event.attributes.extension(name) {
            headers.insert(name, v);
        }
    }
    match mode {
        Mode::Structured => {
            headers.insert("Content-Type", STRUCTURED_CONTENT_TYPE);
            (event.structured_bytes(), headers)
        }
        Mode::Binary => {
            // `value`: already percent-encoded.
            let mut put = |name: &str, value: String| match ce_header(name) {
                Some(n) => headers.insert(n, value),
                None => headers.insert(format!("ce-{name}"), value),
            };
            for (name, value) in event.attributes.all() {
                match value {
                    // Digits, `-`, `:`, `.`, `T`, `Z`, or `true` / `false`: nothing to encode.
                    AttributeValue::Str(s) => put(name, header_value(s)),
                    other => put(name, other.text().into_owned()),
                }
            }
            (event.data.as_bytes().clone(), headers)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_header_names() {
        for name in [
            "specversion",
            "id",
            "type",
            "source",
            "datacontenttype",
            "dataschema",
            "subject",
            "time",
            "partitionkey",
            "resourceversion",
            "origin",
        ] {
            assert_eq!(ce_header(name).unwrap().to_string(), format!("ce-{name}"));
        }
        assert!(ce_header("other").is_none());
    }
}
