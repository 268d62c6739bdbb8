//! What a stream is asked to watch ([`StreamSpec`] and its `initial` and `missing_kind`
//! options), what it emits ([`Item`]) and how it fails ([`ReflectorError`]).

use std::sync::Arc;

use kube::Client;
use kube::api::GroupVersionKind;
use serde::{Deserialize, Serialize};

use crate::model::{Change, Effect, Shard, SharedIndex};
use crate::observe::health::Health;
use crate::source::client::ApiLimiter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
/// `initial`: what a stream without a checkpoint emits first: every existing object once
/// (`snapshot`), or only the changes from then on (`now`).
pub enum Initial {
    #[default]
    Snapshot,
    Now,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
/// `missing_kind`: a kind that is not served (CRD not installed yet) is waited for (`wait`),
/// or stops kubecast (`fail`).
pub enum MissingKind {
    #[default]
    Wait,
    Fail,
}

/// What one stream watches.
#[derive(Clone)]
pub struct StreamSpec {
    /// Index of the stream in the pipeline; carried by every item.
    pub id: usize,
    /// Human-readable, e.g. `v1 ConfigMap in namespace shop`.
    pub name: String,
    /// `[[resources]]` index, for messages.
    pub resource_index: usize,
    pub cluster: String,
    pub client: Client,
    pub limiter: ApiLimiter,
    pub gvk: GroupVersionKind,
    /// `None`: cluster-wide.
    pub namespace: Option<String>,
    pub label_selector: String,
    pub field_selector: String,
    pub page_size: u32,
    /// Server-side timeout of each watch request (`timeoutSeconds`).
    pub watch_timeout_seconds: u32,
    pub initial: Initial,
    pub missing_kind: MissingKind,
    /// Try streaming lists first (falling back to paginated lists when rejected).
    pub streaming_lists: bool,
    /// Where the stream reports its phase for readiness.
    pub health: Arc<Health>,
    /// The shard of the stream's objects it runs (`[coordination] shards`); `None`: all.
    pub shard: Option<Shard>,
}

/// Where a stream starts: its loaded position, the index held by its watermark.
#[derive(Debug, Default)]
pub struct Start {
    /// Where its watch resumes; `None`: it lists first.
    pub resume: Option<String>,
    /// Changes after `resume` delivered and acknowledged before a restart (see `Position`).
    pub acked_ahead: Vec<(String, String)>,
    /// The acknowledged index (the watermark's), which the reflector reads under its own
    /// changes not acknowledged yet (`view.rs`).
    pub index: SharedIndex,
    /// The first list emits every object, whatever `initial` says (`kubecast state reset
    /// --to snapshot`).
    pub snapshot: bool,
    /// `index` was adopted from another shard count's state (no `resume`): the first list is a
    /// relist-diff against it, as after 410 Gone, never a snapshot.
    pub relist: bool,
    /// Resumed from another shard count's positions: per old shard, the resourceVersion up
    /// to which its objects' changes were delivered (see `Position::floors`).
    pub floors: Vec<(crate::model::Shard, u64)>,
}

/// One unit the reflector hands to the pipeline. `change` is `None` for items that only
/// change the checkpoint (bookmarks, end of a list, the objects of an `initial = "now"`
/// list).
#[derive(Debug)]
pub struct Item {
    pub stream: usize,
    pub seq: u64,
    pub effect: Effect,
    pub change: Option<Change>,
    /// The change was delivered before a restart (`acked_ahead`): it is not sent again, but
    /// shaping sees it, so its per-object state (`ignore_status_only`, `keep_previous`) is
    /// the object's latest, not a version from before it.
    pub delivered_before: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReflectorError {
    #[error(
        "resources[{index}] ({stream}): forbidden: {message} (fix: grant get, list and watch on {resource} to kubecast's identity)"
    )]
    Forbidden { index: usize, stream: String, resource: String, message: String },
    #[error("resources[{index}] ({stream}): {message}")]
    Kind { index: usize, stream: String, message: String },
    #[error(
        "resources[{index}] ({stream}): the apiserver refuses the selector: {message} (fix: correct resources[{index}].field_selector or label_selector; field selectors take metadata.name, metadata.namespace and the fields the kind itself supports, e.g. status.phase or spec.nodeName for Pods)"
    )]
    Selector { index: usize, stream: String, message: String },
}

impl StreamSpec {
    /// `e` as a fatal error when it is the apiserver refusing this stream's selector (400 on a
    /// stream that has one; the apiserver names the field label or the requirement it cannot
    /// take): no retry would be answered differently.
    pub(super) fn refused_selector(&self, e: &kube::Error) -> Option<ReflectorError> {
        let kube::Error::Api(s) = e else { return None };
        let (label, field) = self.selectors();
        let about_selector = about_users_selector(&s.message);
        (s.code == 400 && (label.is_some() || field.is_some()) && about_selector).then(|| ReflectorError::Selector {
            index: self.resource_index,
            stream: self.name.clone(),
            message: s.message.clone(),
        })
    }

    /// The label and field selectors as the list and the watch requests take them (`None`:
    /// not set): both requests select the same objects.
    pub(super) fn selectors(&self) -> (Option<String>, Option<String>) {
        let set = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        (set(&self.label_selector), set(&self.field_selector))
    }
}

/// Whether an apiserver's 400 `message` is about a label or field selector (names a field
/// label, a selector or a requirement it cannot parse), and not about the shard selector,
/// which is kubecast's own and not the user's to correct.
fn about_users_selector(message: &str) -> bool {
    let message = message.to_ascii_lowercase();
    !message.contains("shardselector")
        && ["field label", "selector", "unable to parse requirement"].iter().any(|m| message.contains(m))
}

#[cfg(test)]
mod tests {
    use super::about_users_selector;

    #[test]
    fn a_refused_shard_selector_is_not_the_user_s_selector() {
        assert!(about_users_selector("\"spec.nope\" is not a known field selector: field label not supported"));
        assert!(about_users_selector("unable to parse requirement: values[0][app]: Invalid value"));
        assert!(!about_users_selector("invalid shardSelector: shardRange(object.metadata.uid, '0x0', '0x8'): bad"));
        assert!(!about_users_selector("the server could not find the requested resource"));
    }
}
