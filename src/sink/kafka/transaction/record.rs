//! A record of the transaction, and producing it.

use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Headers, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord};

use super::context::TxnContext;

/// How long a produce waits while librdkafka's queue is full.
const QUEUE_WAIT: Duration = Duration::from_secs(30);

/// One record of the transaction.
#[derive(Clone)]
pub struct Record {
    pub topic: String,
    pub key: String,
    /// `None`: a tombstone.
    pub payload: Option<Vec<u8>>,
    pub headers: Option<OwnedHeaders>,
}

impl Record {
    pub(super) fn size(&self) -> usize {
        self.topic.len() + self.key.len() + self.payload.as_ref().map_or(0, Vec::len) + 64
    }

    /// At least the size librdkafka compares with `message.max.bytes` before it takes a record:
    /// key, value and headers with their framing, each length counted at its largest.
    pub(super) fn wire_size(&self) -> usize {
        /// A record's framing at its largest (librdkafka's `RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD`).
        const FRAMING: usize = 36;
        /// A header's two lengths at their largest.
        const HEADER_FRAMING: usize = 20;
        let headers: usize = self
            .headers
            .as_ref()
            .map_or(0, |h| h.iter().map(|h| h.key.len() + h.value.map_or(0, <[u8]>::len) + HEADER_FRAMING).sum());
        FRAMING + self.key.len() + self.payload.as_ref().map_or(0, Vec::len) + headers
    }
}

/// `r` as librdkafka's record.
pub(super) fn base_record(r: &Record) -> BaseRecord<'_, str, [u8]> {
    let mut br = BaseRecord::<str, [u8]>::to(&r.topic).key(&r.key);
    if let Some(p) = &r.payload {
        br = br.payload(p);
    }
    if let Some(h) = &r.headers {
        br = br.headers(h.clone());
    }
    br
}

pub(super) fn produce(producer: &BaseProducer<TxnContext>, r: &Record) -> KafkaResult<()> {
    producer.send(base_record(r)).map_err(|(e, _)| e)
}

/// [`produce`], waiting (up to [`QUEUE_WAIT`]) while librdkafka's queue is full.
pub(super) fn produce_blocking(producer: &BaseProducer<TxnContext>, r: &Record) -> KafkaResult<()> {
    let deadline = Instant::now() + QUEUE_WAIT;
    loop {
        match produce(producer, r) {
            Err(KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            other => return other,
        }
    }
}
