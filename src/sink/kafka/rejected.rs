//! The Kafka errors no retry fixes, one list for the sink and the transactional producer.

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// A record no retry delivers: too large or invalid, a topic that does not exist (the broker
/// does not create it; librdkafka waited `topic.metadata.propagation.max.ms` for it), no
/// permission. Shared by the sink and the transactional producer.
/// `e` in words, with the fix where kubecast knows it (the reason of a dead-lettered event).
pub(super) fn with_fix(e: &KafkaError) -> String {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge) => format!(
            "{e} (fix: set the resource's max_event_bytes below the limit, so that larger events are sent without their object, or raise the limit: [sink.kafka.properties] \"message.max.bytes\" and the topic's max.message.bytes)"
        ),
        _ => e.to_string(),
    }
}

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

#[cfg(test)]
mod tests {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode};

    #[test]
    fn a_record_too_large_names_max_event_bytes_and_the_limits() {
        let e = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let text = super::with_fix(&e);
        assert!(text.contains("max_event_bytes") && text.contains("message.max.bytes"), "{text}");
        let other = KafkaError::MessageProduction(RDKafkaErrorCode::TopicAuthorizationFailed);
        assert_eq!(super::with_fix(&other), other.to_string());
    }
}
