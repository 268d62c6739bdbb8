//! [`CheckpointError`]: why a store could not be opened, read or written.

use std::path::{Path, PathBuf};

use crate::model::Refusal;

/// The files of the file store that hold the stream `path` belongs to (` (a.json and
/// a.journal)`), or nothing for a record of a broker store.
fn files_of(path: &Path) -> String {
    match path.extension().and_then(|e| e.to_str()) {
        Some("json" | "journal") => {
            format!(" ({} and {})", path.with_extension("json").display(), path.with_extension("journal").display())
        }
        _ => String::new(),
    }
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
        "checkpoint {path} is corrupt ({cause}); kubecast will not guess where to resume (fix: restore it, or delete the stream's state{} to start the stream over: it then emits its initial list again, per `initial`)",
        files_of(path)
    )]
    Corrupt { path: PathBuf, cause: String },
    #[error(
        "checkpoint {path} has format version {found}, this kubecast reads versions 1 and 2 (fix: run the kubecast version that wrote it, or delete the file to start the stream over)"
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
    /// The state was written under a higher lease epoch than this process holds: a later
    /// holder of the Lease owns it. Refused before anything is written.
    #[error(
        "{what} was written under lease epoch {stored} (by {writer}), and this process holds epoch {ours}: a later holder of the Lease owns the state, so this process does not write it and stops (fix: none needed if that holder is the active process now; if the Lease was deleted and made again, set its spec.leaseTransitions to {stored} so that the next holder's epoch is higher)"
    )]
    Superseded { what: String, stored: i64, ours: i64, writer: String },
    #[error("{what}: {cause}")]
    Broker { what: String, cause: String },
    /// The broker refuses this process's state writes for a set-up reason (a missing ACL, a
    /// setting it does not accept): no other process owns the state.
    #[error(
        "{what}: the broker refuses kubecast's state writes, {refusal}: {why}; no other kubecast owns the state, and nothing was written (fix: {})",
        refusal.fix()
    )]
    Refused { what: String, refusal: Refusal, why: String },
    /// Exactly-once: the delivery stopped between an event's send and its acknowledgement, so
    /// the open transaction holds what no state covers: it was aborted, not committed.
    #[error(
        "{what}: an event was sent into the open transaction but never acknowledged (the delivery stopped before it); the transaction is aborted, not committed, and everything since the last commit is sent again after the restart"
    )]
    Abandoned { what: String },
    /// The store is set up in a way kubecast cannot keep state in, or (exactly-once) a
    /// transaction holds a record no retry can deliver (not retried: the process stops).
    #[error("{what}: {why}")]
    Unusable { what: String, why: String },
    /// Exactly-once: an event's destination refuses every record (a topic that does not exist,
    /// a Write permission not granted), so the transaction holding `events` events cannot
    /// commit; they are kept and sent again until the operator fixes it (retried, never fatal).
    #[error("{what}: {why} ({refusal}; {events} event(s) held; fix: {})", refusal.fix())]
    EventsRefused { what: String, refusal: Refusal, destination: String, events: usize, why: String },
}

impl CheckpointError {
    /// Whether retrying the write can help (else the process stops).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Self::Fenced { .. }
                | Self::Superseded { .. }
                | Self::OtherCluster { .. }
                | Self::Locked { .. }
                | Self::Unusable { .. }
                | Self::Refused { .. }
                | Self::Abandoned { .. }
        )
    }
}
