//! `[sink]`: which sink, and its settings.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::http::HttpConfig;
use super::kafka::KafkaConfig;
use super::nats::NatsConfig;
use crate::model::Problem;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SinkType {
    #[default]
    Stdout,
    File,
    Kafka,
    Nats,
    Http,
}

impl fmt::Display for SinkType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SinkType::Stdout => "stdout",
            SinkType::File => "file",
            SinkType::Kafka => "kafka",
            SinkType::Nats => "nats",
            SinkType::Http => "http",
        })
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    #[serde(rename = "type", default)]
    pub kind: SinkType,
    /// For `type = "file"`: the JSON-lines file events are appended to.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// For `type = "kafka"`.
    #[serde(default)]
    pub kafka: Option<KafkaConfig>,
    /// For `type = "nats"`.
    #[serde(default)]
    pub nats: Option<NatsConfig>,
    /// For `type = "http"` (may be absent: the URL then comes from `K_SINK`).
    #[serde(default)]
    pub http: Option<HttpConfig>,
}

impl SinkConfig {
    /// Problems with `[sink]` and its tables.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        match self.kind {
            SinkType::File if self.path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) => out.push(Problem::new(
                "sink.path",
                "is required when sink.type = \"file\"",
                "set sink.path = \"events.jsonl\" (or KUBECAST_SINK__PATH)",
            )),
            SinkType::Stdout | SinkType::Kafka | SinkType::Nats | SinkType::Http if self.path.is_some() => {
                out.push(Problem::new(
                    "sink.path",
                    format!("is only used by sink.type = \"file\", but sink.type = \"{}\"", self.kind),
                    "remove sink.path, or set sink.type = \"file\"",
                ))
            }
            SinkType::Nats if self.nats.is_none() => out.push(Problem::new(
                "sink.nats",
                "is required when sink.type = \"nats\"",
                "add a [sink.nats] table with at least url = \"nats://host:4222\"",
            )),
            SinkType::Kafka if self.kafka.is_none() => out.push(Problem::new(
                "sink.kafka",
                "is required when sink.type = \"kafka\"",
                "add a [sink.kafka] table with at least brokers = \"host:9092\"",
            )),
            _ => {}
        }
        if let Some(k) = &self.kafka {
            if self.kind != SinkType::Kafka {
                out.push(Problem::new(
                    "sink.kafka",
                    format!("is only used by sink.type = \"kafka\", but sink.type = \"{}\"", self.kind),
                    "remove [sink.kafka], or set sink.type = \"kafka\"",
                ));
            }
            out.extend(k.problems());
        }
        if self.kind == SinkType::Http {
            out.extend(self.http.clone().unwrap_or_default().problems());
        } else if self.http.is_some() {
            out.push(Problem::new(
                "sink.http",
                format!("is only used by sink.type = \"http\", but sink.type = \"{}\"", self.kind),
                "remove [sink.http], or set sink.type = \"http\"",
            ));
        }
        if let Some(n) = &self.nats {
            if self.kind != SinkType::Nats {
                out.push(Problem::new(
                    "sink.nats",
                    format!("is only used by sink.type = \"nats\", but sink.type = \"{}\"", self.kind),
                    "remove [sink.nats], or set sink.type = \"nats\"",
                ));
            }
            out.extend(n.problems());
        }
        out
    }

    /// Whether events go to a broker (Kafka or NATS).
    pub fn is_broker(&self) -> bool {
        matches!(self.kind, SinkType::Kafka | SinkType::Nats)
    }
}
