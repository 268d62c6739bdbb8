//! The CloudEvent contract: how one observed change of one object becomes one CloudEvent.
//!
//! * `id` = `{uid}:{resourceVersion}:{verb}`: the same change gets the same id, also after
//!   restarts and relists, so consumers can drop duplicates on `source` + `id`.
//! * `source` = `k8s://{cluster}/api/v1/{plural}` for the core group,
//!   `k8s://{cluster}/apis/{group}/{version}/{plural}` otherwise.
//! * `type` = `io.kubecast.{group}.{Kind}.{verb}`, group `core` for the core group, verb one
//!   of `added`, `modified`, `deleted`.
//! * `subject` = `namespace/name`, or `name` for cluster-scoped objects.
//! * extensions: `partitionkey` (uid), `resourceversion`, `origin` (snapshot | watch | resync).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use std::borrow::Cow;

pub use cloudevents::event::ExtensionValue;
use kube::api::ApiResource;

use crate::config::Verb;
use crate::object::RawObject;
use crate::sink::template::TypeFields;

/// Where an event's change was observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The initial list of a stream that had no checkpoint.
    Snapshot,
    /// A live watch event.
    Watch,
    /// Derived by diffing a relist against what the stream had delivered (after 410 Gone).
    Resync,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Snapshot => "snapshot",
            Origin::Watch => "watch",
            Origin::Resync => "resync",
        }
    }
}

/// One change of one object, as the reflector saw it.
#[derive(Debug, Clone)]
pub struct Change {
    pub verb: Verb,
    pub origin: Origin,
    pub object: RawObject,
    /// The resource type's event attributes (shared by all changes of a stream).
    pub source: Arc<EventSource>,
}

impl Change {
    pub fn into_cloudevent(self) -> Result<CloudEvent, EventError> {
        let source = self.source.clone();
        source.build(self)
    }
}

/// A CloudEvent ready to send: its attributes and its data, the object as JSON, serialized
/// once. Sinks use the bytes as they are (binary mode: Kafka borrows them, NATS shares them by
/// reference count) or splice them into the structured form.
#[derive(Debug, Clone)]
pub struct CloudEvent {
    pub attributes: Attributes,
    pub data: Bytes,
    /// The structured form, when built ahead by [`CloudEvent::seal_structured`]; `data` is
    /// then a slice of it.
    structured: Option<Bytes>,
}

/// The attributes of a kubecast CloudEvent (spec 1.0), in two allocations per event.
///
/// Not the cloudevents-sdk `Event`: that one holds every attribute and extension in a `String`
/// of its own and the extensions in a `HashMap` with `String` keys, 12 allocations per event
/// (built by the reflector's thread, freed by the queue's: each free then a cache miss). Here
/// the id `{uid}:{rv}:{verb}` holds `partitionkey` and `resourceversion` too, `source` and
/// `type` are per resource type (interned), `origin` and `datacontenttype` are constants, and
/// further extensions (shaping, trace context: not on every event) sit in a short list. The
/// SDK stays the reference: [`Attributes::to_sdk`], and a test checks that the structured JSON
/// is the SDK's.
#[derive(Debug, Clone, PartialEq)]
pub struct Attributes {
    /// `{uid}:{rv}:{verb}`.
    id: String,
    uid_len: usize,
    rv_len: usize,
    source: &'static str,
    ty: &'static str,
    subject: String,
    time: DateTime<Utc>,
    datacontenttype: &'static str,
    origin: Origin,
    /// Other extensions, in name order.
    others: Vec<(&'static str, ExtensionValue)>,
}

/// An attribute's value as the encoders read it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AttributeValue<'a> {
    Str(&'a str),
    Time(&'a DateTime<Utc>),
    Bool(bool),
    Int(i64),
}

impl AttributeValue<'_> {
    /// The value as text (a header value): strings as they are, the time in RFC 3339 with
    /// `Z`, booleans and integers as JSON writes them.
    pub fn text(&self) -> Cow<'_, str> {
        match *self {
            AttributeValue::Str(s) => Cow::Borrowed(s),
            AttributeValue::Time(t) => Cow::Owned(t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)),
            AttributeValue::Bool(b) => Cow::Borrowed(if b { "true" } else { "false" }),
            AttributeValue::Int(i) => Cow::Owned(i.to_string()),
        }
    }
}

impl<'a> From<&'a ExtensionValue> for AttributeValue<'a> {
    fn from(v: &'a ExtensionValue) -> Self {
        match v {
            ExtensionValue::String(s) => AttributeValue::Str(s),
            ExtensionValue::Boolean(b) => AttributeValue::Bool(*b),
            ExtensionValue::Integer(i) => AttributeValue::Int(*i),
        }
    }
}

/// The extensions every event has (its `id` or constants).
const OWN_EXTENSIONS: [&str; 3] = ["origin", "partitionkey", "resourceversion"];

impl Attributes {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn source(&self) -> &str {
        self.source
    }

    pub fn ty(&self) -> &str {
        self.ty
    }

    pub fn subject(&self) -> &str {
        &self.subject
    }

    pub fn time(&self) -> &DateTime<Utc> {
        &self.time
    }

    pub fn datacontenttype(&self) -> &str {
        self.datacontenttype
    }

    pub fn set_datacontenttype(&mut self, content_type: &'static str) {
        self.datacontenttype = content_type;
    }

    /// The object's uid (the `partitionkey` extension).
    pub fn partition_key(&self) -> &str {
        &self.id[..self.uid_len]
    }

    /// The object's resourceVersion (the `resourceversion` extension).
    pub fn resource_version(&self) -> &str {
        &self.id[self.uid_len + 1..self.uid_len + 1 + self.rv_len]
    }

    /// Sets (or replaces) extension `name`; not one of `origin`, `partitionkey`,
    /// `resourceversion`, which every event has from its change.
    pub fn set_extension(&mut self, name: &'static str, value: impl Into<ExtensionValue>) {
        assert!(!OWN_EXTENSIONS.contains(&name), "extension {name:?} comes from the change");
        // The structured form writes names as they are (no escaping).
        debug_assert!(
            !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
            "extension names are lowercase letters and digits (CloudEvents): {name:?}"
        );
        let value = value.into();
        match self.others.binary_search_by(|(n, _)| (*n).cmp(name)) {
            Ok(at) => self.others[at].1 = value,
            Err(at) => self.others.insert(at, (name, value)),
        }
    }

    pub fn extension(&self, name: &str) -> Option<AttributeValue<'_>> {
        self.extensions().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// The context attributes in the SDK's order: specversion, id, type, source,
    /// datacontenttype, subject, time.
    pub fn iter_attributes(&self) -> impl Iterator<Item = (&'static str, AttributeValue<'_>)> {
        [
            ("specversion", AttributeValue::Str("1.0")),
            ("id", AttributeValue::Str(&self.id)),
            ("type", AttributeValue::Str(self.ty)),
            ("source", AttributeValue::Str(self.source)),
            ("datacontenttype", AttributeValue::Str(self.datacontenttype)),
            ("subject", AttributeValue::Str(&self.subject)),
            ("time", AttributeValue::Time(&self.time)),
        ]
        .into_iter()
    }

    /// Every attribute: the context attributes, then the extensions (what the structured form
    /// and the binary-mode headers carry).
    pub fn all(&self) -> impl Iterator<Item = (&'static str, AttributeValue<'_>)> {
        self.iter_attributes().chain(self.extensions())
    }

    /// The extensions in name order: every event of a stream lists them in the same order.
    pub fn extensions(&self) -> impl Iterator<Item = (&'static str, AttributeValue<'_>)> {
        let own = [
            ("origin", AttributeValue::Str(self.origin.as_str())),
            ("partitionkey", AttributeValue::Str(self.partition_key())),
            ("resourceversion", AttributeValue::Str(self.resource_version())),
        ];
        let (mut own, mut others) = (own.into_iter().peekable(), self.others.iter().peekable());
        std::iter::from_fn(move || match (own.peek(), others.peek()) {
            (Some((a, _)), Some((b, _))) if b < a => others.next().map(|(n, v)| (*n, v.into())),
            (Some(_), _) => own.next(),
            (None, _) => others.next().map(|(n, v)| (*n, v.into())),
        })
    }

    /// The same attributes as a cloudevents-sdk event (the reference the tests compare with).
    #[cfg(test)]
    pub fn to_sdk(&self) -> cloudevents::Event {
        use cloudevents::{AttributesWriter, EventBuilder, EventBuilderV10};
        let mut event = EventBuilderV10::new()
            .id(self.id.clone())
            .source(self.source)
            .ty(self.ty)
            .subject(self.subject.clone())
            .time(self.time)
            .build()
            .expect("id, source and type are set");
        event.set_datacontenttype(Some(self.datacontenttype));
        for (name, value) in self.extensions() {
            let value = match value {
                AttributeValue::Str(s) => ExtensionValue::String(s.to_string()),
                AttributeValue::Bool(b) => ExtensionValue::Boolean(b),
                AttributeValue::Int(i) => ExtensionValue::Integer(i),
                AttributeValue::Time(_) => ExtensionValue::String(value.text().into_owned()),
            };
            event.set_extension(name, value);
        }
        event
    }
}

/// `s` as a string that lives as long as the process, the same one for equal strings: the
/// per-resource-type `source` and `type` of events (a few per watched resource; a kind
/// discovered again, e.g. a CRD re-created with another version, may add a few more, never
/// freed).
fn intern(s: String) -> &'static str {
    static STRINGS: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut strings = STRINGS.get_or_init(Default::default).lock().expect("interned strings");
    if let Some(known) = strings.get(s.as_str()) {
        return known;
    }
    let leaked: &'static str = Box::leak(s.into_boxed_str());
    strings.insert(leaked);
    leaked
}

impl CloudEvent {
    pub fn id(&self) -> &str {
        self.attributes.id()
    }

    /// The structured-mode JSON: `{...attributes, "data": <object>}`.
    pub fn to_structured(&self) -> Vec<u8> {
        match self.sealed() {
            Some(whole) => whole.to_vec(),
            None => self.structured_with(Some(&self.data)),
        }
    }

    /// The structured-mode JSON as shared bytes: the sealed buffer itself when the event was
    /// sealed (no copy), else built now.
    pub fn structured_bytes(&self) -> Bytes {
        match self.sealed() {
            Some(whole) => whole.clone(),
            None => Bytes::from(self.structured_with(Some(&self.data))),
        }
    }

    /// The structured form built by [`CloudEvent::seal_structured`], if it is still the event's.
    pub fn sealed(&self) -> Option<&Bytes> {
        let whole = self.structured.as_ref()?;
        // `data` still the slice made by the seal (a shaping step after it would have replaced
        // it); attributes changed after it are caught by the debug check.
        if self.data.len() >= whole.len() || self.data.as_ptr() != whole[whole.len() - 1 - self.data.len()..].as_ptr() {
            return None;
        }
        debug_assert!(
            whole[..] == self.structured_with(Some(&self.data))[..],
            "the event was changed after seal_structured"
        );
        Some(whole)
    }

    /// Builds the structured form now, once, and makes `data` a slice of it: for sinks that
    /// send structured events, the object is copied into its message here, where the pipeline
    /// has just read it (in cache), rather than at send time, after waiting in the queue, and
    /// only one buffer per event stays alive (the watch line's is released). Call after the
    /// event's last change (shaping, trace context); debug builds check that nothing changed.
    pub fn seal_structured(&mut self) {
        let whole = Bytes::from(self.structured_with(Some(&self.data)));
        // `...,"data":<data>}`: the data ends just before the closing brace.
        let end = whole.len() - 1;
        self.data = whole.slice(end - self.data.len()..end);
        self.structured = Some(whole);
    }

    /// The length of [`CloudEvent::to_structured`], without copying the data.
    pub fn structured_len(&self) -> usize {
        match self.sealed() {
            Some(whole) => whole.len(),
            // `{...}` + `,"data":` + data.
            None => self.structured_with(None).len() + br#","data":"#.len() + self.data.len(),
        }
    }

    /// The structured-mode JSON without `data` (e.g. when the object is too large).
    pub fn to_structured_without_data(&self) -> Vec<u8> {
        self.structured_with(None)
    }

    /// Written by hand rather than with the SDK's `Serialize`: the same JSON (the tests compare
    /// the two) at a third of the cost, and the extensions in name order, so that every event
    /// of a stream has the same layout (the SDK keeps them in a hash map).
    fn structured_with(&self, data: Option<&[u8]>) -> Vec<u8> {
        let mut out = Vec::with_capacity(512 + data.map_or(0, <[u8]>::len));
        out.push(b'{');
        // Attribute names are lowercase letters and digits (spec): written as they are.
        let member = |out: &mut Vec<u8>, name: &str| {
            if out.len() > 1 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b"\":");
        };
        for (name, value) in self.attributes.all() {
            member(&mut out, name);
            match value {
                AttributeValue::Str(s) => json_string(&mut out, s),
                AttributeValue::Time(_) => json_string(&mut out, &value.text()),
                AttributeValue::Bool(b) => out.extend_from_slice(if b { b"true" } else { b"false" }),
                AttributeValue::Int(i) => out.extend_from_slice(i.to_string().as_bytes()),
            }
        }
        if let Some(data) = data {
            member(&mut out, "data");
            out.extend_from_slice(data);
        }
        out.push(b'}');
        out
    }
}

/// `s` as a JSON string: copied as it is when nothing in it needs an escape (ids, names,
/// times: nearly always), else escaped by serde_json.
fn json_string(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("a string serialises");
    }
}

/// Per-resource-type parts of every event (computed once per stream).
#[derive(Debug, Clone)]
pub struct EventSource {
    source: &'static str,
    /// `type` per verb, in [`Verb::ALL`] order.
    types: [&'static str; 3],
    resource: ApiResource,
    type_fields: &'static TypeFields,
}

impl EventSource {
    pub fn new(cluster: &str, ar: &ApiResource) -> Self {
        let source = if ar.group.is_empty() {
            format!("k8s://{cluster}/api/{}/{}", ar.version, ar.plural)
        } else {
            format!("k8s://{cluster}/apis/{}/{}/{}", ar.group, ar.version, ar.plural)
        };
        let type_fields = TypeFields::new(cluster, ar).intern();
        let ty = |verb: Verb| intern(format!("io.kubecast.{}.{}.{}", type_fields.group, ar.kind, verb.as_str()));
        Self { source: intern(source), types: Verb::ALL.map(ty), resource: ar.clone(), type_fields }
    }

    /// The destination template fields of the resource type.
    pub fn type_fields(&self) -> &'static TypeFields {
        self.type_fields
    }

    pub fn source(&self) -> &str {
        self.source
    }

    pub fn api_resource(&self) -> &ApiResource {
        &self.resource
    }

    /// Builds the CloudEvent for `change`.
    pub fn build(&self, change: Change) -> Result<CloudEvent, EventError> {
        let Change { verb, origin, object, .. } = change;
        let meta = &object.metadata;
        let uid = meta.uid.as_deref().filter(|u| !u.is_empty()).ok_or(EventError::MissingField("metadata.uid"))?;
        let rv = meta
            .resource_version
            .as_deref()
            .filter(|r| !r.is_empty())
            .ok_or(EventError::MissingField("metadata.resourceVersion"))?;
        let name = meta.name.as_deref().ok_or(EventError::MissingField("metadata.name"))?;
        let subject = match meta.namespace.as_deref() {
            Some(ns) if !ns.is_empty() => [ns, "/", name].concat(),
            _ => name.to_string(),
        };
        let attributes = Attributes {
            id: [uid, ":", rv, ":", verb.as_str()].concat(),
            uid_len: uid.len(),
            rv_len: rv.len(),
            source: self.source,
            ty: self.types[crate::metrics::verb_index(verb)],
            subject,
            time: Utc::now(),
            datacontenttype: "application/json",
            origin,
            others: Vec::new(),
        };
        // List items come without apiVersion/kind; every payload describes itself.
        let data = object.into_json_bytes(&self.resource);
        Ok(CloudEvent { attributes, data, structured: None })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("object has no {0}; it cannot be given a stable event id")]
    MissingField(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::GroupVersionKind;

    #[test]
    fn contract() {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("apps", "v1", "Deployment"), "deployments");
        let src = Arc::new(EventSource::new("prod", &ar));
        let obj = RawObject::from_value(
            &serde_json::json!({"metadata": {"name": "web", "namespace": "shop", "uid": "u-1", "resourceVersion": "42"}}),
        )
        .unwrap();
        let ev =
            Change { verb: Verb::Modified, origin: Origin::Watch, object: obj, source: src }.into_cloudevent().unwrap();
        let json: serde_json::Value = serde_json::from_slice(&ev.to_structured()).unwrap();
        assert_eq!(json["id"], "u-1:42:modified");
        assert_eq!(json["source"], "k8s://prod/apis/apps/v1/deployments");
        assert_eq!(json["type"], "io.kubecast.apps.Deployment.modified");
        assert_eq!(json["subject"], "shop/web");
        assert_eq!(json["partitionkey"], "u-1");
        assert_eq!(json["resourceversion"], "42");
        assert_eq!(json["origin"], "watch");
        assert_eq!(json["data"]["kind"], "Deployment");
        assert_eq!(json["datacontenttype"], "application/json");
    }

    #[test]
    fn a_sealed_event_shares_one_buffer_and_stays_the_same_json() {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
        let src = Arc::new(EventSource::new("c", &ar));
        let obj = RawObject::from_value(&serde_json::json!({"metadata": {"name": "a", "namespace": "n", "uid": "u", "resourceVersion": "1"}, "spec": {"s": "}"}}))
            .unwrap();
        let mut ev =
            Change { verb: Verb::Added, origin: Origin::Watch, object: obj, source: src }.into_cloudevent().unwrap();
        let (before, data) = (ev.to_structured(), ev.data.clone());
        assert_eq!(ev.structured_len(), before.len());
        assert!(ev.sealed().is_none());
        ev.seal_structured();
        let whole = ev.sealed().expect("sealed").clone();
        assert_eq!(whole[..], before[..]);
        assert_eq!(ev.structured_len(), before.len());
        assert_eq!(ev.data, data);
        assert!(whole.as_ptr_range().contains(&ev.data.as_ptr()), "data is a slice of the structured form");
        assert_eq!(ev.structured_bytes().as_ptr(), whole.as_ptr(), "no copy at send time");
        // Data replaced after the seal (as a later shaping step would): built anew.
        ev.data = Bytes::from_static(b"{}");
        assert!(ev.sealed().is_none());
        assert_eq!(ev.structured_len(), ev.to_structured().len());
        let json: serde_json::Value = serde_json::from_slice(&ev.structured_bytes()).unwrap();
        assert_eq!(json["data"], serde_json::json!({}));
    }

    #[test]
    fn structured_json_is_the_sdks_with_sorted_extensions() {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
        let src = Arc::new(EventSource::new("c", &ar));
        let obj = RawObject::from_value(&serde_json::json!({"metadata": {"name": "a\"b", "namespace": "n", "uid": "u", "resourceVersion": "1"}, "spec": {"x": [1, 2]}}))
            .unwrap();
        let mut ev =
            Change { verb: Verb::Added, origin: Origin::Resync, object: obj, source: src }.into_cloudevent().unwrap();
        ev.attributes.set_extension("truncated", ExtensionValue::Boolean(true));
        ev.attributes.set_extension("attempt", ExtensionValue::Integer(3));
        ev.attributes.set_extension("payload", ExtensionValue::String("full\u{e9}\"".into()));
        let ours: serde_json::Value = serde_json::from_slice(&ev.to_structured()).unwrap();
        let mut sdk = serde_json::to_value(ev.attributes.to_sdk()).unwrap();
        sdk["data"] = serde_json::from_slice(&ev.data).unwrap();
        assert_eq!(ours, sdk);
        // The reference built with the SDK's builder from the change itself, not from ours.
        use cloudevents::{AttributesWriter, EventBuilder, EventBuilderV10};
        let mut reference = EventBuilderV10::new()
            .id("u:1:added")
            .source("k8s://c/api/v1/pods")
            .ty("io.kubecast.core.Pod.added")
            .subject("n/a\"b")
            .time(*ev.attributes.time())
            .extension("partitionkey", "u")
            .extension("resourceversion", "1")
            .extension("origin", "resync")
            .extension("truncated", true)
            .extension("attempt", 3i64)
            .extension("payload", "full\u{e9}\"")
            .build()
            .unwrap();
        reference.set_datacontenttype(Some("application/json"));
        let mut reference = serde_json::to_value(reference).unwrap();
        reference["data"] = serde_json::from_slice(&ev.data).unwrap();
        assert_eq!(ours, reference);
        let text = String::from_utf8(ev.to_structured()).unwrap();
        let at = |k: &str| text.find(&format!("\"{k}\":")).unwrap();
        let names = ["attempt", "origin", "partitionkey", "payload", "resourceversion", "truncated"];
        assert!(names.windows(2).all(|w| at(w[0]) < at(w[1])), "{text}");
        assert!(at("specversion") < at("attempt") && at("truncated") < at("data"));
        let without: serde_json::Value = serde_json::from_slice(&ev.to_structured_without_data()).unwrap();
        assert!(without.get("data").is_none());
        assert_eq!(without["id"], ours["id"]);
    }

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
        let (payload, _) = crate::sink::nats::encode(&ev, crate::sink::nats::Mode::Binary);
        assert_eq!(payload.as_ptr(), text, "NATS binary mode shares the bytes");
        let (value, _) = crate::sink::kafka::encode(&ev, crate::sink::kafka::Mode::Binary);
        assert_eq!(value.as_ptr(), text, "Kafka binary mode borrows them");
    }

    fn event(uid: &str, rv: &str, verb: Verb) -> CloudEvent {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
        let src = Arc::new(EventSource::new("c", &ar));
        let obj =
            RawObject::from_value(&serde_json::json!({"metadata": {"name": "a", "uid": uid, "resourceVersion": rv}}))
                .unwrap();
        Change { verb, origin: Origin::Watch, object: obj, source: src }.into_cloudevent().unwrap()
    }

    #[test]
    fn attributes_read_back_and_extensions_replace() {
        // A uid or resourceVersion with `:` in it is still read back whole.
        let mut ev = event("u:1", "7:8", Verb::Deleted);
        let a = &mut ev.attributes;
        assert_eq!((a.id(), a.partition_key(), a.resource_version()), ("u:1:7:8:deleted", "u:1", "7:8"));
        assert_eq!(a.ty(), "io.kubecast.core.Pod.deleted");
        assert_eq!(a.subject(), "a", "cluster-scoped: the name alone");
        a.set_extension("payload", "metadata");
        a.set_extension("payload", "full");
        a.set_extension("attempt", 2i64);
        let names: Vec<&str> = a.extensions().map(|(n, _)| n).collect();
        assert_eq!(names, ["attempt", "origin", "partitionkey", "payload", "resourceversion"]);
        assert_eq!(a.extension("payload"), Some(AttributeValue::Str("full")), "replaced, not added");
        assert_eq!(AttributeValue::Int(-3).text(), "-3");
        assert_eq!(AttributeValue::Bool(false).text(), "false");
        let t = chrono::DateTime::parse_from_rfc3339("2026-11-22T06:00:00.123456+00:00").unwrap().to_utc();
        assert_eq!(AttributeValue::Time(&t).text(), "2026-11-22T06:00:00.123456Z");
    }

    #[test]
    #[should_panic(expected = "comes from the change")]
    fn own_extensions_are_not_set_afterwards() {
        event("u", "1", Verb::Added).attributes.set_extension("partitionkey", "other");
    }
}
