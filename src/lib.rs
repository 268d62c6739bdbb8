//! kubecast: Kubernetes changes as CloudEvents. See ARCHITECTURE.md for the code map.
//!
//! The folders follow the data flow, and each imports only those before it in this list
//! (`tests/layers.rs` checks it):
//!
//! ```text
//! model     the data and its contracts (change, CloudEvent, position, Problem)
//! observe   metrics, traces, health, the admin server
//! source    apiserver client, watch, reflector (list + watch, resume, relist-diff)
//! sink      stdout | file | kafka | nats
//! state     watermark, checkpoint store, persister
//! coordination  the Lease of the active process, shard members, assignment, count changes
//! delivery  queue (order, limits), retry, dead letter
//! shaping   the shaping stage: filters, redaction, payload, CloudEvent per change
//! config    the TOML file: gathers every component's settings
//! app       the binary's commands, wiring, supervision, shutdown
//! ```

//!
//! The public surface is what the binary (`main.rs`: `app::cli`, `app::allocator`,
//! `app::run`, `config::Config`, `observe::trace::init`), the benchmarks and examples
//! (`app::wiring::Pipeline` to drive the stages after the reflectors, `source::reflector::Item`
//! to feed them, `model` to build changes, `sink::Sink` and the Kafka/NATS encoders,
//! `shaping::Shaper`, `source::watch::decode_line`, `state::watermark::Watermark`) and the
//! configuration's types need. The integration tests run the binary and use none of it.
//! Everything else is `pub(crate)`.

pub mod app;
pub mod config;
pub mod coordination;
pub mod delivery;
pub mod model;
pub mod observe;
pub mod shaping;
pub mod sink;
pub mod source;
pub mod state;
