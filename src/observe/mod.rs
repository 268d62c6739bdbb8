//! What kubecast tells about itself: Prometheus metrics, OpenTelemetry traces per event,
//! health (stream phases, sink reachability) and the admin server that serves them.
//!
//! Invariant: every stage may report here; this folder imports only `model`.

pub mod admin;
pub(crate) mod health;
pub(crate) mod metrics;
pub mod trace;
