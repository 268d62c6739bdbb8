//! The file store: per stream, a snapshot file (`<stream id>.json`, written atomically: temp
//! file, fsync, rename, fsync of the directory) and a journal (`<stream id>.journal`) of the
//! deltas written since, one JSON line each, fsynced. A write appends one line; once the
//! journal is larger than the snapshot (and 64 KiB) the next write is a full one: a new
//! snapshot, then the journal is emptied. So the bytes written stay in proportion to the
//! changes (at most about twice them).
//!
//! Every snapshot and journal line carries a sequence number; loading applies the journal lines
//! newer than the snapshot (a crash between the snapshot's rename and the journal's truncation
//! leaves only older lines). A last line without its newline was torn by a crash during the
//! append: it is cut off (that write was never acknowledged as done). Any other line that
//! cannot be read is an error naming the file and line.
//!
//! The directory is locked (`flock` on [`LOCK_FILE`]) for one process: a second one fails at
//! start naming the holder.

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::error::CheckpointError;
use super::record::check_cluster;
use super::stream::{Delta, Owner, StreamKey};
use crate::model::{EntryRef, IndexEntry, ObjectIndex, Position, Rv};

/// Version of the snapshot format this build writes (it reads 1 too: no journal then).
pub const FORMAT_VERSION: u32 = 2;

/// Name of the lock file in the checkpoint directory.
pub const LOCK_FILE: &str = ".kubecast.lock";

/// Journal size below which no compaction happens, whatever the snapshot's size.
const MIN_COMPACTION_BYTES: u64 = 64 * 1024;
/// The read buffer of a snapshot being loaded.
const READ_BUFFER: usize = 256 * 1024;

/// The `version` of a snapshot that did not parse, read on its own (the rest skipped).
fn version_of(path: &Path) -> Option<u32> {
    #[derive(Deserialize)]
    struct Versioned {
        version: u32,
    }
    let file = fs::File::open(path).ok()?;
    serde_json::from_reader::<_, Versioned>(std::io::BufReader::new(file)).ok().map(|v| v.version)
}

/// `[uid, namespace, name, resourceVersion]`; namespace `""` for cluster-scoped objects.
type Row = (String, String, String, String);

/// A snapshot as read: its rows go straight into the compact index, one at a time.
#[derive(Deserialize)]
struct Snapshot {
    version: u32,
    stream: StreamKey,
    #[serde(default)]
    cluster_uid: Option<String>,
    /// The last journal sequence number included (version 1: none, 0).
    #[serde(default)]
    seq: u64,
    resource_version: Option<String>,
    objects: Rows,
    /// `[uid, resourceVersion]` of changes acknowledged out of order (see `Position`).
    #[serde(default)]
    acked_ahead: Vec<(String, String)>,
    #[serde(default)]
    snapshot: bool,
}

/// A snapshot as written: its rows are read from the compact index as they are written.
#[derive(Serialize)]
struct SnapshotOut<'a> {
    version: u32,
    stream: &'a StreamKey,
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster_uid: Option<&'a str>,
    seq: u64,
    resource_version: Option<&'a str>,
    objects: RowsOut<'a>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    acked_ahead: &'a [(String, String)],
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    snapshot: bool,
}

#[derive(Deserialize)]
struct JournalLine {
    seq: u64,
    resource_version: Option<String>,
    #[serde(default)]
    acked_ahead: Vec<(String, String)>,
    #[serde(default)]
    upserts: Vec<Row>,
    #[serde(default)]
    removes: Vec<String>,
    #[serde(default)]
    snapshot: bool,
}

#[derive(Serialize)]
struct JournalLineOut<'a> {
    seq: u64,
    resource_version: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    acked_ahead: &'a [(String, String)],
    #[serde(skip_serializing_if = "RowsOut::is_empty")]
    upserts: RowsOut<'a>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    removes: &'a [String],
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    snapshot: bool,
}

/// The rows of a snapshot, read into an index without a list of rows in between.
#[derive(Default)]
struct Rows(ObjectIndex);

impl<'de> Deserialize<'de> for Rows {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Rows;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array of [uid, namespace, name, resourceVersion]")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Rows, A::Error> {
                let mut index = ObjectIndex::new();
                while let Some((uid, ns, name, rv)) = seq.next_element::<Row>()? {
                    let entry = EntryRef {
                        namespace: (!ns.is_empty()).then_some(ns.as_str()),
                        name: &name,
                        resource_version: Rv::Text(&rv),
                    };
                    index.insert_ref(&uid, entry);
                }
                Ok(Rows(index))
            }
        }
        d.deserialize_seq(Visit)
    }
}

/// An index written as rows, straight from its compact form.
struct RowsOut<'a>(&'a ObjectIndex);

impl RowsOut<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for RowsOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{SerializeSeq, SerializeTuple};
        /// One row, its uid and resourceVersion formatted as they are written.
        struct RowOut<'a>(crate::model::index::UidRef<'a>, EntryRef<'a>);
        impl Serialize for RowOut<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                struct Text<T>(T);
                impl<T: std::fmt::Display> Serialize for Text<T> {
                    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                        s.collect_str(&self.0)
                    }
                }
                let mut t = s.serialize_tuple(4)?;
                t.serialize_element(&Text(self.0))?;
                t.serialize_element(self.1.namespace.unwrap_or(""))?;
                t.serialize_element(self.1.name)?;
                t.serialize_element(&Text(self.1.resource_version))?;
                t.end()
            }
        }
        let mut seq = s.serialize_seq(Some(self.0.len()))?;
        for (uid, e) in self.0.iter() {
            seq.serialize_element(&RowOut(uid, e))?;
        }
        seq.end()
    }
}

/// Counts the bytes written through it (the snapshot's size, without a copy of it in memory).
struct Counted<W> {
    inner: W,
    bytes: u64,
}

impl<W: Write> Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Per stream: what the store knows of its files.
#[derive(Debug, Default, Clone, Copy)]
struct Files {
    snapshot: Option<u64>,
    /// The journal's length up to its last complete line.
    journal: u64,
    next_seq: u64,
}

/// The directory of checkpoint files, locked for this process while the store (or a clone of
/// it) lives.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
    owner: Owner,
    files: Arc<Mutex<HashMap<String, Files>>>,
    written: Arc<std::sync::atomic::AtomicU64>,
    /// Holds an exclusive `flock` on [`LOCK_FILE`] (`None`: opened by [`scan`], read only).
    _lock: Option<Arc<fs::File>>,
}

fn entry((uid, ns, name, rv): Row) -> (String, IndexEntry) {
    (uid, IndexEntry { namespace: (!ns.is_empty()).then_some(ns), name, resource_version: rv })
}

impl FileStore {
    /// Creates the directory if needed and locks it; fails naming the holder when another
    /// process has it.
    pub fn open(dir: &Path, owner: Owner) -> Result<Self, CheckpointError> {
        let derr = |cause| CheckpointError::Dir { dir: dir.to_path_buf(), cause };
        fs::create_dir_all(dir).map_err(derr)?;
        let path = dir.join(LOCK_FILE);
        let mut lock =
            fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(derr)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                let holder = fs::read_to_string(&path).unwrap_or_default();
                let holder =
                    if holder.trim().is_empty() { "holder unknown".to_string() } else { holder.trim().to_string() };
                return Err(CheckpointError::Locked { dir: dir.to_path_buf(), holder });
            }
            Err(fs::TryLockError::Error(cause)) => return Err(derr(cause)),
        }
        // Who holds it, for the other process's message.
        let host = crate::state::host_name();
        let me = format!("pid {} on host {host}, since {}", std::process::id(), chrono::Utc::now().to_rfc3339());
        lock.set_len(0).and_then(|()| lock.write_all(me.as_bytes())).and_then(|()| lock.flush()).map_err(derr)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            owner,
            files: Arc::default(),
            written: Arc::default(),
            _lock: Some(Arc::new(lock)),
        })
    }

    /// Bytes written to snapshots and journals so far.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The stream's snapshot file.
    pub fn path(&self, key: &StreamKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The stream's journal file.
    pub fn journal_path(&self, key: &StreamKey) -> PathBuf {
        self.dir.join(format!("{}.journal", key.id()))
    }

    fn files(&self, key: &StreamKey) -> Files {
        self.files.lock().expect("files lock").get(&key.id()).copied().unwrap_or_default()
    }

    fn set_files(&self, key: &StreamKey, f: Files) {
        self.files.lock().expect("files lock").insert(key.id(), f);
    }

    /// `Ok(None)` when the stream has no checkpoint yet.
    ///
    /// The snapshot is parsed as it is read, each row straight into the index: a million
    /// objects' 50 MB of rows are never held as text beside the index they become.
    pub fn load(&self, key: &StreamKey) -> Result<Option<Position>, CheckpointError> {
        let path = self.path(key);
        let file = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if self.journal_path(key).exists() {
                    return Err(CheckpointError::Corrupt {
                        path: self.journal_path(key),
                        cause: format!("a journal without its snapshot {}", path.display()),
                    });
                }
                self.set_files(key, Files::default());
                return Ok(None);
            }
            Err(cause) => return Err(CheckpointError::Read { path, cause }),
        };
        let size = file.metadata().map_err(|cause| CheckpointError::Read { path: path.clone(), cause })?.len();
        let corrupt = |cause: String| CheckpointError::Corrupt { path: path.clone(), cause };
        let reader = std::io::BufReader::with_capacity(READ_BUFFER, file);
        let snap = match serde_json::from_reader::<_, Snapshot>(reader) {
            Ok(snap) if snap.version == 1 || snap.version == FORMAT_VERSION => snap,
            Ok(snap) => return Err(CheckpointError::UnknownVersion { path, found: snap.version }),
            // A future format may not parse as this one: reported as such, not as corrupt.
            Err(e) => {
                return Err(match version_of(&path) {
                    Some(v) if v != 1 && v != FORMAT_VERSION => CheckpointError::UnknownVersion { path, found: v },
                    _ => corrupt(e.to_string()),
                });
            }
        };
        if &snap.stream != key {
            return Err(CheckpointError::OtherStream { path, found: format!("{:?}", snap.stream) });
        }
        check_cluster("checkpoint", &path.display().to_string(), snap.cluster_uid.as_deref(), &self.owner)?;
        let mut position = Position {
            resource_version: snap.resource_version,
            objects: snap.objects.0,
            acked_ahead: snap.acked_ahead,
            snapshot: snap.snapshot,
            adopted_from: None,
            floors: Vec::new(),
        };
        let (journal, last) = self.replay(key, snap.seq, &mut position)?;
        self.set_files(key, Files { snapshot: Some(size), journal, next_seq: last.max(snap.seq) + 1 });
        Ok(Some(position))
    }

    /// Applies the journal lines after `seq`; cuts a torn last line off. Returns the journal's
    /// good length and its last sequence number.
    fn replay(&self, key: &StreamKey, seq: u64, position: &mut Position) -> Result<(u64, u64), CheckpointError> {
        let path = self.journal_path(key);
        let file = match fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, seq)),
            Err(cause) => return Err(CheckpointError::Read { path, cause }),
        };
        let mut reader = std::io::BufReader::new(file);
        let (mut good, mut last, mut n) = (0u64, seq, 0usize);
        let mut line = Vec::new();
        loop {
            line.clear();
            let read = reader
                .read_until(b'\n', &mut line)
                .map_err(|cause| CheckpointError::Read { path: path.clone(), cause })?;
            if read == 0 {
                break;
            }
            n += 1;
            if line.last() != Some(&b'\n') && self._lock.is_none() {
                // Read only ([`scan`]): the owner may be appending this line right now.
                break;
            }
            if line.last() != Some(&b'\n') {
                tracing::warn!(journal = %path.display(), line = n, "cutting off a torn last journal line (a crash during its write)");
                let f = fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|cause| CheckpointError::Write { path: path.clone(), cause })?;
                f.set_len(good)
                    .and_then(|()| f.sync_all())
                    .map_err(|cause| CheckpointError::Write { path: path.clone(), cause })?;
                break;
            }
            let l: JournalLine = serde_json::from_slice(&line)
                .map_err(|e| CheckpointError::Corrupt { path: path.clone(), cause: format!("line {n}: {e}") })?;
            good += read as u64;
            if l.seq <= seq {
                continue; // already in the snapshot
            }
            last = l.seq;
            for (uid, e) in l.upserts.into_iter().map(entry) {
                position.objects.insert(&uid, &e);
            }
            for uid in l.removes {
                position.objects.remove(&uid);
            }
            position.resource_version = l.resource_version;
            position.acked_ahead = l.acked_ahead;
            position.snapshot = l.snapshot;
        }
        Ok((good, last))
    }

    /// Whether the next write should be a full snapshot: none yet, or the journal outgrew it.
    pub fn wants_full(&self, key: &StreamKey) -> bool {
        let f = self.files(key);
        match f.snapshot {
            None => true,
            Some(s) => f.journal > s.max(MIN_COMPACTION_BYTES),
        }
    }

    pub fn write(&self, key: &StreamKey, delta: &Delta) -> Result<(), CheckpointError> {
        let mut f = self.files(key);
        let seq = f.next_seq.max(1);
        if delta.full || f.snapshot.is_none() {
            if !delta.full {
                // Never happens in practice (the first write is full); keep it correct anyway.
                return Err(CheckpointError::Write {
                    path: self.path(key),
                    cause: std::io::Error::other("the first write of a stream must be a full one"),
                });
            }
            let snap = SnapshotOut {
                version: FORMAT_VERSION,
                stream: key,
                cluster_uid: self.owner.cluster_uid.as_deref(),
                seq,
                resource_version: delta.resource_version.as_deref(),
                objects: RowsOut(&delta.upserts),
                acked_ahead: &delta.acked_ahead,
                snapshot: delta.snapshot,
            };
            let size = self.write_snapshot(key, &snap)?;
            self.written.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
            // The journal's lines are all older than the snapshot now.
            let jpath = self.journal_path(key);
            if f.journal > 0 || jpath.exists() {
                let werr = |cause| CheckpointError::Write { path: jpath.clone(), cause };
                let j = fs::OpenOptions::new().write(true).create(true).truncate(false).open(&jpath).map_err(werr)?;
                j.set_len(0).and_then(|()| j.sync_all()).map_err(werr)?;
            }
            f = Files { snapshot: Some(size), journal: 0, next_seq: seq + 1 };
        } else {
            let line = JournalLineOut {
                seq,
                resource_version: delta.resource_version.as_deref(),
                acked_ahead: &delta.acked_ahead,
                upserts: RowsOut(&delta.upserts),
                removes: &delta.removes,
                snapshot: delta.snapshot,
            };
            let mut bytes = serde_json::to_vec(&line).expect("journal line serialises");
            bytes.push(b'\n');
            let jpath = self.journal_path(key);
            let werr = |cause| CheckpointError::Write { path: jpath.clone(), cause };
            let new = !jpath.exists();
            let mut j = fs::OpenOptions::new().write(true).create(true).truncate(false).open(&jpath).map_err(werr)?;
            if new {
                // A new journal's name must be durable too, or its lines vanish with it.
                self.sync_dir().map_err(werr)?;
            }
            // Whatever a failed append left after the last good line goes first.
            j.set_len(f.journal).map_err(werr)?;
            use std::io::Seek;
            j.seek(std::io::SeekFrom::Start(f.journal)).map_err(werr)?;
            j.write_all(&bytes).and_then(|()| j.sync_data()).map_err(werr)?;
            f.journal += bytes.len() as u64;
            self.written.fetch_add(bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
            f.next_seq = seq + 1;
        }
        self.set_files(key, f);
        Ok(())
    }

    /// Makes the directory's entries durable (a renamed snapshot, a new journal). A file system
    /// that cannot fsync a directory (EINVAL) keeps them without it.
    fn sync_dir(&self) -> std::io::Result<()> {
        match fs::File::open(&self.dir).and_then(|d| d.sync_all()) {
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Ok(()),
            other => other,
        }
    }

    /// Temp file (written as it is serialised), fsync, rename, fsync of the directory; the
    /// snapshot's size.
    fn write_snapshot(&self, key: &StreamKey, snap: &SnapshotOut<'_>) -> Result<u64, CheckpointError> {
        let path = self.path(key);
        let tmp = path.with_extension("json.tmp");
        let werr = |cause| CheckpointError::Write { path: path.clone(), cause };
        let f = fs::File::create(&tmp).map_err(werr)?;
        let mut out = Counted { inner: std::io::BufWriter::with_capacity(256 * 1024, f), bytes: 0 };
        serde_json::to_writer(&mut out, snap).map_err(|e| werr(e.into()))?;
        let f = out.inner.into_inner().map_err(|e| werr(e.into_error()))?;
        f.sync_all().map_err(werr)?;
        drop(f);
        fs::rename(&tmp, &path).map_err(werr)?;
        // The rename is durable only once the directory is: else a power loss can bring the
        // old snapshot back after the journal was emptied (an older position: changes sent again).
        self.sync_dir().map_err(werr)?;
        Ok(out.bytes)
    }
}

/// One stream as [`scan`] found it.
#[derive(Debug)]
pub struct ScannedFile {
    pub key: StreamKey,
    pub cluster_uid: Option<String>,
    pub position: Position,
    /// The later modification time of its snapshot and journal.
    pub modified: Option<std::time::SystemTime>,
    pub snapshot: PathBuf,
}

/// Every stream with a snapshot in `dir`, read without the lock and without changing anything
/// (a torn last journal line is skipped, not cut off): for `kubecast state`, also while a
/// kubecast owns the directory. A missing directory holds no stream.
pub fn scan(dir: &Path) -> Result<Vec<ScannedFile>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(cause) => return Err(CheckpointError::Dir { dir: dir.to_path_buf(), cause }),
    };
    let store = FileStore {
        dir: dir.to_path_buf(),
        owner: Owner::default(),
        files: Arc::default(),
        written: Arc::default(),
        _lock: None,
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| {
            // Another program's file beside the streams' (`notes.json`) is not a stream: left
            // alone, said once. A file named like a stream that does not read is an error below.
            let ours = named_like_a_stream(p);
            if !ours {
                tracing::warn!(file = %p.display(), "not a stream's file of kubecast (its name has no stream id); skipped");
            }
            ours
        })
        .collect();
    paths.sort();
    let mut out = Vec::new();
    for path in paths {
        #[derive(Deserialize)]
        struct Head {
            stream: StreamKey,
            #[serde(default)]
            cluster_uid: Option<String>,
        }
        let bytes = fs::read(&path).map_err(|cause| CheckpointError::Read { path: path.clone(), cause })?;
        let head: Head = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::Corrupt { path: path.clone(), cause: e.to_string() })?;
        drop(bytes);
        if store.path(&head.stream) != path {
            return Err(CheckpointError::OtherStream { path, found: format!("{:?}", head.stream) });
        }
        let Some(position) = store.load(&head.stream)? else { continue };
        let mtime = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
        let modified = mtime(&path).max(mtime(&store.journal_path(&head.stream)));
        out.push(ScannedFile { key: head.stream, cluster_uid: head.cluster_uid, position, modified, snapshot: path });
    }
    Ok(out)
}

/// Whether `path`'s name is a stream's snapshot name: `<kind>.<group>.<version>.<scope>.<16 hex
/// digits>[.shard-i-of-n].json` ([`StreamKey::file_name`]).
fn named_like_a_stream(path: &Path) -> bool {
    let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else { return false };
    let parts: Vec<&str> = stem.split('.').collect();
    parts.len() >= 5
        && parts.iter().any(|p| p.len() == 16 && p.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

#[cfg(test)]
mod tests;
