//! The CloudEvents Kafka binding: binary mode (`data` with `ce_*` headers) or structured mode
//! (the JSON event).

use std::borrow::Cow;

use rdkafka::message::{Header, OwnedHeaders};

use super::config::Mode;
use crate::model::{AttributeValue, CloudEvent};

/// The record value and headers of `event` in `mode`.
pub fn encode(event: &CloudEvent, mode: Mode) -> (Cow<'_, [u8]>, OwnedHeaders) {
    let (payload, mut headers) = match mode {
        Mode::Structured => {
            let headers = OwnedHeaders::new_with_capacity(1)
                .insert(Header { key: "content-type", value: Some("application/cloudevents+json; charset=UTF-8") });
            let payload = match event.sealed() {
                Some(whole) => Cow::Borrowed(&whole[..]),
                None => Cow::Owned(event.to_structured()),
            };
            (payload, headers)
        }
        Mode::Binary => (Cow::Borrowed(event.data_bytes()), binary_headers(event)),
    };
    // W3C trace context as plain headers too (traces on), so consumers continue the trace.
    for name in ["traceparent", "tracestate"] {
        if let Some(AttributeValue::Str(v)) = event.attributes.extension(name) {
            headers = headers.insert(Header { key: name, value: Some(v) });
        }
    }
    (payload, headers)
}

/// Binary mode: `content-type` from `datacontenttype`, `ce_<name>` for everything else.
fn binary_headers(event: &CloudEvent) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(12);
    let mut key = String::with_capacity(24);
    for (name, value) in event.attributes.all() {
        let v = value.text();
        if name == "datacontenttype" {
            headers = headers.insert(Header { key: "content-type", value: Some(v.as_ref()) });
        } else {
            key.clear();
            key.push_str("ce_");
            key.push_str(name);
            headers = headers.insert(Header { key: &key, value: Some(v.as_ref()) });
        }
    }
    headers
}
