//! The event's last form, as the sink asks for it: extensions added to every event (Knative's
//! `K_CE_OVERRIDES`), the event types and payload of Knative's ApiServerSource for existing
//! Triggers, and the structured form built ahead. Applied after shaping, once per event.
//!
//! ApiServerSource compatibility, read from Knative's adapter: `type`
//! `dev.knative.apiserver.{resource|ref}.{add|update|delete}`; `source` the apiserver's URL;
//! `subject` the old self-link form `/apis/{apiVersion}/namespaces/{namespace}/{kind}s/{name}`
//! (lower-case kind plus `s`, as Knative writes it, also for cluster-scoped objects);
//! extensions `kind`, `name`, `namespace`; data the object (`Resource`) or
//! `{"apiVersion","kind","name","namespace"}` (`Reference`). The `id` stays kubecast's (the
//! same id for the same change, not a random one), and so do `time` and kubecast's own
//! extensions.

use crate::model::{CloudEvent, ExtensionValue, Verb};
use crate::sink::http::Format;
use crate::sink::{SinkConfig, SinkType};

/// Which ApiServerSource mode the events imitate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KnativeMode {
    Resource,
    Reference,
}

/// What every event gets after shaping.
#[derive(Debug, Clone, Default)]
pub struct EventForm {
    /// Build the structured form once, now ([`CloudEvent::seal_structured`]).
    pub seal: bool,
    /// Extensions added to every event (names leaked once at start: a handful).
    pub extensions: Vec<(&'static str, ExtensionValue)>,
    /// ApiServerSource's events, with this `source` (the apiserver's URL).
    pub knative: Option<(KnativeMode, &'static str)>,
}

/// The object's identity, for the ApiServerSource form.
pub struct ObjectRef<'a> {
    pub api_version: &'a str,
    pub kind: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
}

impl EventForm {
    /// The form `sink` asks for; `seal` when it sends structured events.
    pub fn for_sink(sink: &SinkConfig, seal: bool) -> Self {
        let Some(http) = sink.http.as_ref().filter(|_| sink.kind == SinkType::Http) else {
            return Self::sealed(seal);
        };
        // Checked with the config (a bad value stops kubecast before this).
        let extensions = crate::sink::http::overrides_from_env().unwrap_or_default();
        let mode = match http.format {
            Format::Kubecast => None,
            Format::ApiserversourceResource => Some(KnativeMode::Resource),
            Format::ApiserversourceReference => Some(KnativeMode::Reference),
        };
        let source = crate::source::client::apiserver_url().unwrap_or("https://kubernetes.default.svc");
        Self { knative: mode.map(|m| (m, source)), ..Self::sealed(seal) }.with_extensions(extensions)
    }

    /// A form that only seals (or not).
    pub fn sealed(seal: bool) -> Self {
        Self { seal, ..Self::default() }
    }

    /// `extensions` as the sink's config gives them (JSON values already checked).
    pub fn with_extensions(mut self, extensions: Vec<(String, serde_json::Value)>) -> Self {
        self.extensions = extensions
            .into_iter()
            .map(|(name, value)| {
                let value = match value {
                    serde_json::Value::Bool(b) => ExtensionValue::Boolean(b),
                    serde_json::Value::Number(n) => ExtensionValue::Integer(n.as_i64().unwrap_or_default()),
                    serde_json::Value::String(s) => ExtensionValue::String(s),
                    other => ExtensionValue::String(other.to_string()),
                };
                (&*Box::leak(name.into_boxed_str()), value)
            })
            .collect();
        self
    }

    /// Whether events are changed at all (besides the seal).
    pub fn changes_events(&self) -> bool {
        !self.extensions.is_empty() || self.knative.is_some()
    }

    /// Gives `event` (of a change `verb` of `object`) its last form.
    pub fn apply(&self, verb: Verb, object: &ObjectRef<'_>, event: &mut CloudEvent) {
        if let Some((mode, source)) = self.knative {
            knative(mode, source, verb, object, event);
        }
        for (name, value) in &self.extensions {
            event.attributes.set_extension(name, value.clone());
        }
        if self.seal {
            event.seal_structured();
        }
    }
}

/// The ApiServerSource form of `event`.
fn knative(mode: KnativeMode, source: &'static str, verb: Verb, o: &ObjectRef<'_>, event: &mut CloudEvent) {
    let ty = match (mode, verb) {
        (KnativeMode::Resource, Verb::Added) => "dev.knative.apiserver.resource.add",
        (KnativeMode::Resource, Verb::Modified) => "dev.knative.apiserver.resource.update",
        (KnativeMode::Resource, Verb::Deleted) => "dev.knative.apiserver.resource.delete",
        (KnativeMode::Reference, Verb::Added) => "dev.knative.apiserver.ref.add",
        (KnativeMode::Reference, Verb::Modified) => "dev.knative.apiserver.ref.update",
        (KnativeMode::Reference, Verb::Deleted) => "dev.knative.apiserver.ref.delete",
    };
    let a = &mut event.attributes;
    a.set_type(ty);
    a.set_source(source);
    a.set_subject(self_link(o));
    a.set_extension("kind", o.kind.to_string());
    a.set_extension("name", o.name.to_string());
    a.set_extension("namespace", o.namespace.to_string());
    if mode == KnativeMode::Reference {
        let reference = serde_json::json!({
            "apiVersion": o.api_version,
            "kind": o.kind,
            "name": o.name,
            "namespace": o.namespace,
        });
        event.data = reference.to_string().into();
        event.attributes.set_datacontenttype("application/json");
    }
}

/// Knative's subject: `/apis/{apiVersion}/namespaces/{namespace}/{kind in lower case}s/{name}`,
/// with `/versionUnknown` after an apiVersion that has a group but no version.
fn self_link(o: &ObjectRef<'_>) -> String {
    let version = if o.api_version.contains('.') && !o.api_version.contains('/') {
        format!("{}/versionUnknown", o.api_version)
    } else {
        o.api_version.to_string()
    };
    format!("/apis/{version}/namespaces/{}/{}s/{}", o.namespace, o.kind.to_lowercase(), o.name)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::api::{ApiResource, GroupVersionKind};

    use super::*;
    use crate::model::{Change, EventSource, Origin, RawObject};

    fn event(verb: Verb) -> CloudEvent {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("apps", "v1", "Deployment"), "deployments");
        let object: RawObject = serde_json::from_str(
            r#"{"apiVersion":"apps/v1","kind":"Deployment","metadata":{"name":"web","namespace":"shop","uid":"u1","resourceVersion":"7"}}"#,
        )
        .unwrap();
        Change { verb, origin: Origin::Watch, object, source: Arc::new(EventSource::new("c", &ar)) }
            .into_cloudevent()
            .unwrap()
    }

    const WEB: ObjectRef<'static> =
        ObjectRef { api_version: "apps/v1", kind: "Deployment", namespace: "shop", name: "web" };

    #[test]
    fn apiserversource_resource_form() {
        let mut e = event(Verb::Modified);
        let (id, data) = (e.id().to_string(), e.data.clone());
        let form = EventForm { knative: Some((KnativeMode::Resource, "https://10.96.0.1:443")), ..Default::default() };
        form.apply(Verb::Modified, &WEB, &mut e);
        let sdk = e.attributes.to_sdk();
        use cloudevents::AttributesReader;
        assert_eq!(sdk.ty(), "dev.knative.apiserver.resource.update");
        assert_eq!(sdk.source().to_string(), "https://10.96.0.1:443");
        assert_eq!(sdk.subject(), Some("/apis/apps/v1/namespaces/shop/deployments/web"));
        assert_eq!(e.id(), id, "kubecast's id: the same change, the same id");
        assert_eq!(e.data, data, "Resource mode: the object");
        assert_eq!(e.attributes.extension("kind").map(|v| v.text().into_owned()).as_deref(), Some("Deployment"));
        assert_eq!(e.attributes.extension("namespace").map(|v| v.text().into_owned()).as_deref(), Some("shop"));
    }

    #[test]
    fn apiserversource_reference_form_and_overrides() {
        let mut e = event(Verb::Deleted);
        let form = EventForm { knative: Some((KnativeMode::Reference, "https://k:6443")), ..EventForm::sealed(true) }
            .with_extensions(vec![("team".into(), serde_json::json!("a")), ("prio".into(), serde_json::json!(2))]);
        form.apply(Verb::Deleted, &WEB, &mut e);
        assert_eq!(e.attributes.ty(), "dev.knative.apiserver.ref.delete");
        let data: serde_json::Value = serde_json::from_str(&e.data).unwrap();
        assert_eq!(
            data,
            serde_json::json!({"apiVersion":"apps/v1","kind":"Deployment","name":"web","namespace":"shop"})
        );
        assert!(e.sealed().is_some(), "sealed after the last change");
        let whole: serde_json::Value = serde_json::from_slice(&e.to_structured()).unwrap();
        assert_eq!(whole["team"], "a");
        assert_eq!(whole["prio"], 2);
        assert_eq!(whole["data"]["kind"], "Deployment");
    }

    #[test]
    fn self_links_as_knative_writes_them() {
        let core = ObjectRef { api_version: "v1", kind: "Pod", namespace: "default", name: "p" };
        assert_eq!(self_link(&core), "/apis/v1/namespaces/default/pods/p");
        let no_version = ObjectRef { api_version: "serving.knative.dev", kind: "Revision", namespace: "n", name: "r" };
        assert_eq!(self_link(&no_version), "/apis/serving.knative.dev/versionUnknown/namespaces/n/revisions/r");
        let cluster = ObjectRef { api_version: "v1", kind: "Namespace", namespace: "", name: "shop" };
        assert_eq!(self_link(&cluster), "/apis/v1/namespaces//namespaces/shop");
    }
}
