//! Why a transaction did not commit, by cause, and which librdkafka errors end the producer.
//! Only a fence means that another producer owns the `transactional.id`: every other reason
//! the producer is dead says what it is, so that a missing permission never looks like a
//! successor.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::model::Refusal;

/// Why a transaction did not commit.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TxnError {
    /// Another producer with this `transactional.id` took over (`ProducerFenced`,
    /// `InvalidProducerEpoch`, librdkafka's `_FENCED`): this one is dead, the state is another
    /// owner's.
    #[error("{0}")]
    Fenced(String),
    /// The broker refuses this producer for a set-up reason (a missing ACL on the
    /// `transactional.id` or the cluster, a transaction timeout above its maximum): no other
    /// owner; the operator must fix it.
    #[error("{reason} ({refusal}; fix: {})", refusal.fix())]
    Refused { refusal: Refusal, reason: String },
    /// The producer is dead for another reason (a fatal librdkafka error).
    #[error("{0}")]
    Fatal(String),
    /// The transaction was abandoned (an event sent into it was never acknowledged): nothing
    /// more is committed by this process.
    #[error("{0}")]
    Abandoned(String),
    /// Not committed; its events are produced again in the next transaction.
    #[error("{0}")]
    Retriable(String),
    /// A record that no retry will deliver: kubecast stops (nothing of it was committed).
    #[error("{0}")]
    Poison(String),
    /// A record's destination refuses every record, a set-up mistake (a topic that does not
    /// exist, a Write permission not granted): not committed; its events are kept and produced
    /// again, with a growing pause between the attempts, until the operator fixes it.
    /// `destination` names the refusing topic, `events` how many events the transaction holds.
    #[error("{reason} ({refusal}; fix: {})", refusal.fix())]
    RecordRefused { refusal: Refusal, destination: String, events: usize, reason: String },
}

impl TxnError {
    /// Whether the producer cannot go on (nothing more is tried with it).
    pub fn ends_the_producer(&self) -> bool {
        !matches!(self, TxnError::Retriable(_) | TxnError::RecordRefused { .. })
    }
}

/// Fenced, refused by the set-up, otherwise fatal, or retriable, from librdkafka's code (never
/// from its text).
pub(super) fn classify(what: &str, e: &KafkaError) -> TxnError {
    use RDKafkaErrorCode as C;
    let code = e.rdkafka_error_code();
    if matches!(code, Some(C::Fenced | C::ProducerFenced | C::InvalidProducerEpoch)) {
        return TxnError::Fenced(format!("{what}: {e}"));
    }
    let fatal = matches!(e, KafkaError::Transaction(t) if t.is_fatal());
    // A refusal ends the producer when librdkafka says so; else it is retried like any other
    // failure (a commit aborted, its events produced again), and named at the next commit.
    match super::super::rejected::refusal(e) {
        Some(refusal) if fatal || !matches!(code, Some(C::UnknownTopicOrPartition | C::UnknownTopic)) => {
            TxnError::Refused { refusal, reason: format!("{what}: {e}") }
        }
        _ if fatal => TxnError::Fatal(format!("{what}: {e}")),
        _ => TxnError::Retriable(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};

    use super::{TxnError, classify};
    use crate::model::Refusal;

    #[test]
    fn only_a_fence_means_another_owner() {
        for code in [C::Fenced, C::ProducerFenced, C::InvalidProducerEpoch] {
            let e = KafkaError::MessageProduction(code);
            assert!(matches!(classify("t", &e), TxnError::Fenced(_)), "{code:?}");
        }
        let cases = [
            (C::TransactionalIdAuthorizationFailed, Refusal::TransactionalIdNotAuthorized),
            (C::ClusterAuthorizationFailed, Refusal::ClusterNotAuthorized),
            (C::InvalidTransactionTimeout, Refusal::TransactionTimeoutRefused),
            (C::TopicAuthorizationFailed, Refusal::TopicNotAuthorized),
        ];
        for (code, refusal) in cases {
            let e = KafkaError::MessageProduction(code);
            match classify("t", &e) {
                TxnError::Refused { refusal: r, reason } => {
                    assert_eq!(r, refusal, "{code:?}");
                    assert!(reason.starts_with("t: "), "{reason}");
                }
                other => panic!("{code:?}: {other:?}"),
            }
        }
        let e = KafkaError::MessageProduction(C::RequestTimedOut);
        assert!(matches!(classify("t", &e), TxnError::Retriable(_)));
        let text = TxnError::Refused { refusal: Refusal::TransactionalIdNotAuthorized, reason: "t: denied".into() }
            .to_string();
        assert!(text.contains("transactional.id") && text.contains("kafka-acls"), "{text}");
    }
}
