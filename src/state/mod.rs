//! What kubecast remembers per stream, and how it gets there: the watermark turns
//! acknowledgements into a position and the changes since the last write (`watermark`), the
//! store keeps positions (`store`: a directory, a Kafka topic or a NATS bucket), the persister
//! writes them periodically (`persister`). Which process may write them (the Leases) is
//! `coordination`'s.
//!
//! Invariant: a stored position never passes an item that was not acknowledged, and only the
//! store's owner writes it.

pub mod persister;
pub mod store;
pub mod watermark;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::Problem;

/// This machine's host name (gethostname(2): the pod's name in Kubernetes), empty if it
/// cannot be read.
pub fn host_name() -> String {
    hostname::get().map(|h| h.to_string_lossy().trim().to_string()).unwrap_or_default()
}

/// `[checkpoint] store`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    #[default]
    File,
    Kafka,
    Nats,
}

impl std::fmt::Display for StoreKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StoreKind::File => "file",
            StoreKind::Kafka => "kafka",
            StoreKind::Nats => "nats",
        })
    }
}

/// `[checkpoint.kafka]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaStoreSettings {
    #[serde(default = "default_state_name")]
    pub topic: String,
    /// Create the topic (compacted, one partition) when it does not exist.
    #[serde(default = "yes")]
    pub create_topic: bool,
    /// Default: the sink's `sink.kafka.brokers` (and its properties).
    #[serde(default)]
    pub brokers: Option<String>,
    /// Connection properties when `brokers` is set (TLS, SASL); `${env:..}`/`${file:..}` allowed.
    #[serde(default)]
    pub properties: std::collections::BTreeMap<String, String>,
    /// Default: `kubecast-state.<cluster>.<lease namespace>.<lease name>` with `[coordination]`,
    /// else `kubecast-state.<cluster>.<hash of the streams>`.
    #[serde(default)]
    pub transactional_id: Option<String>,
    /// The replication factor of the topic kubecast creates. Default: the smaller of 3 and the
    /// number of brokers.
    #[serde(default)]
    pub replication_factor: Option<u16>,
    /// Its `min.insync.replicas`. Default: 2 with 3 replicas or more, else 1.
    #[serde(default)]
    pub min_insync_replicas: Option<u16>,
}

/// `[checkpoint.nats]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NatsStoreSettings {
    #[serde(default = "default_state_name")]
    pub bucket: String,
    /// Create the bucket (history 1, file storage) when it does not exist.
    #[serde(default = "yes")]
    pub create_bucket: bool,
    /// Default: the sink's connection (`sink.nats`).
    #[serde(default)]
    pub url: Option<String>,
    /// The replicas of the bucket kubecast creates. Default: the smaller of 3 and the servers
    /// of the cluster, 1 outside a cluster.
    #[serde(default)]
    pub replicas: Option<usize>,
}

fn default_state_name() -> String {
    "kubecast-state".into()
}
fn yes() -> bool {
    true
}

impl Default for KafkaStoreSettings {
    fn default() -> Self {
        Self {
            topic: default_state_name(),
            create_topic: true,
            brokers: None,
            properties: Default::default(),
            transactional_id: None,
            replication_factor: None,
            min_insync_replicas: None,
        }
    }
}

impl Default for NatsStoreSettings {
    fn default() -> Self {
        Self { bucket: default_state_name(), create_bucket: true, url: None, replicas: None }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Where positions are kept: `file` (in `dir`), `kafka` or `nats`.
    #[serde(default)]
    pub store: StoreKind,
    #[serde(default = "default_checkpoint_dir")]
    pub dir: PathBuf,
    /// How often changed checkpoints are written, in milliseconds (and always at shutdown).
    #[serde(default = "default_flush_interval_ms")]
    pub flush_interval_ms: u64,
    #[serde(default)]
    pub kafka: KafkaStoreSettings,
    #[serde(default)]
    pub nats: NatsStoreSettings,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            store: StoreKind::File,
            dir: default_checkpoint_dir(),
            flush_interval_ms: default_flush_interval_ms(),
            kafka: KafkaStoreSettings::default(),
            nats: NatsStoreSettings::default(),
        }
    }
}

fn default_flush_interval_ms() -> u64 {
    1000
}

fn default_checkpoint_dir() -> PathBuf {
    PathBuf::from("./kubecast-state")
}

impl CheckpointConfig {
    /// Problems with `[checkpoint]`.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if self.flush_interval_ms == 0 {
            out.push(Problem::new(
                "checkpoint.flush_interval_ms",
                "must be at least 1",
                "set e.g. flush_interval_ms = 1000",
            ));
        }
        if self.nats.replicas.is_some_and(|r| !(1..=5).contains(&r)) {
            out.push(Problem::new(
                "checkpoint.nats.replicas",
                format!("is {}; JetStream keeps 1 to 5 replicas", self.nats.replicas.unwrap_or_default()),
                "set 1 to 5 (3 in a cluster of 3 servers or more), or remove it for the default",
            ));
        }
        if self.kafka.replication_factor == Some(0) {
            out.push(Problem::new(
                "checkpoint.kafka.replication_factor",
                "is 0",
                "set at least 1 (3 where the cluster has 3 brokers or more), or remove it for the default",
            ));
        }
        match (self.kafka.min_insync_replicas, self.kafka.replication_factor) {
            (Some(0), _) => out.push(Problem::new(
                "checkpoint.kafka.min_insync_replicas",
                "is 0",
                "set at least 1, or remove it for the default",
            )),
            (Some(isr), Some(rf)) if isr > rf => out.push(Problem::new(
                "checkpoint.kafka.min_insync_replicas",
                format!("is {isr}, above checkpoint.kafka.replication_factor ({rf}): no write of the state would ever succeed"),
                format!("set at most {rf}"),
            )),
            _ => {}
        }
        if self.kafka.brokers.is_some() {
            out.extend(crate::sink::kafka::security::problems("checkpoint.kafka.properties", &self.kafka.properties));
            out.extend(crate::sink::kafka::properties::problems("checkpoint.kafka.properties", &self.kafka.properties));
            for (k, v) in &self.kafka.properties {
                let key = format!("checkpoint.kafka.properties.\"{k}\"");
                if k == "bootstrap.servers" {
                    out.push(Problem::new(
                        key.clone(),
                        "duplicates checkpoint.kafka.brokers",
                        "set checkpoint.kafka.brokers instead",
                    ));
                }
                if let Err(e) = crate::sink::secret::resolve(v) {
                    out.push(Problem::new(key, e, "set that variable or create that file"));
                }
            }
        } else if !self.kafka.properties.is_empty() {
            out.push(Problem::new(
                "checkpoint.kafka.properties",
                "are only used with checkpoint.kafka.brokers: without it the store uses the sink's connection and its properties",
                "set checkpoint.kafka.brokers, or move them to [sink.kafka.properties]",
            ));
        }
        // Connection settings of a store that is not the one in use would be ignored: the
        // positions would go elsewhere than meant (e.g. into the pod's files, lost with it).
        let store = format!("{:?}", self.store).to_lowercase();
        let unused = |key: &str, wants: &str| {
            Problem::new(
                format!("checkpoint.{key}"),
                format!("is only used with checkpoint.store = \"{wants}\", and the store is \"{store}\""),
                format!("set checkpoint.store = \"{wants}\" to keep the positions there, or remove checkpoint.{key}"),
            )
        };
        if self.store != StoreKind::Kafka {
            if self.kafka.brokers.is_some() {
                out.push(unused("kafka.brokers", "kafka"));
            }
            if self.kafka.transactional_id.is_some() {
                out.push(unused("kafka.transactional_id", "kafka"));
            }
        }
        if self.store != StoreKind::Nats && self.nats.url.is_some() {
            out.push(unused("nats.url", "nats"));
        }
        if let Some(url) = &self.nats.url
            && let Some((message, fix)) = crate::sink::nats::url_problem(url)
        {
            out.push(Problem::new("checkpoint.nats.url", message, fix));
        }
        if self.store == StoreKind::Kafka
            && let Some(why) = crate::sink::kafka::topic_name_problem(&self.kafka.topic)
        {
            out.push(Problem::new(
                "checkpoint.kafka.topic",
                format!("{:?} is not a Kafka topic name: {why}", self.kafka.topic),
                "e.g. \"kubecast-state\"",
            ));
        }
        if self.store == StoreKind::Nats
            && (self.nats.bucket.is_empty()
                || !self.nats.bucket.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            out.push(Problem::new(
                "checkpoint.nats.bucket",
                format!("{:?} is not a bucket name (letters, digits, - and _)", self.nats.bucket),
                "e.g. \"kubecast-state\"",
            ));
        }
        if self.dir.as_os_str().is_empty() {
            out.push(Problem::new("checkpoint.dir", "must not be empty", "set a directory, e.g. \"./kubecast-state\""));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_name_is_the_kernels() {
        let name = super::host_name();
        assert!(!name.is_empty());
        // Linux also shows it here (what kubecast read before).
        if let Ok(proc) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
            assert_eq!(name, proc.trim());
        }
    }
}
