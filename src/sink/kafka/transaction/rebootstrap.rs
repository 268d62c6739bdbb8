//! The transactional producer left without any broker it can reach, and how it finds one
//! again.
//!
//! A KRaft broker paused or cut off longer than its session with the controller is fenced when
//! it comes back: for a moment its metadata lists no broker (itself included) and no partition
//! leader. librdkafka 2.12 then drops the broker it knew, as one that left the cluster. When
//! that broker had already been reported down during the outage, and no request was in flight
//! to it, no re-bootstrap starts: the producer knows no broker at all ("No brokers available
//! for Transactions"), finds neither the transaction coordinator nor the partitions' leaders,
//! and skips every metadata refresh ("no usable brokers"), so even
//! `metadata.recovery.rebootstrap.trigger.ms` never fires. Every commit then times out, in its
//! flush or waiting for `EndTxn`, for as long as the process runs, while the broker answers
//! everyone else.
//!
//! kubecast gives it `bootstrap.servers` again ([`add_bootstrap_brokers`], librdkafka's
//! `rd_kafka_brokers_add`) after a commit that failed while librdkafka's statistics list no
//! broker; its next leader or coordinator query connects there, and the commit resumes where
//! it stopped (same producer, same transaction: nothing sent twice). Only then: with a broker
//! known (down or not), librdkafka would add a twin of it at each call. The re-bootstrap
//! trigger is shortened too ([`rebootstrap_soon`]), for an outage during which metadata
//! requests are still sent but never answered.

use std::ffi::CString;

use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};

use super::context::TxnContext;

/// The property, and its value unless `[sink.kafka.properties]` sets it.
const PROPERTY: &str = "metadata.recovery.rebootstrap.trigger.ms";
const TRIGGER_MS: u32 = 10_000;

/// How often librdkafka reports its brokers (`statistics.interval.ms`), unless the operator
/// set it: how the producer left without any is seen ([`TxnContext::knows_a_broker`]).
const STATISTICS_MS: u32 = 5_000;

/// Sets a short re-bootstrap trigger and the statistics on `config`, unless the operator set
/// them.
pub(super) fn rebootstrap_soon(config: &mut ClientConfig) {
    if config.get(PROPERTY).is_none() {
        config.set(PROPERTY, TRIGGER_MS.to_string());
    }
    if config.get("statistics.interval.ms").is_none() {
        config.set("statistics.interval.ms", STATISTICS_MS.to_string());
    }
}

/// Adds `config`'s `bootstrap.servers` to `producer`'s brokers (one already known as a
/// bootstrap broker is kept as it is; a broker learned from metadata gets a bootstrap twin,
/// dropped again at the next metadata): how many it now has of them.
pub(super) fn add_bootstrap_brokers(producer: &BaseProducer<TxnContext>, config: &ClientConfig) -> usize {
    let Some(list) = config.get("bootstrap.servers").and_then(|b| CString::new(b).ok()) else {
        return 0;
    };
    // SAFETY: the client handle is valid while `producer` lives; librdkafka copies the
    // NUL-terminated list and takes its own lock (callable from any thread).
    let added = unsafe { rdkafka::bindings::rd_kafka_brokers_add(producer.client().native_ptr(), list.as_ptr()) };
    usize::try_from(added).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sink::kafka::polled::PolledProducer;

    #[test]
    fn the_trigger_is_short_unless_the_operator_set_one() {
        let mut c = ClientConfig::new();
        rebootstrap_soon(&mut c);
        assert_eq!(c.get(PROPERTY), Some("10000"));
        assert_eq!(c.get("statistics.interval.ms"), Some("5000"));
        let mut c = ClientConfig::new();
        c.set(PROPERTY, "60000");
        rebootstrap_soon(&mut c);
        assert_eq!(c.get(PROPERTY), Some("60000"), "the operator's value stays");
    }

    #[test]
    fn the_bootstrap_servers_are_added_again() {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", "127.0.0.1:1,127.0.0.1:2");
        let producer = PolledProducer::create(&c, TxnContext::new("t".into(), Arc::default(), Arc::default()), "test")
            .expect("a producer");
        assert_eq!(add_bootstrap_brokers(&producer, &c), 2, "both, already known: kept");
        assert_eq!(add_bootstrap_brokers(&producer, &ClientConfig::new()), 0, "no bootstrap.servers");
    }

    #[test]
    fn the_statistics_say_whether_a_broker_is_known() {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", "127.0.0.1:1").set("statistics.interval.ms", "100");
        let producer = PolledProducer::create(&c, TxnContext::new("t".into(), Arc::default(), Arc::default()), "test")
            .expect("a producer");
        producer.context().knows_a_broker.store(false, std::sync::atomic::Ordering::Relaxed);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !producer.context().knows_a_broker() {
            assert!(std::time::Instant::now() < deadline, "the statistics list the configured broker");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
