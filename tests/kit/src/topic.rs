//! Reading a Kafka topic as it is now: every partition from the beginning up to the end it
//! had when the read began (a verdict on what was published needs all of it, not what one
//! partition's reader happened to have fetched).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message, OwnedMessage};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

/// Every record of `topic` (on the test broker) up to the end each partition had when called,
/// partition by partition in offset order; `read_committed`: committed records only (records
/// of aborted transactions are skipped; a transaction still open then is waited for). Waits up to
/// 60 s for the topic to exist and for the read; panics after that.
pub fn read_to_end(topic: &str, read_committed: bool) -> Vec<OwnedMessage> {
    read(topic, read_committed, true)
}

/// Like [`read_to_end`], but nothing if the topic does not exist (yet).
pub fn read_if_any(topic: &str, read_committed: bool) -> Vec<OwnedMessage> {
    read(topic, read_committed, false)
}

fn read(topic: &str, read_committed: bool, wait_for_topic: bool) -> Vec<OwnedMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", crate::env_var("KAFKA_BROKERS"))
        .set("group.id", crate::unique("topic-reader"))
        .set("enable.auto.commit", "false")
        .set("allow.auto.create.topics", "false")
        .set("isolation.level", if read_committed { "read_committed" } else { "read_uncommitted" })
        .create()
        .expect("a Kafka consumer");
    let timeout = Duration::from_secs(10);
    let deadline = Instant::now() + Duration::from_secs(60);
    let partitions = loop {
        // Retried: a test that stops the shared broker may run meanwhile.
        match consumer.fetch_metadata(Some(topic), timeout) {
            Ok(md) => {
                if let Some(t) = md.topics().iter().find(|t| t.name() == topic && t.error().is_none())
                    && !t.partitions().is_empty()
                {
                    break t.partitions().iter().map(|p| p.id()).collect::<Vec<i32>>();
                }
                if !wait_for_topic {
                    return Vec::new();
                }
            }
            Err(e) => eprintln!("metadata of {topic}: {e}; again"),
        }
        assert!(Instant::now() < deadline, "topic {topic} does not exist after 60 s");
        std::thread::sleep(Duration::from_millis(300));
    };
    let mut tpl = TopicPartitionList::new();
    let mut ends = Vec::new();
    // The ends as a reader of uncommitted records sees them: a reader of committed ones would be
    // told the start of the oldest open transaction, and miss what was committed after it.
    let uncommitted: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", crate::env_var("KAFKA_BROKERS"))
        .set("group.id", crate::unique("topic-ends"))
        .create()
        .expect("a Kafka consumer");
    for &p in &partitions {
        let (_, high) = uncommitted.fetch_watermarks(topic, p, timeout).expect("the partition's end");
        ends.push((p, high));
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    // The position passes transaction markers and aborted records too, which are not delivered.
    let reached = |c: &BaseConsumer| {
        let positions = c.position().expect("the consumer's positions");
        ends.iter().all(|&(p, end)| {
            end == 0 || matches!(positions.find_partition(topic, p).map(|e| e.offset()), Some(Offset::Offset(o)) if o >= end)
        })
    };
    while !reached(&consumer) {
        assert!(Instant::now() < deadline, "topic {topic} not read to its end {ends:?} within 60 s");
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => out.push(m.detach()),
            Some(Err(e)) => eprintln!("reading {topic}: {e}"),
            None => {}
        }
    }
    out.sort_by_key(|m| (m.partition(), m.offset()));
    out
}

/// The value of header `key` of `m`, as text.
pub fn header(m: &OwnedMessage, key: &str) -> Option<String> {
    m.headers()?.iter().find(|h| h.key == key).and_then(|h| h.value).map(|v| String::from_utf8_lossy(v).into_owned())
}
