//! `Refusal`: why a destination refuses every event, not one: a mistake in the set-up (a
//! topic or stream that does not exist, a permission not granted, a setting the broker does
//! not accept). Unlike a poison event, no event is at fault, so none goes to the dead letter:
//! the events wait in order (the stream is held, its position does not move), readiness names
//! the cause and the fix, and delivery resumes by itself once the operator fixes it.
//!
//! Each broker's client maps its own error codes to these ([`crate::sink`]); every decision
//! (hold? dead letter? stop? fenced?) matches on the enum, never on an error's text.

use std::fmt;

/// Why a destination refuses every event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Refusal {
    /// The Kafka topic does not exist, and the broker does not create it.
    MissingTopic,
    /// No JetStream stream covers the NATS subject.
    MissingStream,
    /// Kafka: the principal may not write to the topic (ACL `Write` on the topic).
    TopicNotAuthorized,
    /// Kafka: the principal lacks a permission on the cluster (`IdempotentWrite`, or `Create`
    /// where the broker creates topics on first use).
    ClusterNotAuthorized,
    /// Kafka: the principal may not use the `transactional.id` (ACL `Write` and `Describe` on
    /// the TransactionalId).
    TransactionalIdNotAuthorized,
    /// Kafka: the principal may not use the consumer group (ACL `Read` on the Group).
    GroupNotAuthorized,
    /// Kafka: the broker's `transaction.max.timeout.ms` is below the producer's
    /// `transaction.timeout.ms`.
    TransactionTimeoutRefused,
    /// NATS: the user may not publish on the subject (its `publish` permissions).
    SubjectNotPermitted,
    /// HTTP: the receiver answers 401 or 403 (credentials missing, wrong or not allowed).
    HttpNotAuthorized,
    /// HTTP: the receiver answers with a redirect (3xx): the URL moved.
    HttpRedirect,
}

impl Refusal {
    /// Every refusal, for tests and for the metric's labels.
    pub const ALL: [Refusal; 10] = [
        Refusal::MissingTopic,
        Refusal::MissingStream,
        Refusal::TopicNotAuthorized,
        Refusal::ClusterNotAuthorized,
        Refusal::TransactionalIdNotAuthorized,
        Refusal::GroupNotAuthorized,
        Refusal::TransactionTimeoutRefused,
        Refusal::SubjectNotPermitted,
        Refusal::HttpNotAuthorized,
        Refusal::HttpRedirect,
    ];

    /// The `reason` label of `kubecast_sink_refused`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::MissingTopic => "missing_topic",
            Refusal::MissingStream => "missing_stream",
            Refusal::TopicNotAuthorized => "topic_not_authorized",
            Refusal::ClusterNotAuthorized => "cluster_not_authorized",
            Refusal::TransactionalIdNotAuthorized => "transactional_id_not_authorized",
            Refusal::GroupNotAuthorized => "group_not_authorized",
            Refusal::TransactionTimeoutRefused => "transaction_timeout_refused",
            Refusal::SubjectNotPermitted => "subject_not_permitted",
            Refusal::HttpNotAuthorized => "http_not_authorized",
            Refusal::HttpRedirect => "http_redirect",
        }
    }

    /// What is missing, in words.
    pub fn what(self) -> &'static str {
        match self {
            Refusal::MissingTopic => "the topic does not exist",
            Refusal::MissingStream => "no JetStream stream covers the subject",
            Refusal::TopicNotAuthorized => "the principal may not write to the topic",
            Refusal::ClusterNotAuthorized => "the principal lacks a permission on the Kafka cluster",
            Refusal::TransactionalIdNotAuthorized => "the principal may not use the transactional.id",
            Refusal::GroupNotAuthorized => "the principal may not use the consumer group",
            Refusal::TransactionTimeoutRefused => {
                "the broker refuses the transaction timeout (above its transaction.max.timeout.ms)"
            }
            Refusal::SubjectNotPermitted => "the NATS user may not publish on the subject",
            Refusal::HttpNotAuthorized => "the HTTP receiver refuses kubecast's credentials (401 or 403)",
            Refusal::HttpRedirect => "the HTTP receiver redirects every request (3xx): the URL moved",
        }
    }

    /// How the operator fixes it; kubecast resumes by itself once it is fixed.
    pub fn fix(self) -> &'static str {
        match self {
            Refusal::MissingTopic => {
                "create the topic (kafka-topics.sh --create), or route the resource to an existing one"
            }
            Refusal::MissingStream => {
                "add the subject to a JetStream stream's subjects, or route the resource elsewhere with `subject`"
            }
            Refusal::TopicNotAuthorized => {
                "grant the principal Write and Describe on the topic (kafka-acls.sh --add --allow-principal User:<name> --operation Write --operation Describe --topic <topic>)"
            }
            Refusal::ClusterNotAuthorized => {
                "grant the principal IdempotentWrite on the cluster (kafka-acls.sh --add --allow-principal User:<name> --operation IdempotentWrite --cluster), or create the topic so that the broker need not"
            }
            Refusal::TransactionalIdNotAuthorized => {
                "grant the principal Write and Describe on the transactional.id (kafka-acls.sh --add --allow-principal User:<name> --operation Write --operation Describe --transactional-id <id>)"
            }
            Refusal::GroupNotAuthorized => {
                "grant the principal Read on the consumer group (kafka-acls.sh --add --allow-principal User:<name> --operation Read --group <group>)"
            }
            Refusal::TransactionTimeoutRefused => {
                "raise the broker's transaction.max.timeout.ms to 60000 or more (kubecast's transactions time out after 60 s; it sets transaction.timeout.ms itself)"
            }
            Refusal::SubjectNotPermitted => "allow the NATS user to publish on the subject (its permissions.publish)",
            Refusal::HttpNotAuthorized => {
                "give kubecast credentials the receiver accepts (sink.http.bearer_token_file, username/password or headers), or allow its identity on the receiver"
            }
            Refusal::HttpRedirect => "set sink.http.url to the address the receiver redirects to",
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what())
    }
}

#[cfg(test)]
mod tests {
    use super::Refusal;

    #[test]
    fn each_refusal_has_its_own_label_and_a_fix() {
        let mut labels: Vec<_> = Refusal::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Refusal::ALL.len());
        for r in Refusal::ALL {
            assert!(!r.fix().is_empty() && !r.what().is_empty(), "{r:?}");
            assert!(r.label().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{r:?}");
        }
    }
}
