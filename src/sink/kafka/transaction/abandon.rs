//! Abandoning a transaction for good (an event sent into it was never acknowledged).

use rdkafka::producer::Producer;
use tracing::warn;

use super::{ABANDON_TIMEOUT, State, Transaction, held, outcome};

impl Transaction {
    /// Aborts the open transaction for good: it may hold records no state covers (an event
    /// sent but never acknowledged, or one record of an event's two). Nothing more is sent
    /// or committed by this process. A transaction whose commit is pending is left to finish
    /// or not: its own state covers exactly its events. Blocking (at most a few seconds).
    pub fn abandon(&self) {
        let mut inner = self.lock();
        if matches!(inner.state, State::Open | State::MustAbort) {
            match inner.producer.abort_transaction(ABANDON_TIMEOUT) {
                Ok(()) => outcome("aborted"),
                Err(e) => warn!(
                    error = %e,
                    "{}: the abandoned transaction could not be aborted now; the broker aborts it when the next process takes over (or after transaction.timeout.ms)",
                    self.what
                ),
            }
        }
        if inner.state != State::Abandoned {
            warn!(
                events = inner.events.len(),
                "{}: transaction abandoned: an event sent into it was not acknowledged; nothing of it is committed, the restart sends it again",
                self.what
            );
        }
        inner.state = State::Abandoned;
        inner.events = Vec::new();
        inner.event_bytes = 0;
        held(&inner);
        // Waiting sends fail now (nothing more is committed).
        self.room.notify_waiters();
    }
}
