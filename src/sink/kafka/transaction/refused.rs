//! While a record's destination refuses every record ([`TxnError::RecordRefused`]: a topic that
//! does not exist, a Write permission not granted): no commit is tried before a pause ends,
//! doubling at each refusal from 1 s up to 30 s, and the refusal is said again meanwhile.

use std::time::{Duration, Instant};

use tracing::warn;

use super::error::TxnError;

/// The longest pause between two commits while a record's destination refuses every record.
const MAX: Duration = Duration::from_secs(30);

/// The pause: until when, how long it was, and the refusal.
#[derive(Debug, Default)]
pub(super) struct Refused(Option<(Instant, Duration, TxnError)>);

impl Refused {
    /// The refusal to return instead of trying to commit, while the pause lasts.
    pub(super) fn pausing(&self) -> Option<TxnError> {
        self.0.as_ref().filter(|(until, _, _)| Instant::now() < *until).map(|(_, _, e)| e.clone())
    }

    /// After a commit of `what` holding `events`: a refusal starts or doubles the pause, a
    /// success ends it.
    pub(super) fn after(&mut self, result: &Result<(), TxnError>, what: &str, events: usize) {
        match result {
            Err(e @ TxnError::RecordRefused { .. }) => {
                let pause = self.0.as_ref().map_or(Duration::from_secs(1), |(_, p, _)| (*p * 2).min(MAX));
                warn!(error = %e, retry_in = ?pause, events, "{what}: a record's destination refuses every record (a set-up mistake); the transaction is aborted and its events kept, nothing is committed until it is fixed");
                self.0 = Some((Instant::now() + pause, pause, e.clone()));
            }
            Ok(()) => self.0 = None,
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Refusal;

    #[test]
    fn the_pause_doubles_up_to_thirty_seconds_and_a_commit_ends_it() {
        let refused = || {
            Err(TxnError::RecordRefused {
                refusal: Refusal::MissingTopic,
                destination: "Kafka topic \"t\"".into(),
                events: 1,
                reason: "t".into(),
            })
        };
        let mut r = Refused::default();
        assert!(r.pausing().is_none());
        let mut pauses = Vec::new();
        for _ in 0..7 {
            r.after(&refused(), "p", 1);
            pauses.push(r.0.as_ref().unwrap().1.as_secs());
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 30, 30]);
        assert!(matches!(r.pausing(), Some(TxnError::RecordRefused { .. })));
        r.after(&Err(TxnError::Retriable("x".into())), "p", 1);
        assert!(r.pausing().is_some(), "another error leaves the pause as it is");
        r.after(&Ok(()), "p", 1);
        assert!(r.pausing().is_none());
    }
}
