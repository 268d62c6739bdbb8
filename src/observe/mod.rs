//! What kubecast tells about itself: Prometheus metrics, OpenTelemetry traces per event,
//! health (stream phases, sink reachability), the admin server that serves them, and the
//! apiserver's errors in words for logs (`kube_error`).
//!
//! Invariant: every stage may report here; this folder imports only `model`.

pub mod admin;
pub mod health;
pub(crate) mod kube_error;
pub(crate) mod metrics;
pub mod refusals;
pub mod trace;
