//! Why a transaction did not commit, and which librdkafka errors end the producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Why a transaction did not commit.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TxnError {
    /// Another producer with this `transactional.id` took over, or the producer is dead.
    #[error("{0}")]
    Fatal(String),
    /// Not committed; its events are produced again in the next transaction.
    #[error("{0}")]
    Retriable(String),
    /// A record that no retry will deliver: kubecast stops (nothing of it was committed).
    #[error("{0}")]
    Poison(String),
}

/// Fenced or otherwise dead: fatal; anything else: retriable.
pub(super) fn classify(what: &str, e: &KafkaError) -> TxnError {
    let fatal = matches!(e, KafkaError::Transaction(t) if t.is_fatal());
    if fatal
        || matches!(
            e.rdkafka_error_code(),
            Some(RDKafkaErrorCode::Fenced | RDKafkaErrorCode::ProducerFenced | RDKafkaErrorCode::InvalidProducerEpoch)
        )
    {
        return TxnError::Fatal(format!("{what}: {e}"));
    }
    TxnError::Retriable(format!("{what}: {e}"))
}
