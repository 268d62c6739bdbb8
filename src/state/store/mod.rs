//! Where stream positions are kept, behind one interface ([`Store`]), chosen by
//! `[checkpoint] store`:
//!
//! - `file` (`file.rs`): one snapshot file and one journal per stream in `[checkpoint] dir`,
//!   the directory locked by one process;
//! - `kafka` (`kafka.rs`): a compacted state topic, written in producer transactions under a
//!   `transactional.id` that a newer process fences;
//! - `nats` (`nats.rs`): a JetStream key-value bucket, each write an atomic batch conditional
//!   on the revision of the stream's position record.
//!
//! Every store keeps the same state per stream (the resume position and the index of
//! delivered objects) and is written with [`Delta`]s: what changed since the last write, so
//! writes are in proportion to the changes, not to the index. A record that cannot be read, of
//! another query, of another cluster or of a newer lease epoch is an error naming it, never a
//! silent replay.
//!
//! Invariant: only the owner of the store writes it (the file lock, the Kafka producer epoch,
//! the NATS revision); an [`CheckpointError::Fenced`] write stops the process.

pub mod file;
pub mod kafka;
pub mod nats;
pub mod record;

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{IndexEntry, Position};

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
    /// `configmap.core.v1.ns-shop.3f2a9c1b7d4e5f60`-style id: readable prefix, hash of the
    /// whole query (cluster name and selectors included).
    pub fn id(&self) -> String {
        let json = serde_json::to_vec(self).expect("StreamKey serialises");
        let hash = Sha256::digest(&json);
        let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
        let group = if self.group.is_empty() { "core" } else { &self.group };
        let scope = match &self.namespace {
            Some(ns) => format!("ns-{ns}"),
            None => "all".to_string(),
        };
        format!("{}.{group}.{}.{scope}.{hex}", self.kind.to_lowercase(), self.version)
    }

    /// The file store's snapshot file name.
    pub fn file_name(&self) -> String {
        format!("{}.json", self.id())
    }
}

/// Who writes the store: stamped on every position record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Owner {
    /// The uid of the cluster's `kube-system` namespace (`None` when it cannot be read).
    pub cluster_uid: Option<String>,
    /// The lease epoch (`leaseTransitions`) this process holds; 0 without `[coordination]`.
    pub epoch: i64,
    /// This process (the lease identity, or host and pid).
    pub writer: String,
}

/// What changed in a stream's position since its last write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// Index entries added or changed.
    pub upserts: Vec<(String, IndexEntry)>,
    /// Index entries removed.
    pub removes: Vec<String>,
    /// `upserts` is the whole index (the file store's compaction; `removes` then only says
    /// what to mark changed again if the write fails).
    pub full: bool,
    /// The position after the change (always written: it is small).
    pub resource_version: Option<String>,
    pub acked_ahead: Vec<(String, String)>,
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
        "checkpoint {path} is corrupt ({cause}); kubecast will not guess where to resume (fix: restore it, or delete the stream's state to start the stream over: it then emits its initial list again, per `initial`)"
    )]
    Corrupt { path: PathBuf, cause: String },
    #[error(
        "checkpoint {path} has format version {found}, this kubecast reads versions 1 and {} (fix: run the kubecast version that wrote it, or delete the file to start the stream over)",
        file::FORMAT_VERSION
    )]
    UnknownVersion { path: PathBuf, found: u32 },
    #[error("checkpoint {path} belongs to another query ({found}); refusing to reuse it (fix: delete it)")]
    OtherStream { path: PathBuf, found: String },
    #[error("checkpoint {path} cannot be written: {cause}")]
    Write { path: PathBuf, cause: std::io::Error },
    #[error(
        "checkpoint directory {dir} is in use by another kubecast process ({holder}); two processes on one directory would publish every change twice and overwrite each other's checkpoints (fix: stop the other process, or give this one its own [checkpoint] dir)"
    )]
    Locked { dir: PathBuf, holder: String },
    #[error(
        "{what} belongs to another cluster (kube-system namespace uid {stored}, this cluster's is {ours}): two clusters share one [cluster] name and one state store (fix: give each cluster its own [cluster] name)"
    )]
    OtherCluster { what: String, stored: String, ours: String },
    #[error(
        "{what}: another kubecast process owns the state now ({why}); this one stops writing and publishing (fix: none needed if that process is the new leader; else give each deployment its own [cluster] name or state topic/bucket)"
    )]
    Fenced { what: String, why: String },
    #[error("{what}: {cause}")]
    Broker { what: String, cause: String },
    /// The store is set up in a way kubecast cannot keep state in (not retried).
    #[error("{what}: {why}")]
    Unusable { what: String, why: String },
}

impl CheckpointError {
    /// Whether retrying the write can help (else the process stops).
    pub fn is_fatal(&self) -> bool {
        matches!(self, Self::Fenced { .. } | Self::OtherCluster { .. } | Self::Locked { .. })
    }
}

/// The configured store, opened for one owner.
#[derive(Debug, Clone)]
pub enum Store {
    File(file::FileStore),
    Kafka(Arc<kafka::KafkaStore>),
    Nats(Arc<nats::NatsStore>),
}

impl Store {
    /// Loads the positions of `keys` (`None`: no state yet), in their order.
    pub async fn load(&self, keys: &[StreamKey]) -> Result<Vec<Option<Position>>, CheckpointError> {
        match self {
            Store::File(f) => {
                let (f, keys) = (f.clone(), keys.to_vec());
                tokio::task::spawn_blocking(move || keys.iter().map(|k| f.load(k)).collect())
                    .await
                    .expect("checkpoint load task")
            }
            Store::Kafka(k) => k.load(keys).await,
            Store::Nats(n) => n.load(keys).await,
        }
    }

    /// Writes the deltas of several streams (one transaction on Kafka). On error nothing of
    /// it may be assumed written.
    pub async fn write(&self, deltas: &[(StreamKey, Delta)]) -> Result<(), CheckpointError> {
        if deltas.is_empty() {
            return Ok(());
        }
        match self {
            Store::File(f) => {
                let (f, deltas) = (f.clone(), deltas.to_vec());
                tokio::task::spawn_blocking(move || deltas.iter().try_for_each(|(k, d)| f.write(k, d)))
                    .await
                    .expect("checkpoint write task")
            }
            Store::Kafka(k) => k.write(deltas).await,
            Store::Nats(n) => n.write(deltas).await,
        }
    }

    /// Whether the next write of `key` should be a full one (the file store compacts its
    /// journal into a new snapshot).
    pub fn wants_full(&self, key: &StreamKey) -> bool {
        match self {
            Store::File(f) => f.wants_full(key),
            _ => false,
        }
    }

    /// For logs: `file ./kubecast-state`, `Kafka topic kubecast-state`...
    pub fn describe(&self) -> String {
        match self {
            Store::File(f) => format!("directory {}", f.dir().display()),
            Store::Kafka(k) => k.describe(),
            Store::Nats(n) => n.describe(),
        }
    }
}
