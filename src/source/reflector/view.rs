//! The index as the reflector sees it: every object after *all* the items it emitted, while
//! the stream holds only one full index, the acknowledged one ([`SharedIndex`], applied by
//! the watermark as items join the acknowledged prefix).
//!
//! The view is that index under its overlay ([`crate::model::shared_index::Overlay`]): per
//! uid, the last index change the reflector emitted for it, until the watermark applies that
//! item. Reading a uid takes the overlay's change if there is one, else the acknowledged
//! index; both are read under the one lock, so the watermark applying an item between the two
//! reads cannot make a change invisible. The overlay never holds more than the items in
//! flight (bounded by the channel and the queue), and nothing once they are acknowledged.

use crate::model::index::EntryRef;
use crate::model::{Effect, IndexEntry, SharedIndex, UidSet};

#[derive(Debug)]
pub(super) struct IndexView {
    acked: SharedIndex,
}

impl IndexView {
    pub(super) fn new(acked: SharedIndex) -> Self {
        Self { acked }
    }

    /// The item numbered `seq` (being emitted, not sent yet) carries `effect`.
    pub(super) fn emitted(&mut self, seq: u64, effect: &Effect) {
        if let Some(op) = effect.op() {
            self.acked.lock().overlay.emitted(seq, op);
        }
    }

    /// `f` of what the view holds for `uid`.
    pub(super) fn with<R>(&self, uid: &str, f: impl FnOnce(Option<EntryRef<'_>>) -> R) -> R {
        let acked = self.acked.lock();
        match acked.overlay.get(uid) {
            Some(p) => f(p.entry.as_ref().map(EntryRef::from)),
            None => f(acked.objects.get(uid)),
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
        for (uid, p) in acked.overlay.iter() {
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
            .filter(|(uid, _)| !acked.overlay.contains(uid))
            .map(|(uid, e)| (uid, e.to_entry()))
            .collect();
        let overlay = acked.overlay.iter().filter(|(uid, _)| !seen.contains(uid));
        absent.extend(overlay.filter_map(|(uid, p)| Some((uid.clone(), p.entry.clone()?))));
        absent
    }

    /// Overlay entries (for tests of its bound).
    #[cfg(test)]
    pub(super) fn pending(&self) -> usize {
        self.acked.lock().overlay.len()
    }

    /// The view as a plain map.
    #[cfg(test)]
    pub(super) fn to_index(&self) -> crate::model::Index {
        let acked = self.acked.lock();
        let mut index = acked.objects.to_index();
        for (uid, p) in acked.overlay.iter() {
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
