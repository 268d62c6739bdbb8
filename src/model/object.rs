//! [`RawObject`]: a Kubernetes object as kubecast handles it: the few metadata fields it needs
//! (uid, name, namespace, resourceVersion) decoded, the whole object kept as the JSON text the
//! apiserver sent. Nothing else is decoded or re-encoded: the event's data is that text.

use std::borrow::Cow;
use std::fmt;

use bytes::Bytes;
use bytestring::ByteString;

use kube::api::{ApiResource, ObjectMeta};
use kube::core::DynamicResourceScope;
use serde::de::{DeserializeSeed, Error as _, IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

#[derive(Clone, Debug)]
pub struct RawObject {
    /// Only `uid`, `name`, `namespace` and `resource_version` are set.
    pub metadata: ObjectMeta,
    /// Whether the JSON has `apiVersion` and `kind` (list items do not).
    pub has_type: bool,
    /// The whole object as JSON text: valid UTF-8 (the type says so: checked once, where the
    /// text arrives), one whole JSON object (every constructor checks it: serde_json in full,
    /// or `json_check`'s structural check for watch lines).
    text: ByteString,
}

/// The identity fields read from the head of an object (see [`read_head`]).
#[derive(Default)]
struct Head {
    /// Whether `apiVersion` / `kind` are present and not null.
    api_version: bool,
    kind: bool,
    metadata: MiniMeta,
    /// The top-level keys seen so far (bit `i`: `HEAD_KEYS[i]`).
    seen: u8,
    /// Set when the parse stopped early because every wanted key was seen.
    complete: bool,
}

/// The top-level keys read, and their bits in `Head::seen`.
const HEAD_KEYS: [&str; 3] = ["apiVersion", "kind", "metadata"];
const API_VERSION: u8 = 1;
const KIND: u8 = 2;
const ALL_KEYS: u8 = 7;
/// The keys of `metadata` read.
const META_KEYS: [&str; 4] = ["name", "namespace", "uid", "resourceVersion"];

#[derive(Default)]
struct MiniMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    resource_version: Option<String>,
}

/// Reads `metadata` into the [`Head`]. When `apiVersion` and `kind` were seen before it and
/// name, namespace, uid and resourceVersion are all read, the head is complete there: the
/// apiserver writes these first in `metadata` (labels, annotations, managedFields follow), so
/// the rest is not scanned. Otherwise (a cluster-scoped object has no namespace) it reads
/// `metadata` to its end.
struct MetaSeed<'a>(&'a mut Head);

impl<'de> DeserializeSeed<'de> for MetaSeed<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for MetaSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("object metadata")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let head = self.0;
        let typed_first = head.seen & (API_VERSION | KIND) == API_VERSION | KIND;
        let m = &mut head.metadata;
        let mut seen = 0u8;
        while let Some(key) = map.next_key_seed(KeyIn(&META_KEYS))? {
            let Some(i) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            let (bit, name) = (1 << i, META_KEYS[i]);
            let slot = match i {
                0 => &mut m.name,
                1 => &mut m.namespace,
                2 => &mut m.uid,
                _ => &mut m.resource_version,
            };
            if seen & bit != 0 {
                return Err(A::Error::duplicate_field(name));
            }
            seen |= bit;
            *slot = map.next_value()?;
            if typed_first && seen == (1 << META_KEYS.len()) - 1 {
                head.complete = true;
                return Err(A::Error::custom("head complete"));
            }
        }
        Ok(())
    }
}

/// Reads a map key as its index in `.0` (`None`: another key). Escaped keys arrive unescaped.
struct KeyIn(&'static [&'static str]);

impl<'de> DeserializeSeed<'de> for KeyIn {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeyIn {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|k| *k == v))
    }
}

/// Reads the top-level keys of an object into the [`Head`]; once `apiVersion`, `kind` and
/// `metadata` were all seen it stops with an error and sets `complete` (the caller treats that
/// as success), so the rest of the object (spec, status: most of it) is not scanned a second
/// time. The apiserver writes these three first (typed objects in Go struct order, custom
/// resources with sorted keys); in any other order the parse just goes on until it has them.
struct HeadVisitor<'a>(&'a mut Head);

impl<'de> Visitor<'de> for HeadVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let head = self.0;
        while let Some(key) = map.next_key_seed(KeyIn(&HEAD_KEYS))? {
            let Some(i) = key else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            let (bit, name) = (1 << i, HEAD_KEYS[i]);
            if head.seen & bit != 0 {
                return Err(A::Error::duplicate_field(name));
            }
            head.seen |= bit;
            match i {
                0 => head.api_version = map.next_value::<Option<IgnoredAny>>()?.is_some(),
                1 => head.kind = map.next_value::<Option<IgnoredAny>>()?.is_some(),
                _ => map.next_value_seed(MetaSeed(&mut *head))?,
            }
            if head.seen == ALL_KEYS {
                head.complete = true;
                return Err(A::Error::custom("head complete"));
            }
        }
        Ok(())
    }
}

/// Decodes the [`Head`] of `text` (one JSON object).
fn read_head(text: &[u8]) -> Result<Head, serde_json::Error> {
    let mut head = Head::default();
    let mut de = serde_json::Deserializer::from_slice(text);
    match de.deserialize_map(HeadVisitor(&mut head)) {
        Ok(()) => de.end()?,
        Err(_) if head.complete => {}
        Err(e) => return Err(e),
    }
    Ok(head)
}

/// Why a text is not an object kubecast can pass on.
#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object text is not UTF-8")]
    Utf8,
    #[error("object text: {0}")]
    Syntax(#[from] super::json_check::SyntaxError),
    #[error("object text is not a JSON object")]
    NotAnObject,
    #[error("object head: {0}")]
    Head(#[from] serde_json::Error),
}

impl RawObject {
    /// Takes `text` as the object if it is UTF-8 and one whole JSON object (the structural check
    /// of [`super::json_check`]: it is passed on as it is), and reads its identity from the
    /// head.
    pub fn from_json(text: Bytes) -> Result<Self, ObjectError> {
        simdutf8::basic::from_utf8(&text).map_err(|_| ObjectError::Utf8)?;
        // SAFETY: checked to be UTF-8 on the line above (simdutf8: several times faster than
        // the standard library's check that `ByteString::try_from` runs).
        let text = unsafe { ByteString::from_bytes_unchecked(text) };
        super::json_check::check_structure(text.as_bytes())?;
        if text.bytes().find(|b| !b.is_ascii_whitespace()) != Some(b'{') {
            return Err(ObjectError::NotAnObject);
        }
        let head = read_head(text.as_bytes())?;
        Ok(Self::with_head(text, head))
    }

    /// `raw` is valid JSON (serde_json checked it); only its head is read.
    pub fn from_raw(raw: Box<RawValue>) -> Result<Self, serde_json::Error> {
        let text = ByteString::from(Box::<str>::from(raw));
        let head = read_head(text.as_bytes())?;
        Ok(Self::with_head(text, head))
    }

    fn with_head(text: ByteString, head: Head) -> Self {
        let m = head.metadata;
        Self {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                ..ObjectMeta::default()
            },
            has_type: head.api_version && head.kind,
            text,
        }
    }

    pub fn from_value(v: &serde_json::Value) -> Result<Self, serde_json::Error> {
        Self::from_raw(RawValue::from_string(serde_json::to_string(v)?)?)
    }

    /// The object's JSON text as it arrived.
    pub fn text(&self) -> &[u8] {
        self.text.as_bytes()
    }

    /// The object's JSON, with `apiVersion` and `kind` added when it came without them (as
    /// items of a list do), so that every payload describes itself.
    pub fn into_json_text(self, ar: &ApiResource) -> ByteString {
        if self.has_type {
            // No copy: the text the apiserver sent becomes the data.
            return self.text;
        }
        let text: &str = &self.text;
        let rest = text.strip_prefix('{').unwrap_or(text);
        let mut out = String::with_capacity(text.len() + 64);
        out.push_str("{\"apiVersion\":");
        out.push_str(&serde_json::to_string(&ar.api_version).expect("string serialises"));
        out.push_str(",\"kind\":");
        out.push_str(&serde_json::to_string(&ar.kind).expect("string serialises"));
        if rest.bytes().any(|b| !b.is_ascii_whitespace() && b != b'}') {
            out.push(',');
        }
        out.push_str(rest);
        out.into()
    }
}

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Box::<RawValue>::deserialize(d)?;
        Self::from_raw(raw).map_err(D::Error::custom)
    }
}

impl Serialize for RawObject {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // The text is valid JSON (checked when the object was made); borrowed, not copied.
        let raw: &RawValue = serde_json::from_str(&self.text).map_err(serde::ser::Error::custom)?;
        raw.serialize(s)
    }
}

impl kube::Resource for RawObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }
    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }
    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }
    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }
    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::GroupVersionKind;

    #[test]
    fn decodes_only_identity_and_keeps_the_text() {
        let text = r#"{"metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"7","labels":{"x":"y"}},"data":{"k":"v"}}"#;
        let o: RawObject = serde_json::from_str(text).unwrap();
        assert_eq!(o.metadata.uid.as_deref(), Some("u"));
        assert_eq!(o.metadata.resource_version.as_deref(), Some("7"));
        assert!(o.metadata.labels.is_none(), "nothing else decoded");
        assert!(!o.has_type);
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "ConfigMap"), "configmaps");
        let v: serde_json::Value = serde_json::from_str(&o.clone().into_json_text(&ar)).unwrap();
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["kind"], "ConfigMap");
        assert_eq!(v["data"]["k"], "v");
        assert_eq!(v["metadata"]["labels"]["x"], "y");

        let typed: RawObject =
            serde_json::from_str(r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"}}"#).unwrap();
        assert!(typed.has_type);
        assert_eq!(&typed.into_json_text(&ar)[..], r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"}}"#);
        let empty: RawObject = serde_json::from_str("{}").unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&empty.into_json_text(&ar)).unwrap()["kind"], "ConfigMap");
    }
}

#[cfg(test)]
mod head_tests {
    use super::*;

    /// What the head parse must find, computed from the whole parsed value.
    fn expected(text: &str) -> (Option<String>, Option<String>, Option<String>, Option<String>, bool) {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        let s = |k: &str| v["metadata"][k].as_str().map(str::to_string);
        let typed = !v["apiVersion"].is_null() && !v["kind"].is_null();
        (s("name"), s("namespace"), s("uid"), s("resourceVersion"), typed)
    }

    fn check(text: &str) {
        let o = RawObject::from_raw(RawValue::from_string(text.to_string()).unwrap()).unwrap();
        let m = &o.metadata;
        let got = (m.name.clone(), m.namespace.clone(), m.uid.clone(), m.resource_version.clone(), o.has_type);
        assert_eq!(got, expected(text), "{text}");
        assert_eq!(o.text(), text.trim().as_bytes(), "the text is kept as it is");
        let checked = RawObject::from_json(Bytes::copy_from_slice(text.as_bytes())).unwrap();
        assert_eq!(checked.text(), text.as_bytes());
        let m2 = &checked.metadata;
        assert_eq!(
            (m2.name.clone(), m2.namespace.clone(), m2.uid.clone(), m2.resource_version.clone(), checked.has_type),
            expected(text)
        );
    }

    #[test]
    fn every_key_order() {
        let parts = [
            r#""apiVersion":"v1""#,
            r#""kind":"Pod""#,
            r#""metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"7"}"#,
            r#""spec":{"metadata":{"name":"inner","uid":"wrong"},"kind":"X"}"#,
            r#""status":{"phase":"Running"}"#,
        ];
        // All 120 orders.
        let mut orders: Vec<Vec<usize>> = vec![vec![]];
        for _ in 0..parts.len() {
            let mut longer = Vec::new();
            for o in &orders {
                for i in (0..parts.len()).filter(|i| !o.contains(i)) {
                    let mut o = o.clone();
                    o.push(i);
                    longer.push(o);
                }
            }
            orders = longer;
        }
        assert_eq!(orders.len(), 120);
        for order in orders {
            let text = format!("{{{}}}", order.iter().map(|&i| parts[i]).collect::<Vec<_>>().join(","));
            check(&text);
        }
    }

    #[test]
    fn metadata_key_orders_and_cluster_scoped_objects() {
        let fields = [
            r#""name":"a""#,
            r#""namespace":"n""#,
            r#""uid":"u""#,
            r#""resourceVersion":"7""#,
            r#""labels":{"uid":"no","name":"no"}"#,
        ];
        for skip in 0..fields.len() + 1 {
            // Each field left out once (none left out last), in both directions.
            let kept: Vec<&str> = fields.iter().enumerate().filter(|(i, _)| *i != skip).map(|(_, f)| *f).collect();
            for meta in [kept.join(","), kept.iter().rev().copied().collect::<Vec<_>>().join(",")] {
                let spec = r#""spec":{"metadata":{"namespace":"no","uid":"no"}}"#;
                check(&format!(r#"{{"apiVersion":"v1","kind":"Pod","metadata":{{{meta}}},{spec}}}"#));
                check(&format!(r#"{{"metadata":{{{meta}}},"apiVersion":"v1","kind":"Pod",{spec}}}"#));
                check(&format!(r#"{{"apiVersion":"v1","metadata":{{{meta}}},{spec},"kind":"Pod"}}"#));
                check(&format!(r#"{{"metadata":{{{meta}}},{spec}}}"#));
            }
        }
        // A cluster-scoped object: no namespace, so metadata is read to its end.
        check(
            r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","uid":"u","resourceVersion":"5","managedFields":[{"manager":"x"}]},"spec":{}}"#,
        );
        check(
            r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"n1","uid":"u","resourceVersion":"5","namespace":null},"spec":{}}"#,
        );
    }

    #[test]
    fn list_items_without_type_and_nested_metadata() {
        // A list item: no apiVersion/kind at the top, but spec has both and a nested metadata.
        check(
            r#"{"metadata":{"name":"a","uid":"u","resourceVersion":"3"},"spec":{"template":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"t","uid":"x"}}},"status":{}}"#,
        );
        // Nested metadata before the real one.
        check(r#"{"spec":{"metadata":{"uid":"wrong"}},"apiVersion":"v1","kind":"K","metadata":{"uid":"right"}}"#);
        // Only one of apiVersion and kind.
        check(r#"{"kind":"Pod","metadata":{"uid":"u"},"spec":{}}"#);
        check(r#"{"apiVersion":"v1","metadata":{"uid":"u"},"spec":{}}"#);
        // null type fields do not count; no metadata at all.
        check(r#"{"apiVersion":null,"kind":"Pod","metadata":{"uid":"u"},"spec":{}}"#);
        check(r#"{"apiVersion":"v1","kind":"Pod","spec":{"metadata":{"uid":"no"}}}"#);
        check("{}");
        check(" { } ");
    }

    #[test]
    fn escaped_keys_and_values() {
        check(
            r#"{"api\u0056ersion":"v1","\u006bind":"Pod","meta\u0064ata":{"na\u006de":"a\"b\\c","uid":"\u00fc"},"spec":{}}"#,
        );
        check(
            r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"x\n\t\/y","annotations":{"a":"{\"metadata\":{}}"},"resourceVersion":"1"},"spec":{"k":"\"kind\":"}}"#,
        );
        check(r#"{"spec":{"s":"\"metadata\":{\"uid\":\"no\"}"},"metadata":{"uid":"yes"}}"#);
        check("{\n  \"apiVersion\" : \"v1\" ,\n  \"kind\":\"Pod\",\n  \"metadata\": {\"uid\":\"u\"}\n, \"spec\": {}}");
    }

    #[test]
    fn invalid_heads_are_errors() {
        let err = |t: &str| RawObject::from_raw(RawValue::from_string(t.to_string()).unwrap()).is_err();
        assert!(err(r#"[1,2]"#), "not an object");
        assert!(err(r#""x""#));
        assert!(err(r#"{"metadata":{"uid":1}}"#), "uid not a string");
        assert!(err(r#"{"metadata":{},"metadata":{}}"#), "duplicate metadata");
        assert!(err(r#"{"metadata":null,"kind":"K","apiVersion":"v1"}"#));

        let checked = |t: &[u8]| RawObject::from_json(Bytes::copy_from_slice(t)).map(|_| ()).map_err(|e| e.to_string());
        assert_eq!(checked(br#"{"metadata":{"uid":"u"}}"#), Ok(()));
        assert_eq!(checked(b"[1,2]").unwrap_err(), "object text is not a JSON object");
        assert!(checked(br#"{"metadata":{"uid":"u"}},"x":1}"#).unwrap_err().contains("expected the end of the text"));
        assert!(checked(br#"{"metadata":{"uid":"u"},"spec":{"a":[1}}"#).unwrap_err().contains("expected ']'"));
        assert!(checked(br#"{"metadata":{"uid":"u"},"spec":{"a":"x}}"#).unwrap_err().contains("closing the string"));
        assert_eq!(checked(b"{\"a\":\"\xff\"}").unwrap_err(), "object text is not UTF-8");
        assert!(checked(br#"{"metadata":{"uid":1}}"#).unwrap_err().starts_with("object head:"));
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;

    #[test]
    fn watch_events_and_lists_carry_raw_objects() {
        let line = r#"{"type":"ADDED","object":{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a","uid":"u","resourceVersion":"3"}}}"#;
        match serde_json::from_str::<kube::api::WatchEvent<RawObject>>(line).unwrap() {
            kube::api::WatchEvent::Added(o) => {
                assert!(o.has_type);
                assert_eq!(o.metadata.uid.as_deref(), Some("u"));
            }
            other => panic!("{other:?}"),
        }
        let list = r#"{"apiVersion":"v1","kind":"ConfigMapList","metadata":{"resourceVersion":"9"},"items":[{"metadata":{"name":"a","uid":"u","resourceVersion":"3"}}]}"#;
        let l: kube::api::ObjectList<RawObject> = serde_json::from_str(list).unwrap();
        assert_eq!(l.items.len(), 1);
        assert_eq!(l.metadata.resource_version.as_deref(), Some("9"));
    }
}
