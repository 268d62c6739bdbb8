//! The sink's producer: librdkafka's producer whose delivery reports are taken on the async
//! runtime. librdkafka calls back when its report queue turns non-empty; that wakes one task,
//! which takes every report waiting and completes each record's future. (rdkafka's
//! `FutureProducer` keeps a thread of its own polling that queue instead: one more thread
//! woken for every batch of reports, and the runtime's worker woken by it.)

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use futures::channel::oneshot;
use rdkafka::bindings as rdsys;
use rdkafka::client::{Client, ClientContext};
use rdkafka::config::{FromClientConfigAndContext, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer as _, ProducerContext};
use rdkafka::{ClientConfig, Timestamp};
use tokio::sync::Notify;

/// Where a record went: its partition and offset.
pub type Delivered = (i32, i64);

/// A record not delivered: why, and the record (its headers, to send it again).
pub type Undelivered = (KafkaError, OwnedMessage);

/// Completes each record's future with its delivery report; the rest is `C`'s.
pub struct Reports<C> {
    inner: C,
}

impl<C: ClientContext> ClientContext for Reports<C> {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, msg: &str) {
        self.inner.log(level, fac, msg);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.inner.error(error, reason);
    }
}

impl<C: ClientContext + 'static> ProducerContext for Reports<C> {
    type DeliveryOpaque = Box<oneshot::Sender<Result<Delivered, Undelivered>>>;

    fn delivery(&self, result: &DeliveryResult<'_>, tx: Self::DeliveryOpaque) {
        let report = match result {
            Ok(m) => Ok((m.partition(), m.offset())),
            Err((e, m)) => Err((e.clone(), m.detach())),
        };
        // The sender is gone only when its send was given up (a dropped future): nobody waits.
        let _ = tx.send(report);
    }
}

/// librdkafka's wake-up: its report queue was empty and is not any more.
unsafe extern "C" fn reports_waiting(_: *mut rdsys::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: `opaque` is the `Notify` of a `Producer`, which disables this callback before
    // it lets go of it.
    let notify = unsafe { &*(opaque as *const Notify) };
    notify.notify_one();
}

/// A producer whose `send` returns once the record is delivered (or not).
pub struct Producer<C: ClientContext + 'static> {
    shared: Arc<Shared<C>>,
    reports: tokio::task::JoinHandle<()>,
}

/// What the producer and its reports task share.
struct Shared<C: ClientContext + 'static> {
    /// librdkafka's main queue (where the delivery reports arrive), a handle of our own.
    queue: *mut rdsys::rd_kafka_queue_t,
    /// Notified by librdkafka (`reports_waiting`) when reports arrive at an empty queue.
    waiting: Notify,
    /// Dropped after the queue handle (`Drop` runs before the fields are dropped).
    base: BaseProducer<Reports<C>>,
}

// SAFETY: the queue handle is used only through librdkafka's thread-safe queue functions, and
// destroyed once, when the last holder lets go.
unsafe impl<C: ClientContext + 'static> Send for Shared<C> {}
// SAFETY: as above.
unsafe impl<C: ClientContext + 'static> Sync for Shared<C> {}

impl<C: ClientContext + 'static> Drop for Shared<C> {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; from here on librdkafka no longer calls back with a
        // pointer to `waiting`, which is dropped after this.
        unsafe {
            rdsys::rd_kafka_queue_cb_event_enable(self.queue, None, std::ptr::null_mut());
            rdsys::rd_kafka_queue_destroy(self.queue);
        }
    }
}

impl<C: ClientContext + 'static> Producer<C> {
    /// Creates the producer and its reports task on the current runtime.
    pub fn create(config: &ClientConfig, context: C) -> KafkaResult<Self> {
        let base = BaseProducer::from_config_and_context(config, Reports { inner: context })?;
        // SAFETY: a new handle on the client's main queue, destroyed before the client
        // (`Shared::drop`).
        let queue = unsafe { rdsys::rd_kafka_queue_get_main(base.client().native_ptr()) };
        let shared = Arc::new(Shared { queue, waiting: Notify::new(), base });
        // SAFETY: `waiting` lives as long as `shared`, whose `drop` disables the callback first.
        unsafe {
            rdsys::rd_kafka_queue_cb_event_enable(
                queue,
                Some(reports_waiting),
                std::ptr::from_ref(&shared.waiting).cast_mut().cast::<c_void>(),
            );
        }
        let reports = tokio::spawn(take_reports(shared.clone()));
        Ok(Self { shared, reports })
    }

    pub fn client(&self) -> &Client<Reports<C>> {
        self.shared.base.client()
    }

    /// Hands the record to librdkafka (waiting while its queue is full) and waits for its
    /// delivery report.
    // The error carries the record back, as rdkafka's own producers do.
    #[allow(clippy::result_large_err)]
    pub async fn send(
        &self,
        topic: &str,
        key: &str,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
    ) -> Result<Delivered, Undelivered> {
        let (tx, rx) = oneshot::channel();
        let mut record = BaseRecord::with_opaque_to(topic, Box::new(tx)).key(key);
        if let Some(h) = headers {
            record = record.headers(h);
        }
        if let Some(p) = payload {
            record = record.payload(p);
        }
        loop {
            match self.shared.base.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                    record = returned;
                    tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                }
                Err((e, returned)) => return Err((e, unsent(returned.topic, returned.headers))),
            }
        }
        // The sender is dropped without a report only if the producer went, which this holds.
        rx.await.unwrap_or_else(|_| Err((KafkaError::Canceled, unsent(topic, None))))
    }

    /// Waits until everything handed to librdkafka is delivered (or `timeout` passes).
    pub fn flush(&self, timeout: Duration) -> KafkaResult<()> {
        self.shared.base.flush(timeout)
    }
}

impl<C: ClientContext + 'static> Drop for Producer<C> {
    fn drop(&mut self) {
        self.reports.abort();
    }
}

/// How long a send waits when librdkafka's queue is full (`queue.buffering.max.messages`)
/// before it tries again.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(10);

/// Report events taken before the reports task lets other tasks run (each holds the reports
/// of one produce request).
const REPORTS_IN_A_ROW: usize = 64;

/// A record that never reached librdkafka's queue, with its headers (to be sent again).
fn unsent(topic: &str, headers: Option<OwnedHeaders>) -> OwnedMessage {
    OwnedMessage::new(None, None, topic.to_string(), Timestamp::NotAvailable, -1, 0, headers)
}

/// Takes every waiting report (and log or error event) each time librdkafka says some arrived.
async fn take_reports<C: ClientContext + 'static>(shared: Arc<Shared<C>>) {
    loop {
        let mut taken = 0usize;
        // SAFETY: the handle lives as long as `shared`.
        while unsafe { rdsys::rd_kafka_queue_length(shared.queue) } > 0 {
            shared.base.poll(Duration::ZERO);
            taken += 1;
            // A long run of reports (a backlog delivered) lets the other tasks run between.
            if taken.is_multiple_of(REPORTS_IN_A_ROW) {
                tokio::task::yield_now().await;
            }
        }
        shared.waiting.notified().await;
    }
}
