//! How soon the transactional producer starts over from `bootstrap.servers` when it knows no
//! broker it can reach.
//!
//! A KRaft broker paused or cut off longer than its session with the controller is fenced when
//! it comes back: for a moment its metadata lists no broker (itself included) and no partition
//! leader. librdkafka 2.12 then drops the broker it knew (it is not in the metadata), and when
//! that broker had already been reported down during the outage it starts no re-bootstrap at
//! once: the producer knows no broker, cannot find the transaction coordinator ("No brokers
//! available for Transactions") nor the partitions' leaders, and waits for
//! `metadata.recovery.rebootstrap.trigger.ms` (5 minutes by default) while the broker answers
//! everyone else. Every commit times out meanwhile, in its flush or in `EndTxn`, and `/readyz`
//! says no commit succeeded. A trigger well below the commit alarm (30 s) lets the producer
//! find the broker again within seconds; while the brokers are really away it only
//! re-bootstraps now and then, which costs a DNS look-up.

use rdkafka::ClientConfig;

/// The property, and its value unless `[sink.kafka.properties]` sets it.
const PROPERTY: &str = "metadata.recovery.rebootstrap.trigger.ms";
const TRIGGER_MS: u32 = 10_000;

/// Sets a short re-bootstrap trigger on `config`, unless the operator set one.
pub(super) fn rebootstrap_soon(config: &mut ClientConfig) {
    if config.get(PROPERTY).is_none() {
        config.set(PROPERTY, TRIGGER_MS.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trigger_is_short_unless_the_operator_set_one() {
        let mut c = ClientConfig::new();
        rebootstrap_soon(&mut c);
        assert_eq!(c.get(PROPERTY), Some("10000"));
        let mut c = ClientConfig::new();
        c.set(PROPERTY, "60000");
        rebootstrap_soon(&mut c);
        assert_eq!(c.get(PROPERTY), Some("60000"), "the operator's value stays");
    }
}
