//! Publish permissions the NATS server refused. A publish on a subject the user may not publish
//! on is not answered: the server reports `Permissions Violation for Publish to "<subject>"`
//! on the connection, apart from the publish, whose PubAck then never comes. The connection's
//! events note each refused subject here, and a publish whose acknowledgement failed on a
//! subject refused shortly before is a set-up mistake ([`Refusal::SubjectNotPermitted`]),
//! not a slow server.
//!
//! [`Refusal::SubjectNotPermitted`]: crate::model::Refusal::SubjectNotPermitted

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a refusal counts: longer than a publish waits for its PubAck.
const REMEMBERED: Duration = Duration::from_secs(120);

/// The subjects the server refused to let this connection publish on, and when.
#[derive(Clone, Default)]
pub struct Refused(Arc<Mutex<HashMap<String, (Instant, String)>>>);

/// The subject of a publish permission violation the server reported, if `message` is one.
pub fn denied_publish(message: &str) -> Option<String> {
    const MARK: &str = "permissions violation for publish to";
    let at = message.to_ascii_lowercase().find(MARK)?;
    let rest = message[at + MARK.len()..].trim().trim_matches(['"', '\'', ' ']);
    let subject = rest.split(['"', '\'', ' ']).next().unwrap_or_default();
    (!subject.is_empty()).then(|| subject.to_string())
}

impl Refused {
    /// Notes a server error; true when it was a publish permission violation.
    pub fn note(&self, message: &str) -> bool {
        let Some(subject) = denied_publish(message) else { return false };
        let mut map = self.0.lock().expect("refused subjects");
        map.retain(|_, (at, _)| at.elapsed() < REMEMBERED);
        map.insert(subject, (Instant::now(), message.to_string()));
        true
    }

    /// The server's words, when it refused a publish on `subject` recently.
    pub fn recent(&self, subject: &str) -> Option<String> {
        let map = self.0.lock().expect("refused subjects");
        map.get(subject).filter(|(at, _)| at.elapsed() < REMEMBERED).map(|(_, said)| said.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permission_violations_name_their_subject() {
        assert_eq!(
            denied_publish("Permissions Violation for Publish to \"denied.shop\"").as_deref(),
            Some("denied.shop")
        );
        assert_eq!(denied_publish("permissions violation for publish to denied.a").as_deref(), Some("denied.a"));
        assert_eq!(denied_publish("Permissions Violation for Subscription to \"x\""), None);
        assert_eq!(denied_publish("authorization violation"), None);
        let r = Refused::default();
        assert!(r.note("Permissions Violation for Publish to \"denied.shop\""));
        assert!(!r.note("slow consumer"));
        assert!(r.recent("denied.shop").unwrap().contains("Permissions Violation"));
        assert_eq!(r.recent("allowed.shop"), None);
    }
}
