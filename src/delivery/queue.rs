//! The queue: one loop, no task per event. Events wait per key (the object's uid); at most one
//! event per key is in flight, so an object's events are never reordered, also under retries,
//! while different objects go out concurrently (up to `max_in_flight`). At most
//! `queue_capacity` events are held; when that is reached the loop stops taking jobs, the
//! bounded channels behind it fill, and the reflectors stop reading their watches. A full
//! queue takes jobs again once a batch fits (an eighth of its capacity, at most 256), so the
//! stages before it wake once per batch rather than once per acknowledged event.
//!
//! Both bounds are the process's: with shards, each shard's queue holds a part of them
//! ([`Part`]: its share shrinks and grows as shards come and go, and the queues together
//! never hold more than the bound, give or take one batch per shard taken at the same time).
//!
//! Each job is acknowledged to its stream's watermark once its event was accepted by the sink
//! or written to the dead letter, or at once when it carries no event.
//!
//! Exactly-once into Kafka: an event holds a gate pass from right before its send (after the
//! rate limits) until its acknowledgement; a commit seals the gate and waits for every pass,
//! so it waits for sends into the open transaction only, never for a rate limit or a backoff.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use governor::DefaultDirectRateLimiter;
use tokio::sync::mpsc;
use tracing::warn;

use super::dead_letter::DeadLetter;
pub use super::error::DeliveryError;
use super::retry::RetryPolicy;
use crate::model::Part;
use crate::model::gate::{Gate, Pass};
use crate::model::{Effect, Verb};
use crate::observe::metrics::{GaugeShare, StreamMetrics};
use crate::observe::refusals::{RefusalHold, Refusals};
use crate::sink::{Outbound, SendError, Sink};
use crate::state::watermark::StreamCheckpoint;

pub type Limiter = Arc<DefaultDirectRateLimiter>;

/// One reflector item after shaping: its checkpoint effect and, unless filtered out or a
/// bookmark, the event to send.
pub struct Job {
    pub stream: usize,
    pub seq: u64,
    pub effect: Effect,
    /// Boxed: a job is moved several times (channel, batch, per-key wait, in-flight future)
    /// and the event is most of its size.
    pub msg: Option<Box<Outbound>>,
    /// The resource's own rate limit, if it has one (in addition to the shared one).
    pub limiter: Option<Limiter>,
    /// The change's verb (metrics labels).
    pub verb: Verb,
}

pub struct Queue {
    pub sink: Arc<Sink>,
    pub limiter: Option<Limiter>,
    pub retry: RetryPolicy,
    pub dead_letter: Arc<DeadLetter>,
    /// Its part of the process's `max_in_flight`: events sent at once.
    pub in_flight: Part,
    /// Its part of the process's `queue_capacity`: events held.
    pub capacity: Part,
    pub checkpoints: Vec<Arc<StreamCheckpoint>>,
    /// Per stream, as `checkpoints`.
    pub metrics: Vec<Arc<StreamMetrics>>,
    /// Exactly-once into Kafka: each event holds a pass from right before its send (after the
    /// rate limits) until its acknowledgement (a commit seals the gate).
    pub gate: Option<Arc<Gate>>,
    /// Where events held by a destination that refuses every event are reported (readiness).
    pub refusals: Arc<Refusals>,
}

impl Queue {
    /// Runs until `rx` is closed and everything taken is delivered, or a fatal error.
    pub async fn run(&self, mut rx: mpsc::Receiver<Job>) -> Result<(), DeliveryError> {
        // Per key with a job ready or in flight: the key's jobs waiting behind that one. Keyed
        // by the key's 64-bit hash (no copy of the key per event): two objects whose keys
        // collide are merely kept in order with each other too.
        let hasher = foldhash::fast::RandomState::default();
        let slot = |key: &str| hasher.hash_one(key);
        let mut per_key: HashMap<u64, VecDeque<Job>, foldhash::fast::RandomState> = HashMap::default();
        // Emptied per-key queues that own an allocation, kept for the next key that needs one
        // (an object with a second event while its first is in flight): no allocation and free
        // per such event.
        let mut spare: Vec<VecDeque<Job>> = Vec::new();
        // Jobs that may start now (each the only one of its key ready or in flight).
        let mut ready: VecDeque<Job> = VecDeque::new();
        // One future type, not boxed itself: each lives in its FuturesUnordered task node.
        let mut in_flight = FuturesUnordered::new();
        let mut held = 0usize;
        let mut input_open = true;
        // Jobs are taken in batches: once the queue is full, it takes more only when a batch
        // fits again. One wake-up of the stage before it (and of its thread) then moves a
        // batch instead of one job each time an event is acknowledged.
        let mut accepting = true;
        let mut batch: Vec<Job> = Vec::with_capacity(refill_batch(self.capacity.share()));
        // This queue's part of the process's gauges (several with shards).
        let g = crate::observe::metrics::get();
        let (depth, flying) = (GaugeShare::new(&g.queue_depth), GaugeShare::new(&g.in_flight));
        loop {
            // Created before the room is looked at: room another shard gives back meanwhile
            // is not missed.
            let freed = self.capacity.freed();
            self.in_flight.set(in_flight.len());
            if !ready.is_empty() {
                for _ in 0..self.in_flight.available() {
                    let Some(job) = ready.pop_front() else { break };
                    in_flight.push(self.deliver(job));
                }
                self.in_flight.set(in_flight.len());
            }
            self.capacity.set(held);
            depth.set(held as i64);
            flying.set(in_flight.len() as i64);
            if !input_open && held == 0 {
                return Ok(());
            }
            // Acknowledgements held behind an event still in flight (its stream's watermark
            // cannot apply them) are bounded too: past the queue's share in one stream, no more
            // jobs are taken until it delivers (backpressure, reported as a stall).
            let (share, room) = (self.capacity.share(), self.capacity.available());
            if room == 0 || self.checkpoints.iter().any(|c| c.waiting() >= share) {
                accepting = false;
            } else if held == 0 || room >= refill_batch(share) {
                accepting = true;
            }
            tokio::select! {
                Some((job, result, pass)) = in_flight.next() => {
                    held -= 1;
                    // On error the pass is dropped unsettled, and so are those of every event
                    // still in flight: the open transaction is then aborted, never committed.
                    result?;
                    let key = slot(job.msg.as_ref().expect("sent jobs have events").key());
                    match per_key.get_mut(&key).and_then(VecDeque::pop_front) {
                        Some(next) => ready.push_back(next),
                        None => {
                            if let Some(emptied) = per_key.remove(&key)
                                && emptied.capacity() > 0 && spare.len() < SPARE_QUEUES {
                                    spare.push(emptied);
                                }
                        }
                    }
                    self.ack(job);
                    if let Some(pass) = pass {
                        pass.settle();
                    }
                }
                // Another shard gave room back, or left: the share or the room may have grown.
                () = freed, if input_open && !accepting => {}
                taken = rx.recv_many(&mut batch, room.max(1)), if input_open && accepting => {
                    if taken == 0 {
                        input_open = false;
                    }
                    for job in batch.drain(..) {
                        let Some(msg) = &job.msg else {
                            self.ack(job);
                            continue;
                        };
                        held += 1;
                        match per_key.entry(slot(msg.key())) {
                            Entry::Occupied(mut waiting) => waiting.get_mut().push_back(job),
                            Entry::Vacant(free) => {
                                free.insert(spare.pop().unwrap_or_default());
                                ready.push_back(job);
                            }
                        }
                    }
                }
            }
        }
    }

    fn ack(&self, job: Job) {
        if job.msg.is_some() {
            self.metrics[job.stream].acked[job.verb.index()].inc();
        }
        self.checkpoints[job.stream].ack(job.seq, job.effect);
    }

    fn deliver(
        &self,
        job: Job,
    ) -> impl Future<Output = (Job, Result<(), DeliveryError>, Option<Pass>)> + Send + 'static {
        let (sink, limiter, retry, dead_letter) =
            (self.sink.clone(), self.limiter.clone(), self.retry, self.dead_letter.clone());
        let metrics = self.metrics[job.stream].clone();
        let gate = self.gate.clone();
        let refusals = self.refusals.clone();
        async move {
            // Taken right before the send, after the rate limits: a commit seals the gate and
            // waits for every pass, so a pass held while waiting for a rate limit would hold
            // the commit too (up to `max_in_flight` events / the rate: past the transaction's
            // timeout with a low rate).
            let mut pass = None;
            let send = Attempt {
                sink: &sink,
                limiter: limiter.as_ref(),
                resource_limiter: job.limiter.as_ref(),
                retry,
                dead_letter: &dead_letter,
                msg: job.msg.as_ref().expect("only jobs with events are sent"),
                metrics: &metrics,
                verb: job.verb.index(),
                gate: gate.as_ref(),
                refusals: &refusals,
            };
            let result = send_with_retries(&send, &mut pass).await;
            (job, result, pass)
        }
    }
}

/// At most this many emptied per-key queues are kept for reuse (each holds a few jobs' room).
const SPARE_QUEUES: usize = 1024;

/// How many free places the queue waits for, once full, before it takes jobs again: an
/// eighth of its capacity, at most 256.
fn refill_batch(capacity: usize) -> usize {
    (capacity / 8).clamp(1, 256)
}

/// One event's send and what it may need: limits, retries, the dead letter, its metrics.
struct Attempt<'a> {
    sink: &'a Sink,
    limiter: Option<&'a Limiter>,
    /// The resource's own rate limit.
    resource_limiter: Option<&'a Limiter>,
    retry: RetryPolicy,
    dead_letter: &'a DeadLetter,
    msg: &'a Outbound,
    metrics: &'a StreamMetrics,
    verb: usize,
    /// Exactly-once: the gate whose pass each attempt holds from its send on.
    gate: Option<&'a Arc<Gate>>,
    /// Where a refused event is reported while it is held.
    refusals: &'a Arc<Refusals>,
}

/// Exactly-once: takes the event's pass, unless it holds one already. Called right before
/// each send (after the rate limits); the pass is then held until the event is acknowledged
/// (its send accepted or its dead letter written), or given back after a retriable failure.
async fn pass_before_send(gate: Option<&Arc<Gate>>, pass: &mut Option<Pass>) {
    if let (Some(g), None) = (gate, &*pass) {
        *pass = Some(g.pass().await);
    }
}

/// Exactly-once: gives the event's pass back before a dead letter that is not written into
/// the transaction (a file): nothing of the event is in the transaction then.
fn outside_the_transaction(dead_letter: &DeadLetter, pass: &mut Option<Pass>) {
    if !dead_letter.in_transaction()
        && let Some(p) = pass.take()
    {
        p.settle();
    }
}

/// Sends the event once, the common case: no rate limit to wait for, no trace, accepted at
/// once. Everything else (rate limits, traces, retries, the dead letter) is in
/// [`send_slowly`], boxed: inline, its state would make every in-flight event's future larger.
///
/// `pass`: the event's gate pass (exactly-once), taken before each send; held on return
/// unless the last failure was retriable and nothing was sent after it.
async fn send_with_retries(send: &Attempt<'_>, pass: &mut Option<Pass>) -> Result<(), DeliveryError> {
    let mut failed = None;
    if send.limiter.is_none() && send.resource_limiter.is_none() && send.msg.trace.is_none() {
        pass_before_send(send.gate, pass).await;
        let started = std::time::Instant::now();
        match send.sink.send(send.msg).await {
            Ok(()) => {
                crate::observe::metrics::get().publish_latency.observe(started.elapsed().as_secs_f64());
                send.metrics.published[send.verb].inc();
                return Ok(());
            }
            Err(e) => failed = Some(e),
        }
    }
    Box::pin(send_slowly(send, failed, pass)).await
}

/// Rate limit, send, retry retriable failures with backoff, dead-letter permanent ones.
/// `failed`: how a first attempt (by [`send_with_retries`]) failed, if one was made (it holds
/// `pass` then).
///
/// Exactly-once: each attempt takes the gate pass after the rate limits, right before its
/// send, so a commit never waits for a rate limit or a backoff. A retriable failure leaves
/// nothing of the event in the transaction (the sink's contract), so the pass is given back
/// before the backoff. A permanent one (refused before it joined the transaction) keeps it
/// through a broker dead letter's write, which goes into the transaction too, and gives it
/// back before a file's, which is outside it and may be retried for long: a commit never waits
/// for it.
async fn send_slowly(
    send: &Attempt<'_>,
    mut failed: Option<SendError>,
    pass: &mut Option<Pass>,
) -> Result<(), DeliveryError> {
    let Attempt { sink, limiter, resource_limiter, retry, dead_letter, msg, metrics, verb, gate, refusals } = *send;
    // Built at the first retry (most events need none).
    let mut backoff = None;
    // While the destination refuses every event: this event's part of the report.
    let mut refused: Option<RefusalHold> = None;
    let mut attempt = 0u32;
    let result = loop {
        attempt += 1;
        let started = std::time::Instant::now();
        let outcome = match failed.take() {
            // The first attempt, made by `send_with_retries` (no limits, no trace).
            Some(e) => Err(e),
            None => {
                if let Some(l) = resource_limiter {
                    l.until_ready().await;
                }
                if let Some(l) = limiter {
                    l.until_ready().await;
                }
                pass_before_send(gate, pass).await;
                if let (Some(t), 1) = (&msg.trace, attempt) {
                    t.child("queue", t.queued_at(), vec![]);
                    t.start_send(
                        sink.system(),
                        &sink.destination(msg),
                        msg.event.id(),
                        msg.event.attributes.source(),
                        sink.trace_attributes(msg),
                    );
                }
                sink.send(msg).await
            }
        };
        let dead = || metrics.dead_lettered[verb].inc();
        // A retry the destination timed itself (HTTP `Retry-After`): retried, not before then.
        let not_before = match &outcome {
            Err(SendError::RetryAfter { after, .. }) => Some(*after),
            _ => None,
        };
        match outcome {
            Ok(()) => {
                crate::observe::metrics::get().publish_latency.observe(started.elapsed().as_secs_f64());
                metrics.published[verb].inc();
                if attempt > 1 {
                    metrics.clear_failure();
                }
                break Ok(None);
            }
            Err(SendError::Fatal(reason)) => break Err(DeliveryError::Fatal(reason)),
            Err(SendError::Permanent(reason)) => {
                outside_the_transaction(dead_letter, pass);
                if let Err(e) = dead_letter.put(sink, msg, &reason).await {
                    break Err(e);
                }
                dead();
                break Ok(Some(reason));
            }
            // A set-up mistake, not this event's: held in order, whatever `max_attempts` and
            // `max_event_age_seconds` say, until the operator fixes it.
            Err(SendError::Refused { refusal, reason }) => {
                if let Some(p) = pass.take() {
                    p.settle();
                }
                let destination = sink.destination(msg);
                match &refused {
                    Some(hold) if hold.is_for(&destination, refusal) => hold.update(&reason),
                    _ => refused = Some(refusals.hold(&destination, refusal, &reason)),
                }
                metrics.retries.inc();
                let said = SendError::Refused { refusal, reason }.to_string();
                metrics.note_failure(msg.event.id(), &said);
                if attempt == 1 || attempt.is_multiple_of(10) {
                    warn!(event_id = %msg.event.id(), destination = %destination, refusal = refusal.label(), attempt, reason = %said, "the destination refuses every event (a set-up mistake); the event is held, not dead-lettered, and retried with backoff until it is fixed");
                }
                tokio::time::sleep(
                    backoff.get_or_insert_with(|| retry.backoff()).next().unwrap_or(std::time::Duration::from_secs(30)),
                )
                .await;
            }
            Err(SendError::Retriable(reason) | SendError::RetryAfter { reason, .. })
                if !retry.may_retry(attempt) || retry.too_old(msg.event.attributes.time()) =>
            {
                let reason = if retry.may_retry(attempt) {
                    let max = retry.max_age.unwrap_or_default().as_secs();
                    format!("not delivered within {max} s (max_event_age_seconds) after {attempt} attempts: {reason}")
                } else {
                    format!("gave up after {attempt} attempts: {reason}")
                };
                outside_the_transaction(dead_letter, pass);
                if let Err(e) = dead_letter.put(sink, msg, &reason).await {
                    break Err(e);
                }
                dead();
                break Ok(Some(reason));
            }
            Err(SendError::Retriable(reason) | SendError::RetryAfter { reason, .. }) => {
                if let Some(p) = pass.take() {
                    p.settle();
                }
                // No longer refused for a set-up reason (e.g. a broker restarting now).
                refused = None;
                metrics.retries.inc();
                metrics.note_failure(msg.event.id(), &reason);
                if attempt == 1 || attempt.is_multiple_of(10) {
                    warn!(event_id = %msg.event.id(), trace_id = %crate::observe::trace::trace_id(msg.trace.as_ref()), destination = %sink.destination(msg), attempt, reason, "send failed; retrying with backoff");
                }
                let delay =
                    backoff.get_or_insert_with(|| retry.backoff()).next().unwrap_or(std::time::Duration::from_secs(30));
                tokio::time::sleep(delay.max(not_before.unwrap_or_default())).await;
            }
        }
    };
    if let Some(t) = &msg.trace {
        let error = match &result {
            Ok(Some(reason)) => Some(format!("dead-lettered: {reason}")),
            Ok(None) => None,
            Err(e) => Some(e.to_string()),
        };
        t.end_send(attempt.saturating_sub(1), error.clone());
        let outcome = if matches!(result, Ok(None)) { "delivered" } else { "not delivered" };
        t.end(outcome.into(), error);
    }
    result.map(|_| ())
}

/// Unit tests: per-object order, acknowledgements and the checkpoint, retries, capacity, fatal errors; with the stub sink (`tests.rs` in the folder of this file's name).
#[cfg(test)]
mod tests;
