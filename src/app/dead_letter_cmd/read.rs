//! Reading the dead letter from where replay last got to, and remembering how far it got:
//!
//! - the file: its complete lines after the byte offset kept in `<file>.replayed` (written
//!   after each event sent, by a rename); a line being appended is left for the next run;
//! - a Kafka topic: a consumer of group `progress` from its committed offsets (`read_committed`),
//!   up to each partition's end when the read started; the offset is committed after each event
//!   sent;
//! - a NATS subject: a durable JetStream consumer named `progress` on the stream that covers it,
//!   every message acknowledged after it is sent; up to the messages pending when the read
//!   started.
//!
//! `--dry-run` reads the same way and remembers nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::entry::Entry;
use super::error::ReplayError;
use crate::sink::kafka::roles::for_consumer;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Where the dead letter is read from (the NATS reader, much the largest, boxed).
pub enum Reader {
    File(FileReader),
    Kafka(KafkaReader),
    Nats(Box<NatsReader>),
}

impl Reader {
    /// The next dead letter not replayed yet, `None` at the end (as it was when the read
    /// started). Errors of one entry (a line that is not an event) are returned as
    /// `Ok(Some(Err(..)))`: skipped, named, and counted.
    pub async fn next(&mut self) -> Result<Option<Result<Entry, String>>, ReplayError> {
        match self {
            Self::File(r) => r.next(),
            Self::Kafka(r) => r.next().await,
            Self::Nats(r) => r.next().await,
        }
    }

    /// The entry last returned is done: the next run starts after it.
    pub async fn done(&mut self) -> Result<(), ReplayError> {
        match self {
            Self::File(r) => r.done(),
            Self::Kafka(r) => r.done(),
            Self::Nats(r) => r.done().await,
        }
    }
}

pub struct FileReader {
    path: PathBuf,
    progress: PathBuf,
    text: Vec<u8>,
    /// Byte offset of the next line.
    at: usize,
    /// Byte offset after the entry last returned.
    after: usize,
    dry_run: bool,
}

impl FileReader {
    pub fn open(path: &Path, dry_run: bool) -> Result<Self, ReplayError> {
        let io = |e: std::io::Error, what: &Path| ReplayError::File(format!("{}: {e}", what.display()));
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io(e, path)),
        };
        let mut progress = path.as_os_str().to_owned();
        progress.push(".replayed");
        let progress = PathBuf::from(progress);
        let at = match std::fs::read_to_string(&progress) {
            Ok(s) => s.trim().parse::<usize>().map_err(|e| {
                ReplayError::File(format!(
                    "{}: not a byte offset ({e}) (fix: delete it to replay the whole file again)",
                    progress.display()
                ))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => return Err(io(e, &progress)),
        };
        if at > text.len() {
            return Err(ReplayError::File(format!(
                "{} says {at} bytes were replayed, but {} has {} (it was cut or replaced; fix: delete {} to replay the whole file again)",
                progress.display(),
                path.display(),
                text.len(),
                progress.display()
            )));
        }
        Ok(Self { path: path.to_path_buf(), progress, text, at, after: at, dry_run })
    }

    fn next(&mut self) -> Result<Option<Result<Entry, String>>, ReplayError> {
        loop {
            let rest = &self.text[self.at..];
            // Only complete lines: the last one may be being written.
            let Some(end) = rest.iter().position(|b| *b == b'\n') else { return Ok(None) };
            let line = &rest[..end];
            let start = self.at;
            self.at += end + 1;
            self.after = self.at;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Ok(Some(
                Entry::from_file_line(line).map_err(|e| format!("{} at byte {start}: {e}", self.path.display())),
            ));
        }
    }

    fn done(&mut self) -> Result<(), ReplayError> {
        if self.dry_run {
            return Ok(());
        }
        let tmp = self.progress.with_extension("replayed.tmp");
        std::fs::write(&tmp, format!("{}\n", self.after))
            .and_then(|()| std::fs::rename(&tmp, &self.progress))
            .map_err(|e| ReplayError::File(format!("{}: {e}", self.progress.display())))
    }
}

pub struct KafkaReader {
    topic: String,
    /// The consumer group that keeps how far replay got.
    group: String,
    consumer: StreamConsumer<ReplayContext>,
    /// Partition -> the offset at which the read ends.
    open: HashMap<i32, i64>,
    last: Option<(i32, i64)>,
    dry_run: bool,
}

impl KafkaReader {
    pub async fn open(cc: &ClientConfig, topic: &str, group: &str, dry_run: bool) -> Result<Self, ReplayError> {
        let what = |e: String| ReplayError::Kafka(format!("dead-letter topic {topic:?}: {e}"));
        let mut cc = for_consumer(cc);
        cc.set("group.id", group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("allow.auto.create.topics", "false")
            .set("isolation.level", "read_committed")
            .set("auto.offset.reset", "earliest");
        let consumer: StreamConsumer<ReplayContext> =
            cc.create_with_context(ReplayContext::default()).map_err(|e| what(format!("consumer: {e}")))?;
        let (consumer, open) = tokio::task::spawn_blocking({
            let topic = topic.to_string();
            move || {
                let open = assign_unreplayed(&consumer, &topic);
                (consumer, open)
            }
        })
        .await
        .expect("the dead-letter reader");
        let open = match open {
            Ok(open) => open,
            Err(e) => {
                // The broker's errors meanwhile (a refused group, whose coordinator a call
                // then only waits for) reach the context when the consumer is served.
                let _ = tokio::time::timeout(Duration::from_millis(500), consumer.recv()).await;
                return Err(what(in_words(e, group, consumer.context())));
            }
        };
        Ok(Self { topic: topic.to_string(), group: group.to_string(), consumer, open, last: None, dry_run })
    }

    async fn next(&mut self) -> Result<Option<Result<Entry, String>>, ReplayError> {
        loop {
            if self.open.is_empty() {
                return Ok(None);
            }
            let m = tokio::time::timeout(Duration::from_secs(60), self.consumer.recv())
                .await
                .map_err(|_| {
                    ReplayError::Kafka(format!(
                        "dead-letter topic {:?}: no record within 60 s before the end of partitions {:?}",
                        self.topic,
                        self.open.keys().collect::<Vec<_>>()
                    ))
                })?
                .map_err(|e| ReplayError::Kafka(format!("dead-letter topic {:?}: {e}", self.topic)))?;
            let (p, o) = (m.partition(), m.offset());
            let Some(end) = self.open.get(&p).copied() else { continue };
            if o >= end {
                self.open.remove(&p);
                continue;
            }
            if o + 1 >= end {
                self.open.remove(&p);
            }
            self.last = Some((p, o));
            return Ok(Some(entry_of(&m).map_err(|e| format!("{} partition {p} offset {o}: {e}", self.topic))));
        }
    }

    fn done(&mut self) -> Result<(), ReplayError> {
        let Some((p, o)) = self.last.take() else { return Ok(()) };
        if self.dry_run {
            return Ok(());
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, p, Offset::Offset(o + 1)).expect("an offset");
        self.consumer.commit(&tpl, rdkafka::consumer::CommitMode::Sync).map_err(|e| {
            ReplayError::Kafka(format!(
                "committing the replay's progress (group offsets): {}",
                in_words(&e, &self.group, self.consumer.context())
            ))
        })
    }
}

/// Assigns `consumer` each partition of `topic` from the replay's committed offset up to the
/// partition's end; the ends (partition -> offset at which the read ends). Blocking.
fn assign_unreplayed(
    consumer: &StreamConsumer<ReplayContext>,
    topic: &str,
) -> Result<HashMap<i32, i64>, rdkafka::error::KafkaError> {
    let md = consumer.fetch_metadata(Some(topic), TIMEOUT)?;
    let mut tpl = TopicPartitionList::new();
    for t in md.topics().iter().filter(|t| t.name() == topic) {
        if let Some(e) = t.error() {
            return Err(rdkafka::error::KafkaError::MetadataFetch(rdkafka::types::RDKafkaErrorCode::from(e)));
        }
        for p in t.partitions() {
            tpl.add_partition(topic, p.id());
        }
    }
    if tpl.count() == 0 {
        let missing = rdkafka::types::RDKafkaErrorCode::UnknownTopicOrPartition;
        return Err(rdkafka::error::KafkaError::MetadataFetch(missing));
    }
    let committed = consumer.committed_offsets(tpl, TIMEOUT)?;
    let mut open = HashMap::new();
    let mut assign = TopicPartitionList::new();
    for e in committed.elements() {
        let (low, high) = consumer.fetch_watermarks(topic, e.partition(), TIMEOUT)?;
        let from = match e.offset() {
            Offset::Offset(o) => o.max(low),
            _ => low,
        };
        if from < high {
            open.insert(e.partition(), high);
            assign.add_partition_offset(topic, e.partition(), Offset::Offset(from))?;
        }
    }
    consumer.assign(&assign)?;
    Ok(open)
}

/// The replay consumer's context: librdkafka's messages logged as kubecast's, and whether the
/// broker refused the group (a call waiting for the group's coordinator then only times out).
#[derive(Default)]
struct ReplayContext {
    group_refused: std::sync::atomic::AtomicBool,
}

impl rdkafka::client::ClientContext for ReplayContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, msg: &str) {
        crate::sink::kafka::LogContext.log(level, fac, msg);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        if crate::sink::kafka::refusal(&error) == Some(crate::model::Refusal::GroupNotAuthorized) {
            self.group_refused.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        crate::sink::kafka::LogContext.error(error, reason);
    }
}

impl rdkafka::consumer::ConsumerContext for ReplayContext {}

/// `e`, with the cause and the fix when it is a set-up mistake (a missing Read permission on
/// the progress group `group`, on the topic).
fn in_words(e: impl std::borrow::Borrow<rdkafka::error::KafkaError>, group: &str, context: &ReplayContext) -> String {
    let e = e.borrow();
    let group_refused = context.group_refused.load(std::sync::atomic::Ordering::Relaxed);
    let refusal = crate::sink::kafka::refusal(e).or(group_refused.then_some(crate::model::Refusal::GroupNotAuthorized));
    match refusal {
        Some(refusal) => {
            format!("{e}: {} (group {group:?}; fix: {})", refusal.what(), refusal.fix().replace("<group>", group))
        }
        None => e.to_string(),
    }
}

fn entry_of(m: &BorrowedMessage<'_>) -> Result<Entry, String> {
    let header = |name: &str| {
        m.headers().and_then(|h| {
            h.iter().find(|x| x.key == name).and_then(|x| x.value).map(|v| String::from_utf8_lossy(v).into_owned())
        })
    };
    let payload = m.payload().ok_or("a record without a value")?;
    Entry::parse(
        payload,
        header("kubecast_original_destination").unwrap_or_default(),
        header("kubecast_dead_letter_reason").unwrap_or_default(),
        header("kubecast_data_dropped").as_deref() == Some("true"),
    )
}

pub struct NatsReader {
    subject: String,
    messages: async_nats::jetstream::consumer::pull::Stream,
    pending: u64,
    last: Option<async_nats::jetstream::Message>,
    dry_run: bool,
}

impl NatsReader {
    pub async fn open(
        js: &async_nats::jetstream::Context,
        subject: &str,
        progress: &str,
        dry_run: bool,
    ) -> Result<Self, ReplayError> {
        use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, pull};
        let what = |e: String| ReplayError::Nats(format!("dead-letter subject {subject:?}: {e}"));
        let name = js
            .stream_by_subject(subject)
            .await
            .map_err(|e| what(format!("no stream covers it, so there are no dead letters to replay ({e})")))?;
        let stream = js.get_stream(&name).await.map_err(|e| what(format!("stream {name}: {e}")))?;
        // The durable consumer's acknowledged floor: where replay got to.
        let floor = match stream.consumer_info(progress).await {
            Ok(info) => info.ack_floor.stream_sequence,
            Err(_) => 0,
        };
        let config = pull::Config {
            filter_subject: subject.to_string(),
            ack_policy: if dry_run { AckPolicy::None } else { AckPolicy::Explicit },
            deliver_policy: if dry_run && floor > 0 {
                DeliverPolicy::ByStartSequence { start_sequence: floor + 1 }
            } else {
                DeliverPolicy::All
            },
            durable_name: (!dry_run).then(|| progress.to_string()),
            ack_wait: Duration::from_secs(60),
            ..Default::default()
        };
        let mut consumer: consumer::PullConsumer = if dry_run {
            stream.create_consumer(config).await
        } else {
            stream.get_or_create_consumer(progress, config).await
        }
        .map_err(|e| what(format!("consumer {progress}: {e}")))?;
        let pending = consumer.info().await.map_err(|e| what(format!("consumer {progress}: {e}")))?.num_pending;
        let messages = consumer.messages().await.map_err(|e| what(format!("consumer {progress}: {e}")))?;
        Ok(Self { subject: subject.to_string(), messages, pending, last: None, dry_run })
    }

    async fn next(&mut self) -> Result<Option<Result<Entry, String>>, ReplayError> {
        if self.pending == 0 {
            return Ok(None);
        }
        let m = tokio::time::timeout(Duration::from_secs(60), self.messages.next())
            .await
            .map_err(|_| ReplayError::Nats(format!("dead-letter subject {:?}: no message within 60 s", self.subject)))?
            .ok_or_else(|| ReplayError::Nats(format!("dead-letter subject {:?}: the consumer ended", self.subject)))?
            .map_err(|e| ReplayError::Nats(format!("dead-letter subject {:?}: {e}", self.subject)))?;
        self.pending -= 1;
        let header = |name: &str| m.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_string());
        let entry = Entry::parse(
            &m.payload,
            header("Kubecast-Original-Destination").unwrap_or_default(),
            header("Kubecast-Dead-Letter-Reason").unwrap_or_default(),
            header("Kubecast-Data-Dropped").as_deref() == Some("true"),
        )
        .map_err(|e| format!("{} ({}): {e}", self.subject, m.info().map(|i| i.stream_sequence).unwrap_or_default()));
        self.last = Some(m);
        Ok(Some(entry))
    }

    async fn done(&mut self) -> Result<(), ReplayError> {
        let Some(m) = self.last.take() else { return Ok(()) };
        if self.dry_run {
            return Ok(());
        }
        m.double_ack().await.map_err(|e| ReplayError::Nats(format!("acknowledging the replay's progress: {e}")))
    }
}
