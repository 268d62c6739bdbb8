//! A stream's identity in every store ([`StreamKey`]), who writes ([`Owner`]) and what a write
//! carries ([`Delta`]).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{ObjectIndex, Shard};

/// Between a stream's id and its shard's label in a shard's id.
pub const SHARD_INFIX: &str = ".shard-";

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
    /// The slice of the stream's objects (`[coordination] shards` above 1); `None`: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<Shard>,
}

impl StreamKey {
    /// `configmap.core.v1.ns-shop.3f2a9c1b7d4e5f60`-style id: readable prefix, hash of the
    /// whole query (cluster name and selectors included); a shard's adds
    /// `.shard-<index>-of-<count>` to its stream's id.
    pub fn id(&self) -> String {
        let base = self.base_id();
        match &self.shard {
            Some(s) => format!("{base}{SHARD_INFIX}{}", s.label()),
            None => base,
        }
    }

    /// The id of the whole stream, without its shard: the same for every shard count.
    pub fn base_id(&self) -> String {
        let whole = StreamKey { shard: None, ..self.clone() };
        let hex = short_hash(&serde_json::to_vec(&whole).expect("StreamKey serialises"));
        let group = if self.group.is_empty() { "core" } else { &self.group };
        let scope = match &self.namespace {
            Some(ns) => format!("ns-{ns}"),
            None => "all".to_string(),
        };
        format!("{}.{group}.{}.{scope}.{hex}", self.kind.to_lowercase(), self.version)
    }

    /// This stream's key for `shard`.
    pub fn with_shard(&self, shard: Option<Shard>) -> StreamKey {
        StreamKey { shard, ..self.clone() }
    }

    /// The file store's snapshot file name.
    pub fn file_name(&self) -> String {
        format!("{}.json", self.id())
    }
}

/// The first 8 bytes of the SHA-256 of `bytes`, in hex: a name part that tells queries apart.
pub fn short_hash(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Who writes the store: stamped on every position record.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Owner {
    /// The uid of the cluster's `kube-system` namespace (`None` when it cannot be read).
    pub cluster_uid: Option<String>,
    /// The lease epoch (`leaseTransitions`) this process holds; `None` when it holds no Lease
    /// (without `[coordination]`; stored as 0). State written under a higher epoch is refused.
    pub epoch: Option<i64>,
    /// This process (the lease identity, or host and pid).
    pub writer: String,
}

/// What changed in a stream's position since its last write.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// Index entries added or changed (compact: a first write after a list carries every
    /// object, at the index's own few dozen bytes each).
    pub upserts: ObjectIndex,
    /// Index entries removed.
    pub removes: Vec<String>,
    /// `upserts` is the whole index (the file store's compaction; `removes` then only says
    /// what to mark changed again if the write fails).
    pub full: bool,
    /// The position after the change (always written: it is small).
    pub resource_version: Option<String>,
    pub acked_ahead: Vec<(String, String)>,
    /// See [`crate::model::Position::snapshot`].
    pub snapshot: bool,
    /// See [`crate::model::Position::floors`]: written until the position passes them all.
    pub floors: Vec<(Shard, u64)>,
}
