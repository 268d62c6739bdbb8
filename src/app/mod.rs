//! The binary's side: the command line (`cli`), the allocator's settings (`allocator`), the
//! async runtime (`runtime`), and `kubecast run`: its wiring (`wiring`, also used by the benchmarks), start-up checks
//! (`preflight`), supervision (`supervise`) and shutdown (`shutdown`), put together in `run`.
//! `kubecast state` (see, reset and move the stored state) is `state_cmd`; `kubecast dead-letter`
//! (list the dead letter, send it again) is `dead_letter_cmd`.
//!
//! Invariant: only this folder (and `main.rs`) knows every stage; nothing in `src/` imports it.

mod active;
pub mod allocator;
pub mod bounds;
pub mod cli;
pub mod connect_check;
mod count_watch;
pub mod dead_letter_cmd;
pub mod ephemeral;
mod error;
pub mod leadership;
mod preflight;
pub mod run;
pub mod runtime;
mod shards;
mod shutdown;
pub mod state_cmd;
mod store;
mod supervise;
pub mod wiring;

/// The process's TLS crypto for every rustls client built without one of its own (the
/// OpenTelemetry exporter's HTTP client): ring, as the apiserver client and the HTTP sink use.
/// Without it such a client would panic when built.
pub fn tls_provider() {
    // Err: one was installed before (a second call); it is kept.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
