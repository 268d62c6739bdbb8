//! `type = "kafka"`: an idempotent rdkafka producer (`enable.idempotence = true`,
//! `acks = all`). An event is accepted when its delivery report says the broker stored it;
//! never fire-and-forget.
//!
//! CloudEvents Kafka protocol binding: binary mode by default (value = `data`, header
//! `content-type` = `datacontenttype`, every other attribute and extension as a `ce_<name>`
//! header), structured mode as an option (value = the JSON event, `content-type:
//! application/cloudevents+json; charset=UTF-8`). The record key is `partitionkey` (the uid),
//! so the events of one object stay in one partition, in order.
//!
//! With `exactly_once = true` the events go into the Kafka state store's producer
//! transaction (`transaction.rs`) instead, committed with the state that advances past them.

mod client;
mod config;
mod encode;
mod limits;
mod logging;
pub mod lookup;
pub(crate) mod off_worker;
mod polled;
mod producer;
pub mod properties;
mod rejected;
pub mod roles;
pub mod security;
pub mod transaction;

pub use client::{KafkaContext, KafkaSink};
pub use config::{DEFAULT_TOPIC, KafkaConfig, Mode, clean_topic_part, topic_name_problem, topic_template};
pub use encode::encode;
pub use logging::{LogContext, log_level};
pub(crate) use rejected::refusal;
