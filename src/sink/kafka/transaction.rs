//! The transactional producer shared by the Kafka state store and, with
//! `[sink.kafka] exactly_once`, by the Kafka sink: the events and the state records that
//! advance past them are committed in one Kafka transaction, so a `read_committed` consumer
//! sees each change once (KIP-98; Kafka Connect does the same for its sources, KIP-618).
//!
//! States of the transaction (the one `Mutex` holds them with the events of the open one):
//!
//! - `Idle`: none open. Without exactly-once, the state store begins one per write.
//! - `Open`: begun; events are produced into it as they are sent, and kept (in send order)
//!   until it commits, to be produced again in the next one if it is aborted.
//! - `MustAbort`: a produce or the commit failed with an error that is not fatal; events are
//!   only kept. The next commit aborts it, begins a new one, produces the kept events again
//!   (same records, same order), then the state records, then commits.
//! - `Committing`: `commit_transaction` did not finish in time (librdkafka: retriable, and
//!   the transaction need not be aborted). It is neither aborted nor produced again: the next
//!   commit calls `commit_transaction` again first (librdkafka resumes it), and only then
//!   begins the next transaction. Events sent meanwhile are only kept. If librdkafka says the
//!   transaction must be aborted after all, it goes to `MustAbort` with every kept event. If
//!   its commit never gets past the flush (librdkafka keeps the records queued after a broker
//!   pause) or its abort never finishes, for longer than `transaction.timeout.ms`, a new
//!   producer takes the `transactional.id` over and sends the kept events again (`replace.rs`).
//! - `Abandoned`: an event was sent into the open transaction but the queue stopped before
//!   acknowledging it (the [`Gate`] is broken): no state covers it, so the transaction is
//!   aborted and nothing more is committed by this process; the restart sends everything
//!   since the last commit again.
//!
//! Fatal errors end it, by cause ([`TxnError`]): fenced by a newer producer with the same
//! `transactional.id` (another owner), refused by the broker for a set-up reason (a missing
//! ACL, a transaction timeout above the broker's maximum: no other owner), or any other fatal
//! error of librdkafka's transaction manager. The caller stops the process.
//! Delivery reports are read for a record rejected for good: one too large for its topic is
//! [`TxnError::Poison`] (the process stops); one whose topic refuses every record (missing, no
//! Write permission) is [`TxnError::RecordRefused`]: aborted, kept, tried again (`refused.rs`).
//!
//! In every state the events kept are bounded ([`Uncommitted`]: `[sink.kafka]
//! max_uncommitted_events`, `max_uncommitted_bytes`, bounds of the process shared by the
//! transactions of the shards it runs): once reached, a send waits, outside
//! the gate, until a commit or an abort for good frees room, so the delivery queue fills and
//! the reflectors stop reading their watches; a broker outage costs bounded memory.
//!
//! The delivery queue holds a [`Gate`] pass from before an event's send until it is
//! acknowledged; the commit seals the gate first, so every event in a committed transaction
//! was acknowledged before the state written with it was taken.
//!
//! librdkafka's transactional calls block: callers run [`Transaction::commit`] on the blocking
//! pool.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer;
use tokio::sync::Notify;
use tracing::{debug, warn};

pub use super::limits::{Limits, Uncommitted};
use super::off_worker::OffWorker;
use super::polled::PolledProducer;
pub use crate::model::gate::Gate;
use crate::observe::metrics::{self, GaugeShare};
pub use context::TxnContext;
pub use error::TxnError;
use error::classify;
use rebootstrap::rebootstrap_soon;
pub use record::Record;
use record::{produce, produce_blocking};
pub use take_over::OwnerCheck;
use take_over::new_producer;

mod abandon;
mod context;
mod error;
mod rebootstrap;
mod record;
mod refused;
mod replace;
mod take_over;

/// How long one transactional call may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// `transaction.timeout.ms`: the broker aborts a transaction open longer (Kafka's default).
pub const TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an abandoned transaction's abort may take (else the broker aborts it when the
/// next process takes the `transactional.id` over, or after `transaction.timeout.ms`).
const ABANDON_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a send waiting for room looks again even if no commit or abort told it.
const ROOM_CHECK: Duration = Duration::from_secs(1);

/// What a send does next with a record.
enum Step {
    Put,
    QueueFull(Record),
    Room(Record),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    Open,
    MustAbort,
    Committing,
    Abandoned,
}

struct Inner {
    /// Replaced by a new one when the broker aborted a transaction for its age (see
    /// [`Transaction::take_over_again`]).
    producer: OffWorker<PolledProducer<TxnContext>>,
    state: State,
    /// When the first record went into the open transaction (`None`: none yet). The broker's
    /// transaction timeout counts from there: a transaction begun but empty is not known to
    /// the broker, so it cannot be aborted for its age.
    first_record: Option<Instant>,
    /// Exactly-once: the events of the open transaction, in send order (`Committing`: those of
    /// the transaction being committed first, then those sent since).
    events: Vec<Record>,
    /// `Committing`: how many of `events` are in the transaction being committed.
    committing: usize,
    /// `commit_transaction` reached librdkafka's commit for the open transaction (its flush
    /// did not time out): the broker may be committing it, so it is never given up to a new
    /// producer (see `replace.rs`).
    end_txn_sent: bool,
    event_bytes: usize,
    /// An early commit was asked for this transaction already (once: a notification per event
    /// past the bound would leave a permit that commits the next, nearly empty, one at once).
    asked_early: bool,
    /// This transaction's part of the process's uncommitted bounds.
    limits: Uncommitted,
    /// Sends wait for room (logged once until a commit frees it).
    full: bool,
    /// `events` and `event_bytes` as this transaction's part of the process's gauges.
    gauges: (GaugeShare, GaugeShare),
    /// A record's topic refuses every record: the pause before the next commit.
    refused: refused::Refused,
}

impl Inner {
    fn room(&self, records: usize, size: usize) -> bool {
        self.limits.room(self.events.len(), self.event_bytes, records, size)
    }
}

/// The transactional producer and its open transaction.
pub struct Transaction {
    /// The producer's configuration (with its `transactional.id`), for a new producer.
    config: ClientConfig,
    connected: Arc<AtomicBool>,
    /// The first record rejected for good, shared by every producer of this transaction.
    poison: Arc<Mutex<Option<context::Rejected>>>,
    /// `transaction.timeout.ms`.
    timeout: Duration,
    /// `None`: never taken over again (the fence stops the process).
    owner: Mutex<Option<OwnerCheck>>,
    /// For errors: the `transactional.id`.
    what: String,
    exactly_once: bool,
    inner: Mutex<Inner>,
    /// The producer's `message.max.bytes`: a larger record is refused by librdkafka for good.
    max_record: usize,
    gate: Arc<Gate>,
    commit_soon: Arc<Notify>,
    /// Notified when a commit or an abort for good freed room.
    room: Notify,
    committed_events: AtomicU64,
}

impl Transaction {
    /// Creates the producer and takes `transactional_id` over (`init_transactions`: a
    /// predecessor's open transaction is aborted and its producer fenced). Blocking.
    pub fn init(
        client: &ClientConfig,
        transactional_id: &str,
        exactly_once: bool,
        connected: Arc<AtomicBool>,
    ) -> Result<Self, TxnError> {
        Self::init_with_timeout(client, transactional_id, exactly_once, connected, TRANSACTION_TIMEOUT)
    }

    /// [`Transaction::init`] with another `transaction.timeout.ms` (tests).
    pub fn init_with_timeout(
        client: &ClientConfig,
        transactional_id: &str,
        exactly_once: bool,
        connected: Arc<AtomicBool>,
        timeout: Duration,
    ) -> Result<Self, TxnError> {
        let what = format!("Kafka transactional producer (transactional.id {transactional_id})");
        let mut config = super::roles::for_producer(client);
        config
            .set("transactional.id", transactional_id)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("transaction.timeout.ms", timeout.as_millis().to_string());
        rebootstrap_soon(&mut config);
        config.set_log_level(super::logging::log_level(&config));
        let max_record = config.get("message.max.bytes").and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
        let poison = Arc::default();
        let producer = new_producer(&config, &what, &connected, &poison)?;
        let txn = Self {
            config,
            connected,
            poison,
            timeout,
            owner: Mutex::new(None),
            what,
            exactly_once,
            inner: Mutex::new(Inner {
                producer: OffWorker::new(producer),
                state: State::Idle,
                first_record: None,
                events: Vec::new(),
                committing: 0,
                end_txn_sent: false,
                event_bytes: 0,
                asked_early: false,
                limits: Uncommitted::default(),
                full: false,
                gauges: (
                    GaugeShare::new(&metrics::get().transaction_events),
                    GaugeShare::new(&metrics::get().transaction_bytes),
                ),
                refused: Default::default(),
            }),
            max_record,
            gate: Arc::new(Gate::default()),
            commit_soon: Arc::new(Notify::new()),
            room: Notify::new(),
            committed_events: AtomicU64::new(0),
        };
        if exactly_once {
            let mut inner = txn.lock();
            txn.reopen(&mut inner)?;
        }
        Ok(txn)
    }

    pub fn exactly_once(&self) -> bool {
        self.exactly_once
    }

    /// Whether the producer reaches its brokers: false when librdkafka says all brokers are
    /// down, true again at the next delivered record or commit.
    pub fn connected(&self) -> Arc<AtomicBool> {
        self.connected.clone()
    }

    /// Lets this process take its `transactional.id` over again when the broker aborted its
    /// transaction for being open longer than `transaction.timeout.ms` (a broker paused or
    /// unreachable that long bumps the producer's epoch, which fences it like a successor
    /// would), as long as `owner` says it still owns the state. Without it such a fence stops
    /// the process.
    pub fn may_take_over(&self, owner: OwnerCheck) {
        *self.owner.lock().expect("owner lock") = Some(owner);
    }

    /// The gate the delivery queue passes before each send (exactly-once).
    pub fn gate(&self) -> &Arc<Gate> {
        &self.gate
    }

    /// Notified when the open transaction holds enough events to be committed early.
    pub fn commit_soon(&self) -> &Arc<Notify> {
        &self.commit_soon
    }

    /// Bounds the sink's events kept uncommitted: a part of the process's bounds (set before
    /// the first send).
    pub fn limit(&self, limits: Uncommitted) {
        self.lock().limits = limits;
    }

    /// Events committed so far (exactly-once).
    pub fn committed_events(&self) -> u64 {
        self.committed_events.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("transaction lock")
    }

    /// Sends an event's records (its tombstone after it) in the open transaction
    /// (exactly-once): produced at once if it is open, kept for the next one if not. `Err` for
    /// a record librdkafka refuses by itself (larger than `message.max.bytes`, checked here in
    /// every state): nothing of the event is kept; and once the transaction was abandoned
    /// (nothing more is committed: the restart sends it again).
    ///
    /// While the transactions not committed yet hold all the [`Limits`] allow, it waits, its
    /// gate pass given back ([`Gate::outside`]: nothing of the event is in the transaction
    /// yet), so the commit that frees room can seal the gate. Once its first record is in,
    /// the others follow without giving the pass back: a commit never takes half an event.
    /// The caller holds a gate pass (the delivery queue's).
    pub async fn send(&self, records: Vec<Record>) -> Result<(), KafkaError> {
        // Refused now whatever the state: kept while the transaction is not open, such a record
        // would make every later attempt to produce the kept events again fail.
        if records.iter().any(|r| r.wire_size() > self.max_record) {
            return Err(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge));
        }
        let (count, size) = (records.len(), records.iter().map(Record::size).sum::<usize>());
        let mut records = records.into_iter();
        let mut next = records.next();
        // Until the first record is in, nothing of the event is in the transaction: waits
        // happen outside the gate.
        let mut first = true;
        while let Some(record) = next.take() {
            let step = {
                let mut inner = self.lock();
                if inner.state == State::Abandoned {
                    return Err(KafkaError::MessageProduction(RDKafkaErrorCode::State));
                }
                if first && !inner.room(count, size) {
                    self.no_room(&mut inner);
                    Step::Room(record)
                } else {
                    match self.put(&mut inner, record)? {
                        None => Step::Put,
                        Some(back) => Step::QueueFull(back),
                    }
                }
            };
            match step {
                Step::Put => {
                    first = false;
                    next = records.next();
                }
                // librdkafka's queue is full: let it drain a little.
                Step::QueueFull(back) => {
                    let drain = tokio::time::sleep(Duration::from_millis(5));
                    if first {
                        self.gate.outside(drain).await;
                    } else {
                        drain.await;
                    }
                    next = Some(back);
                }
                Step::Room(back) => {
                    self.gate.outside(self.room_freed(count, size)).await;
                    next = Some(back);
                }
            }
        }
        Ok(())
    }

    /// Waits until a commit or an abort for good may have freed room (at most [`ROOM_CHECK`]:
    /// room that another shard's transaction gives back is seen then).
    async fn room_freed(&self, count: usize, size: usize) {
        let freed = self.room.notified();
        tokio::pin!(freed);
        freed.as_mut().enable();
        // Looked at again once registered: a commit may have freed room meanwhile. Never waits
        // for the lock: a commit holds it through librdkafka's blocking calls (up to 30 s while
        // the broker is away), and this runs on the runtime's threads; locked means no room yet.
        let room = match self.inner.try_lock() {
            Ok(inner) => inner.state == State::Abandoned || inner.room(count, size),
            Err(_) => false,
        };
        if !room {
            let _ = tokio::time::timeout(ROOM_CHECK, freed).await;
        }
    }

    /// The transaction holds all it may: ask for the commit that frees room (once per
    /// transaction), and say so once.
    fn no_room(&self, inner: &mut Inner) {
        if !inner.asked_early {
            inner.asked_early = true;
            self.commit_soon.notify_one();
        }
        if !inner.full {
            inner.full = true;
            metrics::get().transaction_full.inc();
            warn!(
                events = inner.events.len(),
                bytes = inner.event_bytes,
                max_events = inner.limits.share().events,
                max_bytes = inner.limits.share().bytes,
                "{}: the uncommitted events reached max_uncommitted_events or max_uncommitted_bytes; sends wait until a commit frees room",
                self.what
            );
        }
    }

    /// Produces `record` if the transaction is open, and keeps it. `Some(record)` back when
    /// librdkafka's queue is full; `Err` for a record too large (not kept).
    fn put(&self, inner: &mut Inner, record: Record) -> Result<Option<Record>, KafkaError> {
        if inner.state == State::Open {
            match produce(&inner.producer, &record) {
                Ok(()) => {
                    inner.first_record.get_or_insert_with(Instant::now);
                }
                Err(KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull)) => return Ok(Some(record)),
                Err(e @ KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge)) => return Err(e),
                Err(e) => {
                    warn!(error = %e, "{}: a record was not produced; the transaction is aborted and its events are sent again", self.what);
                    inner.state = State::MustAbort;
                }
            }
        }
        inner.event_bytes += record.size();
        inner.events.push(record);
        held(inner);
        if !inner.asked_early && inner.limits.commit_soon(inner.events.len(), inner.event_bytes) {
            inner.asked_early = true;
            self.commit_soon.notify_one();
        }
        Ok(None)
    }

    /// Commits the open transaction with `records` (the state records) after its events; with
    /// exactly-once, opens the next one. Blocking; the caller has sealed the [`Gate`].
    ///
    /// A commit that did not finish in time is finished first (its own state records with
    /// it); `records` then go into the next transaction. On any other error that is not fatal
    /// nothing of it is committed: the transaction is aborted (now, or at the next call if the
    /// broker does not answer) and its events are produced again in the next one. On `Err` the
    /// caller writes its state records again later (they are whole states: writing one twice
    /// is harmless).
    pub fn commit(&self, records: &[Record]) -> Result<(), TxnError> {
        let mut inner = self.lock();
        if let Some(e) = inner.refused.pausing().filter(|_| inner.state != State::Abandoned) {
            return Err(e);
        }
        let mut result = match self.commit_locked(&mut inner, records) {
            Err(TxnError::Fenced(why)) if inner.state != State::Abandoned => Err(self.take_over_again(&mut inner, why)),
            Err(e @ TxnError::Retriable(_)) => Err(self.recover(&mut inner, e)),
            other => other,
        };
        let events = inner.events.len();
        if let Err(TxnError::RecordRefused { events: held, .. }) = &mut result {
            *held = events;
        }
        inner.refused.after(&result, &self.what, events);
        result
    }

    fn commit_locked(&self, inner: &mut Inner, records: &[Record]) -> Result<(), TxnError> {
        if inner.state == State::Abandoned {
            return Err(TxnError::Abandoned(format!(
                "{}: the transaction was abandoned; nothing more is committed",
                self.what
            )));
        }
        if inner.state == State::Committing {
            match inner.producer.commit_transaction(TIMEOUT) {
                Ok(()) => {
                    let n = inner.committing;
                    self.committed(inner, n);
                    debug!("{}: the commit that had timed out finished", self.what);
                }
                Err(e) => return Err(self.commit_failed(inner, &e)),
            }
        }
        self.ready(inner)?;
        if !records.is_empty() {
            inner.first_record.get_or_insert_with(Instant::now);
        }
        if let Err(e) = records.iter().try_for_each(|r| produce_blocking(&inner.producer, r)) {
            inner.state = State::MustAbort;
            return Err(self.abort_soon(inner, self.failure(&e)));
        }
        match inner.producer.commit_transaction(TIMEOUT) {
            Ok(()) => {
                let n = inner.events.len();
                self.committed(inner, n);
                if self.exactly_once {
                    self.reopen(inner)?;
                }
                Ok(())
            }
            Err(e) => {
                inner.committing = inner.events.len();
                Err(self.commit_failed(inner, &e))
            }
        }
    }

    /// The first `n` events (and the state records with them) are committed.
    fn committed(&self, inner: &mut Inner, n: usize) {
        outcome("committed");
        self.connected.store(true, Ordering::Relaxed);
        self.committed_events.fetch_add(n as u64, Ordering::Relaxed);
        inner.events.drain(..n);
        inner.events.shrink_to(1024);
        inner.event_bytes = inner.events.iter().map(Record::size).sum();
        held(inner);
        inner.asked_early = false;
        inner.full = false;
        inner.committing = 0;
        inner.first_record = None;
        inner.state = State::Idle;
        self.room.notify_waiters();
    }

    /// `commit_transaction` failed with `e`: call it again next time if librdkafka says so
    /// (it timed out; the transaction need not be aborted), else abort. The wrapper flushes
    /// first: a flush that timed out left the transaction whole and open, so it is committed
    /// again too.
    fn commit_failed(&self, inner: &mut Inner, e: &KafkaError) -> TxnError {
        // The wrapper's flush comes before librdkafka's commit: past it, `EndTxn` may be sent.
        inner.end_txn_sent |= !matches!(e, KafkaError::Flush(_));
        let err = self.failure(e);
        let again = match e {
            KafkaError::Transaction(t) => t.is_retriable() && !t.txn_requires_abort(),
            KafkaError::Flush(code) => *code == RDKafkaErrorCode::OperationTimedOut,
            _ => false,
        };
        if again && matches!(err, TxnError::Retriable(_)) {
            inner.state = State::Committing;
            outcome("commit_pending");
            warn!(
                error = %e,
                events = inner.committing,
                "{}: the commit did not finish in time; it is finished before the next one (not aborted, not sent again)",
                self.what
            );
            return err;
        }
        inner.state = State::MustAbort;
        self.abort_soon(inner, err)
    }

    /// In `MustAbort` after `err`: aborts now unless `err` is fatal (the events go out again
    /// at once); if the broker does not answer, the next commit aborts first.
    fn abort_soon(&self, inner: &mut Inner, err: TxnError) -> TxnError {
        if err.ends_the_producer() {
            return err;
        }
        if let Err(again) = self.ready(inner) {
            if again.ends_the_producer() {
                return again;
            }
            warn!(error = %again, "{}: the failed transaction is aborted at the next commit", self.what);
        }
        err
    }

    /// Brings the transaction to `Open` (exactly-once) or `Idle`-then-begun (state only):
    /// aborts a failed one, begins, produces the kept events again.
    fn ready(&self, inner: &mut Inner) -> Result<(), TxnError> {
        if inner.state == State::MustAbort {
            inner.producer.abort_transaction(TIMEOUT).map_err(|e| self.failure(&e))?;
            outcome("aborted");
            warn!(
                events = inner.events.len(),
                "{}: transaction aborted; its events are sent again in the next one", self.what
            );
            inner.state = State::Idle;
            if let Some(p) = self.poisoned() {
                return Err(p);
            }
        }
        if inner.state == State::Idle {
            self.reopen(inner)?;
        }
        Ok(())
    }

    /// Begins a transaction and produces the kept events into it (same order).
    fn reopen(&self, inner: &mut Inner) -> Result<(), TxnError> {
        inner.producer.begin_transaction().map_err(|e| classify(&self.what, &e))?;
        inner.state = State::Open;
        inner.end_txn_sent = false;
        // Kept events keep the aborted transaction's age: the broker may fence for it.
        inner.first_record = if inner.events.is_empty() { None } else { inner.first_record.or(Some(Instant::now())) };
        if !inner.events.is_empty() {
            debug!(events = inner.events.len(), "{}: sending the aborted transaction's events again", self.what);
        }
        for r in &inner.events {
            if let Err(e) = produce_blocking(&inner.producer, r) {
                inner.state = State::MustAbort;
                return Err(self.failure(&e));
            }
        }
        Ok(())
    }

    /// The error to report for `e`: a rejected record first (it explains the failure).
    fn failure(&self, e: &KafkaError) -> TxnError {
        match classify(&self.what, e) {
            retriable @ TxnError::Retriable(_) => self.poisoned().unwrap_or(retriable),
            ends => ends,
        }
    }

    fn poisoned(&self) -> Option<TxnError> {
        let p = self.poison.lock().expect("poison lock").take()?;
        if let Some(refusal) = p.refusal {
            return Some(TxnError::RecordRefused {
                refusal,
                destination: format!("Kafka topic {:?}", p.topic),
                events: 0,
                reason: format!("{}: {}", self.what, p.text),
            });
        }
        let p = p.text;
        Some(TxnError::Poison(format!(
            "{}: {p}; no retry can deliver it, and exactly-once cannot skip it (fix: create the topic, grant the producer access, or raise the topic's max.message.bytes; then restart kubecast)",
            self.what
        )))
    }
}

/// The events held and their bytes, as metrics.
fn held(inner: &Inner) {
    inner.limits.hold(inner.events.len(), inner.event_bytes);
    inner.gauges.0.set(inner.events.len() as i64);
    inner.gauges.1.set(i64::try_from(inner.event_bytes).unwrap_or(i64::MAX));
}

fn outcome(outcome: &'static str) {
    metrics::get().transactions.get_or_create(&metrics::Outcome { outcome }).inc();
}

/// Unit tests without a broker (`tests.rs` in the folder of this file's name).
#[cfg(test)]
mod tests;
