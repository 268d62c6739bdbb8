//! Delays between NATS connection attempts: the first attempt of a reconnection at once, then
//! 50 ms doubling up to 2.5 s, each plus a random jitter of up to as much again (backon), so
//! at most 5 s; forever. Started over after each successful connection.

use std::sync::Mutex;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

const MIN: Duration = Duration::from_millis(50);
const MAX: Duration = Duration::from_millis(2500);

/// async-nats asks for a delay before each attempt, with the number of consecutive attempts
/// (1 for the first after a connection was lost or before the first one).
#[derive(Default)]
pub(super) struct ReconnectDelay(Mutex<Option<ExponentialBackoff>>);

impl ReconnectDelay {
    pub(super) fn before(&self, attempts: usize) -> Duration {
        let mut backoff = self.0.lock().expect("reconnect backoff lock");
        if attempts <= 1 {
            *backoff = None;
            return Duration::ZERO;
        }
        backoff
            .get_or_insert_with(|| {
                ExponentialBuilder::default()
                    .with_min_delay(MIN)
                    .with_max_delay(MAX)
                    .with_factor(2.0)
                    .with_jitter()
                    .without_max_times()
                    .build()
            })
            .next()
            .unwrap_or(MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_once_then_doubling_jittered_up_to_five_seconds_and_again_after_a_connection() {
        let delay = ReconnectDelay::default();
        for round in 0..2 {
            assert_eq!(delay.before(1), Duration::ZERO, "round {round}: the first attempt at once");
            let delays: Vec<Duration> = (2..40).map(|n| delay.before(n)).collect();
            let mut base = MIN;
            for (i, d) in delays.iter().enumerate() {
                assert!(
                    *d >= base && *d < base * 2,
                    "round {round}, attempt {}: {d:?} not in [{base:?}, {:?})",
                    i + 2,
                    base * 2
                );
                base = (base * 2).min(MAX);
            }
            assert!(delays.iter().all(|d| *d < MAX * 2), "at most 5 s");
            // Jittered: the delays at the cap are not all the same.
            let capped: std::collections::BTreeSet<Duration> = delays[10..].iter().copied().collect();
            assert!(capped.len() > 1, "round {round}: no jitter: {capped:?}");
        }
    }
}
