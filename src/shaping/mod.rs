//! Event shaping, per `[[resources]]` entry, between the reflector and the outbound queue:
//! what leaves the cluster and which events are worth sending.
//!
//! For each change, in this order:
//! 1. **Safe payload**: `metadata.managedFields` and the
//!    `kubectl.kubernetes.io/last-applied-configuration` annotation are dropped (unless
//!    `keep_managed_fields`; the annotation is dropped from Secrets anyway, as it holds their
//!    data).
//! 2. **Change detection** (`ignore_status_only`): a hash of the object without `status`,
//!    `metadata.resourceVersion`, `metadata.generation`, `metadata.managedFields` and the
//!    `ignore_fields` is kept per object (8 bytes + the map entry, no object); a `modified`
//!    event whose hash did not change is dropped.
//! 3. **Redaction**: Secret `data` / `stringData` values (unless `redact_secrets = false`) and
//!    the `redact` field paths become `"<redacted>"`; keys stay.
//! 4. **Previous object** (`keep_previous`): the shaped object is kept per uid, for CEL's
//!    `oldObject` and the `patch` payload.
//! 5. **Filter**: the `events` verbs, then the CEL `filter` (sees the shaped object).
//! 6. **Payload**: `full`, `metadata` or `patch`; then `max_event_bytes`.
//!
//! Dropped events are still acknowledged, so they advance the checkpoint like delivered ones.
//! The fast path (no option but the default managedFields removal) edits only the metadata's
//! text and never decodes the rest of the object.

pub(crate) mod filter;
pub mod form;
pub(crate) mod json;
mod options;
pub(crate) mod stage;

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

use crate::model::ExtensionValue;
use serde_json::Value;
use serde_json::value::RawValue;
use tracing::{error, warn};

use crate::model::{CloudEvent, Origin, Verb};
use filter::Filter;
use json::FieldPath;
pub use options::{FilterErrorRule, PayloadMode, ShapingOptions};

pub const REDACTED: &str = "<redacted>";
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";
const PATCH_CONTENT_TYPE: &str = "application/json-patch+json";

/// Why a change produced no event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dropped {
    Verb,
    StatusOnly,
    Filter,
    Unreadable,
}

impl Dropped {
    /// The `reason` label of `kubecast_events_filtered_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Dropped::Verb => "verb",
            Dropped::StatusOnly => "status_only",
            Dropped::Filter => "filter",
            Dropped::Unreadable => "unreadable",
        }
    }
}

/// The shaping of one `[[resources]]` entry, with its per-object state.
pub struct Shaper {
    filter: Option<Filter>,
    filter_error: FilterErrorRule,
    keep_managed_fields: bool,
    is_secret: bool,
    redact_secret_data: bool,
    redact: Vec<FieldPath>,
    max_event_bytes: usize,
    ignore_status_only: bool,
    skip: Vec<FieldPath>,
    keep_previous: bool,
    payload: PayloadMode,
    /// uid hash -> hash of the object's significant content (`ignore_status_only`).
    hashes: HashMap<u64, u64>,
    /// uid -> the shaped object's JSON (`keep_previous`).
    previous: HashMap<String, Box<[u8]>>,
    /// uid -> digest of each Secret value (`payload = "patch"` on Secrets): which keys changed,
    /// when both sides of the patch are redacted. Keyed with a random seed of this process;
    /// held in memory only, never sent.
    secret_digests: HashMap<String, Vec<(String, u64)>>,
    digest_seed: foldhash::quality::RandomState,
    describe: String,
    /// The verbs that are sent.
    events: Vec<Verb>,
    /// Run-time filter errors (`kubecast_filter_errors_total`).
    filter_errors: prometheus_client::metrics::counter::Counter,
}

impl Shaper {
    pub fn new(r: &ShapingOptions) -> Shaper {
        let group = r.group.as_str();
        let is_secret = group.is_empty() && r.kind == "Secret";
        if is_secret && !r.redact_secrets {
            warn!(resource = %r.describe, "redact_secrets = false: Secret values leave the cluster in events");
        }
        let mut skip: Vec<FieldPath> =
            ["status", "metadata.resourceVersion", "metadata.generation", "metadata.managedFields"]
                .iter()
                .map(|p| FieldPath::parse(p).expect("valid"))
                .collect();
        skip.extend(r.ignore_fields.iter().map(|p| FieldPath::parse(p).expect("validated")));
        Shaper {
            filter: r.filter.as_deref().map(|f| Filter::compile(f, r.keep_previous).expect("validated")),
            filter_error: r.filter_error,
            keep_managed_fields: r.keep_managed_fields,
            is_secret,
            redact_secret_data: is_secret && r.redact_secrets,
            redact: r.redact.iter().map(|p| FieldPath::parse(p).expect("validated")).collect(),
            max_event_bytes: usize::try_from(r.max_event_bytes).unwrap_or(usize::MAX),
            ignore_status_only: r.ignore_status_only,
            skip,
            keep_previous: r.keep_previous,
            payload: r.payload,
            hashes: HashMap::new(),
            previous: HashMap::new(),
            secret_digests: HashMap::new(),
            digest_seed: foldhash::quality::RandomState::default(),
            describe: r.describe.clone(),
            events: r.events.clone(),
            filter_errors: crate::observe::metrics::get()
                .filter_errors
                .get_or_create(&crate::observe::metrics::resource(group, &r.kind))
                .clone(),
        }
    }

    /// Whether `events` lists `verb` (else its changes are not sent).
    pub fn wants(&self, verb: Verb) -> bool {
        self.events.contains(&verb)
    }

    /// Whether changes of unwanted verbs must still be seen (to keep per-object state).
    pub fn keeps_state(&self) -> bool {
        self.ignore_status_only || self.keep_previous
    }

    /// Whether the whole object must be decoded (else shaping works on its text).
    fn needs_value(&self) -> bool {
        self.redact_secret_data
            || self.is_secret
            || !self.redact.is_empty()
            || self.keep_previous
            || self.payload != PayloadMode::Full
    }

    /// Shapes `event` (the change of object `uid`) in place; `Err` when it is not to be sent.
    /// `wanted`: whether `events` lists its verb (state is kept either way).
    pub fn apply(&mut self, verb: Verb, uid: &str, wanted: bool, event: &mut CloudEvent) -> Result<(), Dropped> {
        if !self.needs_value() {
            return self.apply_on_text(verb, uid, wanted, event);
        }
        let mut v: Value = match serde_json::from_str(&event.data) {
            Ok(v) => v,
            Err(e) => {
                // Not possible with an apiserver's JSON; never send what could not be redacted.
                error!(resource = %self.describe, event_id = event.id(), error = %e, "object is not JSON; event dropped");
                return Err(Dropped::Unreadable);
            }
        };
        if let Some(meta) = v.get_mut("metadata").and_then(Value::as_object_mut) {
            if !self.keep_managed_fields {
                meta.remove("managedFields");
            }
            if !self.keep_managed_fields || self.redact_secret_data {
                let now_empty = meta.get_mut("annotations").and_then(Value::as_object_mut).is_some_and(|a| {
                    a.remove(LAST_APPLIED);
                    a.is_empty()
                });
                if now_empty {
                    meta.remove("annotations");
                }
            }
        }
        let unchanged = self.ignore_status_only && self.note_hash(verb, uid, |skip| json::hash_skipping(&v, skip));
        let changed_secret_keys = self.note_secret_digests(verb, uid, &v);
        if self.redact_secret_data {
            for field in ["data", "stringData"] {
                if let Some(m) = v.get_mut(field).and_then(Value::as_object_mut) {
                    for value in m.values_mut() {
                        *value = Value::String(REDACTED.into());
                    }
                }
            }
        }
        let redacted = Value::String(REDACTED.into());
        for p in &self.redact {
            json::redact(&mut v, &p.0, &redacted);
        }
        let old: Option<Value> = if self.keep_previous {
            let old = self.previous.get(uid).and_then(|b| serde_json::from_slice(b).ok());
            match verb {
                Verb::Deleted => {
                    self.previous.remove(uid);
                }
                Verb::Added | Verb::Modified => {
                    let bytes = serde_json::to_vec(&v).expect("a Value serialises");
                    self.previous.insert(uid.to_string(), bytes.into_boxed_slice());
                }
            }
            old
        } else {
            None
        };
        if !wanted {
            return Err(Dropped::Verb);
        }
        if unchanged && verb == Verb::Modified {
            return Err(Dropped::StatusOnly);
        }
        if let Some(f) = self.filter.as_ref().filter(|_| judged_by_filter(verb, event)) {
            let result = f.eval(&v, old.as_ref(), verb.as_str());
            self.filtered(result, event.id())?;
        }
        let fallback = (self.max_event_bytes > 0).then(|| metadata_only(&v));
        let (data, mode) = match (self.payload, verb, old) {
            (PayloadMode::Metadata, _, _) => (metadata_only(&v), PayloadMode::Metadata),
            (PayloadMode::Patch, Verb::Modified, Some(old)) => {
                let mut patch = json_patch::diff(&old, &v);
                // Both sides redacted: a changed value would not show. Its key does.
                for path in changed_secret_keys {
                    let op = json_patch::PatchOperation::Replace(json_patch::ReplaceOperation {
                        path: json_patch::jsonptr::PointerBuf::parse(&path).expect("built from tokens"),
                        value: Value::String(REDACTED.into()),
                    });
                    if !patch.0.contains(&op) {
                        patch.0.push(op);
                    }
                }
                (serde_json::to_value(patch).expect("a patch serialises"), PayloadMode::Patch)
            }
            _ => (v, PayloadMode::Full),
        };
        event.data = serde_json::to_string(&data).expect("a Value serialises").into();
        if mode == PayloadMode::Patch {
            event.attributes.set_datacontenttype(PATCH_CONTENT_TYPE);
        }
        if self.payload != PayloadMode::Full {
            event.attributes.set_extension("payload", ExtensionValue::String(mode.as_str().into()));
        }
        self.cap(event, fallback);
        Ok(())
    }

    /// The text path: the default removals, change detection and the filter without decoding
    /// more of the object than they read.
    fn apply_on_text(&mut self, verb: Verb, uid: &str, wanted: bool, event: &mut CloudEvent) -> Result<(), Dropped> {
        if !wanted && !self.ignore_status_only {
            return Err(Dropped::Verb);
        }
        // UTF-8 by the data's type (checked once, when the object was read).
        let data = event.data.clone();
        let text: &str = &data;
        let stripped = if self.keep_managed_fields { None } else { strip_noise(text) };
        let text = stripped.as_deref().unwrap_or(text);
        let unchanged = self.ignore_status_only && self.note_hash(verb, uid, |skip| json::text_hash(text, skip));
        if !wanted {
            return Err(Dropped::Verb);
        }
        if unchanged && verb == Verb::Modified {
            return Err(Dropped::StatusOnly);
        }
        if let Some(f) = self.filter.as_ref().filter(|_| judged_by_filter(verb, event)) {
            let result = f.eval_text(text, verb.as_str());
            self.filtered(result, event.id())?;
        }
        if let Some(stripped) = stripped {
            event.data = stripped.into();
        }
        self.cap(event, None);
        Ok(())
    }

    /// `payload = "patch"` on redacted Secrets: records a digest of each value of the object
    /// and returns the JSON pointers (`/data/password`) of the values a `modified` change
    /// changed, of keys present before and after (added and removed keys show in the patch).
    fn note_secret_digests(&mut self, verb: Verb, uid: &str, v: &Value) -> Vec<String> {
        if !(self.redact_secret_data && self.payload == PayloadMode::Patch) {
            return Vec::new();
        }
        if verb == Verb::Deleted {
            self.secret_digests.remove(uid);
            return Vec::new();
        }
        let mut now = Vec::new();
        for field in ["data", "stringData"] {
            if let Some(m) = v.get(field).and_then(Value::as_object) {
                for (key, value) in m {
                    let token = key.replace('~', "~0").replace('/', "~1");
                    now.push((format!("/{field}/{token}"), self.digest_seed.hash_one(value.to_string())));
                }
            }
        }
        let before = self.secret_digests.insert(uid.to_string(), now.clone());
        match (verb, before) {
            (Verb::Modified, Some(before)) => now
                .into_iter()
                .filter(|(path, digest)| before.iter().any(|(p, d)| p == path && d != digest))
                .map(|(path, _)| path)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Records the object's content hash (`ignore_status_only`); whether a `modified` change
    /// left it as it was.
    fn note_hash(&mut self, verb: Verb, uid: &str, hash: impl FnOnce(&[FieldPath]) -> u64) -> bool {
        let key = uid_key(uid);
        match verb {
            Verb::Deleted => {
                self.hashes.remove(&key);
                false
            }
            Verb::Added => {
                let h = hash(&self.skip);
                self.hashes.insert(key, h);
                false
            }
            Verb::Modified => {
                let h = hash(&self.skip);
                self.hashes.insert(key, h) == Some(h)
            }
        }
    }

    /// The filter's verdict, with the run-time error rule.
    fn filtered(&mut self, result: Result<bool, filter::EvalError>, event_id: &str) -> Result<(), Dropped> {
        match result {
            Ok(true) => Ok(()),
            Ok(false) => Err(Dropped::Filter),
            Err(e) => {
                self.filter_errors.inc();
                let source = self.filter.as_ref().map_or("", |f| f.source());
                warn!(
                    resource = %self.describe, event_id, filter = source, error = %e,
                    rule = ?self.filter_error, "filter failed on this object; handled by filter_error"
                );
                match self.filter_error {
                    FilterErrorRule::Drop => Err(Dropped::Filter),
                    FilterErrorRule::Deliver => Ok(()),
                }
            }
        }
    }

    /// `max_event_bytes`: an event whose structured form is larger falls back to the metadata
    /// payload, with the extension `truncated = true`.
    /// `fallback`: the metadata payload of the shaped object (else taken from the data).
    fn cap(&self, event: &mut CloudEvent, fallback: Option<Value>) {
        if self.max_event_bytes == 0 || event.structured_len() <= self.max_event_bytes {
            return;
        }
        let meta = fallback
            .unwrap_or_else(|| metadata_only(&serde_json::from_str::<Value>(&event.data).unwrap_or(Value::Null)));
        event.data = serde_json::to_string(&meta).expect("a Value serialises").into();
        event.attributes.set_datacontenttype("application/json");
        if self.payload != PayloadMode::Full {
            event.attributes.set_extension("payload", ExtensionValue::String(PayloadMode::Metadata.as_str().into()));
        }
        event.attributes.set_extension("truncated", ExtensionValue::Boolean(true));
    }
}

/// Whether the CEL `filter` decides on this event. Not for a resync delete (an object deleted
/// while kubecast was not watching, found missing by a relist): it carries only the object's
/// name, namespace, uid and resourceVersion, so a filter reading anything else would drop it
/// by accident and the delete would be lost for good. Only `events` can exclude it.
fn judged_by_filter(verb: Verb, event: &CloudEvent) -> bool {
    !(verb == Verb::Deleted && event.attributes.origin() == Origin::Resync)
}

fn uid_key(uid: &str) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    uid.hash(&mut h);
    h.finish()
}

/// `{"apiVersion", "kind", "metadata"}` of an object.
fn metadata_only(v: &Value) -> Value {
    let mut out = serde_json::Map::new();
    for k in ["apiVersion", "kind", "metadata"] {
        if let Some(x) = v.get(k) {
            out.insert(k.to_string(), x.clone());
        }
    }
    Value::Object(out)
}

/// The fast path of the default removals: when the object has managedFields or the
/// last-applied annotation, the object's text with them cut out of its metadata; the rest of
/// the text is copied as it is, never decoded. `None`: nothing to remove. Only the metadata's
/// text is searched for the two names (members before it are skipped, not searched).
pub fn strip_noise(text: &str) -> Option<String> {
    let meta = json::top_level(text, "metadata")?;
    let mtext = meta.get();
    if !mtext.contains("\"managedFields\"") && !mtext.contains(LAST_APPLIED) {
        return None;
    }
    let annotations_text: String;
    let new_annotations: Box<RawValue>;
    let mut entries = json::entries(mtext).ok()?;
    let before = entries.len();
    entries.retain(|(k, _)| k != "managedFields");
    let mut changed = entries.len() != before;
    if let Some(pos) = entries.iter().position(|(k, _)| k == "annotations")
        && entries[pos].1.get().contains(LAST_APPLIED)
    {
        let mut a = json::entries(entries[pos].1.get()).ok()?;
        a.retain(|(k, _)| k != LAST_APPLIED);
        changed = true;
        if a.is_empty() {
            entries.remove(pos);
        } else {
            let mut buf = Vec::new();
            json::write_object(&mut buf, &a);
            annotations_text = String::from_utf8(buf).ok()?;
            new_annotations = RawValue::from_string(annotations_text).ok()?;
            entries[pos].1 = &new_annotations;
        }
    }
    if !changed {
        return None;
    }
    let mut metadata = Vec::with_capacity(mtext.len());
    json::write_object(&mut metadata, &entries);
    let start = json::offset_in(text, mtext);
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..start]);
    // Only the rewritten metadata is checked again, not the whole object.
    out.push_str(std::str::from_utf8(&metadata).ok()?);
    out.push_str(&text[start + mtext.len()..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_drop_reason_has_a_metric() {
        for d in [Dropped::Verb, Dropped::StatusOnly, Dropped::Filter, Dropped::Unreadable] {
            assert!(crate::observe::metrics::FILTER_REASONS.contains(&d.as_str()), "{d:?}");
        }
    }

    #[test]
    fn strip_noise_cuts_only_the_noise() {
        let obj = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "annotations": {LAST_APPLIED: "{\"data\":1}", "keep": "me"},
                         "managedFields": [{"manager": "kubectl"}]},
            "data": {"k": "v \"managedFields\""}});
        let text = serde_json::to_vec(&obj).unwrap();
        let out: Value = serde_json::from_str(&strip_noise(std::str::from_utf8(&text).unwrap()).unwrap()).unwrap();
        assert_eq!(
            out,
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "annotations": {"keep": "me"}},
                   "data": {"k": "v \"managedFields\""}})
        );
        let only_last_applied = json!({"metadata": {"name": "a", "annotations": {LAST_APPLIED: "x"}}, "spec": {}});
        let out: Value =
            serde_json::from_str(&strip_noise(&serde_json::to_string(&only_last_applied).unwrap()).unwrap()).unwrap();
        assert_eq!(out, json!({"metadata": {"name": "a"}, "spec": {}}));
        // Mentioned elsewhere only: nothing to do.
        let clean = serde_json::to_string(&json!({"metadata": {"name": "a"}, "data": {"managedFields": "x"}})).unwrap();
        assert!(strip_noise(&clean).is_none());
    }
}
