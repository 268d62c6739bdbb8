//! A producer whose reports (delivery reports, logs, errors, statistics) a thread of its own
//! serves, woken by librdkafka when they arrive: as rdkafka's `ThreadedProducer`, without its
//! polling loop. That loop polls every 100 ms, and each poll ends by spinning on the clock for
//! the last fraction of a millisecond (rdkafka 0.39 rounds the time left down to whole
//! milliseconds, then polls without waiting until the deadline is past): ~9 ms of CPU per
//! second per producer, all the time, idle or not. A replica holding 4 shards with its state in
//! Kafka spent 1.2 s of CPU per 35 s doing nothing (2026-12-03).
//!
//! Here librdkafka calls back when its report queue turns non-empty (`rd_kafka_queue_cb_event_enable`,
//! as the sink's async producer, `producer.rs`); the callback unparks the thread, which takes
//! every report waiting and parks again. No timer, no wake-up while nothing arrives.

use std::ffi::c_void;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::bindings as rdsys;
use rdkafka::config::FromClientConfigAndContext;
use rdkafka::error::KafkaResult;
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};

/// librdkafka's wake-up: its main queue was empty and is not any more.
unsafe extern "C" fn reports_waiting(_: *mut rdsys::rd_kafka_t, opaque: *mut c_void) {
    // SAFETY: `opaque` is the boxed `Thread` of a `PolledProducer`, which disables this
    // callback before it lets go of it.
    let thread = unsafe { &*(opaque as *const Thread) };
    thread.unpark();
}

/// A handle on librdkafka's main queue, for the thread that serves it.
struct Queue(*mut rdsys::rd_kafka_queue_t);

// SAFETY: used only through librdkafka's thread-safe queue functions; destroyed once, by the
// producer, after the thread using it has ended.
unsafe impl Send for Queue {}

/// A `BaseProducer` whose reports are served by a thread of its own (see the module
/// documentation). Dereferences to the `BaseProducer`.
pub struct PolledProducer<C: ProducerContext + 'static> {
    base: Arc<BaseProducer<C>>,
    queue: *mut rdsys::rd_kafka_queue_t,
    /// What the callback unparks (boxed: its address is librdkafka's opaque pointer).
    thread: Box<Thread>,
    stop: Arc<AtomicBool>,
    serving: Option<JoinHandle<()>>,
}

// SAFETY: the queue handle is used only through librdkafka's thread-safe functions; the rest
// is Send and Sync (`BaseProducer` is, for a context that is).
unsafe impl<C: ProducerContext + 'static> Send for PolledProducer<C> {}
// SAFETY: as above.
unsafe impl<C: ProducerContext + 'static> Sync for PolledProducer<C> {}

impl<C: ProducerContext + 'static> PolledProducer<C> {
    /// Creates the producer and the thread serving its reports, named `name`.
    pub fn create(config: &ClientConfig, context: C, name: &str) -> KafkaResult<Self> {
        let base = Arc::new(BaseProducer::from_config_and_context(config, context)?);
        // SAFETY: a new handle on the client's main queue, destroyed in `drop` after the thread.
        let queue = unsafe { rdsys::rd_kafka_queue_get_main(base.client().native_ptr()) };
        let stop = Arc::new(AtomicBool::new(false));
        let serving = {
            let (base, stop, queue) = (base.clone(), stop.clone(), Queue(queue));
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || serve(&base, &queue, &stop))
                .map_err(|e| rdkafka::error::KafkaError::ClientCreation(format!("the {name} thread: {e}")))?
        };
        let thread = Box::new(serving.thread().clone());
        // SAFETY: `thread` lives as long as `self`, whose `drop` disables the callback first.
        unsafe {
            rdsys::rd_kafka_queue_cb_event_enable(
                queue,
                Some(reports_waiting),
                std::ptr::from_ref::<Thread>(&thread).cast_mut().cast::<c_void>(),
            );
        }
        // Reports that arrived before the callback was on: looked at once more.
        thread.unpark();
        Ok(Self { base, queue, thread, stop, serving: Some(serving) })
    }
}

/// Takes every waiting report, then parks until librdkafka (or `drop`) unparks the thread.
fn serve<C: ProducerContext>(base: &BaseProducer<C>, queue: &Queue, stop: &AtomicBool) {
    loop {
        // SAFETY: the handle outlives this thread (destroyed after it was joined).
        while unsafe { rdsys::rd_kafka_queue_length(queue.0) } > 0 {
            // One event per call: a report batch, a log line, an error or statistics.
            base.poll(Duration::ZERO);
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        std::thread::park();
    }
}

impl<C: ProducerContext + 'static> Deref for PolledProducer<C> {
    type Target = BaseProducer<C>;

    fn deref(&self) -> &BaseProducer<C> {
        &self.base
    }
}

impl<C: ProducerContext + 'static> Drop for PolledProducer<C> {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; from here on librdkafka no longer calls back with a
        // pointer to `thread`.
        unsafe { rdsys::rd_kafka_queue_cb_event_enable(self.queue, None, std::ptr::null_mut()) };
        self.stop.store(true, Ordering::Release);
        self.thread.unpark();
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
        // SAFETY: the thread using the handle has ended; destroyed once.
        unsafe { rdsys::rd_kafka_queue_destroy(self.queue) };
        // The producer itself goes with `base` (its last holder now), after the handle.
    }
}
