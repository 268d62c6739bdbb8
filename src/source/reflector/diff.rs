//! The reflector's decisions, as pure functions (no I/O, no channel, no clock): what a listed
//! object, the end of a list and a watch event emit, given the index of delivered objects
//! (the [`IndexView`]: what the index holds after every emitted item). The index changes
//! with the items themselves: emitting one records its change in the view (`state.rs`). The
//! reflector (`list.rs`, `watching.rs`) does the I/O around them.

use std::collections::HashSet;

use kube::api::{ApiResource, ObjectMeta};

use super::view::IndexView;
use crate::model::{Effect, IndexEntry, IndexOp, RawObject, Verb};

/// An object's uid and what the index keeps of it; `None` for an object without uid, name or
/// resourceVersion (it cannot be tracked).
pub(super) fn index_entry(meta: &ObjectMeta) -> Option<(String, IndexEntry)> {
    Some((
        meta.uid.clone().filter(|u| !u.is_empty())?,
        IndexEntry {
            namespace: meta.namespace.clone().filter(|n| !n.is_empty()),
            name: meta.name.clone()?,
            resource_version: meta.resource_version.clone().filter(|r| !r.is_empty())?,
        },
    ))
}

/// One listed object against the index: `None` when the index has it at this resourceVersion
/// (unchanged: nothing to emit); otherwise `added` (a new uid) or `modified` (another
/// resourceVersion), to be emitted with `Effect::Diffed(IndexOp::Upsert(uid, entry))`.
/// The objects of the index a completed list did not contain were deleted while the stream
/// was not watching: [`IndexView::absent_from`] the list's uids.
pub(super) fn listed(index: &IndexView, uid: &str, entry: &IndexEntry) -> Option<Verb> {
    index.with(uid, |known| match known {
        None => Some(Verb::Added),
        Some(old) if !old.resource_version.is(&entry.resource_version) => Some(Verb::Modified),
        Some(_) => None,
    })
}

/// The last known identity of an object deleted while the stream was not watching.
pub(super) fn tombstone(ar: &ApiResource, uid: &str, entry: &IndexEntry) -> RawObject {
    let mut metadata = serde_json::json!({"name": entry.name, "uid": uid, "resourceVersion": entry.resource_version});
    if let Some(ns) = &entry.namespace {
        metadata["namespace"] = ns.clone().into();
    }
    RawObject::from_value(&serde_json::json!({"apiVersion": ar.api_version, "kind": ar.kind, "metadata": metadata}))
        .expect("a tombstone is valid JSON")
}

/// What one watch event does; see [`watched`].
#[derive(Debug, PartialEq)]
pub(super) struct Watched {
    /// The item's effect: the index change, and resume after the event.
    pub effect: Effect,
    /// Where the watch resumes now: the event's resourceVersion.
    pub rv: String,
    /// The change was delivered before a restart (out of order, recorded in `acked_ahead`):
    /// the item is emitted with `delivered_before`, so it is not sent again (shaping still
    /// sees it).
    pub already_sent: bool,
}

/// A watch event `verb` of the object `(uid, entry)`: its index change (removes the uid for
/// `deleted`, else holds `entry`), and takes the change out of `acked_ahead` if it was
/// delivered before a restart.
pub(super) fn watched(
    acked_ahead: &mut HashSet<(String, String)>,
    verb: Verb,
    uid: String,
    entry: IndexEntry,
) -> Watched {
    let rv = entry.resource_version.clone();
    let already_sent = !acked_ahead.is_empty() && acked_ahead.remove(&(uid.clone(), rv.clone()));
    let op = if verb == Verb::Deleted { IndexOp::Remove(uid) } else { IndexOp::Upsert(uid, entry) };
    Watched { effect: Effect::Watched { op, rv: rv.clone() }, rv, already_sent }
}

#[cfg(test)]
mod tests;
