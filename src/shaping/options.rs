//! `ShapingOptions`: what shaping reads of one `[[resources]]` entry (`config` builds it from
//! the entry; shaping never reads the config itself).

use serde::{Deserialize, Serialize};

use super::filter::Filter;
use super::json::FieldPath;
use crate::model::{Problem, Verb};

/// `payload`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PayloadMode {
    /// The object (after removals and redaction).
    #[default]
    Full,
    /// `apiVersion`, `kind` and `metadata` only: a reference to the object.
    Metadata,
    /// `modified`: an RFC 6902 JSON Patch from the previous object (needs `keep_previous`);
    /// `added` / `deleted` and a `modified` whose previous object is not known (after a
    /// restart): the full object. The `payload` extension says which.
    Patch,
}

impl PayloadMode {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            PayloadMode::Full => "full",
            PayloadMode::Metadata => "metadata",
            PayloadMode::Patch => "patch",
        }
    }
}

/// `filter_error`: what happens to an event whose filter fails at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FilterErrorRule {
    #[default]
    Deliver,
    Drop,
}

/// The shaping settings of one `[[resources]]` entry (see `config/kubecast.toml`).
#[derive(Debug, Clone, Default)]
pub struct ShapingOptions {
    /// API group (`""` for the core group) and kind: Secrets are redacted.
    pub group: String,
    pub kind: String,
    /// Short description for messages, e.g. `apps/v1 Deployment`.
    pub describe: String,
    /// The verbs that are sent (`events`).
    pub events: Vec<Verb>,
    pub filter: Option<String>,
    pub filter_error: FilterErrorRule,
    pub keep_managed_fields: bool,
    pub redact_secrets: bool,
    pub redact: Vec<String>,
    pub max_event_bytes: u64,
    pub ignore_status_only: bool,
    pub ignore_fields: Vec<String>,
    pub keep_previous: bool,
    pub payload: PayloadMode,
}

impl ShapingOptions {
    /// Whether `events` lists `verb`.
    pub fn wants(&self, verb: Verb) -> bool {
        self.events.contains(&verb)
    }

    /// Problems with these options; keys relative to the `[[resources]]` entry.
    pub fn problems(&self) -> Vec<Problem> {
        let r = self;
        let mut out = Vec::new();
        if let Some(f) = &r.filter
            && let Err(e) = Filter::compile(f, r.keep_previous)
        {
            out.push(Problem::new("filter", e.0, "see the CEL examples in config/kubecast.toml"));
        }
        for (key, paths) in [("redact", &r.redact), ("ignore_fields", &r.ignore_fields)] {
            for (i, p) in paths.iter().enumerate() {
                if let Err(e) = FieldPath::parse(p) {
                    out.push(Problem::new(
                        format!("{key}[{i}]"),
                        e,
                        "write a dotted path like \"spec.password\" or \"data.*\"",
                    ));
                }
            }
        }
        if !r.ignore_fields.is_empty() && !r.ignore_status_only {
            out.push(Problem::new(
                "ignore_fields",
                "is only used with ignore_status_only = true",
                "set ignore_status_only = true, or remove ignore_fields",
            ));
        }
        if r.payload == PayloadMode::Patch && !r.keep_previous {
            out.push(Problem::new(
                "payload",
                "\"patch\" needs the previous object: keep_previous = true",
                "set keep_previous = true (memory: one copy of each object), or use payload = \"full\"",
            ));
        }
        if r.max_event_bytes != 0 && r.max_event_bytes < 1024 {
            out.push(Problem::new(
                "max_event_bytes",
                format!("{} is too small for even a metadata payload", r.max_event_bytes),
                "use at least 1024, or 0 for no cap",
            ));
        }
        out
    }
}
