//! Unit tests of the transaction without a broker.

use super::*;
use rdkafka::error::KafkaResult;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::BaseProducer;

/// The size checked before a record is kept is never below librdkafka's own check (no
/// broker needed: librdkafka refuses a record larger than `message.max.bytes` at once),
/// and at most a few bytes per header above it.
#[test]
fn a_record_librdkafka_refuses_as_too_large_is_refused_before_it_is_kept() {
    const MAX: usize = 2000;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:1")
        .set("message.max.bytes", MAX.to_string())
        .create()
        .expect("a producer");
    for headers in [0usize, 1, 5] {
        let (mut refused_by_librdkafka, mut refused_here) = (0, 0);
        for len in MAX - 400..=MAX {
            let h = (0..headers).fold(OwnedHeaders::new(), |h, i| {
                h.insert(Header { key: &format!("ce_h{i}"), value: Some("a value") })
            });
            let record =
                Record { topic: "t".into(), key: "some-uid".into(), payload: Some(vec![b'x'; len]), headers: Some(h) };
            let too_large = matches!(
                produce_base(&producer, &record),
                Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge))
            );
            refused_by_librdkafka += usize::from(too_large);
            refused_here += usize::from(record.wire_size() > MAX);
            assert!(!too_large || record.wire_size() > MAX, "{len} bytes with {headers} headers");
        }
        assert!(refused_by_librdkafka > 0, "the limit was reached with {headers} headers");
        assert!(
            refused_here - refused_by_librdkafka <= 20 * headers + 10,
            "{headers} headers: {refused_here} refused here, {refused_by_librdkafka} by librdkafka"
        );
    }
    producer.purge(rdkafka::producer::PurgeConfig::default().queue());
}

fn produce_base(producer: &BaseProducer, r: &Record) -> KafkaResult<()> {
    producer.send(super::record::base_record(r)).map_err(|(e, _)| e)
}
