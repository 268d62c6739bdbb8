//! Retry policy: jittered exponential backoff (backon); `max_attempts = 0` retries forever.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

use super::config::DeliveryConfig;

#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    min: Duration,
    max: Duration,
}

impl RetryPolicy {
    pub fn new(cfg: &DeliveryConfig) -> Self {
        Self {
            max_attempts: cfg.max_attempts,
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

    /// Whether attempt number `attempt` (1-based) failing retriably leaves attempts.
    pub fn may_retry(&self, attempt: u32) -> bool {
        self.max_attempts == 0 || attempt < self.max_attempts
    }
}
