//! A producer fenced by the broker's own timeout, not by a successor: the transaction was open
//! longer than `transaction.timeout.ms` (the broker was paused or unreachable meanwhile), so
//! the broker aborted it and bumped the producer's epoch. librdkafka reports that as the same
//! fatal "fenced" as a successor's `init_transactions`, and the producer is dead either way.
//! When the transaction was that old and this process still owns the state (the
//! [`OwnerCheck`]), a new producer takes the `transactional.id` over and the kept events are
//! produced again in a new transaction: nothing of the aborted one was committed, so nothing
//! is lost or doubled. A younger transaction was fenced by another producer: that stays fatal.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use rdkafka::ClientConfig;
use rdkafka::producer::Producer;

use crate::sink::kafka::polled::PolledProducer;

use std::time::Duration;

use super::context::TxnContext;
use super::error::{TxnError, classify};
use crate::sink::kafka::properties::describe;

/// How long `init_transactions` may take.
const INIT_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether this process may take its `transactional.id` over again after the broker aborted
/// its transaction for being open too long: it holds the Lease (confirmed within the renew
/// deadline), or runs without coordination.
pub type OwnerCheck = Arc<dyn Fn() -> bool + Send + Sync>;

/// `Ok` when a fence of a transaction open for `age` can only be the broker's timeout
/// (`age` >= `timeout`) and `owner` says this process still owns the state; else why not,
/// added to the fatal error (empty: nothing to add).
pub(super) fn may_take_over_again(age: Duration, timeout: Duration, owner: Option<&OwnerCheck>) -> Result<(), String> {
    if age < timeout {
        return Err(String::new());
    }
    match owner {
        Some(owner) if owner() => Ok(()),
        Some(_) => Err(format!(
            "; the transaction was open {} s, past transaction.timeout.ms, but this process no longer holds the Lease",
            age.as_secs()
        )),
        None => Err(String::new()),
    }
}

/// `Ok` when a transaction open for `age` whose commit keeps failing may be given up to a new
/// producer: it is past `timeout` (the broker aborts a transaction that old by itself),
/// `abortable` (its commit was never asked of the broker: `EndTxn` not sent, or it must be
/// aborted anyway), and `owner` says this process still owns the state; else why not.
pub(super) fn may_replace_stuck(
    age: Duration,
    timeout: Duration,
    abortable: bool,
    owner: Option<&OwnerCheck>,
) -> Result<(), &'static str> {
    if !abortable {
        // The broker may be committing it: a new producer would let it finish, and sending
        // its events again would double them.
        return Err("its commit may have reached the broker");
    }
    if age < timeout {
        return Err("younger than transaction.timeout.ms");
    }
    match owner {
        Some(owner) if owner() => Ok(()),
        Some(_) => Err("this process no longer holds the Lease"),
        None => Err("never taken over by this process"),
    }
}

/// A transactional producer that took the `transactional.id` over (`init_transactions`).
/// Blocking.
pub(super) fn new_producer(
    config: &ClientConfig,
    what: &str,
    connected: &Arc<AtomicBool>,
    poison: &Arc<Mutex<Option<super::context::Rejected>>>,
) -> Result<PolledProducer<TxnContext>, TxnError> {
    let context = TxnContext::new(
        config.get("transactional.id").unwrap_or_default().to_string(),
        connected.clone(),
        poison.clone(),
    );
    let producer = PolledProducer::create(config, context, "kafka-txn-reports")
        .map_err(|e| TxnError::Retriable(format!("{what}: {}", describe(&e))))?;
    producer.init_transactions(INIT_TIMEOUT).map_err(|e| classify(what, &e))?;
    Ok(producer)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    #[test]
    fn only_a_transaction_past_its_timeout_whose_process_owns_the_state_is_taken_over_again() {
        let yes: OwnerCheck = Arc::new(|| true);
        let no: OwnerCheck = Arc::new(|| false);
        let old = Duration::from_secs(61);
        assert_eq!(may_take_over_again(old, TIMEOUT, Some(&yes)), Ok(()));
        // Younger than the timeout: the broker did not abort it, a successor fenced it.
        assert_eq!(may_take_over_again(Duration::from_secs(59), TIMEOUT, Some(&yes)), Err(String::new()));
        let lost = may_take_over_again(old, TIMEOUT, Some(&no)).unwrap_err();
        assert!(lost.contains("no longer holds the Lease"), "{lost}");
        // Never allowed (no owner check set): stays fatal.
        assert_eq!(may_take_over_again(old, TIMEOUT, None), Err(String::new()));
    }

    #[test]
    fn only_a_stuck_transaction_past_its_timeout_never_committed_whose_process_owns_the_state_is_replaced() {
        let yes: OwnerCheck = Arc::new(|| true);
        let no: OwnerCheck = Arc::new(|| false);
        let old = Duration::from_secs(61);
        assert_eq!(may_replace_stuck(old, TIMEOUT, true, Some(&yes)), Ok(()));
        assert!(may_replace_stuck(Duration::from_secs(59), TIMEOUT, true, Some(&yes)).is_err());
        // Its commit may be with the broker: replacing could commit it and send it again.
        assert!(may_replace_stuck(old, TIMEOUT, false, Some(&yes)).is_err());
        assert!(may_replace_stuck(old, TIMEOUT, true, Some(&no)).is_err());
        assert!(may_replace_stuck(old, TIMEOUT, true, None).is_err());
    }
}
