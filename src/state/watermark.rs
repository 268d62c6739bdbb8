//! The acknowledgement path: per stream, an ordered watermark over the items the reflector
//! emitted. Every item has a stream-local sequence number and the effect it has on the
//! stream's checkpoint; the checkpoint is the result of applying the effects of the longest
//! prefix of items that are *all* acknowledged (delivered by the sink, or dropped by a filter,
//! or needing no delivery such as a bookmark). Acknowledgements may arrive out of order; the
//! checkpoint never passes an unacknowledged item.
//!
//! The watermark also remembers which index entries changed since the last write, so a write
//! carries those ([`Delta`]) and not the whole index.
//!
//! The index of the acknowledged prefix is the stream's only full index ([`SharedIndex`]):
//! the watermark applies each item's index change to it as the item joins the prefix, and
//! the stream's reflector reads it (under its overlay of what is not acknowledged yet).

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::store::{Delta, StreamKey};
use crate::model::{Effect, Position, Shard, SharedIndex};
#[cfg(test)]
use crate::model::{IndexEntry, IndexOp};

type Uids = HashSet<String, foldhash::fast::RandomState>;

/// At most this many acknowledgements ahead of a gap are stored with a position (about 54
/// bytes each: ~220 KB, well within a Kafka record's or a NATS message's default 1 MB). More
/// pile up only behind an event retried for long; those left out are sent again after a
/// restart (duplicates, never a loss), and the position stays writable.
pub const MAX_ACKED_AHEAD: usize = 4096;

/// The set of changed uids keeps its table between writes up to this many entries.
const KEEP_CHANGED: usize = 4096;

/// The ordered watermark of one stream.
#[derive(Debug)]
pub struct Watermark {
    /// The next sequence number the contiguous acknowledged prefix waits for.
    next: u64,
    /// Acknowledged items after a gap.
    ahead: BTreeMap<u64, Effect>,
    /// Where the acknowledged prefix resumes.
    resource_version: Option<String>,
    /// The acknowledged prefix's index (`applied` = `next`), shared with the reflector.
    index: SharedIndex,
    /// Index entries changed (added, updated or removed) since the last write.
    changed: Uids,
    /// Anything changed since the last write (the position, `ahead` or the index).
    dirty: bool,
    /// The next list emits every object (see `Position::snapshot`): kept until a list is
    /// acknowledged.
    snapshot: bool,
    /// The old shard count's floors (see `Position::floors`), written with the position until
    /// it passes them all.
    floors: Vec<(Shard, u64)>,
}

impl Watermark {
    /// Starts from a loaded (or empty) checkpoint; the reflector numbers its items from 0.
    pub fn new(start: Position) -> Self {
        // Adopted from another shard count: none of the index is stored under this shard yet,
        // so the first write carries all of it.
        let mut changed = Uids::default();
        if start.adopted_from.is_some() {
            changed.extend(start.objects.iter().map(|(uid, _)| uid.to_string()));
        }
        Self {
            next: 0,
            ahead: BTreeMap::new(),
            resource_version: start.resource_version,
            index: SharedIndex::new(start.objects),
            changed,
            dirty: start.adopted_from.is_some(),
            snapshot: start.snapshot,
            floors: start.floors,
        }
    }

    /// The acknowledged index, for the stream's reflector.
    pub fn index(&self) -> SharedIndex {
        self.index.clone()
    }

    pub fn ack(&mut self, seq: u64, effect: Effect) {
        if seq < self.next {
            return; // already applied (defensive: an item is acknowledged once)
        }
        if seq > self.next {
            self.ahead.insert(seq, effect);
            // Persisted too: a restart must not send an acknowledged change again.
            self.dirty = true;
            return;
        }
        let mut acked = self.index.lock();
        self.changed.extend(effect.op().map(|op| op.uid().to_owned()));
        self.snapshot &= !matches!(effect, Effect::Listed { .. });
        acked.apply(effect, &mut self.resource_version);
        self.next += 1;
        while let Some(e) = self.ahead.remove(&self.next) {
            self.changed.extend(e.op().map(|op| op.uid().to_owned()));
            self.snapshot &= !matches!(e, Effect::Listed { .. });
            acked.apply(e, &mut self.resource_version);
            self.next += 1;
        }
        debug_assert_eq!(acked.applied, self.next, "the shared index is applied up to the watermark");
        self.dirty = true;
    }

    /// The position of the acknowledged prefix (a copy of the index: for tests and checks).
    pub fn committed(&self) -> Position {
        Position {
            resource_version: self.resource_version.clone(),
            objects: self.index.lock().objects.clone(),
            acked_ahead: Vec::new(),
            snapshot: self.snapshot,
            adopted_from: None,
            floors: Vec::new(),
        }
    }

    /// Number of acknowledged items waiting behind an unacknowledged one.
    pub fn waiting(&self) -> usize {
        self.ahead.len()
    }

    /// What to write, if anything changed since the last write: the changed entries, or the
    /// whole index when `full`. At most [`MAX_ACKED_AHEAD`] acknowledgements ahead of a gap
    /// (the first ones) go with it.
    pub fn take(&mut self, full: bool) -> Option<Delta> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        // Passed once the position is above every floor: no event the watch sends from there
        // can be at or below one.
        let resumed_at = self.resource_version.as_deref().and_then(|rv| rv.parse::<u64>().ok());
        if resumed_at.is_some_and(|at| self.floors.iter().all(|(_, floor)| at > *floor)) {
            self.floors.clear();
        }
        let mut d = Delta {
            full,
            resource_version: self.resource_version.clone(),
            acked_ahead: self.ahead.values().filter_map(Effect::change_key).take(MAX_ACKED_AHEAD).collect(),
            snapshot: self.snapshot,
            floors: self.floors.clone(),
            ..Default::default()
        };
        let acked = self.index.lock();
        for uid in self.changed.drain() {
            match acked.objects.get(&uid) {
                Some(e) if !full => d.upserts.insert_ref(&uid, e),
                Some(_) => {}
                None => d.removes.push(uid),
            }
        }
        if self.changed.capacity() > KEEP_CHANGED {
            // Sized for a list's burst (tens of thousands of uids a second): given back.
            self.changed.shrink_to(0);
        }
        if full {
            // A copy of the compact index (its slots and name arena), not of its strings.
            d.upserts = acked.objects.clone();
        }
        Some(d)
    }

    /// A write of `d` failed: what it carried is to be written again.
    pub fn restore(&mut self, d: &Delta) {
        self.dirty = true;
        self.changed.extend(d.upserts.iter().map(|(u, _)| u.to_string()));
        self.changed.extend(d.removes.iter().cloned());
    }
}

/// A stream's watermark.
#[derive(Debug)]
pub struct StreamCheckpoint {
    pub key: StreamKey,
    watermark: Mutex<Watermark>,
    /// Acknowledged items waiting behind an unacknowledged one, readable without the lock
    /// (the queue stops taking jobs while a stream has too many: backpressure, not growth).
    waiting: AtomicUsize,
}

impl StreamCheckpoint {
    /// Starts from the stream's loaded position (`None`: none yet).
    pub fn new(key: StreamKey, loaded: Option<Position>) -> Self {
        Self { key, watermark: Mutex::new(Watermark::new(loaded.unwrap_or_default())), waiting: AtomicUsize::new(0) }
    }

    pub fn ack(&self, seq: u64, effect: Effect) {
        let mut wm = self.watermark.lock().expect("watermark lock");
        wm.ack(seq, effect);
        self.waiting.store(wm.waiting(), Ordering::Relaxed);
    }

    /// Acknowledged items waiting behind an unacknowledged one (kept out of the position).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Whether anything changed since the last write (a `take` would give a delta).
    pub fn is_dirty(&self) -> bool {
        self.watermark.lock().expect("watermark lock").dirty
    }

    /// See [`Watermark::take`].
    pub fn take(&self, full: bool) -> Option<Delta> {
        self.watermark.lock().expect("watermark lock").take(full)
    }

    /// See [`Watermark::restore`].
    pub fn restore(&self, d: &Delta) {
        self.watermark.lock().expect("watermark lock").restore(d);
    }

    /// See [`Watermark::committed`].
    pub fn committed(&self) -> Position {
        self.watermark.lock().expect("watermark lock").committed()
    }

    /// See [`Watermark::index`].
    pub fn index(&self) -> SharedIndex {
        self.watermark.lock().expect("watermark lock").index()
    }

    /// How many items (from the stream's start in this process) are acknowledged in order.
    pub fn acked_items(&self) -> u64 {
        self.watermark.lock().expect("watermark lock").next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(rv: &str) -> IndexEntry {
        IndexEntry { namespace: Some("ns".into()), name: "n".into(), resource_version: rv.into() }
    }

    #[test]
    fn checkpoint_never_passes_an_unacked_item() {
        let mut wm = Watermark::new(Position::default());
        wm.ack(1, Effect::Watched { op: IndexOp::Upsert("b".into(), entry("11")), rv: "11".into() });
        wm.ack(2, Effect::Bookmark("15".into()));
        assert_eq!(wm.committed().resource_version, None, "item 0 is not acked yet");
        assert_eq!(wm.waiting(), 2);
        wm.ack(0, Effect::Watched { op: IndexOp::Upsert("a".into(), entry("10")), rv: "10".into() });
        assert_eq!(wm.committed().resource_version.as_deref(), Some("15"));
        assert_eq!(wm.committed().objects.len(), 2);
        wm.ack(3, Effect::Watched { op: IndexOp::Remove("a".into()), rv: "16".into() });
        assert_eq!(wm.committed().objects.len(), 1);
        assert_eq!(wm.waiting(), 0);
    }

    #[test]
    fn the_shared_index_is_the_acknowledged_prefix() {
        let start = Position {
            resource_version: Some("5".into()),
            objects: [("z".to_string(), entry("4"))].into_iter().collect(),
            acked_ahead: Vec::new(),
            snapshot: false,
            adopted_from: None,
            floors: Vec::new(),
        };
        let mut wm = Watermark::new(start);
        let shared = wm.index();
        assert_eq!(shared.lock().objects.get("z").map(|e| e.to_entry()), Some(entry("4")), "the loaded index");
        wm.ack(1, Effect::Watched { op: IndexOp::Upsert("b".into(), entry("11")), rv: "11".into() });
        let acked = shared.lock();
        assert_eq!((acked.applied, acked.objects.len()), (0, 1), "item 0 is not acked yet");
        drop(acked);
        wm.ack(0, Effect::Watched { op: IndexOp::Remove("z".into()), rv: "10".into() });
        let committed = wm.committed().objects.to_index();
        let acked = shared.lock();
        assert_eq!(acked.applied, 2);
        assert_eq!(acked.objects.to_index(), committed);
        assert_eq!(acked.objects.get("b").map(|e| e.to_entry()), Some(entry("11")));
        assert!(!acked.objects.contains("z"));
    }

    #[test]
    fn diffed_items_do_not_move_the_resume_point_until_the_list_is_done() {
        let mut wm = Watermark::new(Position { resource_version: Some("5".into()), ..Default::default() });
        wm.ack(0, Effect::Diffed(IndexOp::Upsert("a".into(), entry("20"))));
        assert_eq!(wm.committed().resource_version.as_deref(), Some("5"));
        assert_eq!(wm.committed().objects.to_index()["a"], entry("20"), "the index changes at once");
        wm.ack(1, Effect::Listed { rv: "21".into() });
        assert_eq!(wm.committed().resource_version.as_deref(), Some("21"));
        assert_eq!(wm.committed().objects.len(), 1);
    }

    /// A new checkpoint of the cluster-wide ConfigMaps of cluster `c`.
    fn configmaps_checkpoint() -> StreamCheckpoint {
        StreamCheckpoint::new(
            StreamKey {
                cluster: "c".into(),
                group: "".into(),
                version: "v1".into(),
                kind: "ConfigMap".into(),
                namespace: None,
                label_selector: "".into(),
                field_selector: "".into(),
                shard: None,
            },
            None,
        )
    }

    /// A position adopted from another shard count carries the old shards' floors in every
    /// write until it is above all of them.
    #[test]
    fn the_floors_are_written_until_the_position_passes_them_all() {
        let floors = vec![(Shard::new(0, 2).unwrap(), 100), (Shard::new(1, 2).unwrap(), 150)];
        let start = Position { resource_version: Some("100".into()), floors: floors.clone(), ..Default::default() };
        let cp = StreamCheckpoint::new(configmaps_checkpoint().key.clone(), Some(start));
        cp.ack(0, Effect::Watched { op: IndexOp::Upsert("a".into(), entry("120")), rv: "120".into() });
        assert_eq!(cp.take(false).unwrap().floors, floors, "120: not above 150 yet");
        cp.ack(1, Effect::Bookmark("150".into()));
        assert_eq!(cp.take(false).unwrap().floors, floors, "150: at the floor, not above it");
        cp.ack(2, Effect::Watched { op: IndexOp::Upsert("b".into(), entry("151")), rv: "151".into() });
        assert!(cp.take(false).unwrap().floors.is_empty(), "151: above both, written without them");
        cp.ack(3, Effect::Bookmark("152".into()));
        assert!(cp.take(false).unwrap().floors.is_empty(), "and never again");
    }

    #[test]
    fn a_position_carries_at_most_max_acked_ahead_acknowledgements_ahead_of_a_gap() {
        let cp = configmaps_checkpoint();
        // Item 0 (an event retried for long) is not acknowledged; 20000 after it are.
        for seq in 1..=20_000u64 {
            let (uid, rv) = (format!("uid-{seq:05}"), format!("{}", 1000 + seq));
            cp.ack(seq, Effect::Watched { op: IndexOp::Upsert(uid, entry(&rv)), rv });
        }
        let d = cp.take(false).unwrap();
        assert_eq!(d.acked_ahead.len(), MAX_ACKED_AHEAD);
        assert_eq!(d.acked_ahead[0], ("uid-00001".to_string(), "1001".to_string()), "the first ones, nearest the gap");
        assert!(d.resource_version.is_none(), "the position itself does not move past the gap");
    }

    #[test]
    fn changes_acknowledged_ahead_are_in_the_delta_and_only_changed_entries_are() {
        let cp = configmaps_checkpoint();
        assert_eq!(cp.take(false), None, "nothing to write");
        cp.ack(1, Effect::Watched { op: IndexOp::Upsert("b".into(), entry("11")), rv: "11".into() });
        cp.ack(2, Effect::Watched { op: IndexOp::Remove("c".into()), rv: "12".into() });
        let d = cp.take(false).expect("acks ahead of a gap are worth a write");
        assert_eq!(d.resource_version, None);
        assert!(d.upserts.is_empty() && d.removes.is_empty());
        assert_eq!(d.acked_ahead, vec![("b".to_string(), "11".to_string()), ("c".to_string(), "12".to_string())]);
        cp.ack(0, Effect::Watched { op: IndexOp::Upsert("a".into(), entry("10")), rv: "10".into() });
        let d = cp.take(false).unwrap();
        assert!(d.acked_ahead.is_empty(), "all in the prefix now");
        assert_eq!(d.resource_version.as_deref(), Some("12"));
        assert_eq!(d.upserts.to_index(), plain(&[("a", entry("10")), ("b", entry("11"))]));
        assert_eq!(d.removes, vec!["c".to_string()]);
        // A failed write is written again.
        cp.restore(&d);
        let again = cp.take(false).unwrap();
        assert_eq!(again.upserts.len() + again.removes.len(), 3);
        // A list that changed one of two entries: a delta of one.
        cp.ack(3, Effect::Diffed(IndexOp::Upsert("b".into(), entry("20"))));
        cp.ack(4, Effect::Listed { rv: "21".into() });
        let d = cp.take(false).unwrap();
        assert_eq!(d.upserts.to_index(), plain(&[("b", entry("20"))]));
        assert!(d.removes.is_empty());
        assert_eq!(d.resource_version.as_deref(), Some("21"));
        let d = {
            cp.ack(5, Effect::Bookmark("30".into()));
            cp.take(true).unwrap()
        };
        assert!(d.full && d.upserts.len() == 2, "a full write carries the whole index");
    }

    #[test]
    fn a_snapshot_mark_is_written_until_a_list_is_acknowledged() {
        let mut wm = Watermark::new(Position { snapshot: true, ..Default::default() });
        wm.ack(0, Effect::Diffed(IndexOp::Upsert("a".into(), entry("20"))));
        let d = wm.take(false).unwrap();
        assert!(d.snapshot, "the list is not done: a restart must list and emit again");
        wm.ack(2, Effect::Bookmark("30".into()));
        wm.ack(1, Effect::Listed { rv: "21".into() });
        let d = wm.take(false).unwrap();
        assert!(!d.snapshot && !wm.committed().snapshot, "the list is acknowledged: the mark is gone");
    }

    fn plain(entries: &[(&str, IndexEntry)]) -> crate::model::Index {
        entries.iter().map(|(u, e)| (u.to_string(), e.clone())).collect()
    }
}
