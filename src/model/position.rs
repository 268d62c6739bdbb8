//! A stream's position: where its watch resumes and the index of the objects it has
//! delivered, and the effect each item the reflector emits has on it once acknowledged.
//!
//! The stores load a [`Position`] straight into the compact [`ObjectIndex`] a stream holds
//! (once, shared as a [`super::SharedIndex`]): no plain copy of the index is made on the way.

use super::index::{IndexEntry, ObjectIndex};

/// The state a stream resumes from, as the stores load and write it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Position {
    /// Where to resume the watch; `None` until the first list completed and was acknowledged.
    pub resource_version: Option<String>,
    pub objects: ObjectIndex,
    /// `(uid, resourceVersion)` of changes after the resume point that were delivered and
    /// acknowledged already, out of order (behind an event still in flight when kubecast
    /// stopped): a resumed watch acknowledges them without sending them again.
    pub acked_ahead: Vec<(String, String)>,
    /// The next list emits every object, whatever `initial` says (`kubecast state reset --to
    /// snapshot`); cleared once that list is acknowledged.
    pub snapshot: bool,
    /// Adopted from the state of another `[coordination] shards` (its count; 1: without
    /// shards): no `resource_version`, so the stream relists and diffs against `objects`; the
    /// whole index is written at the first write (none of it is stored under this shard yet).
    pub adopted_from: Option<u32>,
    /// Adopted and resumed by watch from the oldest of the old count's positions: per old
    /// shard, the resourceVersion up to which it had delivered its objects' changes. A watch
    /// event of an object at or below its old shard's floor was delivered already (not sent
    /// again). Written with the position until it passes them all (a restart before that
    /// skips the same events).
    pub floors: Vec<(super::shard::Shard, u64)>,
}

/// An index change carried by an item.
#[derive(Debug, Clone, PartialEq)]
pub enum IndexOp {
    Upsert(String, IndexEntry),
    Remove(String),
}

/// What acknowledging an item does to the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// A live watch event: update the index, resume after `rv`.
    Watched { op: IndexOp, rv: String },
    /// An event derived by a relist-diff: update the index; the resume point moves only with
    /// the list's [`Effect::Listed`].
    Diffed(IndexOp),
    /// A bookmark: resume after `rv`.
    Bookmark(String),
    /// A list (and its diff) is complete: resume after `rv`. The index needs no change: the
    /// list's `Diffed` items before it made it the list.
    Listed { rv: String },
}

impl IndexOp {
    pub fn uid(&self) -> &str {
        match self {
            IndexOp::Upsert(uid, _) | IndexOp::Remove(uid) => uid,
        }
    }

    pub fn apply(&self, objects: &mut ObjectIndex) {
        match self {
            IndexOp::Upsert(uid, entry) => objects.insert(uid, entry),
            IndexOp::Remove(uid) => {
                objects.remove(uid);
            }
        }
    }
}

impl Effect {
    /// `(uid, resourceVersion)` of a watched change (what a resumed watch would deliver again).
    pub fn change_key(&self) -> Option<(String, String)> {
        match self {
            Effect::Watched { op: IndexOp::Upsert(uid, e), .. } => Some((uid.clone(), e.resource_version.clone())),
            Effect::Watched { op: IndexOp::Remove(uid), rv } => Some((uid.clone(), rv.clone())),
            _ => None,
        }
    }

    /// The index change the item carries, if any.
    pub fn op(&self) -> Option<&IndexOp> {
        match self {
            Effect::Watched { op, .. } | Effect::Diffed(op) => Some(op),
            Effect::Bookmark(_) | Effect::Listed { .. } => None,
        }
    }

    /// What acknowledging the item does to the resume point and the index.
    pub fn apply(self, resume: &mut Option<String>, objects: &mut ObjectIndex) {
        match self {
            Effect::Watched { op, rv } => {
                op.apply(objects);
                *resume = Some(rv);
            }
            Effect::Diffed(op) => op.apply(objects),
            Effect::Bookmark(rv) | Effect::Listed { rv } => *resume = Some(rv),
        }
    }
}
