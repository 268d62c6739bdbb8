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
//! another query or of another cluster is an error naming it, never a silent replay. Every
//! position record carries the lease epoch it was written under: a process holding a lower
//! epoch than one stored is refused as it loads ([`CheckpointError::Superseded`]), before it
//! writes (a later holder of the Lease owns the state; the file store keeps no epoch: its
//! directory lock admits one process).
//!
//! Invariant: only the owner of the store writes it (the file lock, the Kafka producer epoch,
//! the NATS revision); an [`CheckpointError::Fenced`] write stops the process.

mod adopt;
mod error;
pub mod file;
pub mod kafka;
pub mod nats;
pub mod record;
mod stream;

use std::sync::Arc;

pub use error::CheckpointError;
pub use stream::{Delta, Owner, StreamKey, short_hash};

use crate::model::Position;

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

    /// Exactly-once into Kafka: the gate the delivery queue passes for each event, sealed by
    /// each write.
    pub fn gate(&self) -> Option<Arc<crate::model::gate::Gate>> {
        match self {
            Store::Kafka(k) if k.transaction().exactly_once() => Some(k.transaction().gate().clone()),
            _ => None,
        }
    }

    /// Exactly-once into Kafka: the `transactional.id` whose commits carry the events.
    pub fn exactly_once_id(&self) -> Option<&str> {
        match self {
            Store::Kafka(k) if k.transaction().exactly_once() => Some(k.transactional_id()),
            _ => None,
        }
    }

    /// Exactly-once into Kafka: aborts the open transaction for good, because the gate is
    /// broken (an event was sent into it and not acknowledged). Nothing for other stores.
    pub async fn abandon(&self) {
        if let Store::Kafka(k) = self {
            k.abandon().await;
        }
    }

    /// Kafka: lets the transactional producer take its `transactional.id` over again after the
    /// broker aborted a transaction for its age, while `owner` says this process still owns
    /// the state (see `sink/kafka/transaction/take_over.rs`). Nothing for other stores.
    pub fn may_take_over(&self, owner: crate::sink::kafka::transaction::OwnerCheck) {
        if let Store::Kafka(k) = self {
            k.transaction().may_take_over(owner);
        }
    }

    /// Exactly-once into Kafka: notified when the open transaction should be committed before
    /// the next interval (it holds many events).
    pub fn commit_soon(&self) -> Option<Arc<tokio::sync::Notify>> {
        match self {
            Store::Kafka(k) if k.transaction().exactly_once() => Some(k.transaction().commit_soon().clone()),
            _ => None,
        }
    }

    /// Bytes of state this store wrote so far (keys and values; file: bytes appended or
    /// renamed into place): what `write` costs, for the benchmarks.
    pub fn bytes_written(&self) -> u64 {
        match self {
            Store::File(f) => f.bytes_written(),
            Store::Kafka(k) => k.bytes_written(),
            Store::Nats(n) => n.bytes_written(),
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
