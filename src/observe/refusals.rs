//! Destinations that refuse every event, while they do: a mistake in the set-up
//! ([`Refusal`]: a missing topic or stream, a permission not granted). The delivery queue
//! holds each such event (retried with backoff, never dead-lettered) with a [`RefusalHold`];
//! `/readyz` names each refused destination with the cause and the fix, and
//! `kubecast_sink_refused{reason}` counts the events held. A hold ends when its event is
//! delivered (or the delivery stops): nothing is left behind to clear.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::model::Refusal;

use super::metrics::{self, Reason};

/// The destinations refused now, with the events held for each.
#[derive(Debug, Default)]
pub struct Refusals {
    held: Mutex<BTreeMap<(String, Refusal), Held>>,
}

#[derive(Debug)]
struct Held {
    events: usize,
    /// The broker's last words about it.
    detail: String,
    since: Instant,
}

impl Refusals {
    /// One more event waits because `destination` refuses it for `refusal` (`detail`: the
    /// broker's words). Held until the returned hold is dropped.
    pub fn hold(self: &Arc<Self>, destination: &str, refusal: Refusal, detail: &str) -> RefusalHold {
        self.hold_many(destination, refusal, detail, 1)
    }

    /// `events` more events wait because `destination` refuses them (exactly-once: the events
    /// of a transaction that cannot commit). Held until the returned hold is dropped.
    pub fn hold_many(
        self: &Arc<Self>,
        destination: &str,
        refusal: Refusal,
        detail: &str,
        events: usize,
    ) -> RefusalHold {
        let key = (destination.to_string(), refusal);
        {
            let mut held = self.held.lock().expect("refusals lock");
            let h = held.entry(key.clone()).or_insert_with(|| Held {
                events: 0,
                detail: String::new(),
                since: Instant::now(),
            });
            h.events += events;
            h.detail = detail.to_string();
        }
        gauge(refusal).inc_by(i64::try_from(events).unwrap_or(i64::MAX));
        RefusalHold { refusals: self.clone(), key, events }
    }

    /// Whether any destination refuses events now.
    pub fn any(&self) -> bool {
        !self.held.lock().expect("refusals lock").is_empty()
    }

    /// One line per refused destination, for `/readyz`.
    pub fn describe(&self) -> Vec<String> {
        self.held
            .lock()
            .expect("refusals lock")
            .iter()
            .map(|((destination, refusal), h)| {
                format!(
                    "sink: {destination} refuses every event: {} ({}); {} event(s) held in order for {} s, none dead-lettered, delivery resumes by itself once fixed (fix: {})",
                    refusal.what(),
                    h.detail,
                    h.events,
                    h.since.elapsed().as_secs(),
                    refusal.fix()
                )
            })
            .collect()
    }

    fn release(&self, key: &(String, Refusal), events: usize) {
        let mut held = self.held.lock().expect("refusals lock");
        if let Some(h) = held.get_mut(key) {
            h.events = h.events.saturating_sub(events);
            if h.events == 0 {
                held.remove(key);
            }
        }
        drop(held);
        gauge(key.1).dec_by(i64::try_from(events).unwrap_or(i64::MAX));
    }
}

fn gauge(refusal: Refusal) -> prometheus_client::metrics::gauge::Gauge {
    metrics::get().sink_refused.get_or_create(&Reason { reason: refusal.label() }).clone()
}

/// One event held by a refusal; dropping it releases the event from the count.
#[derive(Debug)]
pub struct RefusalHold {
    refusals: Arc<Refusals>,
    key: (String, Refusal),
    events: usize,
}

impl RefusalHold {
    /// Whether this hold is for `destination` refusing for `refusal`.
    pub fn is_for(&self, destination: &str, refusal: Refusal) -> bool {
        self.key.0 == destination && self.key.1 == refusal
    }

    /// The broker's newest words about it.
    pub fn update(&self, detail: &str) {
        if let Some(h) = self.refusals.held.lock().expect("refusals lock").get_mut(&self.key) {
            h.detail = detail.to_string();
        }
    }
}

impl Drop for RefusalHold {
    fn drop(&mut self) {
        self.refusals.release(&self.key, self.events);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_is_refused_while_any_of_its_events_is_held() {
        let r = Arc::new(Refusals::default());
        assert!(!r.any() && r.describe().is_empty());
        let one = r.hold("topic t", Refusal::MissingTopic, "Unknown topic or partition");
        let two = r.hold("topic t", Refusal::MissingTopic, "Unknown topic or partition (again)");
        let other = r.hold("topic u", Refusal::TopicNotAuthorized, "Topic authorization failed");
        let lines = r.describe();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("sink: topic t refuses every event: the topic does not exist"), "{lines:?}");
        assert!(lines[0].contains("(again)") && lines[0].contains("2 event(s) held"), "{lines:?}");
        assert!(lines[0].contains("fix: create the topic"), "{lines:?}");
        assert!(lines[1].contains("may not write to the topic") && lines[1].contains("kafka-acls"), "{lines:?}");
        assert!(one.is_for("topic t", Refusal::MissingTopic) && !one.is_for("topic t", Refusal::MissingStream));
        drop(one);
        assert_eq!(r.describe().len(), 2);
        drop(two);
        assert_eq!(r.describe().len(), 1);
        other.update("Topic authorization failed (principal User:limited)");
        assert!(r.describe()[0].contains("User:limited"));
        drop(other);
        assert!(!r.any());
        let many = r.hold_many("topic t", Refusal::MissingTopic, "Unknown topic", 40);
        assert!(r.describe()[0].contains("40 event(s) held"), "{:?}", r.describe());
        drop(many);
        assert!(!r.any());
    }
}
