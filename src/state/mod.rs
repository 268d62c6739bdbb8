//! What kubecast remembers per stream, and how it gets there: the watermark turns
//! acknowledgements into a position (`watermark`), the store keeps positions (`store`), the
//! persister writes them periodically and at shutdown (`persister`).
//!
//! Invariant: a stored position never passes an item that was not acknowledged.

pub mod lease;
pub(crate) mod persister;
pub mod store;
pub mod watermark;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::Problem;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    #[serde(default = "default_checkpoint_dir")]
    pub dir: PathBuf,
    /// How often changed checkpoints are written, in milliseconds (and always at shutdown).
    #[serde(default = "default_flush_interval_ms")]
    pub flush_interval_ms: u64,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { dir: default_checkpoint_dir(), flush_interval_ms: default_flush_interval_ms() }
    }
}

fn default_flush_interval_ms() -> u64 {
    1000
}

fn default_checkpoint_dir() -> PathBuf {
    PathBuf::from("./kubecast-state")
}

impl CheckpointConfig {
    /// Problems with `[checkpoint]`.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.flush_interval_ms == 0 {
            out.push(Problem::new(
                "checkpoint.flush_interval_ms",
                "must be at least 1",
                "set e.g. flush_interval_ms = 1000",
            ));
        }
        if self.dir.as_os_str().is_empty() {
            out.push(Problem::new("checkpoint.dir", "must not be empty", "set a directory, e.g. \"./kubecast-state\""));
        }
        out
    }
}
