//! Where changes come from: the apiserver client and its rate limiter (`client`), selector
//! checks (`selector`), the watch request and its line decoding (`watch`) and the reflector,
//! one list+watch state machine per stream (`reflector`).
//!
//! Invariant: a stream's items are numbered in the order its changes happened, and nothing in
//! this folder moves a stream's position itself: it emits the effect of each item, and the
//! state folder applies it once the item is acknowledged.

pub mod api_request;
pub mod client;
pub mod connect;
pub mod gather;
pub mod reflector;
pub(crate) mod selector;
pub mod sharding;
pub mod watch;
