//! What happened to an object (`Verb`) and how kubecast learnt of it (`Origin`).

use serde::{Deserialize, Serialize};

/// A change verb as configured in `events` and used in CloudEvent types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    Added,
    Modified,
    Deleted,
}

impl Verb {
    pub const ALL: [Verb; 3] = [Verb::Added, Verb::Modified, Verb::Deleted];

    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Added => "added",
            Verb::Modified => "modified",
            Verb::Deleted => "deleted",
        }
    }

    /// The verb's place in [`Verb::ALL`] (per-verb arrays: metrics, event types).
    pub const fn index(self) -> usize {
        match self {
            Verb::Added => 0,
            Verb::Modified => 1,
            Verb::Deleted => 2,
        }
    }
}

/// Where an event's change was observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The initial list of a stream that had no checkpoint.
    Snapshot,
    /// A live watch event.
    Watch,
    /// Derived by diffing a relist against what the stream had delivered (after 410 Gone).
    Resync,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Snapshot => "snapshot",
            Origin::Watch => "watch",
            Origin::Resync => "resync",
        }
    }
}
