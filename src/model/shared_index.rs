//! The acknowledged index of one stream, held once and shared by the two that need it: the
//! watermark (`src/state/watermark.rs`) applies each item's index change to it when the item
//! joins the acknowledged prefix, and the reflector (`src/source/reflector/view.rs`) reads
//! it under an overlay of the changes it emitted that are not acknowledged yet.
//!
//! Invariant: `objects` is the result of applying, in order, the index changes of the items
//! `0..applied` (numbered by the reflector from 0 in this process) to the loaded index.

use std::sync::{Arc, Mutex, MutexGuard};

use super::index::ObjectIndex;

#[derive(Debug, Default)]
pub struct AckedIndex {
    pub objects: ObjectIndex,
    /// How many items (from the first) are applied.
    pub applied: u64,
}

/// A handle on one stream's [`AckedIndex`].
#[derive(Debug, Clone, Default)]
pub struct SharedIndex(Arc<Mutex<AckedIndex>>);

impl SharedIndex {
    /// The index loaded at start, no item applied yet.
    pub fn new(objects: ObjectIndex) -> Self {
        Self(Arc::new(Mutex::new(AckedIndex { objects, applied: 0 })))
    }

    /// Held briefly: never across an `.await`. Lock order: a watermark's lock, then this.
    pub fn lock(&self) -> MutexGuard<'_, AckedIndex> {
        self.0.lock().expect("index lock")
    }
}
