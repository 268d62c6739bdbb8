//! Configuration: the TOML file (or the embedded defaults), then `KUBECAST_`-prefixed
//! environment overrides with `__` as the nesting separator, then semantic validation.
//!
//! Every error names the key it is about and says how to fix it.

use std::fmt;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

use crate::admin::AdminConfig;
use crate::delivery::DeliveryConfig;
use crate::selector;
use crate::shaping::{FilterErrorRule, PayloadMode};
use crate::sink::kafka::KafkaConfig;
use crate::sink::nats::NatsConfig;
use crate::sink::template::Template;

/// The configuration used when `--config` is not given (also the demo's).
pub const EMBEDDED_DEFAULTS: &str = include_str!("../config/default.toml");

/// Environment variables with this prefix and a `__` in the rest of their name override keys
/// of the file: `KUBECAST_SINK__PATH=x` sets `sink.path`.
pub const ENV_PREFIX: &str = "KUBECAST_";

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub cluster: ClusterConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub sink: SinkConfig,
    #[serde(default)]
    pub delivery: DeliveryConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub telemetry: crate::telemetry::TelemetryConfig,
    #[serde(default)]
    pub resources: Vec<ResourceConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Goes into every CloudEvent's `source`.
    #[serde(default = "default_cluster_name")]
    pub name: String,
    /// Path of a kubeconfig; default: `KUBECONFIG`, then `~/.kube/config`, then in-cluster.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    /// Requests per second kubecast sends to the apiserver (discovery, list pages, watch
    /// starts), all streams together.
    #[serde(default = "default_qps")]
    pub qps: u32,
    /// Requests that may go at once above `qps` (e.g. starting many streams).
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// Server-side timeout of each watch request; the watch is then resumed from where it was
    /// (no relist). kubecast also gives up on a watch silent for this long plus 5 s.
    #[serde(default = "default_watch_timeout")]
    pub watch_timeout_seconds: u32,
    /// Read the initial state with streaming lists (`sendInitialEvents`) where the apiserver
    /// supports them, falling back to paginated lists; `false`: always paginated lists.
    #[serde(default = "default_true")]
    pub streaming_lists: bool,
}

fn default_true() -> bool {
    true
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            name: default_cluster_name(),
            kubeconfig: None,
            qps: default_qps(),
            burst: default_burst(),
            watch_timeout_seconds: default_watch_timeout(),
            streaming_lists: true,
        }
    }
}

fn default_qps() -> u32 {
    20
}

fn default_burst() -> u32 {
    40
}

fn default_watch_timeout() -> u32 {
    290
}

fn default_cluster_name() -> String {
    "local".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    #[serde(default = "default_checkpoint_dir")]
    pub dir: PathBuf,
    /// How often changed checkpoints are written, in milliseconds (and always at shutdown).
    #[serde(default = "default_flush_interval_ms")]
    pub flush_interval_ms: u64,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { dir: default_checkpoint_dir(), flush_interval_ms: default_flush_interval_ms() }
    }
}

fn default_flush_interval_ms() -> u64 {
    1000
}

fn default_checkpoint_dir() -> PathBuf {
    PathBuf::from("./kubecast-state")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SinkType {
    #[default]
    Stdout,
    File,
    Kafka,
    Nats,
}

impl fmt::Display for SinkType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SinkType::Stdout => "stdout",
            SinkType::File => "file",
            SinkType::Kafka => "kafka",
            SinkType::Nats => "nats",
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
}

/// A change verb as configured in `events` and used in CloudEvent types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    Added,
    Modified,
    Deleted,
}

impl Verb {
    pub const ALL: [Verb; 3] = [Verb::Added, Verb::Modified, Verb::Deleted];

    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Added => "added",
            Verb::Modified => "modified",
            Verb::Deleted => "deleted",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceConfig {
    /// `"group/version"`, or `"v1"` for the core group.
    pub api_version: String,
    /// Any kind the server serves, CRDs included.
    pub kind: String,
    /// Empty: all namespaces (one cluster-wide watch). Otherwise one watch per namespace.
    #[serde(default)]
    pub namespaces: Vec<String>,
    #[serde(default)]
    pub label_selector: String,
    #[serde(default)]
    pub field_selector: String,
    #[serde(default = "all_verbs")]
    pub events: Vec<Verb>,
    /// First start without a checkpoint: `snapshot` emits every existing object once,
    /// `now` only changes from then on.
    #[serde(default)]
    pub initial: Initial,
    /// Objects per page of a LIST.
    #[serde(default = "default_page_size")]
    pub page_size: u32,
    /// When the kind is not served (CRD not installed yet): `wait` rediscovers with backoff and
    /// starts the stream when it appears; `fail` stops kubecast with an error.
    #[serde(default)]
    pub missing_kind: MissingKind,
    /// This resource's Kafka topic template, overriding `[sink.kafka] topic`.
    #[serde(default)]
    pub topic: Option<String>,
    /// This resource's NATS subject template, overriding `[sink.nats] subject`.
    #[serde(default)]
    pub subject: Option<String>,
    /// This resource's own events-per-second limit, within `[delivery] rate_per_second`.
    #[serde(default)]
    pub rate_per_second: Option<u32>,
    /// A CEL expression over `object`, `oldObject`, `verb`: only events for which it is true
    /// are sent (see `src/shaping`).
    #[serde(default)]
    pub filter: Option<String>,
    /// A filter that fails at run time on an object: `deliver` (default) or `drop` the event.
    #[serde(default)]
    pub filter_error: FilterErrorRule,
    /// Keep `metadata.managedFields` and the last-applied annotation (dropped by default).
    #[serde(default)]
    pub keep_managed_fields: bool,
    /// Redact the values of Secrets' `data` / `stringData` (default true).
    #[serde(default = "yes")]
    pub redact_secrets: bool,
    /// Field paths whose values are redacted, e.g. `spec.password`, `data.*`.
    #[serde(default)]
    pub redact: Vec<String>,
    /// Events larger than this (structured JSON bytes) carry the metadata payload and
    /// `truncated = true`; 0 = no cap.
    #[serde(default)]
    pub max_event_bytes: u64,
    /// Drop `modified` events that changed only status / resourceVersion / managedFields /
    /// `ignore_fields`.
    #[serde(default)]
    pub ignore_status_only: bool,
    #[serde(default)]
    pub ignore_fields: Vec<String>,
    /// Keep the previous object per uid (for `oldObject` and `payload = "patch"`).
    #[serde(default)]
    pub keep_previous: bool,
    #[serde(default)]
    pub payload: PayloadMode,
}

fn yes() -> bool {
    true
}

fn default_page_size() -> u32 {
    500
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Initial {
    #[default]
    Snapshot,
    Now,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingKind {
    #[default]
    Wait,
    Fail,
}

fn all_verbs() -> Vec<Verb> {
    Verb::ALL.to_vec()
}

impl ResourceConfig {
    /// `(group, version)`; the core group is `""`.
    pub fn group_version(&self) -> (&str, &str) {
        match self.api_version.split_once('/') {
            Some((g, v)) => (g, v),
            None => ("", self.api_version.as_str()),
        }
    }

    pub fn wants(&self, verb: Verb) -> bool {
        self.events.contains(&verb)
    }

    /// This resource's own destination template for `sink` (`topic` or `subject`).
    pub fn route(&self, sink: SinkType) -> Option<&str> {
        match sink {
            SinkType::Kafka => self.topic.as_deref(),
            SinkType::Nats => self.subject.as_deref(),
            SinkType::Stdout | SinkType::File => None,
        }
    }

    /// Short human description, e.g. `apps/v1 Deployment`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.api_version, self.kind)
    }
}

/// One problem with a key of the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key, e.g. `resources[1].label_selector`.
    pub key: String,
    pub message: String,
    pub fix: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {} (fix: {})", self.key, self.message, self.fix)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "config file {path} cannot be read: {cause} (fix: pass an existing, readable file to --config / KUBECAST_CONFIG, or omit it to use the embedded defaults)"
    )]
    Unreadable { path: PathBuf, cause: std::io::Error },
    #[error("config{origin}: {problem}")]
    Parse { origin: String, problem: Problem },
    #[error("invalid config{origin}:\n{}", .problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid { origin: String, problems: Vec<Problem> },
}

impl Config {
    /// Loads the file at `path` (or the embedded defaults when `None`), applies environment
    /// overrides and validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let (figment, origin) = match path {
            Some(p) => {
                // figment treats a missing file as empty: refuse that explicitly.
                std::fs::read(p).map_err(|cause| ConfigError::Unreadable { path: p.to_path_buf(), cause })?;
                (Figment::from(Toml::file_exact(p)), format!(" {}", p.display()))
            }
            None => (Figment::from(Toml::string(EMBEDDED_DEFAULTS)), " (embedded defaults)".to_string()),
        };
        let figment = figment.merge(env_overrides());
        let config: Config =
            figment.extract().map_err(|e| ConfigError::Parse { origin: origin.clone(), problem: problem_of(&e) })?;
        let problems = config.problems();
        if problems.is_empty() { Ok(config) } else { Err(ConfigError::Invalid { origin, problems }) }
    }

    /// Semantic checks serde cannot express. Empty when the config is valid.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut push = |key: String, message: String, fix: &str| out.push(Problem { key, message, fix: fix.into() });

        if !is_dns_label(&self.cluster.name) {
            push(
                "cluster.name".into(),
                format!(
                    "{:?} is not a valid cluster name (it goes into every CloudEvent source URI)",
                    self.cluster.name
                ),
                "use lower-case letters, digits and '-', at most 63 characters, e.g. \"prod-eu-1\"",
            );
        }
        if self.cluster.qps == 0 {
            push("cluster.qps".into(), "must be at least 1".into(), "set e.g. qps = 20");
        }
        if self.cluster.burst == 0 {
            push("cluster.burst".into(), "must be at least 1".into(), "set e.g. burst = 40");
        }
        if !(1..=3600).contains(&self.cluster.watch_timeout_seconds) {
            push(
                "cluster.watch_timeout_seconds".into(),
                format!("{} is out of range", self.cluster.watch_timeout_seconds),
                "use 1 to 3600; the default is 290",
            );
        }
        if self.checkpoint.flush_interval_ms == 0 {
            push(
                "checkpoint.flush_interval_ms".into(),
                "must be at least 1".into(),
                "set e.g. flush_interval_ms = 1000",
            );
        }
        if self.checkpoint.dir.as_os_str().is_empty() {
            push("checkpoint.dir".into(), "must not be empty".into(), "set a directory, e.g. \"./kubecast-state\"");
        }
        match self.sink.kind {
            SinkType::File if self.sink.path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) => push(
                "sink.path".into(),
                "is required when sink.type = \"file\"".into(),
                "set sink.path = \"events.jsonl\" (or KUBECAST_SINK__PATH)",
            ),
            SinkType::Stdout | SinkType::Kafka | SinkType::Nats if self.sink.path.is_some() => push(
                "sink.path".into(),
                format!("is only used by sink.type = \"file\", but sink.type = \"{}\"", self.sink.kind),
                "remove sink.path, or set sink.type = \"file\"",
            ),
            SinkType::Nats if self.sink.nats.is_none() => push(
                "sink.nats".into(),
                "is required when sink.type = \"nats\"".into(),
                "add a [sink.nats] table with at least url = \"nats://host:4222\"",
            ),
            SinkType::Kafka if self.sink.kafka.is_none() => push(
                "sink.kafka".into(),
                "is required when sink.type = \"kafka\"".into(),
                "add a [sink.kafka] table with at least brokers = \"host:9092\"",
            ),
            _ => {}
        }
        if let Some(k) = &self.sink.kafka {
            if self.sink.kind != SinkType::Kafka {
                push(
                    "sink.kafka".into(),
                    format!("is only used by sink.type = \"kafka\", but sink.type = \"{}\"", self.sink.kind),
                    "remove [sink.kafka], or set sink.type = \"kafka\"",
                );
            }
            for (key, message, fix) in k.problems() {
                push(key, message, &fix);
            }
        }
        if let Some(n) = &self.sink.nats {
            if self.sink.kind != SinkType::Nats {
                push(
                    "sink.nats".into(),
                    format!("is only used by sink.type = \"nats\", but sink.type = \"{}\"", self.sink.kind),
                    "remove [sink.nats], or set sink.type = \"nats\"",
                );
            }
            for (key, message, fix) in n.problems() {
                push(key, message, &fix);
            }
        }
        let is_broker = matches!(self.sink.kind, SinkType::Kafka | SinkType::Nats);
        for (key, message, fix) in self.delivery.problems(is_broker) {
            push(key, message, &fix);
        }
        for (key, message, fix) in self.telemetry.problems() {
            push(key, message, &fix);
        }
        if self.resources.is_empty() {
            push(
                "resources".into(),
                "no [[resources]] entry: nothing would be watched".into(),
                "add at least one [[resources]] table with api_version and kind",
            );
        }
        for (i, r) in self.resources.iter().enumerate() {
            let key = |k: &str| format!("resources[{i}].{k}");
            if !is_api_version(&r.api_version) {
                push(
                    key("api_version"),
                    format!("{:?} is not \"group/version\" or \"v1\"", r.api_version),
                    "write e.g. \"v1\", \"apps/v1\" or \"example.com/v1alpha1\"",
                );
            }
            if r.kind.trim().is_empty() {
                push(key("kind"), "must not be empty".into(), "set the Kind name, e.g. \"ConfigMap\"");
            } else if !r.kind.chars().all(|c| c.is_ascii_alphanumeric())
                || !r.kind.starts_with(|c: char| c.is_ascii_uppercase())
            {
                push(
                    key("kind"),
                    format!("{:?} is not a Kind name", r.kind),
                    "use the CamelCase Kind as in the object's `kind` field, e.g. \"ConfigMap\", not the plural resource name",
                );
            }
            let mut seen = std::collections::HashSet::new();
            for (j, ns) in r.namespaces.iter().enumerate() {
                if !is_dns_label(ns) {
                    push(
                        format!("resources[{i}].namespaces[{j}]"),
                        format!("{ns:?} is not a valid namespace name"),
                        "use a DNS label (lower-case letters, digits, '-'); an empty list means all namespaces",
                    );
                } else if !seen.insert(ns) {
                    push(
                        format!("resources[{i}].namespaces[{j}]"),
                        format!("{ns:?} is listed twice"),
                        "list each namespace once",
                    );
                }
            }
            if let Err(e) = selector::validate_label_selector(&r.label_selector) {
                push(
                    key("label_selector"),
                    format!("{:?}: {e}", r.label_selector),
                    "use Kubernetes label selector syntax, e.g. \"app=web,tier in (a,b),!canary\"",
                );
            }
            if let Err(e) = selector::validate_field_selector(&r.field_selector) {
                push(
                    key("field_selector"),
                    format!("{:?}: {e}", r.field_selector),
                    "use Kubernetes field selector syntax, e.g. \"metadata.name=foo,status.phase!=Running\"",
                );
            }
            if !(1..=100_000).contains(&r.page_size) {
                push(
                    key("page_size"),
                    format!("{} is out of range", r.page_size),
                    "use 1 to 100000; the default is 500",
                );
            }
            if let Some(t) = &r.topic {
                if self.sink.kind != SinkType::Kafka {
                    push(
                        key("topic"),
                        format!("is only used by the kafka sink, but sink.type = \"{}\"", self.sink.kind),
                        if self.sink.kind == SinkType::Nats { "use `subject` for NATS" } else { "remove it" },
                    );
                } else if let Err(e) = Template::parse(t) {
                    push(key("topic"), e, "use a template like \"kubecast.{cluster}.{resource}\"");
                }
            }
            if let Some(t) = &r.subject {
                if self.sink.kind != SinkType::Nats {
                    push(
                        key("subject"),
                        format!("is only used by the nats sink, but sink.type = \"{}\"", self.sink.kind),
                        if self.sink.kind == SinkType::Kafka { "use `topic` for Kafka" } else { "remove it" },
                    );
                } else if let Err(e) = crate::sink::nats::subject_template(t) {
                    push(key("subject"), e, "use a template like \"kubecast.{cluster}.{resource}.{namespace}\"");
                }
            }
            if r.rate_per_second == Some(0) {
                push(key("rate_per_second"), "must be at least 1".into(), "remove it for no per-resource limit");
            }
            for (k, message, fix) in crate::shaping::problems(r) {
                push(key(&k), message, &fix);
            }
            if r.events.is_empty() {
                push(
                    key("events"),
                    "is empty: no event would ever be emitted".into(),
                    "list some of \"added\", \"modified\", \"deleted\", or remove the key for all three",
                );
            }
        }
        out
    }

    /// One-line summary for `check-config`.
    pub fn summary(&self) -> String {
        let resources: Vec<String> = self
            .resources
            .iter()
            .map(|r| {
                let scope = if r.namespaces.is_empty() {
                    "all namespaces".to_string()
                } else {
                    format!("namespaces {}", r.namespaces.join(","))
                };
                format!("{} ({scope})", r.describe())
            })
            .collect();
        let sink = match (&self.sink.kind, &self.sink.path, &self.sink.kafka, &self.sink.nats) {
            (SinkType::File, Some(p), _, _) => format!("file {}", p.display()),
            (SinkType::Kafka, _, Some(k), _) => format!("kafka {} topic {}", k.brokers, k.topic),
            (SinkType::Nats, _, _, Some(n)) => format!(
                "nats {} subject {} ({})",
                n.url,
                n.subject,
                if n.jetstream { "JetStream" } else { "core NATS, at-most-once" }
            ),
            (k, _, _, _) => k.to_string(),
        };
        format!(
            "config OK: cluster {:?}, sink {sink}, {} resource(s): {}",
            self.cluster.name,
            self.resources.len(),
            resources.join("; ")
        )
    }
}

fn env_overrides() -> Env {
    // Only variables with a `__` are config keys: every key lives in a section, and this keeps
    // the CLI's own variables (KUBECAST_CONFIG, KUBECAST_LOG_FORMAT, ...) out of the config.
    Env::prefixed(ENV_PREFIX).filter(|k| k.as_str().contains("__")).split("__")
}

fn problem_of(e: &figment::Error) -> Problem {
    use figment::error::Kind;
    let key = if e.path.is_empty() { "(file)".to_string() } else { dotted_key(&e.path) };
    let (message, fix) = match &e.kind {
        Kind::UnknownField(field, expected) => (
            format!("unknown key `{field}`"),
            if expected.is_empty() {
                "remove it".to_string()
            } else {
                format!("remove it, or use one of: {}", expected.join(", "))
            },
        ),
        Kind::UnknownVariant(v, expected) => {
            (format!("unknown value {v:?}"), format!("use one of: {}", expected.join(", ")))
        }
        Kind::MissingField(f) => (format!("required key `{f}` is missing"), format!("add `{f} = ...`")),
        Kind::InvalidType(actual, expected) => {
            (format!("wrong type: found {actual}, expected {expected}"), format!("write {expected}"))
        }
        Kind::InvalidValue(actual, expected) => {
            (format!("invalid value: found {actual}, expected {expected}"), format!("write {expected}"))
        }
        Kind::DuplicateField(f) => (format!("key `{f}` is given twice"), "keep one of them".into()),
        Kind::Message(m) => (m.clone(), "correct the TOML syntax at the position shown".into()),
        other => (other.to_string(), "correct the value".into()),
    };
    let mut message = message;
    if e.metadata.as_ref().is_some_and(|md| md.name.contains("environment")) {
        let var = format!("{ENV_PREFIX}{}", e.path.join("__").to_uppercase());
        message.push_str(&format!(" (set by the environment variable {var})"));
    }
    Problem { key, message, fix }
}

/// `["resources", "0", "kind"]` -> `resources[0].kind`.
fn dotted_key(path: &[String]) -> String {
    let mut key = String::new();
    for seg in path.iter().flat_map(|s| s.split('.')) {
        if seg.parse::<usize>().is_ok() {
            key.push_str(&format!("[{seg}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(seg);
        }
    }
    key
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_api_version(s: &str) -> bool {
    let version_ok = |v: &str| {
        !v.is_empty() && v.starts_with('v') && v.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    };
    match s.split_once('/') {
        None => version_ok(s),
        Some((g, v)) => !g.is_empty() && g.split('.').all(is_dns_label) && version_ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_defaults_are_valid() {
        let cfg = Config::load(None).expect("embedded defaults must be valid");
        assert_eq!(cfg.sink.kind, SinkType::Stdout);
        assert!(!cfg.resources.is_empty());
    }

    #[test]
    fn api_version_forms() {
        assert!(is_api_version("v1"));
        assert!(is_api_version("apps/v1"));
        assert!(is_api_version("example.kubecast.io/v1alpha1"));
        assert!(!is_api_version("apps"));
        assert!(!is_api_version("/v1"));
        assert!(!is_api_version("Apps/v1"));
    }
}
