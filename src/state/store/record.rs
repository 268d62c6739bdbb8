//! The state records of the broker stores (Kafka state topic, NATS key-value bucket): one
//! keyed record per delivered object and one position record per stream, so a write carries
//! what changed and compaction (Kafka) or history 1 (NATS KV) keeps the latest of each key.
//!
//! ```text
//! key                                  value
//! <stream id>.p                        {"format":1,"stream":{..},"cluster_uid":..,"epoch":..,
//!                                       "writer":..,"resource_version":..,"acked_ahead":[..]}
//! <stream id>.o.<uid>                  ["namespace","name","resourceVersion"]
//! <stream id>.o.<uid>   (deleted)      Kafka: null value (tombstone); NATS: a delete marker
//! ```
//!
//! The stream id ([`StreamKey::id`]) names the query, so streams of other queries or other
//! deployments sharing the topic or bucket are skipped. A record that cannot be read is an
//! error naming its key, never a silent replay.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;
use super::stream::{Owner, SHARD_INFIX, StreamKey};
use crate::model::{EntryRef, ObjectIndex, Position, Rv, Shard};

/// Format of the position record this build writes and reads.
pub const RECORD_FORMAT: u32 = 1;

/// The key of a stream's position record.
pub fn position_key(stream: &str) -> String {
    format!("{stream}.p")
}

/// The key of one object's index record.
pub fn object_key(stream: &str, uid: &str) -> String {
    format!("{stream}.o.{uid}")
}

/// The stored position of a stream (without its index).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PositionRecord {
    pub format: u32,
    pub stream: StreamKey,
    /// The uid of the cluster's `kube-system` namespace, when kubecast could read it.
    #[serde(default)]
    pub cluster_uid: Option<String>,
    /// The lease epoch of the writer (0 without `[coordination]`).
    pub epoch: i64,
    pub writer: String,
    pub resource_version: Option<String>,
    #[serde(default)]
    pub acked_ahead: Vec<(String, String)>,
    /// See [`Position::snapshot`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot: bool,
}

impl PositionRecord {
    pub fn new(key: &StreamKey, owner: &Owner, rv: Option<&str>, acked_ahead: &[(String, String)]) -> Self {
        Self {
            format: RECORD_FORMAT,
            stream: key.clone(),
            cluster_uid: owner.cluster_uid.clone(),
            epoch: owner.epoch.unwrap_or(0),
            writer: owner.writer.clone(),
            resource_version: rv.map(str::to_string),
            acked_ahead: acked_ahead.to_vec(),
            snapshot: false,
        }
    }

    /// With the stream's [`Position::snapshot`] mark.
    pub fn with_snapshot(self, snapshot: bool) -> Self {
        Self { snapshot, ..self }
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("position record serialises")
    }
}

pub fn encode_object(e: EntryRef<'_>) -> Vec<u8> {
    serde_json::to_vec(&(e.namespace.unwrap_or(""), e.name, e.resource_version.to_string()))
        .expect("index record serialises")
}

/// Folds the records of a store, read in order, into the positions of `keys`.
pub struct Loader<'a> {
    /// Where the records come from, for errors (e.g. `Kafka topic kubecast-state`).
    place: String,
    owner: &'a Owner,
    /// stream id -> its slot in `keys`.
    ids: HashMap<String, usize>,
    keys: &'a [StreamKey],
    /// stream id without its shard -> the shard this process loads (see [`check_layout`]).
    bases: HashMap<String, Option<Shard>>,
    positions: Vec<Option<PositionRecord>>,
    indexes: Vec<ObjectIndex>,
}

impl<'a> Loader<'a> {
    pub fn new(place: impl Into<String>, keys: &'a [StreamKey], owner: &'a Owner) -> Self {
        Self {
            place: place.into(),
            owner,
            ids: keys.iter().enumerate().map(|(i, k)| (k.id(), i)).collect(),
            bases: layout_of(keys),
            keys,
            positions: vec![None; keys.len()],
            indexes: vec![ObjectIndex::default(); keys.len()],
        }
    }

    fn corrupt(&self, key: &str, cause: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Corrupt { path: format!("{} record {key:?}", self.place).into(), cause: cause.to_string() }
    }

    /// One record; `value` `None` for a deletion. Keys of other streams are skipped.
    pub fn apply(&mut self, key: &str, value: Option<&[u8]>) -> Result<(), CheckpointError> {
        if check_layout(&self.place, key, &self.bases)? == Layout::OtherShard {
            return Ok(());
        }
        let Some((slot, rest)) = split_key(key, &self.ids) else { return Ok(()) };
        match (rest, value) {
            (Rest::Position, None) => {
                // Never written by kubecast: someone removed the position.
                return Err(self.corrupt(key, "the position record was deleted"));
            }
            (Rest::Position, Some(bytes)) => {
                #[derive(Deserialize)]
                struct Versioned {
                    format: u32,
                }
                let v: Versioned = serde_json::from_slice(bytes).map_err(|e| self.corrupt(key, e))?;
                if v.format != RECORD_FORMAT {
                    return Err(self.corrupt(
                        key,
                        format!("format {} (this kubecast reads format {RECORD_FORMAT}; run the kubecast version that wrote it)", v.format),
                    ));
                }
                let p: PositionRecord = serde_json::from_slice(bytes).map_err(|e| self.corrupt(key, e))?;
                if p.stream != self.keys[slot] {
                    return Err(CheckpointError::OtherStream {
                        path: format!("{} record {key:?}", self.place).into(),
                        found: format!("{:?}", p.stream),
                    });
                }
                check_cluster(&self.place, key, p.cluster_uid.as_deref(), self.owner)?;
                check_epoch(&self.place, key, &p, self.owner)?;
                self.positions[slot] = Some(p);
            }
            (Rest::Object(uid), None) => {
                self.indexes[slot].remove(uid);
            }
            (Rest::Object(uid), Some(bytes)) => {
                let (ns, name, rv): (String, String, String) =
                    serde_json::from_slice(bytes).map_err(|e| self.corrupt(key, e))?;
                if name.is_empty() || rv.is_empty() {
                    return Err(self.corrupt(key, "empty name or resourceVersion"));
                }
                let entry = EntryRef {
                    namespace: (!ns.is_empty()).then_some(ns.as_str()),
                    name: &name,
                    resource_version: Rv::Text(&rv),
                };
                self.indexes[slot].insert_ref(uid, entry);
            }
            (Rest::Unknown, _) => return Err(self.corrupt(key, "not a kubecast state key")),
        }
        Ok(())
    }

    /// The positions, in the order of `keys` (`None`: no state yet). An index without a
    /// position record is an error: kubecast writes the position with every index change.
    pub fn finish(self) -> Result<Vec<Option<Position>>, CheckpointError> {
        let mut out = Vec::new();
        for ((p, objects), key) in self.positions.into_iter().zip(self.indexes).zip(self.keys) {
            match p {
                Some(rec) => out.push(Some(Position {
                    resource_version: rec.resource_version,
                    objects,
                    acked_ahead: rec.acked_ahead,
                    snapshot: rec.snapshot,
                })),
                None if objects.is_empty() => out.push(None),
                None => {
                    return Err(CheckpointError::Corrupt {
                        path: format!("{} records of {}", self.place, key.id()).into(),
                        cause: format!("{} index records but no position record", objects.len()),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// One stream of a broker store as [`fold_all`] found it (for `kubecast state`).
#[derive(Debug)]
pub struct ScannedStream {
    pub record: PositionRecord,
    pub position: Position,
    /// When its position record was written (ms since the epoch), if the broker says.
    pub written_ms: Option<i64>,
}

/// The latest record of each key of a store (value `None`: deleted), with its time in ms.
pub type Latest = HashMap<String, (Option<Vec<u8>>, Option<i64>)>;

/// Every stream in `records`: the streams are found by their position records (which name
/// their query), then every record is folded as [`Loader`] does, without an owner (no cluster
/// check: the caller shows the stored cluster uid).
pub fn fold_all(place: &str, records: &Latest) -> Result<Vec<ScannedStream>, CheckpointError> {
    let corrupt =
        |key: &str, cause: String| CheckpointError::Corrupt { path: format!("{place} record {key:?}").into(), cause };
    let mut found: Vec<(String, Option<i64>)> = Vec::new();
    let mut keys = Vec::new();
    for (key, (value, ts)) in records {
        let (Some(id), Some(bytes)) = (key.strip_suffix(".p"), value) else { continue };
        #[derive(Deserialize)]
        struct Versioned {
            format: u32,
        }
        let Ok(v) = serde_json::from_slice::<Versioned>(bytes) else {
            if id.contains(".o.") {
                continue; // an index record of an object with uid "p"
            }
            return Err(corrupt(key, "not a position record".into()));
        };
        if v.format != RECORD_FORMAT {
            return Err(corrupt(key, format!("format {} (this kubecast reads format {RECORD_FORMAT})", v.format)));
        }
        let p: PositionRecord = serde_json::from_slice(bytes).map_err(|e| corrupt(key, e.to_string()))?;
        if p.stream.id() != id {
            return Err(CheckpointError::OtherStream {
                path: format!("{place} record {key:?}").into(),
                found: format!("{:?}", p.stream),
            });
        }
        keys.push(p.stream);
        found.push((key.clone(), *ts));
    }
    let owner = Owner::default();
    let mut loader = Loader::new(place, &keys, &owner);
    // Every stream found is listed, each shard of a sharded one too: no shard is "another
    // process's" here, and no layout is refused (a listing shows what is stored).
    loader.bases.clear();
    for (key, (value, _)) in records {
        if value.is_none() && key.ends_with(".p") {
            continue; // a deleted position record (not kubecast's doing): no stream
        }
        loader.apply(key, value.as_deref())?;
    }
    let records_of: Vec<Option<PositionRecord>> = loader.positions.clone();
    let positions = loader.finish()?;
    records_of
        .into_iter()
        .zip(positions)
        .zip(found)
        .map(|((record, position), (key, written_ms))| match (record, position) {
            (Some(record), Some(position)) => Ok(ScannedStream { record, position, written_ms }),
            // Each stream was found by its position record above, which the loader read.
            _ => Err(corrupt(&key, "its position record could not be read back".into())),
        })
        .collect()
}

/// Refuses state of another cluster that used the same `[cluster] name`.
pub fn check_cluster(place: &str, what: &str, stored: Option<&str>, owner: &Owner) -> Result<(), CheckpointError> {
    if let (Some(stored), Some(ours)) = (stored, owner.cluster_uid.as_deref())
        && stored != ours
    {
        return Err(CheckpointError::OtherCluster {
            what: format!("{place} {what}"),
            stored: stored.to_string(),
            ours: ours.to_string(),
        });
    }
    Ok(())
}

/// Refuses state written under a higher lease epoch than `owner` holds: a later holder of the
/// Lease owns it (this process lost the Lease, or the Lease was made again). A process that
/// holds no Lease (`epoch` `None`) is not compared.
pub fn check_epoch(place: &str, what: &str, stored: &PositionRecord, owner: &Owner) -> Result<(), CheckpointError> {
    match owner.epoch {
        Some(ours) if stored.epoch > ours => Err(CheckpointError::Superseded {
            what: format!("{place} record {what:?}"),
            stored: stored.epoch,
            ours,
            writer: stored.writer.clone(),
        }),
        _ => Ok(()),
    }
}

/// The stream ids (without shard) of `keys` -> the shard each is loaded for.
pub fn layout_of(keys: &[StreamKey]) -> HashMap<String, Option<Shard>> {
    keys.iter().map(|k| (k.base_id(), k.shard)).collect()
}

/// What [`check_layout`] found a key to be.
#[derive(Debug, PartialEq, Eq)]
pub enum Layout {
    /// A record of another shard of the same count (another process's), or of another stream.
    OtherShard,
    /// Possibly one of the streams loaded: read on.
    Ours,
}

/// Refuses state that a different `[coordination] shards` wrote for a stream loaded
/// (`bases`: see [`layout_of`]): the position record of the whole stream while shards are
/// loaded, or of a shard of another count. Records of the other shards of the same count are
/// [`Layout::OtherShard`].
pub fn check_layout(place: &str, key: &str, bases: &HashMap<String, Option<Shard>>) -> Result<Layout, CheckpointError> {
    let stored = |shard: Option<Shard>| shard.map_or(1, |s| s.count());
    if let Some(at) = key.find(SHARD_INFIX) {
        let (base, rest) = (&key[..at], &key[at + SHARD_INFIX.len()..]);
        let label = rest.split('.').next().unwrap_or_default();
        if let (Some(ours), Some(theirs)) = (bases.get(base), Shard::parse_label(label)) {
            if ours.is_none_or(|o| o.count() != theirs.count()) {
                return Err(layout_error(place, key, theirs.count(), stored(*ours)));
            }
            if *ours != Some(theirs) {
                return Ok(Layout::OtherShard);
            }
        }
        return Ok(Layout::Ours);
    }
    if let Some(base) = key.strip_suffix(".p")
        && let Some(Some(ours)) = bases.get(base)
    {
        return Err(layout_error(place, key, 1, ours.count()));
    }
    Ok(Layout::Ours)
}

fn layout_error(place: &str, key: &str, stored: u32, ours: u32) -> CheckpointError {
    CheckpointError::ShardLayout { what: format!("{place} record {key:?}"), stored, ours }
}

enum Rest<'k> {
    Position,
    Object(&'k str),
    Unknown,
}

/// `<stream>.p` or `<stream>.o.<uid>`, for one of `ids`. Stream ids contain dots themselves
/// (a group may even contain `.o.`), so each place the rest could start is tried against the
/// known ids; keys of unknown streams give `None`.
fn split_key<'k>(key: &'k str, ids: &HashMap<String, usize>) -> Option<(usize, Rest<'k>)> {
    for (i, _) in key.match_indices('.') {
        let Some(&slot) = ids.get(&key[..i]) else { continue };
        let rest = &key[i + 1..];
        return Some((
            slot,
            match rest.strip_prefix("o.") {
                _ if rest == "p" => Rest::Position,
                Some(uid) if !uid.is_empty() && !uid.contains('.') => Rest::Object(uid),
                _ => Rest::Unknown,
            },
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Index, IndexEntry};
    use proptest::prelude::*;

    fn key(kind: &str) -> StreamKey {
        StreamKey {
            cluster: "c".into(),
            group: "apps".into(),
            version: "v1".into(),
            kind: kind.into(),
            namespace: Some("shop".into()),
            label_selector: "".into(),
            field_selector: "".into(),
            shard: None,
        }
    }

    fn owner(epoch: i64, uid: Option<&str>) -> Owner {
        Owner { cluster_uid: uid.map(Into::into), epoch: Some(epoch), writer: "w".into() }
    }

    #[test]
    fn keys_split_back_into_stream_and_uid() {
        let mut odd = key("Widget");
        odd.group = "o.example.com".into();
        let ids: HashMap<String, usize> = [(key("Deployment").id(), 0), (odd.id(), 1)].into_iter().collect();
        let uid = "6f1c1a9e-2b7d-4c1e-9f00-0123456789ab";
        for (id, slot) in &ids {
            assert!(matches!(split_key(&position_key(id), &ids), Some((s, Rest::Position)) if s == *slot));
            assert!(
                matches!(split_key(&object_key(id, uid), &ids), Some((s, Rest::Object(u))) if s == *slot && u == uid)
            );
        }
        assert!(split_key(&object_key(&key("StatefulSet").id(), uid), &ids).is_none(), "not ours");
    }

    #[test]
    fn state_of_another_shard_count_is_refused_and_other_shards_are_skipped() {
        let whole = key("Deployment");
        let shard = |i, n| whole.with_shard(Shard::new(i, n));
        assert_eq!(shard(1, 4).id(), format!("{}.shard-1-of-4", whole.id()));
        assert_eq!(shard(1, 4).base_id(), whole.id(), "the stream's id does not change without shards");
        let mine = owner(1, None);
        let ours = [shard(1, 4)];
        let record = |k: &StreamKey| PositionRecord::new(k, &mine, Some("10"), &[]).encode();
        let mut l = Loader::new("test", &ours, &mine);
        // The other shards of the same count: another process's, skipped unread.
        l.apply(&position_key(&shard(0, 4).id()), Some(b"not read")).unwrap();
        l.apply(&object_key(&shard(3, 4).id(), "u"), Some(b"not read")).unwrap();
        l.apply(&position_key(&shard(1, 4).id()), Some(&record(&shard(1, 4)))).unwrap();
        // Another count, or the whole stream's state: refused, naming both counts.
        for (other, stored) in [(shard(0, 2), 2), (whole.clone(), 1)] {
            let e = l.apply(&position_key(&other.id()), Some(&record(&other))).unwrap_err();
            assert!(matches!(e, CheckpointError::ShardLayout { stored: s, ours: 4, .. } if s == stored), "{e}");
        }
        assert!(l.finish().unwrap()[0].is_some());
        // Without shards, a shard's state is refused too; another stream's shards are not ours.
        let plain = [whole.clone()];
        let mut l = Loader::new("test", &plain, &mine);
        l.apply(&position_key(&key("StatefulSet").with_shard(Shard::new(0, 2)).id()), Some(b"x")).unwrap();
        let e = l.apply(&object_key(&shard(0, 2).id(), "u"), Some(b"[]")).unwrap_err();
        assert!(matches!(e, CheckpointError::ShardLayout { stored: 2, ours: 1, .. }), "{e}");
        assert!(e.to_string().contains("shards = 2") && e.to_string().contains("shards = 1"), "{e}");
    }

    #[test]
    fn foreign_cluster_and_bad_records_are_errors() {
        let keys = [key("Deployment")];
        let k = &keys[0];
        let mine = owner(3, Some("uid-a"));
        let p = |o: &Owner| PositionRecord::new(k, o, Some("10"), &[]).encode();
        let mut l = Loader::new("test", &keys, &mine);
        let e = l.apply(&position_key(&k.id()), Some(&p(&owner(3, Some("uid-b"))))).unwrap_err().to_string();
        assert!(e.contains("uid-b") && e.contains("uid-a"), "{e}");
        l.apply(&position_key(&k.id()), Some(&p(&owner(3, Some("uid-a"))))).unwrap();
        let e = l.apply(&object_key(&k.id(), "u"), Some(b"{")).unwrap_err().to_string();
        assert!(e.contains(".o.u"), "names the record: {e}");
        let e = l.apply(&position_key(&k.id()), Some(b"{\"format\":9}")).unwrap_err().to_string();
        assert!(e.contains("format 9"), "{e}");
        // Another stream's records are not ours.
        l.apply(&object_key(&key("StatefulSet").id(), "u"), Some(b"{")).unwrap();
        let mut l = Loader::new("test", &keys, &mine);
        l.apply(&object_key(&k.id(), "u"), Some(&encode_object((&entry("1")).into()))).unwrap();
        assert!(l.finish().unwrap_err().to_string().contains("no position record"));
    }

    /// State written under a higher lease epoch belongs to a later holder of the Lease: refused,
    /// naming the record, both epochs and the writer; the same or a lower epoch is loaded, and
    /// a process without a Lease is not compared.
    #[test]
    fn a_higher_stored_epoch_is_refused() {
        let keys = [key("Deployment")];
        let k = &keys[0];
        let record = |epoch: i64| {
            let writer = Owner { writer: "kubecast-b".into(), ..owner(epoch, None) };
            PositionRecord::new(k, &writer, Some("10"), &[]).encode()
        };
        let mine = owner(3, None);
        let mut l = Loader::new("NATS bucket s", &keys, &mine);
        let e = l.apply(&position_key(&k.id()), Some(&record(4))).unwrap_err();
        assert!(e.is_fatal(), "{e}");
        let text = e.to_string();
        for part in [
            "NATS bucket s",
            &position_key(&k.id()),
            "lease epoch 4",
            "kubecast-b",
            "holds epoch 3",
            "leaseTransitions",
        ] {
            assert!(text.contains(part), "{part:?} missing from: {text}");
        }
        for epoch in [3, 2, 0] {
            let mut l = Loader::new("test", &keys, &mine);
            l.apply(&position_key(&k.id()), Some(&record(epoch))).unwrap();
            assert_eq!(l.finish().unwrap()[0].as_ref().unwrap().resource_version.as_deref(), Some("10"));
        }
        let no_lease = Owner { epoch: None, ..mine };
        let mut l = Loader::new("test", &keys, &no_lease);
        l.apply(&position_key(&k.id()), Some(&record(7))).unwrap();
        // What a process without a Lease writes is stored as epoch 0.
        assert_eq!(PositionRecord::new(k, &no_lease, None, &[]).epoch, 0);
    }

    #[test]
    fn fold_all_finds_every_stream_by_its_position_record() {
        let (a, b) = (key("Deployment"), key("StatefulSet"));
        let me = owner(2, Some("uid-a"));
        let mut latest = Latest::new();
        let mut put = |k: String, v: Option<Vec<u8>>, ts: i64| {
            latest.insert(k, (v, Some(ts)));
        };
        put(position_key(&a.id()), Some(PositionRecord::new(&a, &me, Some("10"), &[]).encode()), 5);
        put(object_key(&a.id(), "u1"), Some(encode_object((&entry("3")).into())), 4);
        put(object_key(&a.id(), "u2"), None, 4);
        put(position_key(&b.id()), Some(PositionRecord::new(&b, &me, None, &[]).encode()), 7);
        // A stream whose position record was deleted is no stream; its records are skipped.
        let c = key("DaemonSet");
        put(position_key(&c.id()), None, 8);
        put(object_key(&c.id(), "u9"), Some(encode_object((&entry("9")).into())), 8);
        let mut found = fold_all("test", &latest).unwrap();
        found.sort_by_key(|s| s.record.stream.kind.clone());
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].record.stream, a);
        assert_eq!(found[0].record.epoch, 2);
        assert_eq!(found[0].position.objects.len(), 1);
        assert_eq!(found[0].position.resource_version.as_deref(), Some("10"));
        assert_eq!(found[0].written_ms, Some(5));
        assert_eq!(found[1].record.stream, b);
        assert!(found[1].position.objects.is_empty());
        // An unreadable record of a stream is an error naming it.
        latest.insert(object_key(&b.id(), "u3"), (Some(b"{".to_vec()), None));
        assert!(fold_all("test", &latest).unwrap_err().to_string().contains(".o.u3"));
        latest.insert(position_key(&b.id()), (Some(b"{\"format\":9}".to_vec()), None));
        assert!(fold_all("test", &latest).unwrap_err().to_string().contains("format 9"));
    }

    /// A sharded stream's state (as `kubecast state list` reads a Kafka or NATS store): every
    /// shard is listed with its own objects, none skipped as another process's.
    #[test]
    fn fold_all_lists_every_shard_of_a_sharded_stream() {
        let whole = key("Deployment");
        let me = owner(3, None);
        let mut latest = Latest::new();
        for i in 0..3 {
            let s = whole.with_shard(Shard::new(i, 3));
            let rv = format!("{}", 10 + i);
            latest
                .insert(position_key(&s.id()), (Some(PositionRecord::new(&s, &me, Some(&rv), &[]).encode()), Some(1)));
            let uid = format!("u{i}");
            latest.insert(object_key(&s.id(), &uid), (Some(encode_object((&entry(&rv)).into())), Some(1)));
        }
        let mut found = fold_all("test", &latest).unwrap();
        found.sort_by_key(|s| s.record.stream.id());
        assert_eq!(found.len(), 3);
        for (i, s) in found.iter().enumerate() {
            assert_eq!(s.record.stream, whole.with_shard(Shard::new(i as u32, 3)));
            assert_eq!(s.position.resource_version.as_deref(), Some(format!("{}", 10 + i).as_str()));
            assert_eq!(s.position.objects.len(), 1, "shard {i}'s own object");
        }
    }

    fn entry(rv: &str) -> IndexEntry {
        IndexEntry { namespace: Some("shop".into()), name: format!("n{rv}"), resource_version: rv.into() }
    }

    proptest! {
        /// Any sequence of writes, folded back, gives the last value of each object.
        #[test]
        fn folding_the_records_gives_the_last_state(ops in proptest::collection::vec((0u8..20, proptest::option::of(1u32..1000)), 0..200)) {
            let keys = [key("Deployment")];
            let k = &keys[0];
            let me = owner(0, None);
            let mut model = Index::default();
            let mut l = Loader::new("test", &keys, &me);
            for (uid, rv) in &ops {
                let uid = format!("u{uid}");
                match rv {
                    Some(rv) => {
                        let e = entry(&rv.to_string());
                        l.apply(&object_key(&k.id(), &uid), Some(&encode_object((&e).into()))).unwrap();
                        model.insert(uid, e);
                    }
                    None => {
                        l.apply(&object_key(&k.id(), &uid), None).unwrap();
                        model.remove(&uid);
                    }
                }
            }
            l.apply(&position_key(&k.id()), Some(&PositionRecord::new(k, &me, Some("7"), &[("a".into(), "8".into())]).encode())).unwrap();
            let pos = l.finish().unwrap().remove(0).unwrap();
            prop_assert_eq!(pos.objects.to_index(), model);
            prop_assert_eq!(pos.resource_version.as_deref(), Some("7"));
            prop_assert_eq!(pos.acked_ahead, vec![("a".to_string(), "8".to_string())]);
        }
    }
}
