//! A stream's position: where its watch resumes and the compact index of the objects it has
//! delivered, and the effect each item the reflector emits has on it once acknowledged.

use std::collections::HashMap;

/// What the stream knows about one delivered object (never the whole object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub namespace: Option<String>,
    pub name: String,
    pub resource_version: String,
}

/// uid -> entry (foldhash: the uids come from the apiserver; hashed once per event).
pub type Index = HashMap<String, IndexEntry, foldhash::fast::RandomState>;

/// The state a stream resumes from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Position {
    /// Where to resume the watch; `None` until the first list completed and was acknowledged.
    pub resource_version: Option<String>,
    pub objects: Index,
    /// `(uid, resourceVersion)` of changes after the resume point that were delivered and
    /// acknowledged already, out of order (behind an event still in flight when kubecast
    /// stopped): a resumed watch acknowledges them without sending them again.
    pub acked_ahead: Vec<(String, String)>,
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
    /// A list (and its diff) is complete: the index is exactly `objects`, resume after `rv`.
    Listed { rv: String, objects: Index },
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

    /// What acknowledging the item does to `cp`.
    pub fn apply(self, cp: &mut Position) {
        let op = match self {
            Effect::Watched { op, rv } => {
                cp.resource_version = Some(rv);
                op
            }
            Effect::Diffed(op) => op,
            Effect::Bookmark(rv) => {
                cp.resource_version = Some(rv);
                return;
            }
            Effect::Listed { rv, objects } => {
                cp.resource_version = Some(rv);
                cp.objects = objects;
                return;
            }
        };
        match op {
            IndexOp::Upsert(uid, entry) => {
                cp.objects.insert(uid, entry);
            }
            IndexOp::Remove(uid) => {
                cp.objects.remove(&uid);
            }
        }
    }
}
