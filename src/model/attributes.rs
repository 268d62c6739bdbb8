//! The attributes of a kubecast CloudEvent, in two allocations per event.

use std::borrow::Cow;

use chrono::{DateTime, Utc};
pub use cloudevents::event::ExtensionValue;

use super::verb::Origin;

/// The attributes of a kubecast CloudEvent (spec 1.0), in two allocations per event.
///
/// Not the cloudevents-sdk `Event`: that one holds every attribute and extension in a `String`
/// of its own and the extensions in a `HashMap` with `String` keys, 12 allocations per event
/// (built by the reflector's thread, freed by the queue's: each free then a cache miss). Here
/// the id's text holds `partitionkey` and `resourceversion` too, `source` and
/// `type` are per resource type (interned), `origin` and `datacontenttype` are constants, and
/// further extensions (shaping, trace context: not on every event) sit in a short list. The
/// SDK stays the reference: [`Attributes::to_sdk`], and a test checks that the structured JSON
/// is the SDK's.
#[derive(Debug, Clone, PartialEq)]
pub struct Attributes {
    /// The id, then (for deletes only) the resourceVersion: `{uid}:{rv}:{verb}`, or
    /// `{uid}:deleted` followed by `{rv}`.
    text: String,
    id_len: usize,
    uid_len: usize,
    rv_at: usize,
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
        &self.text[..self.id_len]
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

    /// Replaces `type` (a sink's compatibility form; interned, a handful per process).
    pub fn set_type(&mut self, ty: &'static str) {
        self.ty = ty;
    }

    /// Replaces `source` (a sink's compatibility form).
    pub fn set_source(&mut self, source: &'static str) {
        self.source = source;
    }

    /// Replaces `subject` (a sink's compatibility form).
    pub fn set_subject(&mut self, subject: String) {
        self.subject = subject;
    }

    pub fn set_datacontenttype(&mut self, content_type: &'static str) {
        self.datacontenttype = content_type;
    }

    /// How the change was observed (the `origin` extension).
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// The object's uid (the `partitionkey` extension).
    pub fn partition_key(&self) -> &str {
        &self.text[..self.uid_len]
    }

    /// The object's resourceVersion (the `resourceversion` extension).
    pub fn resource_version(&self) -> &str {
        &self.text[self.rv_at..self.rv_at + self.rv_len]
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
            ("id", AttributeValue::Str(self.id())),
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
            .id(self.id().to_string())
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

impl Attributes {
    /// The attributes of a change: `id` = `{uid}:{rv}:{verb}`, `time` now, no further
    /// extensions.
    /// `delete_once`: a delete's id leaves the resourceVersion out (see [`super::EventSource`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        uid: &str,
        rv: &str,
        verb: &str,
        delete_once: bool,
        source: &'static str,
        ty: &'static str,
        subject: String,
        origin: Origin,
    ) -> Self {
        // An object is deleted once: a delete's id does not depend on which resourceVersion
        // the path that saw it knew (the watch's deletion or a relist's last known one).
        let (text, id_len, rv_at) = if delete_once && verb == "deleted" {
            let text = [uid, ":deleted", rv].concat();
            let id_len = uid.len() + ":deleted".len();
            (text, id_len, id_len)
        } else {
            let text = [uid, ":", rv, ":", verb].concat();
            let len = text.len();
            (text, len, uid.len() + 1)
        };
        Attributes {
            text,
            id_len,
            uid_len: uid.len(),
            rv_at,
            rv_len: rv.len(),
            source,
            ty,
            subject,
            time: Utc::now(),
            datacontenttype: "application/json",
            origin,
            others: Vec::new(),
        }
    }
}
