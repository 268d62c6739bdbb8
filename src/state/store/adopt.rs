//! State a stream left under another `[coordination] shards` (or without shards), and when a
//! shard resumes from it.
//!
//! Each shard's positions cover its own objects only, from its own resourceVersion, so the
//! positions of N shards cannot resume M shards as they are. What they do give is an index per
//! object range: the union of the old shards' indexes, cut to the objects a new shard owns, is
//! that shard's list of what was delivered. The new shard resumes with that index and no
//! resourceVersion: a relist-diff against it (`origin = resync`), never a full snapshot. Objects
//! unchanged since the old count delivered them send nothing; a change the old count had not
//! delivered is sent as the object's state now; an object deleted meanwhile as a delete.
//!
//! Which layout is the stream's state: the one whose position record was written last (the
//! records' order in the store: Kafka offsets, NATS stream sequences). Going back to a count
//! used before, that count's own records are older than the last count's: the last count's
//! index is adopted, with the objects only the older records still name (a relist-diff
//! settles them: deletes of objects that are gone, the state of those that changed).

use std::collections::BTreeMap;

use crate::model::{EntryRef, ObjectIndex, Position, Shard};

/// A shard's position under another layout: its resourceVersion as a number (`None`: none
/// yet, or not a number) and its acknowledgements ahead.
type ShardPosition = (Option<u64>, Vec<(String, String)>);

/// The state of one stream under one other layout (`count`: 1 = without shards).
#[derive(Debug, Default)]
struct Layout {
    /// Order (in the store) of its latest position record.
    newest: u64,
    /// Its shards' positions: per shard (`None`: the whole stream), its resourceVersion as a
    /// number (`None`: none yet, or not a number) and its acknowledgements ahead.
    shards: BTreeMap<Option<Shard>, ShardPosition>,
    /// The objects of its index that this process's shard owns.
    objects: ObjectIndex,
}

/// What a loader found of one stream under other layouts.
#[derive(Debug, Default)]
pub struct Foreign {
    layouts: BTreeMap<u32, Layout>,
}

/// Where a shard's position came from, when it was adopted from another layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// The layout's shard count (1: without shards).
    pub count: u32,
    /// Its shards whose positions were read.
    pub shards: usize,
}

impl Foreign {
    /// A position record of the layout of `count` (of its shard `shard`), read at `order`.
    /// (`rv` and `acked_ahead`: the record's.)
    pub fn position(
        &mut self,
        count: u32,
        shard: Option<Shard>,
        order: u64,
        rv: Option<&str>,
        acked_ahead: &[(String, String)],
    ) {
        let l = self.layouts.entry(count).or_default();
        l.newest = l.newest.max(order);
        let rv = rv.and_then(|rv| rv.parse().ok());
        l.shards.insert(shard, (rv, acked_ahead.to_vec()));
    }

    /// An index record of the layout of `count` (`entry` `None`: removed), kept when `ours`
    /// (this process's shard; `None`: the whole stream) owns the object.
    pub fn object(&mut self, count: u32, ours: Option<Shard>, uid: &str, entry: Option<EntryRef<'_>>) {
        if ours.is_some_and(|s| !s.owns(uid)) {
            return;
        }
        let objects = &mut self.layouts.entry(count).or_default().objects;
        match entry {
            Some(e) => objects.insert_ref(uid, e),
            None => {
                objects.remove(uid);
            }
        }
    }

    /// The layout to adopt instead of `own` (read at `own_order`), if one was written after
    /// it (or there is no own state).
    pub fn newer_than(&self, own_order: Option<u64>) -> Option<u32> {
        let (count, l) = self.layouts.iter().filter(|(_, l)| !l.shards.is_empty()).max_by_key(|(_, l)| l.newest)?;
        own_order.is_none_or(|own| l.newest > own).then_some(*count)
    }

    /// The position adopted from the layout of `count` for shard `ours` (`None`: the whole
    /// stream): its index (the objects `ours` owns), with the objects only `own` (older) still
    /// names. Where every shard of the layout has a resourceVersion, the stream resumes by
    /// watch from the oldest of them, each old shard's own as the floor of its objects (nothing
    /// is missed, nothing sent twice); else it relists and diffs.
    pub fn adopt(mut self, count: u32, ours: Option<Shard>, own: Option<&ObjectIndex>) -> (Position, Adopted) {
        let l = self.layouts.remove(&count).unwrap_or_default();
        let mut objects = l.objects;
        if let Some(own) = own {
            for (uid, e) in own.iter() {
                let uid = uid.to_string();
                if objects.get(&uid).is_none() {
                    objects.insert_ref(&uid, e);
                }
            }
        }
        let complete = l.shards.len() as u32 == count && l.shards.values().all(|(rv, _)| rv.is_some());
        let (resource_version, floors, acked_ahead) = if complete {
            let floors: Vec<(Shard, u64)> = l
                .shards
                .iter()
                .map(|(s, (rv, _))| {
                    (s.unwrap_or_else(|| Shard::new(0, 1).expect("the whole stream")), rv.unwrap_or_default())
                })
                .collect();
            let oldest = floors.iter().map(|(_, rv)| *rv).min().unwrap_or_default();
            let ahead = l
                .shards
                .values()
                .flat_map(|(_, a)| a.iter().cloned())
                .filter(|(uid, _)| ours.is_none_or(|s| s.owns(uid)))
                .collect();
            (Some(oldest.to_string()), floors, ahead)
        } else {
            (None, Vec::new(), Vec::new())
        };
        let position =
            Position { resource_version, objects, acked_ahead, snapshot: false, adopted_from: Some(count), floors };
        (position, Adopted { count, shards: l.shards.len() })
    }
}
