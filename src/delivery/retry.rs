//! Retry policy: jittered exponential backoff (backon); `max_attempts = 0` retries forever.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use super::config::DeliveryConfig;

#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    /// `max_event_age_seconds`, if set.
    pub max_age: Option<Duration>,
    min: Duration,
    max: Duration,
}

impl RetryPolicy {
    pub fn new(cfg: &DeliveryConfig) -> Self {
        Self {
            max_attempts: cfg.max_attempts,
            max_age: (cfg.max_event_age_seconds > 0).then(|| Duration::from_secs(cfg.max_event_age_seconds)),
            min: Duration::from_millis(cfg.backoff_min_ms),
            max: Duration::from_millis(cfg.backoff_max_ms),
        }
    }

    /// Delays between attempts of one event.
    pub fn backoff(&self) -> ExponentialBackoff {
        ExponentialBuilder::default()
            .with_min_delay(self.min)
            .with_max_delay(self.max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
    }

    /// Whether an event observed at `observed` is past `max_event_age_seconds`.
    pub fn too_old(&self, observed: &chrono::DateTime<chrono::Utc>) -> bool {
        self.max_age.is_some_and(|max| (chrono::Utc::now() - *observed).to_std().is_ok_and(|age| age >= max))
    }

    /// Whether attempt number `attempt` (1-based) failing retriably leaves attempts.
    pub fn may_retry(&self, attempt: u32) -> bool {
        self.max_attempts == 0 || attempt < self.max_attempts
    }
}
