//! The dead-letter destination: where an event goes when the sink will never accept it (too
//! large, not authorized, cannot be encoded) or `max_attempts` ran out. The event's stream then
//! goes on with the object's later events: the dead-lettered event is missing from the
//! destination, in its place (order of the rest is kept). A dead letter that cannot be written
//! is retried (`[delivery] max_attempts` times, 0 = as long as it takes), then kubecast stops
//! with the checkpoint before the event: an accepted event is never dropped. The destination
//! is checked at start ([`DeadLetter::check`]). The file dead letter is the file sink's writer:
//! a line counts once it is fsynced, and a write cut short is cut back.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rdkafka::message::{Header, OwnedHeaders};
use serde_json::json;
use tokio::sync::OnceCell;
use tracing::{error, warn};

use super::config::{DeadLetterConfig, DeadLetterType};
use super::error::{DeliveryError, Undeliverable};
use super::retry::RetryPolicy;
use crate::observe::refusals::{RefusalHold, Refusals};
use crate::sink::{FileSink, NatsSink, Outbound, SendError, Sink, kafka};

pub enum Target {
    File {
        path: PathBuf,
        /// The process's one writer of `path` ([`shared_file`]).
        file: Arc<OnceCell<FileSink>>,
    },
    Broker {
        topic: String,
    },
    Stop,
}

/// The writer of the dead-letter file at `path`, one per process: a sharded process runs a
/// pipeline (and a dead letter) per shard, all with the same file, and two writers of one file
/// would each cut it back to their own idea of its end after a failed write, cutting off lines
/// the other wrote (events already counted as dead-lettered). Kept while a dead letter uses it.
fn shared_file(path: &std::path::Path) -> Arc<OnceCell<FileSink>> {
    static FILES: Mutex<BTreeMap<PathBuf, Weak<OnceCell<FileSink>>>> = Mutex::new(BTreeMap::new());
    let mut files = FILES.lock().expect("dead-letter files lock");
    files.retain(|_, cell| cell.strong_count() > 0);
    if let Some(cell) = files.get(path).and_then(Weak::upgrade) {
        return cell;
    }
    let cell = Arc::new(OnceCell::new());
    files.insert(path.to_path_buf(), Arc::downgrade(&cell));
    cell
}

pub struct DeadLetter {
    target: Target,
    retry: RetryPolicy,
    count: AtomicU64,
    /// Where a dead-letter destination that refuses every event (a missing topic or stream, a
    /// permission not granted) is reported while the event waits for it.
    refusals: Arc<Refusals>,
}

impl DeadLetter {
    pub fn new(cfg: &DeadLetterConfig, checkpoint_dir: &std::path::Path, retry: RetryPolicy) -> Self {
        let target = match cfg.kind {
            DeadLetterType::File => {
                let path = cfg.path.clone().unwrap_or_else(|| checkpoint_dir.join("dead-letter.jsonl"));
                Target::File { file: shared_file(&path), path }
            }
            DeadLetterType::Broker => Target::Broker { topic: cfg.destination.clone().unwrap_or_default() },
            DeadLetterType::Stop => Target::Stop,
        };
        Self { target, retry, count: AtomicU64::new(0), refusals: Arc::default() }
    }

    /// Reports a dead-letter destination that refuses every event to `refusals` (`/readyz`,
    /// `kubecast_sink_refused`), as the queue reports the sink's own destinations.
    pub fn reporting_to(mut self, refusals: Arc<Refusals>) -> Self {
        self.refusals = refusals;
        self
    }

    #[cfg(test)]
    /// How many events went to the dead letter since start.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Whether a dead letter goes into the sink's broker (with exactly-once: into the open
    /// transaction, so the event's gate pass must be held while it is written); a file or
    /// `stop` is outside any transaction.
    pub fn in_transaction(&self) -> bool {
        matches!(self.target, Target::Broker { .. })
    }

    /// Where dead letters go, for messages.
    pub fn describe(&self) -> String {
        match &self.target {
            Target::File { path, .. } => format!("file {}", path.display()),
            Target::Broker { topic } => format!("broker destination {topic:?}"),
            Target::Stop => "none (type = \"stop\")".into(),
        }
    }

    /// At start: the destination can take dead letters (the file opens; the Kafka topic exists
    /// or the broker creates it; a JetStream stream covers the NATS subject, or kubecast creates
    /// one). A file that cannot be opened stops kubecast. A broker destination that is missing
    /// is a set-up mistake like a missing event topic: logged here, named on `/readyz` by the
    /// start-up look-up (`app::connect_check`), and a dead letter that comes before it is fixed
    /// waits for it (held, see [`DeadLetter::put`]). A broker not reachable yet is not an error
    /// (the check is skipped, with a warning).
    pub async fn check(&self, sink: &Sink) -> Result<(), DeliveryError> {
        let fail = |what: String| DeliveryError::DeadLetterCheck(what);
        match &self.target {
            Target::Stop => Ok(()),
            Target::File { path, file } => file
                .get_or_try_init(|| FileSink::open(path.clone(), "delivery.dead_letter.path"))
                .await
                .map(|_| ())
                .map_err(|e| fail(format!("[delivery.dead_letter] path {}: {e}", path.display()))),
            Target::Broker { topic } => {
                if let Some(k) = sink.kafka() {
                    match k.topic_exists(topic).await {
                        Ok(true) => Ok(()),
                        Ok(false) => {
                            warn!(
                                topic,
                                "[delivery.dead_letter] destination: Kafka topic {topic:?} does not exist and the broker does not create it; a dead letter waits until it does (fix: create the topic, or name an existing one)"
                            );
                            Ok(())
                        }
                        Err(e) => {
                            warn!(topic, error = %e, "the dead-letter topic could not be checked (broker not reachable?); checked when it is used");
                            Ok(())
                        }
                    }
                } else if let Some(n) = sink.nats() {
                    if !n.is_connected() {
                        warn!(subject = %topic, "NATS is not reachable yet: the dead-letter subject is checked when it is used");
                        return Ok(());
                    }
                    if let Err(e) = n.ensure_streams(std::slice::from_ref(topic)).await {
                        warn!(subject = %topic, error = %e, "[delivery.dead_letter] destination: a dead letter waits until a stream covers the subject");
                    }
                    Ok(())
                } else if sink.http().is_some() {
                    match url::Url::parse(topic) {
                        Ok(u) if matches!(u.scheme(), "http" | "https") => Ok(()),
                        _ => Err(fail(format!(
                            "[delivery.dead_letter] destination {:?}: with sink.type = \"http\" the dead letter is another receiver's URL (fix: e.g. destination = \"http://dead-letter.example/\")",
                            crate::sink::secret::url_for_display(topic)
                        ))),
                    }
                } else {
                    Err(fail(
                        "[delivery.dead_letter] type = \"broker\" needs a broker or HTTP sink (kafka, nats or http)"
                            .into(),
                    ))
                }
            }
        }
    }

    /// Writes `msg` with `reason`; returns when it is stored, retrying up to `max_attempts`
    /// times (0: as long as it takes); then the error stops kubecast. A broker destination that
    /// refuses every event (missing, or a permission not granted) is a set-up mistake: the
    /// event waits for it, retried with backoff whatever `max_attempts` says, and the
    /// destination is reported as refused until it takes the event.
    pub async fn put(&self, sink: &Sink, msg: &Outbound, reason: &str) -> Result<(), DeliveryError> {
        let destination = sink.destination(msg);
        let id = msg.event.id().to_string();
        if let Target::Stop = self.target {
            return Err(Undeliverable { id, destination, reason: reason.to_string() }.into());
        }
        error!(event_id = %id, trace_id = %crate::observe::trace::trace_id(msg.trace.as_ref()), destination = %destination, reason, "event cannot be delivered; writing it to the dead letter");
        let mut backoff = self.retry.backoff();
        let mut attempt = 0u32;
        // Attempts that failed for another reason than a refusal: what `max_attempts` counts.
        let mut failed = 0u32;
        let mut held: Option<RefusalHold> = None;
        loop {
            attempt += 1;
            let result = match &self.target {
                Target::File { path, file } => {
                    write_file(path, file, msg, &destination, reason).await.map_err(SendError::Retriable)
                }
                Target::Broker { topic } => self.write_broker(sink, topic, msg, &destination, reason).await,
                Target::Stop => unreachable!(),
            };
            match result {
                Ok(()) => {
                    self.count.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(SendError::Refused { refusal, reason: said }) => {
                    let Target::Broker { topic } = &self.target else { unreachable!("only a broker refuses") };
                    let where_ = format!("{topic} (the dead letter)");
                    match &held {
                        Some(h) if h.is_for(&where_, refusal) => h.update(&said),
                        _ => held = Some(self.refusals.hold(&where_, refusal, &said)),
                    }
                    if attempt == 1 || attempt.is_multiple_of(10) {
                        let e = SendError::Refused { refusal, reason: said };
                        warn!(event_id = %id, dead_letter = %topic, refusal = refusal.label(), attempt, error = %e, "the dead-letter destination refuses every event (a set-up mistake); the event waits for it, retried with backoff until it is fixed");
                    }
                }
                Err(e) => {
                    held = None;
                    failed += 1;
                    if !self.retry.may_retry(failed) {
                        return Err(DeliveryError::DeadLetterUnwritable {
                            id,
                            dead_letter: self.describe(),
                            attempts: failed,
                            error: e.to_string(),
                        });
                    }
                    warn!(event_id = %id, error = %e, attempt, "dead letter not written; retrying");
                }
            }
            tokio::time::sleep(backoff.next().unwrap_or(std::time::Duration::from_secs(30))).await;
        }
    }

    async fn write_broker(
        &self,
        sink: &Sink,
        topic: &str,
        msg: &Outbound,
        destination: &str,
        reason: &str,
    ) -> Result<(), SendError> {
        if let Some(n) = sink.nats() {
            return write_nats(n, topic, msg, destination, reason).await;
        }
        if let Some(h) = sink.http() {
            return h.send_dead_letter(topic, msg, reason).await;
        }
        let Some(k) = sink.kafka() else {
            return Err(SendError::Fatal("the dead letter type \"broker\" needs a broker sink".into()));
        };
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
                k.send_raw(topic, msg.key(), &payload, headers(h)).await
            }
            Err(e) => Err(e),
        }
    }
}

/// `{"reason":..,"destination":..,"failed_at":..,"event":<the structured event>}` as one line.
async fn write_file(
    path: &std::path::Path,
    file: &OnceCell<FileSink>,
    msg: &Outbound,
    destination: &str,
    reason: &str,
) -> Result<(), String> {
    let sink = file
        .get_or_try_init(|| FileSink::open(path.to_path_buf(), "delivery.dead_letter.path"))
        .await
        .map_err(|e| e.to_string())?;
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
    sink.write_line(&line).await.map_err(|e| e.to_string())
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
) -> Result<(), SendError> {
    let one_line = |s: &str| s.replace(['\r', '\n'], " ");
    let headers = || {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Content-Type", "application/cloudevents+json; charset=UTF-8");
        h.insert("Kubecast-Dead-Letter-Reason", one_line(reason).as_str());
        h.insert("Kubecast-Original-Destination", destination);
        h
    };
    // Its own message id: the event's may be in the stream's duplicate window already (stored,
    // PubAck lost), and the dead letter would be dropped as a duplicate of it.
    let id = format!("{}:dead-letter", msg.event.id());
    let id = id.as_str();
    let payload = bytes::Bytes::from(msg.event.to_structured());
    match n.publish(subject.to_string(), headers(), payload, id).await {
        Ok(()) => Ok(()),
        Err(SendError::Permanent(_)) => {
            let mut h = headers();
            h.insert("Kubecast-Data-Dropped", "true");
            let payload = bytes::Bytes::from(msg.event.to_structured_without_data());
            n.publish(subject.to_string(), h, payload, id).await
        }
        Err(e) => Err(e),
    }
}

/// Unit tests: the file and stop dead letters; with the stub sink (`tests.rs` in the folder of this file's name).
#[cfg(test)]
mod tests;
