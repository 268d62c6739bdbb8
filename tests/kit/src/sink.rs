//! Reading what kubecast emitted: the file sink's JSON lines, one CloudEvent (structured
//! mode) per line.

use std::path::Path;

use serde_json::Value;

/// Every event of the file sink at `path` (none if it does not exist yet), parsed.
pub fn read_events(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    // A line not ended yet is being written (a read sees a large write in part): read next time.
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("sink line is not JSON ({e}): {l}")))
        .collect()
}

/// One line per event: type, subject, id, origin (for assertion messages).
pub fn pretty(evs: &[Value]) -> String {
    evs.iter()
        .map(|e| format!("  {} {} {} origin={}", e["type"], e["subject"], e["id"], e["origin"]))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Events whose subject is `subject`.
pub fn about<'a>(evs: &'a [Value], subject: &str) -> Vec<&'a Value> {
    evs.iter().filter(|e| e["subject"] == subject).collect()
}

/// The verb (last segment of `type`) of an event.
pub fn verb(e: &Value) -> &str {
    e["type"].as_str().unwrap().rsplit('.').next().unwrap()
}

/// `evs` without the events about `subject` (e.g. a barrier of [`crate::settle`]).
pub fn without(evs: &[Value], subject: &str) -> Vec<Value> {
    evs.iter().filter(|e| e["subject"] != subject).cloned().collect()
}
