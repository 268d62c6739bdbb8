//! `type = "nats"`: async-nats, JetStream by default.
//!
//! **JetStream** (`jetstream = true`, default): every event is published with
//! `Nats-Msg-Id` = `<CloudEvent id>@<subject>` and counts as accepted only when its PubAck
//! arrives (with the subject: two `[[resources]]` entries that both see an object send the
//! same event id to their own subjects, and JetStream's duplicate window spans subjects).
//! Publishes are pipelined (one per object at a time, up to `[delivery] max_in_flight` objects
//! at once). A retry or a replay after a crash carries the same `Nats-Msg-Id`, so the stream's
//! duplicate window drops it; a PubAck with `duplicate = true` counts as accepted.
//!
//! **Core NATS** (`jetstream = false`): at-most-once. There is no broker acknowledgement: an
//! event counts as accepted once the client wrote it to the connection (publish + flush).
//! Events in flight when the connection or kubecast dies can be lost.
//!
//! CloudEvents NATS protocol binding: structured mode by default (payload = the JSON event,
//! header `Content-Type: application/cloudevents+json; charset=UTF-8`), binary mode as an
//! option (payload = data, every attribute and extension as a `ce-<name>` header, values
//! percent-encoded as the binding says).
//!
//! Subjects come from a template (see [`clean_subject_token`] for how field values become
//! subject tokens).

mod client;
mod config;
mod encode;
mod permissions;
mod reconnect;
mod url_credentials;

pub use client::NatsSink;
pub use config::{
    DEFAULT_SUBJECT, Mode, NatsConfig, Storage, StreamSettings, TlsSettings, clean_subject_token, subject_problem,
    subject_template, url_problem,
};
pub use encode::encode;
pub use url_credentials::{UrlCredentials, url_credentials};
