//! Looking destinations up without creating them (metadata only): what `kubecast check-config
//! --connect` and the start of `run` report before the first event. A producer's metadata
//! request may make a broker with `auto.create.topics.enable` create the topic; this client's
//! never does (`allow.auto.create.topics = false`).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::LogContext;
use super::rejected::refusal;
use super::roles::{for_consumer, for_producer};
use crate::model::Refusal;

/// What the cluster says of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicState {
    /// It exists, with this many replicas (its first partition's).
    Exists { replicas: usize },
    /// It does not exist.
    Missing,
    /// The principal may not see it (or another set-up refusal).
    Refused(Refusal),
    /// The broker answered with another error for it.
    Error(String),
}

/// Each of `topics` as the cluster sees it, and the cluster's broker count. Blocking (one
/// metadata request per topic, each up to `timeout`); `Err` when the brokers do not answer.
pub fn lookup_topics(
    client: &ClientConfig,
    topics: &[String],
    timeout: Duration,
) -> Result<(Vec<(String, TopicState)>, usize), String> {
    let mut cc = for_consumer(client);
    // No group.id: no group coordinator to connect to (metadata only).
    cc.set("allow.auto.create.topics", "false");
    let consumer: BaseConsumer<LogContext> =
        cc.create_with_context(LogContext).map_err(|e| format!("Kafka client: {}", super::properties::describe(&e)))?;
    let mut brokers = 0;
    let mut out = Vec::with_capacity(topics.len());
    for topic in topics {
        let md = consumer.fetch_metadata(Some(topic), timeout).map_err(|e| format!("Kafka metadata: {e}"))?;
        brokers = md.brokers().len();
        let state = match md.topics().iter().find(|t| t.name() == topic) {
            None => TopicState::Missing,
            Some(t) => match t.error() {
                None if !t.partitions().is_empty() => {
                    TopicState::Exists { replicas: t.partitions()[0].replicas().len() }
                }
                None => TopicState::Missing,
                Some(e) => {
                    let code = RDKafkaErrorCode::from(e);
                    match refusal(&KafkaError::MetadataFetch(code)) {
                        Some(Refusal::MissingTopic) => TopicState::Missing,
                        Some(r) => TopicState::Refused(r),
                        None => TopicState::Error(code.to_string()),
                    }
                }
            },
        };
        out.push((topic.clone(), state));
    }
    Ok((out, brokers))
}

/// Whether the cluster's brokers create topics on first use (`auto.create.topics.enable` of
/// one broker); `None` when it cannot be read (no permission to describe the broker's config).
pub async fn broker_auto_creates(client: &ClientConfig, broker: i32) -> Option<bool> {
    let admin: AdminClient<LogContext> = for_producer(client).create_with_context(LogContext).ok()?;
    let admin = super::off_worker::OffWorker::new(admin);
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let described = admin.describe_configs(&[ResourceSpecifier::Broker(broker)], &opts).await.ok()?;
    let resource = described.into_iter().next()?.ok()?;
    let value = resource.get("auto.create.topics.enable")?.value.clone()?;
    Some(value == "true")
}

/// The id of one broker of the cluster (for [`broker_auto_creates`]). Blocking.
pub fn any_broker(client: &ClientConfig, timeout: Duration) -> Option<i32> {
    let mut cc = for_consumer(client);
    cc.set("allow.auto.create.topics", "false");
    let consumer: BaseConsumer<LogContext> = cc.create_with_context(LogContext).ok()?;
    let md = consumer.fetch_metadata(None, timeout).ok()?;
    md.brokers().first().map(|b| b.id())
}
