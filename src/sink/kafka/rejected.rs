//! The Kafka errors no retry of the same record fixes, by cause, one list for the sink and the
//! transactional producer: what is wrong with one record (too large, invalid: the dead
//! letter), and what is wrong with the set-up (a missing topic, a permission not granted, a
//! transaction timeout the broker refuses: a [`Refusal`], which holds the stream until the
//! operator fixes it).

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::model::Refusal;

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

/// A record no retry delivers, whatever the set-up: too large or invalid, or a topic name the
/// broker does not accept. Its event goes to the dead letter.
pub(super) fn rejected_for_good(e: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        e.rdkafka_error_code(),
        Some(C::MessageSizeTooLarge | C::InvalidMessageSize | C::InvalidRecord | C::InvalidTopic)
    )
}

/// The set-up mistake behind `e`, if it is one: every event to that destination fails the
/// same way until the operator fixes it (the broker does not create the topic: librdkafka
/// waited `topic.metadata.propagation.max.ms` for it; an ACL is missing; the broker's
/// `transaction.max.timeout.ms` is lower than the producer's timeout).
pub(crate) fn refusal(e: &KafkaError) -> Option<Refusal> {
    use RDKafkaErrorCode as C;
    Some(match e.rdkafka_error_code()? {
        C::UnknownTopic | C::UnknownTopicOrPartition => Refusal::MissingTopic,
        C::TopicAuthorizationFailed => Refusal::TopicNotAuthorized,
        C::ClusterAuthorizationFailed => Refusal::ClusterNotAuthorized,
        C::TransactionalIdAuthorizationFailed => Refusal::TransactionalIdNotAuthorized,
        C::GroupAuthorizationFailed => Refusal::GroupNotAuthorized,
        C::InvalidTransactionTimeout => Refusal::TransactionTimeoutRefused,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use rdkafka::error::{KafkaError, RDKafkaErrorCode as C};

    use crate::model::Refusal;

    #[test]
    fn a_record_too_large_names_max_event_bytes_and_the_limits() {
        let e = KafkaError::MessageProduction(C::MessageSizeTooLarge);
        let text = super::with_fix(&e);
        assert!(text.contains("max_event_bytes") && text.contains("message.max.bytes"), "{text}");
        let other = KafkaError::MessageProduction(C::TopicAuthorizationFailed);
        assert_eq!(super::with_fix(&other), other.to_string());
    }

    #[test]
    fn a_set_up_mistake_is_a_refusal_never_a_poison_record() {
        let cases = [
            (C::UnknownTopicOrPartition, Refusal::MissingTopic),
            (C::UnknownTopic, Refusal::MissingTopic),
            (C::TopicAuthorizationFailed, Refusal::TopicNotAuthorized),
            (C::ClusterAuthorizationFailed, Refusal::ClusterNotAuthorized),
            (C::TransactionalIdAuthorizationFailed, Refusal::TransactionalIdNotAuthorized),
            (C::GroupAuthorizationFailed, Refusal::GroupNotAuthorized),
            (C::InvalidTransactionTimeout, Refusal::TransactionTimeoutRefused),
        ];
        for (code, refusal) in cases {
            let e = KafkaError::MessageProduction(code);
            assert_eq!(super::refusal(&e), Some(refusal), "{code:?}");
            assert!(!super::rejected_for_good(&e), "{code:?} is not the record's fault");
        }
        for code in [C::MessageSizeTooLarge, C::InvalidRecord, C::InvalidTopic, C::InvalidMessageSize] {
            let e = KafkaError::MessageProduction(code);
            assert!(super::rejected_for_good(&e) && super::refusal(&e).is_none(), "{code:?}");
        }
        for code in [C::RequestTimedOut, C::AllBrokersDown, C::NotLeaderForPartition, C::ProducerFenced] {
            let e = KafkaError::MessageProduction(code);
            assert!(!super::rejected_for_good(&e) && super::refusal(&e).is_none(), "{code:?}: retried as it is");
        }
    }
}
