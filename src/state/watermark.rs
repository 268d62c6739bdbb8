//! The acknowledgement path: per stream, an ordered watermark over the items the reflector
//! emitted. Every item has a stream-local sequence number and the effect it has on the
//! stream's checkpoint; the checkpoint is the result of applying the effects of the longest
//! prefix of items that are *all* acknowledged (delivered by the sink, or dropped by a filter,
//! or needing no delivery such as a bookmark). Acknowledgements may arrive out of order; the
//! checkpoint never passes an unacknowledged item.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::store::{CheckpointError, CheckpointStore, StreamKey};
use crate::model::{Effect, Position};
#[cfg(test)]
use crate::model::{Index, IndexEntry, IndexOp};

/// The ordered watermark of one stream.
#[derive(Debug)]
pub struct Watermark {
    /// The next sequence number the contiguous acknowledged prefix waits for.
    next: u64,
    /// Acknowledged items after a gap.
    ahead: BTreeMap<u64, Effect>,
    committed: Position,
    dirty: bool,
}

impl Watermark {
    /// Starts from a loaded (or empty) checkpoint; the reflector numbers its items from 0.
    pub fn new(start: Position) -> Self {
        Self { next: 0, ahead: BTreeMap::new(), committed: start, dirty: false }
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
        effect.apply(&mut self.committed);
        self.next += 1;
        while let Some(e) = self.ahead.remove(&self.next) {
            e.apply(&mut self.committed);
            self.next += 1;
        }
        self.dirty = true;
    }

    pub fn committed(&self) -> &Position {
        &self.committed
    }

    /// Number of acknowledged items waiting behind an unacknowledged one.
    pub fn waiting(&self) -> usize {
        self.ahead.len()
    }
}

/// A stream's watermark together with where it is persisted.
#[derive(Debug)]
pub struct StreamCheckpoint {
    pub key: StreamKey,
    store: CheckpointStore,
    watermark: Mutex<Watermark>,
    /// Held while the position is encoded and written.
    writing: Mutex<()>,
    /// Acknowledged items waiting behind an unacknowledged one, readable without the lock
    /// (the queue stops taking jobs while a stream has too many: backpressure, not growth).
    waiting: AtomicUsize,
}

impl StreamCheckpoint {
    /// Loads the stream's checkpoint (`None` inside when it has none yet).
    pub fn load(store: CheckpointStore, key: StreamKey) -> Result<(Self, Option<Position>), CheckpointError> {
        let loaded = store.load(&key)?;
        let wm = Watermark::new(loaded.clone().unwrap_or_default());
        Ok((
            Self { key, store, watermark: Mutex::new(wm), writing: Mutex::new(()), waiting: AtomicUsize::new(0) },
            loaded,
        ))
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

    /// Writes the committed checkpoint if it changed since the last write.
    pub fn persist_if_dirty(&self) -> Result<bool, CheckpointError> {
        // One write of this stream at a time (the persister's and the final one at shutdown
        // share a temp file name), in the order they encoded: a later write never loses to an
        // earlier, older one.
        let _writing = self.writing.lock().expect("checkpoint write lock");
        let bytes = {
            let mut wm = self.watermark.lock().expect("watermark lock");
            if !wm.dirty {
                return Ok(false);
            }
            wm.dirty = false;
            let ahead: Vec<(String, String)> = wm.ahead.values().filter_map(Effect::change_key).collect();
            self.store.encode(&self.key, &wm.committed, &ahead)
        };
        if let Err(e) = self.store.write(&self.key, &bytes) {
            self.watermark.lock().expect("watermark lock").dirty = true;
            return Err(e);
        }
        Ok(true)
    }

    pub fn committed(&self) -> Position {
        self.watermark.lock().expect("watermark lock").committed().clone()
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
    fn diffed_items_do_not_move_the_resume_point_until_the_list_is_done() {
        let mut wm = Watermark::new(Position { resource_version: Some("5".into()), ..Default::default() });
        wm.ack(0, Effect::Diffed(IndexOp::Upsert("a".into(), entry("20"))));
        assert_eq!(wm.committed().resource_version.as_deref(), Some("5"));
        let mut objects = Index::default();
        objects.insert("a".into(), entry("20"));
        wm.ack(1, Effect::Listed { rv: "21".into(), objects });
        assert_eq!(wm.committed().resource_version.as_deref(), Some("21"));
    }

    #[test]
    fn changes_acknowledged_ahead_are_persisted_and_loaded() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        let key = StreamKey {
            cluster: "c".into(),
            group: "".into(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            namespace: None,
            label_selector: "".into(),
            field_selector: "".into(),
        };
        let (cp, _) = StreamCheckpoint::load(store.clone(), key.clone()).unwrap();
        cp.ack(1, Effect::Watched { op: IndexOp::Upsert("b".into(), entry("11")), rv: "11".into() });
        cp.ack(2, Effect::Watched { op: IndexOp::Remove("c".into()), rv: "12".into() });
        assert!(cp.persist_if_dirty().unwrap(), "acks ahead of a gap are worth a write");
        let loaded = store.load(&key).unwrap().unwrap();
        assert_eq!(loaded.resource_version, None);
        assert_eq!(loaded.acked_ahead, vec![("b".to_string(), "11".to_string()), ("c".to_string(), "12".to_string())]);
        cp.ack(0, Effect::Watched { op: IndexOp::Upsert("a".into(), entry("10")), rv: "10".into() });
        cp.persist_if_dirty().unwrap();
        let loaded = store.load(&key).unwrap().unwrap();
        assert!(loaded.acked_ahead.is_empty(), "all in the prefix now");
        assert_eq!(loaded.resource_version.as_deref(), Some("12"));
    }
}
