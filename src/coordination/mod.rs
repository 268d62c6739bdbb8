//! Which process runs what: the Lease that makes one process active (`lease`, its errors in
//! `lease_error`), and with `[coordination] shards` the member Leases of the replicas
//! (`members`), the shard assignment they decide on (`assignment`) and a change of the shard
//! count (`count_change`), which a replica without shards takes part in too (`count_guard`). The state (`state`) is written only by the holder of its Lease.
//!
//! Invariant: a Lease made anew starts above every epoch the state store has seen, so that a
//! new holder fences every older one; a decision reads every replica's member Lease, of every
//! shard count.

pub mod assignment;
pub mod count_change;
pub mod count_guard;
pub mod lease;
pub mod lease_error;
pub mod members;
