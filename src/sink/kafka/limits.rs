//! How many of the sink's events may wait uncommitted in the exactly-once transaction
//! (`[sink.kafka] max_uncommitted_events`, `max_uncommitted_bytes`): bounds of the process,
//! shared by the transactions of the shards it runs ([`Uncommitted`]).

use std::sync::Arc;

use crate::model::{Budget, Part};

/// How many of the sink's events the transactions not committed yet may hold
/// (`[sink.kafka] max_uncommitted_events` and `max_uncommitted_bytes`). Once either is
/// reached, a send waits until a commit (or an abort for good) frees room: the delivery queue
/// then stops taking jobs, and the reflectors stop reading their watches. Half of either asks
/// for the next commit early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Records (an event; its tombstone is one more).
    pub events: usize,
    /// Bytes of topic, key and value, plus 64 per record.
    pub bytes: usize,
}

impl Limits {
    pub const DEFAULT_EVENTS: usize = 40_000;
    pub const DEFAULT_BYTES: usize = 64 * 1024 * 1024;

    /// Whether `size` bytes in `records` more records fit: always when nothing is held (an
    /// event larger than the bound still goes out, alone).
    pub(super) fn room(&self, held: usize, held_bytes: usize, records: usize, size: usize) -> bool {
        held == 0 || (held + records <= self.events && held_bytes + size <= self.bytes)
    }

    /// Whether the next commit is asked for early.
    pub(super) fn commit_soon(&self, held: usize, held_bytes: usize) -> bool {
        held >= (self.events / 2).max(1) || held_bytes >= (self.bytes / 2).max(1)
    }
}

/// A transaction's part of the process's uncommitted bounds: its share is the bounds divided
/// by the shards running (see [`crate::model::budget`]), and it takes more only while the
/// process's transactions together hold less than the bounds.
#[derive(Debug)]
pub struct Uncommitted {
    events: Part,
    bytes: Part,
}

impl Uncommitted {
    /// A part of the process's bounds `events` and `bytes` (one per shard's transaction).
    pub fn part_of(events: &Arc<Budget>, bytes: &Arc<Budget>) -> Self {
        Self { events: events.part(), bytes: bytes.part() }
    }

    /// Bounds of its own (a transaction not sharing them).
    pub fn alone(limits: Limits) -> Self {
        Self::part_of(&Budget::new(limits.events), &Budget::new(limits.bytes))
    }

    /// This transaction's share now.
    pub fn share(&self) -> Limits {
        Limits { events: self.events.share(), bytes: self.bytes.share() }
    }

    /// Whether `size` bytes in `records` more records fit, with `held` records of `held_bytes`
    /// held by this transaction: within its share and the process's bounds; always when it
    /// holds nothing (an event larger than the bound still goes out, alone).
    pub(super) fn room(&self, held: usize, held_bytes: usize, records: usize, size: usize) -> bool {
        held == 0
            || (self.share().room(held, held_bytes, records, size)
                && self.events.budget().used() + records <= self.events.budget().total()
                && self.bytes.budget().used() + size <= self.bytes.budget().total())
    }

    /// Whether the next commit is asked for early (half of this transaction's share).
    pub(super) fn commit_soon(&self, held: usize, held_bytes: usize) -> bool {
        self.share().commit_soon(held, held_bytes)
    }

    /// This transaction now holds `events` records of `bytes`.
    pub(super) fn hold(&self, events: usize, bytes: usize) {
        self.events.set(events);
        self.bytes.set(bytes);
    }
}

impl Default for Uncommitted {
    fn default() -> Self {
        Self::alone(Limits::default())
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self { events: Self::DEFAULT_EVENTS, bytes: Self::DEFAULT_BYTES }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn room_until_either_bound_and_always_for_the_first_event() {
        let l = Limits { events: 3, bytes: 1000 };
        assert!(l.room(0, 0, 1, 5000), "an event larger than the bound goes out alone");
        assert!(l.room(2, 500, 1, 500), "the third event, 1000 bytes in all");
        assert!(!l.room(3, 300, 1, 10), "three events held");
        assert!(!l.room(2, 500, 1, 501), "1001 bytes");
        assert!(!l.room(2, 10, 2, 10), "an event and its tombstone count two");
    }

    #[test]
    fn the_commit_is_asked_for_early_at_half_of_either() {
        let l = Limits { events: 40_000, bytes: 64 * 1024 * 1024 };
        assert!(!l.commit_soon(19_999, 32 * 1024 * 1024 - 1));
        assert!(l.commit_soon(20_000, 0));
        assert!(l.commit_soon(1, 32 * 1024 * 1024));
        assert!(Limits { events: 1, bytes: 1 }.commit_soon(1, 0), "never a bound of 0");
        assert_eq!(Limits::default(), l);
    }

    #[test]
    fn transactions_share_the_process_bounds() {
        let (events, bytes) = (Budget::new(100), Budget::new(10_000));
        let a = Uncommitted::part_of(&events, &bytes);
        assert_eq!(a.share(), Limits { events: 100, bytes: 10_000 }, "alone, the whole bounds");
        a.hold(90, 9_000);
        let b = Uncommitted::part_of(&events, &bytes);
        assert_eq!(b.share(), Limits { events: 50, bytes: 5_000 });
        assert!(b.room(0, 0, 1, 500), "holding nothing, an event always goes in");
        b.hold(1, 500);
        assert!(b.room(1, 500, 1, 500), "up to the process's bytes (9500 + 500)");
        assert!(!b.room(1, 500, 1, 501), "past the process's bytes, though within b's share");
        assert!(!a.room(90, 9_000, 1, 10), "a is past its new share");
        a.hold(10, 1_000);
        assert!(b.room(1, 500, 1, 3_000), "room given back by the other transaction");
        assert!(b.commit_soon(25, 0), "early at half of its share");
        drop(a);
        assert_eq!(b.share(), Limits { events: 100, bytes: 10_000 }, "the share grows back");
    }
}
