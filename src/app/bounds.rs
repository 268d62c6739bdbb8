//! The process's memory bounds, shared by the shards it runs: `[delivery] queue_capacity` and
//! `max_in_flight`, and with exactly-once `[sink.kafka] max_uncommitted_events` and
//! `max_uncommitted_bytes`. Each shard's pipeline takes a part of each (`model::budget`), so a
//! replica that inherits every shard during a broker outage holds what one unsharded process
//! would, not that times the shards. The channels between the stages follow the queue: each
//! holds an eighth of `queue_capacity` (at most 1024) divided by the shard count, at least 16,
//! so the two stages before the queue hold at most a quarter more than it and 2048 items in
//! all, whatever the shards (but for the floor of 32 per shard).

use std::sync::Arc;

use crate::config::Config;
use crate::model::Budget;
use crate::sink::kafka::transaction::{Limits, Uncommitted};

/// The largest capacity of a channel between stages (reflectors -> shaping -> queue): that of
/// an unsharded process with the default `queue_capacity` (10000).
pub const CHANNEL_CAPACITY: usize = 1024;
/// The smallest (a stage wakes the next once per this many items at worst).
const MIN_CHANNEL_CAPACITY: usize = 16;

/// The process's bounds; cloned, the same bounds.
#[derive(Debug, Clone)]
pub struct Bounds {
    pub queue: Arc<Budget>,
    pub in_flight: Arc<Budget>,
    uncommitted_events: Arc<Budget>,
    uncommitted_bytes: Arc<Budget>,
    channel_capacity: usize,
}

impl Bounds {
    /// The bounds `config` sets, for the whole process.
    pub fn of(config: &Config) -> Self {
        let d = &config.delivery;
        let limits = config
            .sink
            .kafka
            .as_ref()
            .map(|k| Limits { events: k.max_uncommitted_events, bytes: k.max_uncommitted_bytes })
            .unwrap_or_default();
        let shards = config.coordination.sharded().map_or(1, |s| s.len());
        Self {
            queue: Budget::new(d.queue_capacity),
            in_flight: Budget::new(d.max_in_flight),
            uncommitted_events: Budget::new(limits.events),
            uncommitted_bytes: Budget::new(limits.bytes),
            channel_capacity: channel_capacity(d.queue_capacity, shards),
        }
    }

    /// A part of the uncommitted bounds, for one shard's transaction.
    pub fn uncommitted(&self) -> Uncommitted {
        Uncommitted::part_of(&self.uncommitted_events, &self.uncommitted_bytes)
    }

    /// The capacity of each channel between the stages of one pipeline.
    pub fn channel_capacity(&self) -> usize {
        self.channel_capacity
    }
}

/// An eighth of the queue's capacity (at most 1024), divided among the shards; at least 16.
fn channel_capacity(queue_capacity: usize, shards: usize) -> usize {
    ((queue_capacity / 8).min(CHANNEL_CAPACITY) / shards.max(1)).max(MIN_CHANNEL_CAPACITY)
}

#[cfg(test)]
mod tests {
    use super::channel_capacity;

    #[test]
    fn the_channels_hold_a_quarter_of_the_queue_whatever_the_shards() {
        assert_eq!(channel_capacity(10_000, 1), 1024, "the default: as before");
        assert_eq!(channel_capacity(10_000, 4), 256);
        assert_eq!(channel_capacity(400, 1), 50);
        assert_eq!(channel_capacity(400, 4), 16, "never below 16");
        assert_eq!(channel_capacity(1_000_000, 1), 1024, "never above 1024");
        for shards in 1..=8 {
            for capacity in [1_000, 10_000, 80_000] {
                // Two channels per shard: at most a quarter of the queue and 2048 in all, but
                // for the floor of 16 each.
                let all = 2 * shards * channel_capacity(capacity, shards);
                assert!(all <= (capacity / 4).min(2048).max(32 * shards), "{capacity} on {shards} shards: {all}");
            }
        }
    }
}
