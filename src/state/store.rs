//! Persisted per-stream checkpoints: the resourceVersion to resume the watch from, plus the
//! compact index of the objects the stream has delivered (uid -> namespace/name,
//! resourceVersion), which a relist is diffed against after 410 Gone.
//!
//! One file per stream in `[checkpoint] dir`, named after the stream's query and a hash of it,
//! so a stream whose scope or selectors changed never reuses another query's checkpoint. Files
//! are written atomically (temp file, fsync, rename, fsync of the directory) in a versioned
//! JSON format. A file that cannot be parsed, has an unknown version or belongs to another
//! query is an error, never a silent full replay.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{IndexEntry, Position};

/// Version of the file format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The identity of a stream: exactly the query it runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamKey {
    pub cluster: String,
    pub group: String,
    pub version: String,
    pub kind: String,
    /// `None`: cluster-wide.
    pub namespace: Option<String>,
    pub label_selector: String,
    pub field_selector: String,
}

impl StreamKey {
    /// `configmap.core.v1.ns-shop.3f2a9c1b7d4e5f60.json`-style file name: readable prefix,
    /// hash of the whole query.
    pub fn file_name(&self) -> String {
        let json = serde_json::to_vec(self).expect("StreamKey serialises");
        let hash = Sha256::digest(&json);
        let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
        let group = if self.group.is_empty() { "core" } else { &self.group };
        let scope = match &self.namespace {
            Some(ns) => format!("ns-{ns}"),
            None => "all".to_string(),
        };
        format!("{}.{group}.{}.{scope}.{hex}.json", self.kind.to_lowercase(), self.version)
    }
}

#[derive(Serialize, Deserialize)]
struct FileFormat {
    version: u32,
    stream: StreamKey,
    resource_version: Option<String>,
    /// `[uid, namespace, name, resourceVersion]`; namespace `""` for cluster-scoped objects.
    objects: Vec<(String, String, String, String)>,
    /// `[uid, resourceVersion]` of changes acknowledged out of order (see `Position`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    acked_ahead: Vec<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(
        "checkpoint directory {dir} cannot be created or used: {cause} (fix: make [checkpoint] dir point to a writable directory)"
    )]
    Dir { dir: PathBuf, cause: std::io::Error },
    #[error("checkpoint {path} cannot be read: {cause}")]
    Read { path: PathBuf, cause: std::io::Error },
    #[error(
        "checkpoint {path} is corrupt ({cause}); kubecast will not guess where to resume (fix: restore the file, or delete it to start the stream over: it then emits its initial list again, per `initial`)"
    )]
    Corrupt { path: PathBuf, cause: String },
    #[error(
        "checkpoint {path} has format version {found}, this kubecast reads version {FORMAT_VERSION} (fix: run the kubecast version that wrote it, or delete the file to start the stream over)"
    )]
    UnknownVersion { path: PathBuf, found: u32 },
    #[error("checkpoint {path} belongs to another query ({found}); refusing to reuse it (fix: delete the file)")]
    OtherStream { path: PathBuf, found: String },
    #[error("checkpoint {path} cannot be written: {cause}")]
    Write { path: PathBuf, cause: std::io::Error },
    #[error(
        "checkpoint directory {dir} is in use by another kubecast process ({holder}); two processes on one directory would publish every change twice and overwrite each other's checkpoints (fix: stop the other process, or give this one its own [checkpoint] dir)"
    )]
    Locked { dir: PathBuf, holder: String },
}

/// Name of the lock file in the checkpoint directory.
pub const LOCK_FILE: &str = ".kubecast.lock";

/// The directory of checkpoint files, locked for this process while the store (or a clone of
/// it) lives.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
    /// Holds an exclusive `flock` on [`LOCK_FILE`]: a second process on the same directory
    /// fails at start instead of writing the same checkpoints.
    _lock: std::sync::Arc<fs::File>,
}

impl CheckpointStore {
    /// Creates the directory if needed and locks it; fails naming the holder when another
    /// process has it.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
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
        let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let me =
            format!("pid {} on host {}, since {}", std::process::id(), host.trim(), chrono::Utc::now().to_rfc3339());
        lock.set_len(0).and_then(|()| lock.write_all(me.as_bytes())).and_then(|()| lock.flush()).map_err(derr)?;
        Ok(Self { dir: dir.to_path_buf(), _lock: std::sync::Arc::new(lock) })
    }

    pub fn path(&self, key: &StreamKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// `Ok(None)` when the stream has no checkpoint yet.
    pub fn load(&self, key: &StreamKey) -> Result<Option<Position>, CheckpointError> {
        let path = self.path(key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(cause) => return Err(CheckpointError::Read { path, cause }),
        };
        // Read the version first, so a future format is reported as such, not as corrupt.
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::Corrupt { path: path.clone(), cause: e.to_string() })?;
        if v.version != FORMAT_VERSION {
            return Err(CheckpointError::UnknownVersion { path, found: v.version });
        }
        let file: FileFormat = serde_json::from_slice(&bytes)
            .map_err(|e| CheckpointError::Corrupt { path: path.clone(), cause: e.to_string() })?;
        if &file.stream != key {
            return Err(CheckpointError::OtherStream { path, found: format!("{:?}", file.stream) });
        }
        let objects = file
            .objects
            .into_iter()
            .map(|(uid, ns, name, rv)| {
                (uid, IndexEntry { namespace: (!ns.is_empty()).then_some(ns), name, resource_version: rv })
            })
            .collect();
        Ok(Some(Position { resource_version: file.resource_version, objects, acked_ahead: file.acked_ahead }))
    }

    /// Writes atomically: a crash leaves either the old or the new file, never a torn one.
    pub fn save(&self, key: &StreamKey, cp: &Position) -> Result<(), CheckpointError> {
        self.write(key, &self.encode(key, cp, &cp.acked_ahead))
    }

    /// The file content for `cp` (cheap enough to do under a lock; the write is not).
    pub fn encode(&self, key: &StreamKey, cp: &Position, acked_ahead: &[(String, String)]) -> Vec<u8> {
        let file = FileFormat {
            version: FORMAT_VERSION,
            stream: key.clone(),
            resource_version: cp.resource_version.clone(),
            objects: cp
                .objects
                .iter()
                .map(|(uid, e)| {
                    (uid.clone(), e.namespace.clone().unwrap_or_default(), e.name.clone(), e.resource_version.clone())
                })
                .collect(),
            acked_ahead: acked_ahead.to_vec(),
        };
        serde_json::to_vec(&file).expect("checkpoint serialises")
    }

    /// Temp file, fsync, rename, fsync of the directory.
    pub fn write(&self, key: &StreamKey, bytes: &[u8]) -> Result<(), CheckpointError> {
        let path = self.path(key);
        let tmp = path.with_extension("json.tmp");
        let werr = |cause| CheckpointError::Write { path: path.clone(), cause };
        let mut f = fs::File::create(&tmp).map_err(werr)?;
        f.write_all(bytes).map_err(werr)?;
        f.sync_all().map_err(werr)?;
        drop(f);
        fs::rename(&tmp, &path).map_err(werr)?;
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ns: Option<&str>, labels: &str) -> StreamKey {
        StreamKey {
            cluster: "c".into(),
            group: "".into(),
            version: "v1".into(),
            kind: "ConfigMap".into(),
            namespace: ns.map(Into::into),
            label_selector: labels.into(),
            field_selector: "".into(),
        }
    }

    #[test]
    fn round_trip_and_identity() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        let k = key(Some("shop"), "app=x");
        assert_eq!(store.load(&k).unwrap(), None);
        let mut cp = Position { resource_version: Some("17".into()), ..Default::default() };
        cp.objects.insert(
            "u1".into(),
            IndexEntry { namespace: Some("shop".into()), name: "a".into(), resource_version: "9".into() },
        );
        cp.objects.insert("u2".into(), IndexEntry { namespace: None, name: "b".into(), resource_version: "12".into() });
        store.save(&k, &cp).unwrap();
        assert_eq!(store.load(&k).unwrap(), Some(cp));
        // Another selector is another stream: no checkpoint.
        assert_eq!(store.load(&key(Some("shop"), "app=y")).unwrap(), None);
        assert_ne!(k.file_name(), key(None, "app=x").file_name());
    }

    #[test]
    fn a_second_store_on_one_directory_is_refused_naming_the_holder() {
        let dir = tempfile::tempdir().unwrap();
        let first = CheckpointStore::open(dir.path()).unwrap();
        let err = CheckpointStore::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("in use by another kubecast process"), "{err}");
        assert!(err.contains(&format!("pid {}", std::process::id())), "{err}");
        drop(first);
        CheckpointStore::open(dir.path()).expect("free again once the holder is gone");
    }

    #[test]
    fn corrupt_and_future_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path()).unwrap();
        let k = key(None, "");
        fs::write(store.path(&k), b"{\"version\":1,\"stream\":").unwrap();
        assert!(matches!(store.load(&k), Err(CheckpointError::Corrupt { .. })));
        fs::write(store.path(&k), b"{\"version\":7}").unwrap();
        assert!(matches!(store.load(&k), Err(CheckpointError::UnknownVersion { found: 7, .. })));
    }
}
