//! Configuration: the TOML file (or the embedded defaults), then `KUBECAST_`-prefixed
//! environment overrides with `__` as the nesting separator, then semantic validation.
//!
//! Every error names the key it is about and says how to fix it.

mod resource;

use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

use crate::coordination::lease::CoordinationConfig;
use crate::delivery::DeliveryConfig;
use crate::model::Problem;
use crate::observe::admin::AdminConfig;
use crate::observe::trace::TelemetryConfig;
use crate::sink::{SinkConfig, SinkType};
use crate::source::client::ClusterConfig;
use crate::state::CheckpointConfig;
pub use resource::ResourceConfig;

/// The configuration used when `--config` is not given (also the demo's).
pub const EMBEDDED_DEFAULTS: &str = include_str!("../../config/default.toml");

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
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub resources: Vec<ResourceConfig>,
    #[serde(default)]
    pub coordination: CoordinationConfig,
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
        let mut problems = single_underscore_overrides(std::env::vars_os().map(|(k, _)| k));
        problems.extend(config.problems());
        if problems.is_empty() { Ok(config) } else { Err(ConfigError::Invalid { origin, problems }) }
    }

    /// Semantic checks serde cannot express. Empty when the config is valid.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        out.extend(self.cluster.problems());
        out.extend(self.checkpoint.problems());
        out.extend(self.sink.problems());
        out.extend(self.delivery.problems(self.sink.is_broker() || self.sink.kind == SinkType::Http));
        if let (crate::delivery::DeadLetterType::Broker, Some(dest)) =
            (self.delivery.dead_letter.kind, self.delivery.dead_letter.destination.as_deref().filter(|d| !d.is_empty()))
        {
            // Checked by the sink's naming rules: the broker would refuse every dead letter.
            let problem = match self.sink.kind {
                SinkType::Kafka => crate::sink::kafka::topic_name_problem(dest)
                    .map(|why| format!("{dest:?} is not a Kafka topic name: {why}")),
                SinkType::Nats => crate::sink::nats::subject_problem(dest)
                    .map(|why| format!("{dest:?} is not a NATS subject to publish to: {why}")),
                SinkType::Http => match url::Url::parse(dest) {
                    Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => None,
                    _ => Some(format!(
                        "{:?} is not an http:// or https:// URL (with an HTTP sink the dead letter is another receiver)",
                        crate::sink::secret::url_for_display(dest)
                    )),
                },
                _ => None,
            };
            if let Some(message) = problem {
                out.push(Problem::new("delivery.dead_letter.destination", message, "e.g. \"kubecast.dead-letter\""));
            }
        }
        out.extend(self.telemetry.problems());
        out.extend(self.coordination.problems());
        out.extend(self.admin.problems());
        if self.resources.is_empty() {
            out.push(Problem::new(
                "resources",
                "no [[resources]] entry: nothing would be watched",
                "add at least one [[resources]] table with api_version and kind",
            ));
        }
        for (i, r) in self.resources.iter().enumerate() {
            out.extend(r.problems(self.sink.kind).into_iter().map(|p| p.within(&format!("resources[{i}]"))));
        }
        out.extend(self.same_streams());
        out.extend(self.store_problems());
        let dead_letter_file =
            matches!(self.delivery.dead_letter.kind, crate::delivery::DeadLetterType::File).then(|| {
                self.delivery.dead_letter.path.clone().unwrap_or_else(|| self.checkpoint.dir.join("dead-letter.jsonl"))
            });
        if self.sink.kind == SinkType::File && dead_letter_file.is_some() && dead_letter_file == self.sink.path {
            out.push(Problem::new(
                "delivery.dead_letter.path",
                "is the file of sink.path: the events and the dead letters would cut each other's lines",
                "give the dead letter a file of its own",
            ));
        }
        out
    }

    /// A broker store needs a connection: the sink's, or its own.
    fn store_problems(&self) -> Vec<Problem> {
        /// With exactly-once, the commit interval's upper bound (the transaction times out at 60 s).
        const MAX_COMMIT_INTERVAL_MS: u64 = 30_000;
        use crate::state::StoreKind;
        let c = &self.checkpoint;
        let mut out = Vec::new();
        match c.store {
            StoreKind::Kafka if c.kafka.brokers.is_none() && self.sink.kind != SinkType::Kafka => {
                out.push(Problem::new(
                    "checkpoint.store",
                    "is \"kafka\" but the sink is not Kafka and checkpoint.kafka.brokers is not set",
                    "set checkpoint.kafka.brokers, or use the store of the sink's kind",
                ))
            }
            StoreKind::Nats if c.nats.url.is_none() && self.sink.kind != SinkType::Nats => out.push(Problem::new(
                "checkpoint.store",
                "is \"nats\" but the sink is not NATS and checkpoint.nats.url is not set",
                "set checkpoint.nats.url, or use the store of the sink's kind",
            )),
            StoreKind::Nats if c.nats.url.is_none() && self.sink.nats.as_ref().is_some_and(|n| !n.jetstream) => out
                .push(Problem::new(
                    "checkpoint.store",
                    "is \"nats\" on the sink's connection, which has jetstream = false",
                    "set sink.nats.jetstream = true (the bucket is a JetStream stream), or checkpoint.nats.url",
                )),
            _ => {}
        }
        if c.store == StoreKind::Kafka {
            // The state store's producer is transactional: librdkafka refuses to create it with
            // delivery timeouts longer than its transaction.timeout.ms, or a socket timeout more
            // than 100 ms longer, at every attempt to open the store.
            let transaction_ms = crate::sink::kafka::transaction::TRANSACTION_TIMEOUT.as_millis() as u64;
            let (section, properties) = match (&c.kafka.brokers, &self.sink.kafka) {
                (None, Some(k)) => ("sink.kafka.properties", &k.properties),
                _ => ("checkpoint.kafka.properties", &c.kafka.properties),
            };
            for (k, limit) in [
                ("message.timeout.ms", transaction_ms),
                ("delivery.timeout.ms", transaction_ms),
                ("socket.timeout.ms", transaction_ms + 100),
            ] {
                if let Some(v) = properties.get(k).and_then(|v| v.trim().parse::<u64>().ok())
                    && v > limit
                {
                    out.push(Problem::new(
                        format!("{section}.\"{k}\""),
                        format!("is {v}; the Kafka state store's transactional producer accepts at most {limit} (its transaction.timeout.ms is {transaction_ms})"),
                        format!("set at most {limit}, or remove it"),
                    ));
                }
            }
        }
        if self.coordination.shards > 1 && c.store == StoreKind::File {
            out.push(Problem::new(
                "coordination.shards",
                format!(
                    "is {} but checkpoint.store is \"file\": the shards move between replicas, and a directory is one replica's",
                    self.coordination.shards
                ),
                "set checkpoint.store = \"kafka\" or \"nats\" (the state where every replica reads it), or shards = 1",
            ));
        }
        if let Some(k) = self.sink.kafka.as_ref().filter(|k| k.exactly_once && self.sink.kind == SinkType::Kafka) {
            if c.store != StoreKind::Kafka {
                out.push(Problem::new(
                    "sink.kafka.exactly_once",
                    format!(
                        "needs the state in the sink's Kafka cluster, but checkpoint.store is \"{}\": events and state can only be committed in one Kafka transaction",
                        c.store
                    ),
                    "set checkpoint.store = \"kafka\"",
                ));
            } else if c.kafka.brokers.as_ref().is_some_and(|b| b != &k.brokers) {
                out.push(Problem::new(
                    "sink.kafka.exactly_once",
                    "needs the state in the sink's Kafka cluster, but checkpoint.kafka.brokers names other brokers",
                    "remove checkpoint.kafka.brokers (the store then uses the sink's connection)",
                ));
            }
            // The events go out through the state store's transactional producer, which is built
            // from the sink's connection: properties of the store's own would not apply to it, and
            // the sink's (SASL, TLS, compression, message.max.bytes) would seem ignored if the store
            // had its own.
            if !c.kafka.properties.is_empty() {
                let names: Vec<String> = c.kafka.properties.keys().map(|k| format!("{k:?}")).collect();
                out.push(Problem::new(
                    "checkpoint.kafka.properties",
                    format!(
                        "sets {} but with sink.kafka.exactly_once the events and the state go out through one producer, built from [sink.kafka] and its properties: these would not apply",
                        names.join(", ")
                    ),
                    "move them to [sink.kafka.properties] (one place for TLS, SASL and producer settings), or remove them",
                ));
            }
            if c.flush_interval_ms > MAX_COMMIT_INTERVAL_MS {
                out.push(Problem::new(
                    "checkpoint.flush_interval_ms",
                    format!(
                        "is {} ms; with sink.kafka.exactly_once it is the transaction's commit interval, which must stay well under the producer's 60 s transaction timeout",
                        c.flush_interval_ms
                    ),
                    format!("set at most {MAX_COMMIT_INTERVAL_MS}"),
                ));
            }
        }
        out
    }

    /// Two `[[resources]]` entries that watch one stream (same kind, namespace and selectors)
    /// would emit every change twice and write one checkpoint from two places.
    fn same_streams(&self) -> Vec<Problem> {
        use crate::source::selector::{canonical_field_selector, canonical_label_selector};
        let mut first: std::collections::HashMap<(String, String, Option<&str>, String, String), usize> =
            std::collections::HashMap::new();
        let mut out = Vec::new();
        for (i, r) in self.resources.iter().enumerate() {
            let scopes: Vec<Option<&str>> = if r.namespaces.is_empty() {
                vec![None]
            } else {
                r.namespaces.iter().map(|n| Some(n.as_str())).collect()
            };
            for ns in scopes {
                // Selectors spelt differently that select the same objects are one stream too.
                let key = (
                    r.api_version.clone(),
                    r.kind.clone(),
                    ns,
                    canonical_label_selector(&r.label_selector),
                    canonical_field_selector(&r.field_selector),
                );
                match first.get(&key) {
                    Some(&j) if j != i => {
                        let scope = ns.map_or("all namespaces".to_string(), |n| format!("namespace {n}"));
                        out.push(Problem::new(
                            format!("resources[{i}]"),
                            format!(
                                "watches the same stream as resources[{j}] ({} in {scope}, selectors that select the same objects): every change would be emitted twice",
                                r.describe()
                            ),
                            format!("merge resources[{i}] into resources[{j}], or remove one of them"),
                        ));
                        break;
                    }
                    _ => {
                        first.insert(key, i);
                    }
                }
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
                crate::sink::secret::url_for_display(&n.url),
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

/// The config's sections, as environment variables start them (`KUBECAST_SINK__...`).
const SECTIONS: [&str; 8] =
    ["cluster", "checkpoint", "sink", "delivery", "admin", "telemetry", "coordination", "resources"];

/// Variables that look like config overrides with one `_` between section and key
/// (`KUBECAST_SINK_TYPE`): not read as config keys, which would silently leave the key as the
/// file says, so they are refused naming the spelling that works.
fn single_underscore_overrides(names: impl Iterator<Item = std::ffi::OsString>) -> Vec<Problem> {
    let mut out: Vec<Problem> = names
        .filter_map(|name| name.into_string().ok())
        .filter(|name| !name.contains("__"))
        .filter_map(|name| {
            let rest = name.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
            let (section, key) = SECTIONS.iter().find_map(|s| Some((*s, rest.strip_prefix(s)?.strip_prefix('_')?)))?;
            (!key.is_empty() && !is_service_link(key)).then(|| {
                Problem::new(
                    format!("{section}.{key}"),
                    format!(
                        "the environment variable {name} is not read: config overrides put two underscores between the section and the key"
                    ),
                    format!(
                        "rename it {ENV_PREFIX}{}__{} (and `__` between nested keys), or unset it",
                        section.to_ascii_uppercase(),
                        key.to_ascii_uppercase()
                    ),
                )
            })
        })
        .collect();
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

/// Whether `key` (after `KUBECAST_<SECTION>_`) ends like a variable Kubernetes puts in pods for
/// each Service of their namespace (service links: `<SERVICE>_SERVICE_HOST`,
/// `<SERVICE>_SERVICE_PORT[_<NAME>]`, `<SERVICE>_PORT[_<port>_<PROTO>[_PROTO|_PORT|_ADDR]]`), as
/// a Service named e.g. `kubecast-admin` gives: not a misspelt override, and not kubecast's.
fn is_service_link(key: &str) -> bool {
    let parts: Vec<&str> = key.split('_').collect();
    let protocol = |p: &str| matches!(p, "tcp" | "udp" | "sctp");
    parts.windows(2).any(|w| w[0] == "service" && matches!(w[1], "host" | "port"))
        || parts.iter().enumerate().any(|(i, p)| {
            *p == "port"
                && match &parts[i + 1..] {
                    [] => true,
                    [number, proto, rest @ ..] => {
                        number.bytes().all(|b| b.is_ascii_digit())
                            && protocol(proto)
                            && matches!(rest, [] | ["proto" | "port" | "addr"])
                    }
                    _ => false,
                }
        })
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
            let (expected, example) = in_words(expected);
            let found = shown_value(&e.path, actual);
            (format!("wrong type: found {found}, expected {expected}"), format!("write {expected}{example}"))
        }
        Kind::InvalidValue(actual, expected) => {
            let (expected, example) = in_words(expected);
            let found = shown_value(&e.path, actual);
            (format!("invalid value: found {found}, expected {expected}"), format!("write {expected}{example}"))
        }
        Kind::DuplicateField(f) => (format!("key `{f}` is given twice"), "keep one of them".into()),
        Kind::Message(m) => (m.clone(), "correct the TOML syntax at the position shown".into()),
        other => (other.to_string(), "correct the value".into()),
    };
    if !e.metadata.as_ref().is_some_and(|md| md.name.contains("environment")) {
        return Problem { key, message, fix };
    }
    let variables = variables_of(&e.path);
    if e.path.first().is_some_and(|s| s == "resources") {
        return Problem {
            key,
            message: format!("{message} (set by the environment variable {variables})"),
            fix: format!(
                "[[resources]] is a list of tables and cannot be set from the environment: write the entries in the config file, and unset {variables}"
            ),
        };
    }
    Problem {
        key,
        message: format!("{message} (set by the environment variable {variables})"),
        fix: format!("{fix}{}", if is_scalar_type_error(&e.kind) { QUOTE_DIGITS } else { "" }),
    }
}

/// The environment's values are read as TOML values: digits become a number.
const QUOTE_DIGITS: &str = " (from the environment, a string of digits is quoted: KUBECAST_...='\"123456\"'; a secret is better given as \"${env:NAME}\" in the file)";

/// Whether figment found a number or a boolean where it wanted another type.
fn is_scalar_type_error(kind: &figment::error::Kind) -> bool {
    use figment::error::{Actual, Kind};
    matches!(kind, Kind::InvalidType(Actual::Unsigned(_) | Actual::Signed(_) | Actual::Bool(_) | Actual::Float(_), _))
}

/// The environment variables that set the key at `path`, or below it. The path ends at the key
/// figment refused: an unknown section's variables go on (`KUBECAST_CHECKPOINT_KAFKA__TOPIC`),
/// so the variables themselves are named.
fn variables_of(path: &[String]) -> String {
    let var = format!("{ENV_PREFIX}{}", path.join("__").to_uppercase());
    let below = format!("{var}__");
    let mut set: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| *k == var || k.starts_with(&below))
        .collect();
    set.sort();
    if set.is_empty() { var } else { set.join(", ") }
}

/// The value figment found, as the error may show it: only its kind for a key that may hold a
/// secret (a password, token, seed, a Kafka property), which a type error must not print.
fn shown_value(path: &[String], actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    let secret = path.iter().any(|k| {
        let k = k.to_ascii_lowercase();
        k == "properties" || ["password", "token", "seed", "secret", "jaas", "key"].iter().any(|s| k.contains(s))
    });
    if !secret {
        return actual.to_string();
    }
    let kind = match actual {
        Actual::Bool(_) => "a boolean",
        Actual::Unsigned(_) | Actual::Signed(_) => "a whole number",
        Actual::Float(_) => "a number",
        Actual::Str(_) | Actual::Char(_) => "a string",
        Actual::Seq => "a list",
        Actual::Map => "a table",
        _ => "a value of another type",
    };
    format!("{kind} (not shown: the key may hold a secret)")
}

/// What serde calls the expected type, in a user's words (`usize` -> a whole number), and an
/// example of it for the fix.
fn in_words(expected: &str) -> (String, &'static str) {
    let (words, example) = match expected {
        "usize" | "u64" | "u32" | "u16" | "u8" => ("a whole number, 0 or more", " (e.g. 100)"),
        "isize" | "i64" | "i32" | "i16" | "i8" => ("a whole number", " (e.g. 100)"),
        "f64" | "f32" => ("a number", " (e.g. 2.5)"),
        "a sequence" => ("a list", " (e.g. [\"a\", \"b\"])"),
        "a map" => ("a table", ""),
        other if other.starts_with("struct ") => ("a table", ""),
        other => return (other.to_string(), ""),
    };
    (words.to_string(), example)
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
    fn one_underscore_after_a_section_is_refused_other_variables_are_not() {
        let names = [
            "KUBECAST_SINK_TYPE",
            "KUBECAST_CHECKPOINT_KAFKA__TOPIC",
            "KUBECAST_SINK__TYPE",
            "KUBECAST_CONFIG",
            "KUBECAST_LOG_FORMAT",
            "KUBECAST_ENV_NODE",
            "KUBECAST_SINK_",
            "KUBECAST_SINKS_TYPE",
            "OTHER_SINK_TYPE",
            "KUBECAST_cluster_name",
            // A Service `kubecast-admin` (or `kubecast-sink-events`) in the pod's namespace.
            "KUBECAST_ADMIN_SERVICE_HOST",
            "KUBECAST_ADMIN_SERVICE_PORT",
            "KUBECAST_ADMIN_SERVICE_PORT_METRICS",
            "KUBECAST_ADMIN_PORT",
            "KUBECAST_ADMIN_PORT_9090_TCP",
            "KUBECAST_ADMIN_PORT_9090_TCP_ADDR",
            "KUBECAST_SINK_EVENTS_PORT_4222_TCP_PROTO",
            "KUBECAST_SINK_EVENTS_SERVICE_HOST",
            // Not service links.
            "KUBECAST_DELIVERY_PORT_RATE",
        ];
        let problems = single_underscore_overrides(names.iter().map(std::ffi::OsString::from));
        let keys: Vec<&str> = problems.iter().map(|p| p.key.as_str()).collect();
        // `KUBECAST_CHECKPOINT_KAFKA__TOPIC` has a `__`: figment reads it (as `checkpoint_kafka.topic`,
        // an unknown section it then refuses by name).
        assert_eq!(keys, ["cluster.name", "delivery.port_rate", "sink.type"]);
        assert!(problems[2].fix.contains("KUBECAST_SINK__TYPE"), "{:?}", problems[2]);
    }
}
