//! The Kafka errors no retry fixes, one list for the sink and the transactional producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// A record no retry delivers: too large or invalid, a topic that does not exist (the broker
/// does not create it; librdkafka waited `topic.metadata.propagation.max.ms` for it), no
/// permission. Shared by the sink and the transactional producer.
pub(super) fn rejected_for_good(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(
            C::MessageSizeTooLarge
                | C::InvalidMessageSize
                | C::InvalidRecord
                | C::InvalidTopic
                | C::UnknownTopic
                | C::UnknownTopicOrPartition
                | C::TopicAuthorizationFailed
                | C::ClusterAuthorizationFailed
        )
    )
}
