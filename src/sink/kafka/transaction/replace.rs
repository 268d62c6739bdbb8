//! A new producer for the `transactional.id`, in place of one that can no longer commit: fenced
//! by the broker's own timeout ([`Transaction::take_over_again`]), or stuck, its transaction
//! unable to reach the broker for longer than `transaction.timeout.ms`
//! ([`Transaction::replace_if_stuck`]).
//!
//! Stuck: after a broker pause, librdkafka can keep the transaction's records queued without
//! sending them, so every commit times out in its flush while the broker answers everyone
//! else (seen with librdkafka 2.12: a KRaft broker fenced by its controller at the resume
//! leaves the metadata, and the producer is left without any broker; `rebootstrap.rs` gives
//! it its brokers back, this bounds whatever else keeps a flush from finishing). Past
//! `transaction.timeout.ms` the transaction can only be aborted: its commit was never asked
//! of the broker (`EndTxn` not sent), and the broker aborts a transaction that old by itself.
//! A new producer's `init_transactions` aborts what the old one left open and fences it; the
//! kept events are produced again in a new transaction, so nothing of the stuck one is
//! committed, nothing is lost or doubled, and no state record passes an event not committed.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdkafka::producer::Producer;
use tracing::warn;

use super::super::off_worker::OffWorker;
use super::error::TxnError;
use super::rebootstrap::add_bootstrap_brokers;
use super::take_over::{may_replace_stuck, may_take_over_again, new_producer};
use super::{Inner, State, Transaction, outcome};

impl Transaction {
    /// `commit` failed with the fatal `why`: takes the `transactional.id` over again if the
    /// broker's timeout fenced this producer and this process still owns the state, else
    /// returns the fatal error. Retriable when taken over (the caller writes again).
    pub(super) fn take_over_again(&self, inner: &mut Inner, why: String) -> TxnError {
        // No record in it: the broker had no transaction to abort for its age, so the fence
        // came from another producer of the transactional.id.
        let age = open_for(inner);
        let owner = self.owner.lock().expect("owner lock").clone();
        if let Err(not) = may_take_over_again(age, self.timeout, owner.as_ref()) {
            return TxnError::Fenced(format!("{why}{not}"));
        }
        warn!(
            error = %why,
            open_seconds = age.as_secs(),
            events = inner.events.len(),
            "{}: the broker aborted the transaction after transaction.timeout.ms and fenced this producer; this process still owns the state, so a new producer takes the transactional.id over and the events are sent again",
            self.what
        );
        if let Err(e) = self.replace_producer(inner) {
            return e;
        }
        TxnError::Retriable(format!(
            "{why}; the broker had aborted the transaction after transaction.timeout.ms: taken over again, its events are sent again"
        ))
    }

    /// `commit` failed with the retriable `err` (returned, or why a new producer failed): a
    /// producer that knows no broker any more gets `bootstrap.servers` again (librdkafka
    /// can be left without any broker, see `rebootstrap.rs`); a stuck transaction is given up
    /// to a new producer ([`Transaction::replace_if_stuck`]).
    pub(super) fn recover(&self, inner: &mut Inner, err: TxnError) -> TxnError {
        if !inner.producer.context().knows_a_broker() {
            let brokers = add_bootstrap_brokers(&inner.producer, &self.config);
            warn!(
                error = %err,
                brokers,
                "{}: the commit failed while the producer knew no broker; it is given bootstrap.servers again (librdkafka can be left without any broker after one was fenced)",
                self.what
            );
        }
        self.replace_if_stuck(inner, err)
    }

    /// `commit` failed with the retriable `err`: if the transaction is stuck (its commit or its
    /// abort has not reached the broker, and it is open longer than `transaction.timeout.ms`)
    /// and this process still owns the state, a new producer takes the `transactional.id`
    /// over and the events are sent again; `err` is returned either way (nothing committed).
    fn replace_if_stuck(&self, inner: &mut Inner, err: TxnError) -> TxnError {
        let must_abort = match inner.state {
            State::Committing => false,
            State::MustAbort => true,
            _ => return err,
        };
        let age = open_for(inner);
        let owner = self.owner.lock().expect("owner lock").clone();
        if may_replace_stuck(age, self.timeout, must_abort || !inner.end_txn_sent, owner.as_ref()).is_err() {
            return err;
        }
        warn!(
            error = %err,
            open_seconds = age.as_secs(),
            events = inner.events.len(),
            connected = self.connected.load(Ordering::Relaxed),
            "{}: the transaction could not reach the broker for longer than transaction.timeout.ms (librdkafka keeps its records queued); nothing of it was committed, so a new producer takes the transactional.id over (the broker aborts the old transaction) and the events are sent again",
            self.what
        );
        match self.replace_producer(inner) {
            Ok(()) => TxnError::Retriable(format!(
                "{err}; the transaction was stuck longer than transaction.timeout.ms: a new producer took the transactional.id over, its events are sent again"
            )),
            Err(e) => e,
        }
    }

    /// A new producer takes the `transactional.id` over (`init_transactions`: the broker aborts
    /// the old one's open transaction and fences it); with exactly-once a new transaction is
    /// begun with the kept events. On `Err` the old producer stays, and the next commit comes
    /// here again. Counted as `outcome="taken_over"` either way it came.
    fn replace_producer(&self, inner: &mut Inner) -> Result<(), TxnError> {
        let producer = new_producer(&self.config, &self.what, &self.connected, &self.poison)?;
        // Dropped off the worker: librdkafka's destroy waits for its threads.
        inner.producer = OffWorker::new(producer);
        outcome("taken_over");
        inner.state = State::Idle;
        inner.first_record = None;
        inner.committing = 0;
        inner.end_txn_sent = false;
        if self.exactly_once {
            self.reopen(inner)?;
        }
        Ok(())
    }
}

/// How long the transaction has held records (the broker's timeout counts from the first).
fn open_for(inner: &Inner) -> Duration {
    inner.first_record.map_or(Duration::ZERO, |t| t.elapsed())
}
