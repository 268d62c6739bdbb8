//! The data that flows through kubecast, and the contracts it keeps: what a change is, how it
//! becomes a CloudEvent, a stream's position and the effect of each item on it, and the
//! `Problem` every component reports its settings' faults with.
//!
//! Invariant: this folder imports nothing of the crate outside it; every stage may import it.

pub mod attributes;
pub mod budget;
pub mod event;
pub mod fields;
pub mod gate;
pub mod index;
pub(crate) mod json_check;
pub mod object;
pub mod position;
pub mod problem;
pub mod refusal;
pub mod shard;
pub mod shared_index;
pub mod verb;

pub use attributes::{AttributeValue, Attributes, ExtensionValue};
pub use budget::{Budget, Part};
pub use event::{Change, CloudEvent, EventError, EventSource};
pub use fields::{Fields, TypeFields};
pub use index::{EntryRef, Index, IndexEntry, ObjectIndex, Rv, UidList, UidSet};
pub use object::RawObject;
pub use position::{Effect, IndexOp, Position};
pub use problem::Problem;
pub use refusal::Refusal;
pub use shard::Shard;
pub use shared_index::SharedIndex;
pub use verb::{Origin, Verb};
