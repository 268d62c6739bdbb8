//! The dead-letter destination: where an event goes when the sink will never accept it (too
//! large, not authorized, cannot be encoded) or `max_attempts` ran out. The event's stream then
//! goes on with the object's later events: the dead-lettered event is missing from the
//! destination, in its place (order of the rest is kept). A dead letter that cannot be written
//! is retried forever: an accepted event is never dropped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use rdkafka::message::{Header, OwnedHeaders};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;
use tracing::{error, warn};

use super::config::{DeadLetterConfig, DeadLetterType};
use super::retry::RetryPolicy;
use crate::sink::{NatsSink, Outbound, SendError, Sink, kafka};

pub enum Target {
    File { path: PathBuf, file: Mutex<Option<tokio::fs::File>> },
    Broker { topic: String },
    Stop,
}

pub struct DeadLetter {
    target: Target,
    retry: RetryPolicy,
    count: AtomicU64,
}

/// A permanent failure with `[delivery.dead_letter] type = "stop"`.
#[derive(Debug, thiserror::Error)]
#[error(
    "event {id} cannot be delivered to {destination}: {reason}; stopping because [delivery.dead_letter] type = \"stop\" (fix: correct the cause, or configure a dead letter)"
)]
pub struct Undeliverable {
    pub id: String,
    pub destination: String,
    pub reason: String,
}

impl DeadLetter {
    pub fn new(cfg: &DeadLetterConfig, checkpoint_dir: &std::path::Path, retry: RetryPolicy) -> Self {
        let target = match cfg.kind {
            DeadLetterType::File => Target::File {
                path: cfg.path.clone().unwrap_or_else(|| checkpoint_dir.join("dead-letter.jsonl")),
                file: Mutex::new(None),
            },
            DeadLetterType::Broker => Target::Broker { topic: cfg.destination.clone().unwrap_or_default() },
            DeadLetterType::Stop => Target::Stop,
        };
        Self { target, retry, count: AtomicU64::new(0) }
    }

    /// How many events went to the dead letter since start.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes `msg` with `reason`; returns when it is stored (retrying as long as it takes).
    pub async fn put(&self, sink: &Sink, msg: &Outbound, reason: &str) -> Result<(), Undeliverable> {
        let destination = sink.destination(msg);
        let id = msg.event.id().to_string();
        if let Target::Stop = self.target {
            return Err(Undeliverable { id, destination, reason: reason.to_string() });
        }
        error!(event_id = %id, trace_id = %crate::observe::trace::trace_id(msg.trace.as_ref()), destination = %destination, reason, "event cannot be delivered; writing it to the dead letter");
        let mut backoff = self.retry.backoff();
        loop {
            let result = match &self.target {
                Target::File { path, file } => self.write_file(path, file, msg, &destination, reason).await,
                Target::Broker { topic } => self.write_broker(sink, topic, msg, &destination, reason).await,
                Target::Stop => unreachable!(),
            };
            match result {
                Ok(()) => {
                    self.count.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) => {
                    warn!(event_id = %id, error = %e, "dead letter not written; retrying");
                    tokio::time::sleep(backoff.next().unwrap_or(std::time::Duration::from_secs(30))).await;
                }
            }
        }
    }

    async fn write_file(
        &self,
        path: &PathBuf,
        file: &Mutex<Option<tokio::fs::File>>,
        msg: &Outbound,
        destination: &str,
        reason: &str,
    ) -> Result<(), String> {
        let mut guard = file.lock().await;
        if guard.is_none() {
            let f = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .await
                .map_err(|e| format!("{}: {e}", path.display()))?;
            *guard = Some(f);
        }
        // {"reason":..,"destination":..,"failed_at":..,"event":<the structured event>}
        let mut line = serde_json::to_vec(&json!({
            "reason": reason,
            "destination": destination,
            "failed_at": chrono::Utc::now().to_rfc3339(),
        }))
        .map_err(|e| e.to_string())?;
        line.pop();
        line.extend_from_slice(b",\"event\":");
        line.extend_from_slice(&msg.event.to_structured());
        line.extend_from_slice(b"}\n");
        let f = guard.as_mut().expect("opened above");
        f.write_all(&line).await.map_err(|e| format!("{}: {e}", path.display()))?;
        f.flush().await.map_err(|e| format!("{}: {e}", path.display()))
    }

    async fn write_broker(
        &self,
        sink: &Sink,
        topic: &str,
        msg: &Outbound,
        destination: &str,
        reason: &str,
    ) -> Result<(), String> {
        if let Some(n) = sink.nats() {
            return write_nats(n, topic, msg, destination, reason).await;
        }
        let Some(k) = sink.kafka() else { return Err("the dead letter type \"broker\" needs a broker sink".into()) };
        let headers = |h: OwnedHeaders| {
            h.insert(Header { key: "kubecast_dead_letter_reason", value: Some(reason) })
                .insert(Header { key: "kubecast_original_destination", value: Some(destination) })
        };
        let (payload, h) = kafka::encode(&msg.event, kafka::Mode::Structured);
        match k.send_raw(topic, msg.key(), &payload, headers(h)).await {
            Ok(()) => Ok(()),
            // Too large for the dead-letter topic as well: keep the event's attributes only.
            Err(SendError::Permanent(_)) => {
                let (_, h) = kafka::encode(&msg.event, kafka::Mode::Structured);
                let h = h.insert(Header { key: "kubecast_data_dropped", value: Some("true") });
                let payload = msg.event.to_structured_without_data();
                k.send_raw(topic, msg.key(), &payload, headers(h)).await.map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// NATS: the structured event on subject `subject`, with headers `Kubecast-Dead-Letter-Reason`
/// and `Kubecast-Original-Destination` (and `Kubecast-Data-Dropped: true` when even the
/// dead-letter subject refuses the event's size).
async fn write_nats(
    n: &NatsSink,
    subject: &str,
    msg: &Outbound,
    destination: &str,
    reason: &str,
) -> Result<(), String> {
    let one_line = |s: &str| s.replace(['\r', '\n'], " ");
    let headers = || {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Content-Type", "application/cloudevents+json; charset=UTF-8");
        h.insert("Kubecast-Dead-Letter-Reason", one_line(reason).as_str());
        h.insert("Kubecast-Original-Destination", destination);
        h
    };
    let id = msg.event.id();
    let payload = bytes::Bytes::from(msg.event.to_structured());
    match n.publish(subject.to_string(), headers(), payload, id).await {
        Ok(()) => Ok(()),
        Err(SendError::Permanent(_)) => {
            let mut h = headers();
            h.insert("Kubecast-Data-Dropped", "true");
            let payload = bytes::Bytes::from(msg.event.to_structured_without_data());
            n.publish(subject.to_string(), h, payload, id).await.map_err(|e| e.to_string())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Unit tests: the file and stop dead letters; with the stub sink (`tests.rs` in the folder of this file's name).
#[cfg(test)]
mod tests;
