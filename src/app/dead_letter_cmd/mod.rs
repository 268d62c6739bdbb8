//! `kubecast dead-letter list | replay`: the events in `[delivery.dead_letter]` (a file, a
//! Kafka topic or a NATS subject), listed, or sent again to the destination each was meant
//! for, one at a time in the order they were dead-lettered, each under its original id and key
//! (consumers drop duplicates on `source` + `id`), encoded as the sink sends events (binary or
//! structured). Replay remembers how far it got (see `read`): run it again after a failure
//! and it goes on; run it again later and it sends only what was dead-lettered since.
//!
//! It sends with a plain idempotent producer, also when the sink is `exactly_once` (its
//! transactional id belongs to the running kubecast): a `read_committed` consumer sees the
//! replayed records at once. A replayed event arrives after the later events of its object that
//! were delivered meanwhile; its `time` and `resourceversion` say where it belongs.
//!
//! An entry the destination still refuses for that event (too large, say) is named and left
//! where it is; replay goes on with the next and exits 1 at the end. A destination that
//! refuses every event (missing, not authorized) or a broker that does not answer stops
//! replay there (exit 1), with the progress kept.

mod entry;
mod error;
mod read;

pub use error::ReplayError;

use std::time::Duration;

use clap::Subcommand;

use crate::config::Config;
use crate::delivery::DeadLetterType;
use crate::sink::{SendError, Sink, SinkType};
use read::{FileReader, KafkaReader, NatsReader, Reader};

/// The `kubecast dead-letter` subcommands.
#[derive(Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// The dead-lettered events not replayed yet: id, original destination and reason, one per
    /// line. Sends nothing, remembers nothing.
    List {
        #[command(flatten)]
        from: From,
    },
    /// Sends the dead-lettered events not replayed yet back to their original destinations, in
    /// order, with their original ids, and remembers how far it got.
    Replay {
        #[command(flatten)]
        from: From,
        /// Only say what would be sent (the same as `list`).
        #[arg(long)]
        dry_run: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct From {
    /// What remembers how far replay got: the Kafka consumer group, or the name of the durable
    /// JetStream consumer (the file dead letter keeps `<file>.replayed` instead).
    #[arg(long, default_value = "kubecast-dead-letter-replay")]
    progress: String,
    /// A dead-letter file to read instead of `[delivery.dead_letter] path` (e.g. one copied out
    /// of a pod).
    #[arg(long)]
    file: Option<std::path::PathBuf>,
}

/// Runs `command`; prints one line per entry on stdout and a summary on stderr.
pub async fn run(config: Config, command: DeadLetterCommand) -> Result<(), ReplayError> {
    let (from, send) = match command {
        DeadLetterCommand::List { from } => (from, false),
        DeadLetterCommand::Replay { from, dry_run } => (from, !dry_run),
    };
    let mut sink_config = config.sink.clone();
    if let Some(k) = sink_config.kafka.as_mut() {
        // The transactional id is the running kubecast's: replay uses a producer of its own.
        k.exactly_once = false;
    }
    let needs_sink = send || (from.file.is_none() && config.delivery.dead_letter.kind == DeadLetterType::Broker);
    let sink = if needs_sink { Some(Sink::open(&sink_config, 1).await?) } else { None };
    let mut reader = open_reader(&config, &from, sink.as_ref(), !send).await?;
    let (mut replayed, mut skipped) = (0u64, 0u64);
    while let Some(entry) = reader.next().await? {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                println!("skipped: {e}");
                skipped += 1;
                reader.done().await?;
                continue;
            }
        };
        if !send {
            println!("{}\t{}\t{}", entry.id, entry.destination, entry.reason);
            continue;
        }
        if entry.data_dropped {
            println!(
                "skipped: {} to {}: the dead letter kept its attributes only (the event was too large for it too); the object's current state is in the next event of the object",
                entry.id, entry.destination
            );
            skipped += 1;
            reader.done().await?;
            continue;
        }
        let sink = sink.as_ref().expect("opened to send");
        match send_one(sink, &entry).await {
            Ok(()) => {
                println!("replayed: {} to {}", entry.id, entry.destination);
                replayed += 1;
            }
            Err(SendError::Permanent(e)) => {
                println!("skipped: {} to {}: refused for this event: {e}", entry.id, entry.destination);
                skipped += 1;
            }
            Err(e) => {
                return Err(ReplayError::Send {
                    id: entry.id,
                    destination: entry.destination,
                    error: e.to_string(),
                    replayed,
                });
            }
        }
        reader.done().await?;
    }
    if send {
        eprintln!("kubecast: {replayed} dead letter(s) replayed, {skipped} skipped");
    }
    if skipped > 0 {
        return Err(ReplayError::Skipped(skipped));
    }
    Ok(())
}

async fn open_reader(config: &Config, from: &From, sink: Option<&Sink>, dry_run: bool) -> Result<Reader, ReplayError> {
    let dl = &config.delivery.dead_letter;
    if let Some(path) = &from.file {
        return Ok(Reader::File(FileReader::open(path, dry_run)?));
    }
    match dl.kind {
        DeadLetterType::Stop => Err(ReplayError::NoDeadLetter),
        DeadLetterType::File => {
            let path = dl.path.clone().unwrap_or_else(|| config.checkpoint.dir.join("dead-letter.jsonl"));
            Ok(Reader::File(FileReader::open(&path, dry_run)?))
        }
        DeadLetterType::Broker => {
            let destination = dl.destination.clone().unwrap_or_default();
            let sink = sink.expect("opened for a broker dead letter");
            match config.sink.kind {
                SinkType::Kafka => {
                    let k = sink.kafka().expect("a Kafka sink");
                    Ok(Reader::Kafka(
                        KafkaReader::open(k.client_config(), &destination, &from.progress, dry_run).await?,
                    ))
                }
                SinkType::Nats => {
                    let n = sink.nats().expect("a NATS sink");
                    let until = std::time::Instant::now() + Duration::from_secs(10);
                    while !n.is_connected() && std::time::Instant::now() < until {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let js = n.jetstream_context().ok_or_else(|| {
                        ReplayError::Nats(
                            "core NATS (sink.nats.jetstream = false) keeps no dead letters to read".into(),
                        )
                    })?;
                    Ok(Reader::Nats(Box::new(NatsReader::open(js, &destination, &from.progress, dry_run).await?)))
                }
                _ => Err(ReplayError::NoDeadLetter),
            }
        }
    }
}

/// Sends `entry`, retrying what may pass later for up to a minute.
async fn send_one(sink: &Sink, entry: &entry::Entry) -> Result<(), SendError> {
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let mut wait = Duration::from_millis(200);
    loop {
        let result = if let Some(k) = sink.kafka() {
            let (payload, headers) = entry.kafka(k.mode() == crate::sink::kafka::Mode::Structured);
            k.send_raw(&entry.destination, entry.key(), &payload, headers).await
        } else if let Some(n) = sink.nats() {
            let (payload, headers) = entry.nats(n.mode() == crate::sink::nats::Mode::Structured);
            n.publish(entry.destination.clone(), headers, payload, &entry.id).await
        } else if let Some(h) = sink.http() {
            let (headers, body) = entry.http(h.mode() == crate::sink::http::Mode::Structured);
            h.send_raw(headers, body).await
        } else {
            Err(SendError::Fatal("replay needs a Kafka, NATS or HTTP sink ([sink] type)".into()))
        };
        match result {
            Err(SendError::Retriable(e) | SendError::RetryAfter { reason: e, .. })
                if std::time::Instant::now() < until =>
            {
                tracing::warn!(event_id = %entry.id, error = %e, "not sent yet; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}
