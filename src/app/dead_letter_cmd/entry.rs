//! One dead-lettered event as read back from the dead letter, and how it is sent again: the
//! structured CloudEvent kubecast wrote, encoded for the sink's mode (binary: `data` with
//! `ce_*` / `ce-*` headers; structured: the JSON as written), to the destination it was meant
//! for, under its original id and key.

use std::borrow::Cow;

use rdkafka::message::{Header, OwnedHeaders};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A dead-lettered event.
#[derive(Debug, Clone)]
pub struct Entry {
    pub id: String,
    /// The topic or subject it was meant for.
    pub destination: String,
    pub reason: String,
    /// The structured event as written to the dead letter.
    pub structured: Vec<u8>,
    /// The attributes (everything but `data`), for binary mode.
    attributes: Map<String, Value>,
    /// `data` as written (JSON text).
    data: Option<Box<RawValue>>,
    /// The dead letter kept the attributes only (the event was too large even for it).
    pub data_dropped: bool,
}

/// The structured event's members, `data` kept as its text.
#[derive(serde::Deserialize)]
struct Structured {
    #[serde(default)]
    data: Option<Box<RawValue>>,
    #[serde(flatten)]
    attributes: Map<String, Value>,
}

impl Entry {
    /// `structured`: the event's JSON; `Err` says what is wrong with it.
    pub fn parse(structured: &[u8], destination: String, reason: String, data_dropped: bool) -> Result<Self, String> {
        let s: Structured =
            serde_json::from_slice(structured).map_err(|e| format!("not a structured CloudEvent: {e}"))?;
        let id = match s.attributes.get("id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => return Err("a CloudEvent without an id".into()),
        };
        if destination.is_empty() {
            return Err(format!("event {id}: the dead letter does not name its original destination"));
        }
        Ok(Self {
            id,
            destination,
            reason,
            structured: structured.to_vec(),
            attributes: s.attributes,
            data: s.data,
            data_dropped,
        })
    }

    /// A line of the file dead letter: `{"reason", "destination", "failed_at", "event"}`.
    pub fn from_file_line(line: &[u8]) -> Result<Self, String> {
        #[derive(serde::Deserialize)]
        struct Line<'a> {
            #[serde(default)]
            reason: String,
            #[serde(default)]
            destination: String,
            #[serde(borrow)]
            event: &'a RawValue,
        }
        let l: Line<'_> = serde_json::from_slice(line).map_err(|e| format!("not a dead-letter line: {e}"))?;
        Self::parse(l.event.get().as_bytes(), l.destination, l.reason, false)
    }

    /// The record key: the object's uid (`partitionkey`), as the sink's.
    pub fn key(&self) -> &str {
        match self.attributes.get("partitionkey") {
            Some(Value::String(k)) => k,
            _ => &self.id,
        }
    }

    fn attribute_text(v: &Value) -> Cow<'_, str> {
        match v {
            Value::String(s) => Cow::Borrowed(s),
            other => Cow::Owned(other.to_string()),
        }
    }

    /// Kafka: the record value and headers in `structured` or binary mode.
    pub fn kafka(&self, structured: bool) -> (Vec<u8>, OwnedHeaders) {
        let mut headers = OwnedHeaders::new();
        for name in ["traceparent", "tracestate"] {
            if let Some(v) = self.attributes.get(name) {
                headers = headers.insert(Header { key: name, value: Some(Self::attribute_text(v).as_ref()) });
            }
        }
        if structured {
            let headers = headers
                .insert(Header { key: "content-type", value: Some("application/cloudevents+json; charset=UTF-8") });
            return (self.structured.clone(), headers);
        }
        for (name, v) in &self.attributes {
            let v = Self::attribute_text(v);
            if name == "datacontenttype" {
                headers = headers.insert(Header { key: "content-type", value: Some(v.as_ref()) });
            } else {
                headers = headers.insert(Header { key: &format!("ce_{name}"), value: Some(v.as_ref()) });
            }
        }
        (self.data_text().into_bytes(), headers)
    }

    /// HTTP: the request headers and body in `structured` or binary mode (values
    /// percent-encoded as the HTTP binding says).
    pub fn http(&self, structured: bool) -> (http::HeaderMap, bytes::Bytes) {
        let mut headers = http::HeaderMap::new();
        let value = |v: &str| {
            http::HeaderValue::from_str(&crate::sink::header_value(v))
                .expect("a percent-encoded value is a header value")
        };
        for name in ["traceparent", "tracestate"] {
            if let Some(v) = self.attributes.get(name) {
                headers.insert(name, value(&Self::attribute_text(v)));
            }
        }
        if structured {
            headers.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/cloudevents+json; charset=utf-8"),
            );
            return (headers, bytes::Bytes::from(self.structured.clone()));
        }
        for (name, v) in &self.attributes {
            let v = value(&Self::attribute_text(v));
            if name == "datacontenttype" {
                headers.insert(http::header::CONTENT_TYPE, v);
            } else if let Ok(n) = http::HeaderName::from_bytes(format!("ce-{name}").as_bytes()) {
                headers.insert(n, v);
            }
        }
        (headers, bytes::Bytes::from(self.data_text()))
    }

    /// NATS: the payload and headers in `structured` or binary mode (values percent-encoded
    /// as the NATS binding says).
    pub fn nats(&self, structured: bool) -> (bytes::Bytes, async_nats::HeaderMap) {
        let mut headers = async_nats::HeaderMap::new();
        for name in ["traceparent", "tracestate"] {
            if let Some(v) = self.attributes.get(name) {
                headers.insert(name, Self::attribute_text(v).as_ref());
            }
        }
        if structured {
            headers.insert("Content-Type", "application/cloudevents+json; charset=UTF-8");
            return (bytes::Bytes::from(self.structured.clone()), headers);
        }
        for (name, v) in &self.attributes {
            let v = crate::sink::header_value(&Self::attribute_text(v));
            headers.insert(format!("ce-{name}").as_str(), v.as_str());
        }
        (bytes::Bytes::from(self.data_text()), headers)
    }

    /// `data`: JSON text (kubecast's `datacontenttype` is `application/json`); a JSON string
    /// holding another content type is sent as that string's text.
    fn data_text(&self) -> String {
        match &self.data {
            None => String::new(),
            Some(raw) => match serde_json::from_str::<Value>(raw.get()) {
                Ok(Value::String(s)) if !self.attributes.get("datacontenttype").is_some_and(is_json) => s,
                _ => raw.get().to_string(),
            },
        }
    }
}

fn is_json(v: &Value) -> bool {
    v.as_str().is_some_and(|t| t.contains("json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVENT: &str = r#"{"specversion":"1.0","id":"u1:7:added","source":"k8s://c/api/v1/configmaps","type":"io.kubecast.core.ConfigMap.added","subject":"ns/a","datacontenttype":"application/json","partitionkey":"u1","resourceversion":"7","data":{"metadata":{"name":"a"},"data":{"k":"a b"}}}"#;

    #[test]
    fn a_file_line_gives_the_event_its_destination_and_reason() {
        let line = format!(
            r#"{{"reason":"too large","destination":"t1","failed_at":"2026-12-01T00:00:00Z","event":{EVENT}}}"#
        );
        let e = Entry::from_file_line(line.as_bytes()).unwrap();
        assert_eq!(
            (e.id.as_str(), e.destination.as_str(), e.reason.as_str(), e.key()),
            ("u1:7:added", "t1", "too large", "u1")
        );
        assert_eq!(e.structured, EVENT.as_bytes());
        assert!(Entry::from_file_line(b"{\"event\":{}}").unwrap_err().contains("without an id"));
        assert!(Entry::from_file_line(b"{\"reason\":\"x\"").is_err());
        let no_destination = format!(r#"{{"reason":"x","event":{EVENT}}}"#);
        assert!(Entry::from_file_line(no_destination.as_bytes()).unwrap_err().contains("original destination"));
    }

    #[test]
    fn binary_mode_sends_the_data_with_every_attribute_as_a_header() {
        let e = Entry::parse(EVENT.as_bytes(), "t".into(), String::new(), false).unwrap();
        let (value, headers) = e.kafka(false);
        assert_eq!(String::from_utf8(value).unwrap(), r#"{"metadata":{"name":"a"},"data":{"k":"a b"}}"#);
        use rdkafka::message::Headers;
        let all: Vec<(String, String)> = headers
            .iter()
            .map(|h| (h.key.to_string(), String::from_utf8(h.value.unwrap().to_vec()).unwrap()))
            .collect();
        assert!(all.contains(&("ce_id".into(), "u1:7:added".into())), "{all:?}");
        assert!(all.contains(&("content-type".into(), "application/json".into())), "{all:?}");
        assert!(all.contains(&("ce_partitionkey".into(), "u1".into())), "{all:?}");
        assert!(!all.iter().any(|(k, _)| k == "ce_data"), "{all:?}");
        let (payload, headers) = e.nats(false);
        assert_eq!(headers.get("ce-subject").unwrap().as_str(), "ns/a");
        assert_eq!(&payload[..], br#"{"metadata":{"name":"a"},"data":{"k":"a b"}}"#);
        let (payload, headers) = e.nats(true);
        assert_eq!(&payload[..], EVENT.as_bytes());
        assert!(headers.get("Content-Type").unwrap().as_str().starts_with("application/cloudevents+json"));
    }
}
