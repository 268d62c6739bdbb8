//! The outbound queue between the reflectors and the sink: per-object order, a bounded
//! number of queued and in-flight events, a shared rate limit, retries with backoff, and a
//! dead-letter destination for events that can never be delivered. Acknowledgements flow back
//! to each stream's watermark (`state/watermark.rs`).
//!
//! Stages around the sink's one `send` (tower style), each separable:
//! `queue` (order + bounds) -> `limit` (governor) -> `retry` (backoff) -> `Sink::send`
//! -> on a permanent failure `dead_letter`.

//! Invariant: at most one event per object is in flight, so an object's events leave in the
//! order they came, also under retries; every job is acknowledged exactly once.

mod config;
pub(crate) mod dead_letter;
mod error;
pub(crate) mod queue;
pub(crate) mod retry;
#[cfg(test)]
mod testkit;

pub use config::{DeadLetterConfig, DeadLetterType, DeliveryConfig};
pub use error::{DeliveryError, Undeliverable};
