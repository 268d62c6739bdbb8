//! [`RawObject`]: a Kubernetes object as kubecast handles it: the few metadata fields it needs
//! (uid, name, namespace, resourceVersion) decoded, the whole object kept as the JSON text the
//! apiserver sent. Nothing else is decoded or re-encoded: the event's data is that text.

use std::borrow::Cow;

use kube::api::{ApiResource, ObjectMeta};
use kube::core::DynamicResourceScope;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

#[derive(Clone, Debug)]
pub struct RawObject {
    /// Only `uid`, `name`, `namespace` and `resource_version` are set.
    pub metadata: ObjectMeta,
    /// Whether the JSON has `apiVersion` and `kind` (list items do not).
    pub has_type: bool,
    pub raw: Box<RawValue>,
}

/// The part of an object that is decoded; every other field is skipped by the parser.
#[derive(Deserialize)]
struct Head {
    #[serde(rename = "apiVersion")]
    api_version: Option<IgnoredAny>,
    kind: Option<IgnoredAny>,
    #[serde(default)]
    metadata: MiniMeta,
}

type IgnoredAny = serde::de::IgnoredAny;

#[derive(Deserialize, Default)]
struct MiniMeta {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

impl RawObject {
    pub fn from_raw(raw: Box<RawValue>) -> Result<Self, serde_json::Error> {
        let head: Head = serde_json::from_str(raw.get())?;
        let m = head.metadata;
        Ok(Self {
            metadata: ObjectMeta {
                name: m.name,
                namespace: m.namespace,
                uid: m.uid,
                resource_version: m.resource_version,
                ..ObjectMeta::default()
            },
            has_type: head.api_version.is_some() && head.kind.is_some(),
            raw,
        })
    }

    pub fn from_value(v: &serde_json::Value) -> Result<Self, serde_json::Error> {
        Self::from_raw(RawValue::from_string(serde_json::to_string(v)?)?)
    }

    /// The object's JSON, with `apiVersion` and `kind` added when it came without them (as
    /// items of a list do), so that every payload describes itself.
    pub fn into_json_bytes(self, ar: &ApiResource) -> Vec<u8> {
        if self.has_type {
            // No copy: the text the apiserver sent becomes the data.
            let text: Box<str> = self.raw.into();
            return text.into_boxed_bytes().into_vec();
        }
        let text = self.raw.get().as_bytes();
        let rest = text.strip_prefix(b"{").unwrap_or(text);
        let mut out = Vec::with_capacity(text.len() + 64);
        out.extend_from_slice(b"{\"apiVersion\":");
        serde_json::to_writer(&mut out, &ar.api_version).expect("string serialises");
        out.extend_from_slice(b",\"kind\":");
        serde_json::to_writer(&mut out, &ar.kind).expect("string serialises");
        if rest.iter().any(|b| !b.is_ascii_whitespace() && *b != b'}') {
            out.push(b',');
        }
        out.extend_from_slice(rest);
        out
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
        self.raw.serialize(s)
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
        let v: serde_json::Value = serde_json::from_slice(&o.clone().into_json_bytes(&ar)).unwrap();
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["kind"], "ConfigMap");
        assert_eq!(v["data"]["k"], "v");
        assert_eq!(v["metadata"]["labels"]["x"], "y");

        let typed: RawObject =
            serde_json::from_str(r#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"}}"#).unwrap();
        assert!(typed.has_type);
        assert_eq!(typed.into_json_bytes(&ar), br#"{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"a"}}"#);
        let empty: RawObject = serde_json::from_str("{}").unwrap();
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&empty.into_json_bytes(&ar)).unwrap()["kind"],
            "ConfigMap"
        );
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
