//! kubecast: Kubernetes changes as CloudEvents. See ARCHITECTURE.md for the data flow.

pub mod ack;
pub mod admin;
pub mod allocator;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod event;
pub mod json_check;
pub mod kubeapi;
pub mod metrics;
pub mod object;
pub mod pipeline;
pub mod reflector;
pub mod selector;
pub mod shaping;
pub mod sink;
pub mod telemetry;
pub mod watch;
