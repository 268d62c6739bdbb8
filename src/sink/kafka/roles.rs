//! One connection configuration (`[sink.kafka]` brokers and properties, or
//! `[checkpoint.kafka]`'s), handed to producers and consumers alike: each gets only the
//! properties of its role. librdkafka ignores a property of the other role, with a
//! `CONFWARN` warning at every start.

use rdkafka::ClientConfig;

/// Producer-only properties (global and topic-level; column "C/P" = "P" of librdkafka 2.12's
/// CONFIGURATION.md, aliases included).
const PRODUCER_ONLY: &[&str] = &[
    "acks",
    "batch.num.messages",
    "batch.size",
    "compression.codec",
    "compression.level",
    "compression.type",
    "delivery.report.only.error",
    "delivery.timeout.ms",
    "dr_cb",
    "dr_msg_cb",
    "enable.gapless.guarantee",
    "enable.idempotence",
    "linger.ms",
    "message.send.max.retries",
    "message.timeout.ms",
    "msg_order_cmp",
    "partitioner",
    "partitioner_cb",
    "produce.offset.report",
    "queue.buffering.backpressure.threshold",
    "queue.buffering.max.kbytes",
    "queue.buffering.max.messages",
    "queue.buffering.max.ms",
    "queuing.strategy",
    "request.required.acks",
    "request.timeout.ms",
    "retries",
    "sticky.partitioning.linger.ms",
    "transaction.timeout.ms",
    "transactional.id",
];

/// Consumer-only properties (column "C/P" = "C" of the same table).
const CONSUMER_ONLY: &[&str] = &[
    "auto.commit.enable",
    "auto.commit.interval.ms",
    "auto.offset.reset",
    "check.crcs",
    "consume.callback.max.messages",
    "consume_cb",
    "coordinator.query.interval.ms",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "enable.partition.eof",
    "fetch.error.backoff.ms",
    "fetch.max.bytes",
    "fetch.message.max.bytes",
    "fetch.min.bytes",
    "fetch.queue.backoff.ms",
    "fetch.wait.max.ms",
    "group.id",
    "group.instance.id",
    "group.protocol",
    "group.protocol.type",
    "group.remote.assignor",
    "heartbeat.interval.ms",
    "isolation.level",
    "max.partition.fetch.bytes",
    "max.poll.interval.ms",
    "offset.store.method",
    "offset.store.path",
    "offset.store.sync.interval.ms",
    "offset_commit_cb",
    "partition.assignment.strategy",
    "queued.max.messages.kbytes",
    "queued.min.messages",
    "rebalance_cb",
    "session.timeout.ms",
];

fn without(cc: &ClientConfig, other_role: &[&str]) -> ClientConfig {
    let mut out = cc.clone();
    let drop: Vec<String> =
        cc.config_map().keys().filter(|k| other_role.contains(k)).map(|k| (*k).to_string()).collect();
    for k in drop {
        out.remove(&k);
    }
    out
}

/// `cc` without the producer-only properties: for a consumer.
pub fn for_consumer(cc: &ClientConfig) -> ClientConfig {
    without(cc, PRODUCER_ONLY)
}

/// `cc` without the consumer-only properties: for a producer (and an admin client, which
/// librdkafka runs as a producer).
pub fn for_producer(cc: &ClientConfig) -> ClientConfig {
    without(cc, CONSUMER_ONLY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both() -> ClientConfig {
        let mut cc = ClientConfig::new();
        for (k, v) in [
            ("bootstrap.servers", "k:9092"),
            ("security.protocol", "SASL_SSL"),
            ("sasl.username", "u"),
            ("client.id", "kubecast"),
            ("acks", "all"),
            ("enable.idempotence", "true"),
            ("linger.ms", "5"),
            ("compression.type", "zstd"),
            ("group.id", "g"),
            ("isolation.level", "read_committed"),
            ("fetch.max.bytes", "1048576"),
        ] {
            cc.set(k, v);
        }
        cc
    }

    fn keys(cc: &ClientConfig) -> Vec<&str> {
        cc.config_map().keys().copied().collect()
    }

    #[test]
    fn a_consumer_gets_the_connection_and_its_own_properties_only() {
        let cc = both();
        let c = for_consumer(&cc);
        assert_eq!(
            keys(&c),
            [
                "bootstrap.servers",
                "client.id",
                "fetch.max.bytes",
                "group.id",
                "isolation.level",
                "sasl.username",
                "security.protocol"
            ]
        );
        assert_eq!(c.get("security.protocol"), Some("SASL_SSL"));
    }

    #[test]
    fn a_producer_gets_the_connection_and_its_own_properties_only() {
        let p = for_producer(&both());
        assert_eq!(
            keys(&p),
            [
                "acks",
                "bootstrap.servers",
                "client.id",
                "compression.type",
                "enable.idempotence",
                "linger.ms",
                "sasl.username",
                "security.protocol"
            ]
        );
    }

    #[test]
    fn the_roles_do_not_overlap() {
        assert!(PRODUCER_ONLY.iter().all(|p| !CONSUMER_ONLY.contains(p)));
    }
}
