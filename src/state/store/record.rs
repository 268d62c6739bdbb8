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

use super::adopt::Foreign;
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
    /// See [`Position::floors`]: the old shard count's floors, until the position passes them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub floors: Vec<(Shard, u64)>,
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
            floors: Vec::new(),
        }
    }

    /// With the stream's [`Position::floors`].
    pub fn with_floors(self, floors: &[(Shard, u64)]) -> Self {
        Self { floors: floors.to_vec(), ..self }
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
    /// Per slot: the order of its own position record, and its state under other layouts.
    own_order: Vec<Option<u64>>,
    foreign: Vec<Foreign>,
    /// stream id without its shard -> its slot.
    base_slots: HashMap<String, usize>,
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
            own_order: vec![None; keys.len()],
            foreign: keys.iter().map(|_| Foreign::default()).collect(),
            base_slots: keys.iter().enumerate().map(|(i, k)| (k.base_id(), i)).collect(),
        }
    }

    fn corrupt(&self, key: &str, cause: impl std::fmt::Display) -> CheckpointError {
        CheckpointError::Corrupt { path: format!("{} record {key:?}", self.place).into(), cause: cause.to_string() }
    }

    /// One record, read at `order` in the store (Kafka offset, NATS stream sequence: later
    /// records have a higher one); `value` `None` for a deletion. Keys of other streams, and of
    /// the other shards of this process's count, are skipped; those of another count are kept
    /// aside (see [`Foreign`]).
    pub fn apply(&mut self, key: &str, value: Option<&[u8]>, order: u64) -> Result<(), CheckpointError> {
        match check_layout(key, &self.bases) {
            Layout::OtherShard => return Ok(()),
            Layout::Other { base, count, rest } => return self.foreign_record(key, base, count, rest, value, order),
            Layout::Ours => {}
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
                self.own_order[slot] = Some(order);
            }
            (Rest::Object(uid), None) => {
                self.indexes[slot].remove(uid);
            }
            (Rest::Object(uid), Some(bytes)) => {
                let (ns, name, rv) = self.object_value(key, bytes)?;
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

    fn object_value(&self, key: &str, bytes: &[u8]) -> Result<(String, String, String), CheckpointError> {
        let (ns, name, rv): (String, String, String) =
            serde_json::from_slice(bytes).map_err(|e| self.corrupt(key, e))?;
        if name.is_empty() || rv.is_empty() {
            return Err(self.corrupt(key, "empty name or resourceVersion"));
        }
        Ok((ns, name, rv))
    }

    /// A record of a loaded stream under another layout (`count`; `rest`: `p` or `o.<uid>`).
    fn foreign_record(
        &mut self,
        key: &str,
        base: &str,
        count: u32,
        rest: &str,
        value: Option<&[u8]>,
        order: u64,
    ) -> Result<(), CheckpointError> {
        let Some(&slot) = self.base_slots.get(base) else { return Ok(()) };
        let ours = self.keys[slot].shard;
        match (rest, value) {
            ("p", Some(bytes)) => {
                let p: PositionRecord = serde_json::from_slice(bytes).map_err(|e| self.corrupt(key, e))?;
                check_cluster(&self.place, key, p.cluster_uid.as_deref(), self.owner)?;
                self.foreign[slot].position(
                    count,
                    p.stream.shard,
                    order,
                    p.resource_version.as_deref(),
                    &p.acked_ahead,
                );
            }
            ("p", None) => {}
            (rest, value) => {
                let Some(uid) = rest.strip_prefix("o.").filter(|u| !u.is_empty() && !u.contains('.')) else {
                    return Err(self.corrupt(key, "not a kubecast state key"));
                };
                match value {
                    None => self.foreign[slot].object(count, ours, uid, None),
                    Some(bytes) => {
                        let (ns, name, rv) = self.object_value(key, bytes)?;
                        let entry = EntryRef {
                            namespace: (!ns.is_empty()).then_some(ns.as_str()),
                            name: &name,
                            resource_version: Rv::Text(&rv),
                        };
                        self.foreign[slot].object(count, ours, uid, Some(entry));
                    }
                }
            }
        }
        Ok(())
    }

    /// The other layouts (shard counts) whose state each stream adopts as read so far: their
    /// index records are needed too (a store that reads by key, NATS, reads them then).
    pub fn adopting(&self) -> Vec<u32> {
        self.foreign.iter().zip(&self.own_order).filter_map(|(f, own)| f.newer_than(*own)).collect()
    }

    /// The positions, in the order of `keys` (`None`: no state yet). An index without a
    /// position record is an error: kubecast writes the position with every index change.
    /// Where another layout's state was written after the stream's own (or it has none), that
    /// state is adopted ([`Foreign::adopt`]).
    pub fn finish(self) -> Result<Vec<Option<Position>>, CheckpointError> {
        let mut out = Vec::new();
        let rows = self.positions.into_iter().zip(self.indexes).zip(self.own_order).zip(self.foreign);
        for ((((p, objects), own_order), foreign), key) in rows.zip(self.keys) {
            let own = match p {
                Some(rec) => Some(Position {
                    resource_version: rec.resource_version,
                    objects,
                    acked_ahead: rec.acked_ahead,
                    snapshot: rec.snapshot,
                    adopted_from: None,
                    floors: rec.floors,
                }),
                None if objects.is_empty() => None,
                None => {
                    return Err(CheckpointError::Corrupt {
                        path: format!("{} records of {}", self.place, key.id()).into(),
                        cause: format!("{} index records but no position record", objects.len()),
                    });
                }
            };
            match foreign.newer_than(own_order) {
                Some(count) => {
                    let (position, adopted) = foreign.adopt(count, key.shard, own.as_ref().map(|p| &p.objects));
                    tracing::info!(
                        stream = %key.id(),
                        from_shards = count,
                        shards_read = adopted.shards,
                        objects = position.objects.len(),
                        own_state = own.is_some(),
                        resume_at = position.resource_version.as_deref().unwrap_or("(a relist-diff)"),
                        "the stream's state was written last with another shard count: resuming from its positions (a watch from the oldest of them, each object's changes sent from where its old shard stopped; a relist-diff where they cannot be resumed)"
                    );
                    out.push(Some(position));
                }
                None => out.push(own),
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
        loader.apply(key, value.as_deref(), 0)?;
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
pub enum Layout<'k> {
    /// A record of another shard of the same count (another process's), or of another stream.
    OtherShard,
    /// A record of a stream loaded, written under another `[coordination] shards` (`count`; 1:
    /// without shards); `rest`: `p` or `o.<uid>`.
    Other { base: &'k str, count: u32, rest: &'k str },
    /// Possibly one of the streams loaded: read on.
    Ours,
}

/// Where `key` belongs for the streams loaded (`bases`: see [`layout_of`]): this process's
/// shard, another shard of its count, or another layout of the same stream (the whole stream
/// while shards are loaded, or a shard of another count).
pub fn check_layout<'k>(key: &'k str, bases: &HashMap<String, Option<Shard>>) -> Layout<'k> {
    if let Some(at) = key.find(SHARD_INFIX) {
        let (base, rest) = (&key[..at], &key[at + SHARD_INFIX.len()..]);
        let (label, after) = rest.split_once('.').unwrap_or((rest, ""));
        if let (Some(ours), Some(theirs)) = (bases.get(base), Shard::parse_label(label)) {
            if ours.is_none_or(|o| o.count() != theirs.count()) {
                return Layout::Other { base, count: theirs.count(), rest: after };
            }
            if *ours != Some(theirs) {
                return Layout::OtherShard;
            }
        }
        return Layout::Ours;
    }
    // The whole stream's records (`<base>.p`, `<base>.o.<uid>`) while a shard is loaded.
    for (at, _) in key.match_indices('.') {
        if let Some(Some(_)) = bases.get(&key[..at]) {
            return Layout::Other { base: &key[..at], count: 1, rest: &key[at + 1..] };
        }
    }
    Layout::Ours
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

/// Unit tests: keys, layouts, other shard counts adopted, bad records, epochs (`tests.rs` in the folder of this file's name).
#[cfg(test)]
mod tests;
