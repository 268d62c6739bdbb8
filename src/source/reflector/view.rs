//! The index as the reflector sees it: every object after *all* the items it emitted, while
//! the stream holds only one full index, the acknowledged one ([`SharedIndex`], applied by
//! the watermark as items join the acknowledged prefix).
//!
//! The view is that index under an overlay (`pending`): per uid, the last index change the
//! reflector emitted for it, with the item's sequence number. Reading a uid takes the
//! overlay's change if there is one, else the acknowledged index.
//!
//! Invariant (why that is exact): an overlay entry is dropped only once the acknowledged
//! prefix contains its item (`seq < applied`); since it is the uid's *last* emitted change,
//! the acknowledged index then holds for the uid just what the overlay did, and no later
//! item touches the uid. A uid without overlay entry has every change to it acknowledged.
//! The overlay is pruned whenever it doubled, so it stays within about twice the items in
//! flight (bounded by the channel and the queue), not the number of objects.

use std::collections::HashMap;

use crate::model::index::EntryRef;
use crate::model::{Effect, IndexEntry, IndexOp, SharedIndex, UidSet};

/// The overlay is not pruned below this many entries.
const MIN_PRUNE: usize = 1024;

/// The last change emitted for a uid: its entry (`None`: removed), by item `seq`.
#[derive(Debug)]
struct Pending {
    entry: Option<IndexEntry>,
    seq: u64,
}

#[derive(Debug)]
pub(super) struct IndexView {
    acked: SharedIndex,
    pending: HashMap<String, Pending, foldhash::fast::RandomState>,
    prune_at: usize,
    /// `prune_at` never goes below this.
    floor: usize,
}

impl IndexView {
    pub(super) fn new(acked: SharedIndex) -> Self {
        Self::with_floor(acked, MIN_PRUNE)
    }

    /// Pruned from `floor` overlay entries on (tests prune at every step).
    pub(super) fn with_floor(acked: SharedIndex, floor: usize) -> Self {
        Self { acked, pending: HashMap::default(), prune_at: floor, floor }
    }

    /// The item numbered `seq` (being emitted) carries `effect`.
    pub(super) fn emitted(&mut self, seq: u64, effect: &Effect) {
        let Some(op) = effect.op() else { return };
        let entry = match op {
            IndexOp::Upsert(_, e) => Some(e.clone()),
            IndexOp::Remove(_) => None,
        };
        match self.pending.get_mut(op.uid()) {
            Some(p) => *p = Pending { entry, seq },
            None => {
                self.pending.insert(op.uid().to_owned(), Pending { entry, seq });
            }
        }
        if self.pending.len() >= self.prune_at {
            self.prune();
        }
    }

    /// Drops the overlay entries whose item is acknowledged (in the prefix).
    fn prune(&mut self) {
        let applied = self.acked.lock().applied;
        self.pending.retain(|_, p| p.seq >= applied);
        if self.pending.capacity() > 4 * self.pending.len().max(self.floor) {
            self.pending.shrink_to(2 * self.pending.len());
        }
        self.prune_at = (2 * self.pending.len()).max(self.floor);
    }

    /// `f` of what the view holds for `uid`.
    pub(super) fn with<R>(&self, uid: &str, f: impl FnOnce(Option<EntryRef<'_>>) -> R) -> R {
        match self.pending.get(uid) {
            Some(p) => f(p.entry.as_ref().map(EntryRef::from)),
            None => f(self.acked.lock().objects.get(uid)),
        }
    }

    /// An owned copy of what the view holds for `uid`.
    #[cfg(test)]
    pub(super) fn get(&self, uid: &str) -> Option<IndexEntry> {
        self.with(uid, |e| e.map(|e| e.to_entry()))
    }

    /// How many objects the view holds.
    pub(super) fn len(&self) -> usize {
        let acked = self.acked.lock();
        let mut len = acked.objects.len();
        for (uid, p) in &self.pending {
            match (acked.objects.contains(uid), p.entry.is_some()) {
                (true, false) => len -= 1,
                (false, true) => len += 1,
                _ => {}
            }
        }
        len
    }

    /// The objects the view holds whose uid is not in `seen`, with their entry.
    pub(super) fn absent_from(&self, seen: &UidSet) -> Vec<(String, IndexEntry)> {
        let acked = self.acked.lock();
        let mut absent: Vec<(String, IndexEntry)> = acked
            .objects
            .iter()
            .filter(|(uid, _)| !seen.contains_ref(*uid))
            .map(|(uid, e)| (uid.to_string(), e))
            .filter(|(uid, _)| !self.pending.contains_key(uid))
            .map(|(uid, e)| (uid, e.to_entry()))
            .collect();
        let overlay = self.pending.iter().filter(|(uid, _)| !seen.contains(uid));
        absent.extend(overlay.filter_map(|(uid, p)| Some((uid.clone(), p.entry.clone()?))));
        absent
    }

    /// Overlay entries (for tests of its bound).
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        self.pending.len()
    }

    /// The view as a plain map.
    #[cfg(test)]
    pub(super) fn to_index(&self) -> crate::model::Index {
        let mut index = self.acked.lock().objects.to_index();
        for (uid, p) in &self.pending {
            match &p.entry {
                Some(e) => index.insert(uid.clone(), e.clone()),
                None => index.remove(uid),
            };
        }
        index
    }
}

#[cfg(test)]
pub(super) mod testkit;
#[cfg(test)]
mod tests;
