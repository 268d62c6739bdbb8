//! The acknowledged index of one stream, held once and shared by the two that need it: the
//! watermark (`src/state/watermark.rs`) applies each item's index change to it when the item
//! joins the acknowledged prefix, and the reflector (`src/source/reflector/view.rs`) reads
//! it under the [`Overlay`] of the changes it emitted that are not applied yet.
//!
//! Invariant: `objects` is the result of applying, in order, the index changes of the items
//! `0..applied` (numbered by the reflector from 0 in this process) to the loaded index.
//!
//! Invariant: the overlay holds, per uid, the last index change emitted for it, exactly while
//! its item is not applied (`seq >= applied`). Reading a uid takes the overlay's change if
//! there is one, else `objects`: that is the index after every emitted item, since a uid
//! without overlay entry has every change to it applied. The overlay is thus never larger
//! than the items in flight, and empty when they all are acknowledged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::index::IndexEntry;
use super::index::ObjectIndex;
use super::position::{Effect, IndexOp};

/// An emptied overlay whose table outgrew this many entries gives its memory back (after a
/// list, the table sized for the thousands of items then in flight).
const KEEP_CAPACITY: usize = 1024;

#[derive(Debug, Default)]
pub struct AckedIndex {
    pub objects: ObjectIndex,
    /// How many items (from the first) are applied.
    pub applied: u64,
    /// The changes emitted and not applied yet (see the module documentation).
    pub overlay: Overlay,
}

impl AckedIndex {
    /// Applies the next item's effect (item number `applied`): its index change to `objects`,
    /// its resume point to `resume`; its change leaves the overlay.
    pub fn apply(&mut self, effect: Effect, resume: &mut Option<String>) {
        if let Some(op) = effect.op() {
            self.overlay.applied(op.uid(), self.applied);
        }
        effect.apply(resume, &mut self.objects);
        self.applied += 1;
    }
}

/// The last index change emitted for a uid: its entry (`None`: removed), by item `seq`.
#[derive(Debug)]
pub struct Pending {
    pub entry: Option<IndexEntry>,
    pub seq: u64,
}

/// Per uid, the last index change emitted and not applied yet.
#[derive(Debug, Default)]
pub struct Overlay(HashMap<String, Pending, foldhash::fast::RandomState>);

impl Overlay {
    /// Item `seq` (being emitted) carries `op`.
    pub fn emitted(&mut self, seq: u64, op: &IndexOp) {
        let entry = match op {
            IndexOp::Upsert(_, e) => Some(e.clone()),
            IndexOp::Remove(_) => None,
        };
        match self.0.get_mut(op.uid()) {
            Some(p) => *p = Pending { entry, seq },
            None => {
                self.0.insert(op.uid().to_owned(), Pending { entry, seq });
            }
        }
    }

    /// Item `seq`, changing `uid`, is applied: the uid leaves the overlay unless a later item
    /// changes it again.
    fn applied(&mut self, uid: &str, seq: u64) {
        if self.0.get(uid).is_some_and(|p| p.seq <= seq) {
            self.0.remove(uid);
            if self.0.is_empty() && self.0.capacity() > KEEP_CAPACITY {
                self.0.shrink_to(0);
            }
        }
    }

    pub fn get(&self, uid: &str) -> Option<&Pending> {
        self.0.get(uid)
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.0.contains_key(uid)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Pending)> + '_ {
        self.0.iter()
    }
}

/// A handle on one stream's [`AckedIndex`].
#[derive(Debug, Clone, Default)]
pub struct SharedIndex(Arc<Mutex<AckedIndex>>);

impl SharedIndex {
    /// The index loaded at start, no item applied yet.
    pub fn new(objects: ObjectIndex) -> Self {
        Self(Arc::new(Mutex::new(AckedIndex { objects, applied: 0, overlay: Overlay::default() })))
    }

    /// Held briefly: never across an `.await`. Lock order: a watermark's lock, then this.
    pub fn lock(&self) -> MutexGuard<'_, AckedIndex> {
        self.0.lock().expect("index lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upsert(uid: &str, rv: &str) -> Effect {
        let e = IndexEntry { namespace: None, name: uid.into(), resource_version: rv.into() };
        Effect::Diffed(IndexOp::Upsert(uid.into(), e))
    }

    #[test]
    fn a_change_leaves_the_overlay_when_its_item_is_applied_unless_changed_again() {
        let shared = SharedIndex::default();
        let mut acked = shared.lock();
        let (a1, a2, b) = (upsert("a", "1"), upsert("a", "2"), upsert("b", "3"));
        for (seq, e) in [&a1, &a2, &b].into_iter().enumerate() {
            acked.overlay.emitted(seq as u64, e.op().unwrap());
        }
        let mut resume = None;
        acked.apply(a1, &mut resume);
        assert_eq!(acked.overlay.get("a").map(|p| p.seq), Some(1), "a's later change stays");
        acked.apply(a2, &mut resume);
        assert!(!acked.overlay.contains("a") && acked.overlay.contains("b"));
        acked.apply(b, &mut resume);
        assert!(acked.overlay.is_empty());
        assert_eq!((acked.applied, acked.objects.len()), (3, 2));
        assert_eq!(acked.objects.get("a").unwrap().name, "a");
    }

    #[test]
    fn an_emptied_overlay_gives_its_table_back() {
        let mut overlay = Overlay::default();
        let ops: Vec<_> = (0..10_000).map(|i| upsert(&format!("u{i}"), "1")).collect();
        for (seq, e) in ops.iter().enumerate() {
            overlay.emitted(seq as u64, e.op().unwrap());
        }
        assert!(overlay.0.capacity() >= 10_000);
        for (seq, e) in ops.iter().enumerate() {
            overlay.applied(e.op().unwrap().uid(), seq as u64);
        }
        assert!(overlay.is_empty() && overlay.0.capacity() <= KEEP_CAPACITY, "{}", overlay.0.capacity());
    }
}
