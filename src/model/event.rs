//! The CloudEvent contract: how one observed change of one object becomes one CloudEvent.
//!
//! * `id` = `{uid}:{resourceVersion}:{verb}` for `added` and `modified`, `{uid}:deleted` for
//!   `deleted` (an object is deleted once; the watch's deletion and a relist's tombstone know
//!   different resourceVersions of it); on a stream with a label or field selector, where
//!   an object can leave (reported deleted) and come back, `{uid}:{resourceVersion}:deleted`.
//!   The same change gets the same id, also after restarts and relists, so consumers can drop
//!   duplicates on `source` + `id`.
//! * `source` = `k8s://{cluster}/api/v1/{plural}` for the core group,
//!   `k8s://{cluster}/apis/{group}/{version}/{plural}` otherwise.
//! * `type` = `io.kubecast.{group}.{Kind}.{verb}`, group `core` for the core group, verb one
//!   of `added`, `modified`, `deleted`.
//! * `subject` = `namespace/name`, or `name` for cluster-scoped objects.
//! * extensions: `partitionkey` (uid), `resourceversion`, `origin` (snapshot | watch | resync).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use bytestring::ByteString;
use kube::api::ApiResource;

use super::attributes::{AttributeValue, Attributes};
use super::fields::TypeFields;
use super::object::RawObject;
use super::verb::{Origin, Verb};

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
    /// The object as JSON text (UTF-8 by its type: checked once, when the object was read).
    pub data: ByteString,
    /// The structured form, when built ahead by [`CloudEvent::seal_structured`]; `data` is
    /// then a slice of it.
    structured: Option<Bytes>,
}

impl CloudEvent {
    pub fn id(&self) -> &str {
        self.attributes.id()
    }

    /// The data's bytes.
    pub fn data_bytes(&self) -> &[u8] {
        self.data.as_bytes()
    }

    /// The structured-mode JSON: `{...attributes, "data": <object>}`.
    pub fn to_structured(&self) -> Vec<u8> {
        match self.sealed() {
            Some(whole) => whole.to_vec(),
            None => self.structured_with(Some(self.data_bytes())),
        }
    }

    /// The structured-mode JSON as shared bytes: the sealed buffer itself when the event was
    /// sealed (no copy), else built now.
    pub fn structured_bytes(&self) -> Bytes {
        match self.sealed() {
            Some(whole) => whole.clone(),
            None => Bytes::from(self.structured_with(Some(self.data_bytes()))),
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
            whole[..] == self.structured_with(Some(self.data_bytes()))[..],
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
        let whole = Bytes::from(self.structured_with(Some(self.data_bytes())));
        // `...,"data":<data>}`: the data ends just before the closing brace.
        let end = whole.len() - 1;
        let data = whole.slice(end - self.data.len()..end);
        debug_assert_eq!(data, self.data.as_bytes());
        // SAFETY: `structured_with` copies `data` as it is right before the closing brace: the
        // slice holds the same bytes as `self.data`, which are UTF-8.
        self.data = unsafe { ByteString::from_bytes_unchecked(data) };
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

/// Per-resource-type parts of every event (computed once per stream).
#[derive(Debug, Clone)]
pub struct EventSource {
    source: &'static str,
    /// `type` per verb, in [`Verb::ALL`] order.
    types: [&'static str; 3],
    resource: ApiResource,
    type_fields: &'static TypeFields,
    /// Whether an object leaves the stream only by being deleted (no label or field
    /// selector): then a delete's id is `{uid}:deleted`, the same whichever path saw it. With a
    /// selector, an object that stops matching is reported deleted, may match again and leave
    /// again: its deletes keep `{uid}:{rv}:deleted`, distinct ids.
    delete_once: bool,
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
        Self { source: intern(source), types: Verb::ALL.map(ty), resource: ar.clone(), type_fields, delete_once: true }
    }

    /// For a stream with a label or field selector (see `delete_once`).
    pub fn with_selector(mut self, selected: bool) -> Self {
        self.delete_once = !selected;
        self
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
        let attributes = Attributes::new(
            uid,
            rv,
            verb.as_str(),
            self.delete_once,
            self.source,
            self.types[verb.index()],
            subject,
            origin,
        );
        // List items come without apiVersion/kind; every payload describes itself.
        let data = object.into_json_text(&self.resource);
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
    use crate::model::attributes::ExtensionValue;
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
        ev.data = ByteString::from_static("{}");
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
        sdk["data"] = serde_json::from_str(&ev.data).unwrap();
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
        reference["data"] = serde_json::from_str(&ev.data).unwrap();
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
        assert_eq!((a.id(), a.partition_key(), a.resource_version()), ("u:1:deleted", "u:1", "7:8"));
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
    fn with_a_selector_deletes_keep_their_resource_version() {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "Pod"), "pods");
        let src = Arc::new(EventSource::new("c", &ar).with_selector(true));
        let obj =
            RawObject::from_value(&serde_json::json!({"metadata": {"name": "a", "uid": "u", "resourceVersion": "7"}}))
                .unwrap();
        let ev =
            Change { verb: Verb::Deleted, origin: Origin::Watch, object: obj, source: src }.into_cloudevent().unwrap();
        assert_eq!(ev.id(), "u:7:deleted", "an object that left the selector may leave again: distinct ids");
        assert_eq!(ev.attributes.resource_version(), "7");
    }

    #[test]
    #[should_panic(expected = "comes from the change")]
    fn own_extensions_are_not_set_afterwards() {
        event("u", "1", Verb::Added).attributes.set_extension("partitionkey", "other");
    }
}
