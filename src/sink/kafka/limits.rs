//! How many of the sink's events may wait uncommitted in the exactly-once transaction
//! (`[sink.kafka] max_uncommitted_events`, `max_uncommitted_bytes`).

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
}
