//! `type = "http"`: CloudEvents over HTTP POST, as Knative's data plane sends them (a Knative
//! broker or channel, a webhook, a function).
//!
//! An event is accepted on a 2xx response. 404, 408, 409, 429, 5xx, timeouts and connection
//! failures are retried with the delivery backoff (a `Retry-After` on 429 and 503 waited for,
//! up to `retry_after_max_seconds`); 401, 403 and redirects refuse every event (held, named
//! on `/readyz`, never dead-lettered); any other status goes to the dead letter with the status
//! and the start of the response body. One event per object in flight, as for every sink, and
//! at most `[delivery] max_in_flight` requests in flight in the process. Responses carry no
//! reply event (no `Prefer: reply`); their bodies are read and dropped.
//!
//! The URL is `url`, or Knative's `K_SINK`; `K_CE_OVERRIDES` adds its extensions to every
//! event (applied with the rest of the event's form, `crate::shaping::form`).

mod client;
mod config;
mod encode;
mod tls;
mod token;
mod verdict;

pub use client::HttpSink;
pub use config::{Format, HttpConfig, HttpVersion, K_CE_OVERRIDES, K_SINK, Mode, overrides_from_env, parse_overrides};
pub use encode::encode;
