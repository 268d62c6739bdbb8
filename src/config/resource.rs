//! `[[resources]]`: what to watch, and how its changes are shaped and routed.

use serde::{Deserialize, Serialize};

use crate::model::{Problem, Verb};
use crate::shaping::{FilterErrorRule, PayloadMode, ShapingOptions};
use crate::sink::SinkType;
use crate::source::client::is_dns_label;
use crate::source::reflector::{Initial, MissingKind};
use crate::source::selector;

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
            SinkType::Stdout | SinkType::File | SinkType::Http => None,
        }
    }

    /// Short human description, e.g. `apps/v1 Deployment`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.api_version, self.kind)
    }

    /// What shaping reads of this entry.
    pub fn shaping(&self) -> ShapingOptions {
        let (group, _) = self.group_version();
        ShapingOptions {
            group: group.to_string(),
            kind: self.kind.clone(),
            describe: self.describe(),
            events: self.events.clone(),
            filter: self.filter.clone(),
            filter_error: self.filter_error,
            keep_managed_fields: self.keep_managed_fields,
            redact_secrets: self.redact_secrets,
            redact: self.redact.clone(),
            max_event_bytes: self.max_event_bytes,
            ignore_status_only: self.ignore_status_only,
            ignore_fields: self.ignore_fields.clone(),
            keep_previous: self.keep_previous,
            payload: self.payload,
        }
    }

    /// Problems with this entry, keys relative to it (`kind`, `namespaces[0]`...); `sink`: the
    /// configured sink type (`topic` and `subject` belong to one each).
    pub fn problems(&self, sink: SinkType) -> Vec<Problem> {
        let r = self;
        let mut out = Vec::new();
        if !is_api_version(&r.api_version) {
            out.push(Problem::new(
                "api_version",
                format!("{:?} is not \"group/version\" or \"v1\"", r.api_version),
                "write e.g. \"v1\", \"apps/v1\" or \"example.com/v1alpha1\"",
            ));
        }
        if r.kind.trim().is_empty() {
            out.push(Problem::new("kind", "must not be empty", "set the Kind name, e.g. \"ConfigMap\""));
        } else if !r.kind.chars().all(|c| c.is_ascii_alphanumeric())
            || !r.kind.starts_with(|c: char| c.is_ascii_uppercase())
        {
            out.push(Problem::new(
                "kind",
                format!("{:?} is not a Kind name", r.kind),
                "use the CamelCase Kind as in the object's `kind` field, e.g. \"ConfigMap\", not the plural resource name",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (j, ns) in r.namespaces.iter().enumerate() {
            if !is_dns_label(ns) {
                out.push(Problem::new(
                    format!("namespaces[{j}]"),
                    format!("{ns:?} is not a valid namespace name"),
                    "use a DNS label (lower-case letters, digits, '-'); an empty list means all namespaces",
                ));
            } else if !seen.insert(ns) {
                out.push(Problem::new(
                    format!("namespaces[{j}]"),
                    format!("{ns:?} is listed twice"),
                    "list each namespace once",
                ));
            }
        }
        if let Err(e) = selector::validate_label_selector(&r.label_selector) {
            out.push(Problem::new(
                "label_selector",
                format!("{:?}: {e}", r.label_selector),
                "use Kubernetes label selector syntax, e.g. \"app=web,tier in (a,b),!canary\"",
            ));
        }
        if let Err(e) = selector::validate_field_selector(&r.field_selector) {
            out.push(Problem::new(
                "field_selector",
                format!("{:?}: {e}", r.field_selector),
                "use Kubernetes field selector syntax, e.g. \"metadata.name=foo,status.phase!=Running\"",
            ));
        }
        if !(1..=100_000).contains(&r.page_size) {
            out.push(Problem::new(
                "page_size",
                format!("{} is out of range", r.page_size),
                "use 1 to 100000; the default is 500",
            ));
        }
        if let Some(t) = &r.topic {
            if sink != SinkType::Kafka {
                out.push(Problem::new(
                    "topic",
                    format!("is only used by the kafka sink, but sink.type = \"{}\"", sink),
                    if sink == SinkType::Nats { "use `subject` for NATS" } else { "remove it" },
                ));
            } else if let Err(e) = crate::sink::kafka::topic_template(t) {
                out.push(Problem::new("topic", e, "use a template like \"kubecast.{cluster}.{resource}\""));
            }
        }
        if let Some(t) = &r.subject {
            if sink != SinkType::Nats {
                out.push(Problem::new(
                    "subject",
                    format!("is only used by the nats sink, but sink.type = \"{}\"", sink),
                    if sink == SinkType::Kafka { "use `topic` for Kafka" } else { "remove it" },
                ));
            } else if let Err(e) = crate::sink::nats::subject_template(t) {
                out.push(Problem::new(
                    "subject",
                    e,
                    "use a template like \"kubecast.{cluster}.{resource}.{namespace}\"",
                ));
            }
        }
        if r.rate_per_second == Some(0) {
            out.push(Problem::new("rate_per_second", "must be at least 1", "remove it for no per-resource limit"));
        }
        out.extend(self.shaping().problems());
        if r.events.is_empty() {
            out.push(Problem::new(
                "events",
                "is empty: no event would ever be emitted",
                "list some of \"added\", \"modified\", \"deleted\", or remove the key for all three",
            ));
        }
        out
    }
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
    fn api_version_forms() {
        assert!(is_api_version("v1"));
        assert!(is_api_version("apps/v1"));
        assert!(is_api_version("example.kubecast.io/v1alpha1"));
        assert!(!is_api_version("apps"));
        assert!(!is_api_version("/v1"));
        assert!(!is_api_version("Apps/v1"));
    }
}
