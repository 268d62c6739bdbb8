//! The NATS store: a JetStream key-value bucket (`[checkpoint.nats] bucket`, history 1)
//! holding the records of `record.rs`.
//!
//! Each write of a stream is one atomic batch (ADR-50, server 2.12; at most 1000 messages, so a
//! larger delta takes several) whose last message rewrites the stream's position record on
//! condition that it is still at the revision this process last wrote or read
//! (`Nats-Expected-Last-Subject-Sequence`): the whole batch is stored or none of it. A process
//! that opens the store claims every stream by rewriting its position record under its own
//! epoch; an older process's next batch then fails its condition, and it stops. Batches before
//! the last of a large delta carry the previous position again, so a crash in between leaves
//! index records newer than the position: on resume those changes are delivered again, with
//! their ids, never lost.
//!
//! Written by hand: the one crate with atomic batches (jetstream-extra) is built for another
//! async-nats; the protocol is three headers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, kv, stream};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::Mutex;
use tracing::info;

use super::error::CheckpointError;
use super::record::{Loader, PositionRecord, encode_object, object_key, position_key};
use super::stream::{Delta, Owner, StreamKey};
use crate::model::Position;

/// At most this many messages per atomic batch (the server's limit is 1000).
const BATCH: usize = 1000;
const TIMEOUT: Duration = Duration::from_secs(10);
/// JetStream's "wrong last sequence" error code.
const WRONG_LAST_SEQUENCE: u64 = 10071;

/// What the NATS store is opened with.
#[derive(Clone)]
pub struct NatsStoreConfig {
    pub client: async_nats::Client,
    pub bucket: String,
    pub create_bucket: bool,
    /// The created bucket's replicas (default: [`default_replicas`]).
    pub replicas: Option<usize>,
}

/// The replicas of a bucket kubecast creates by default: the smaller of 3 and the servers of
/// the cluster the connection's server belongs to (`connect_urls` lists them), 1 for a server
/// outside a cluster.
pub fn default_replicas(clustered: bool, servers: usize) -> usize {
    if clustered { servers.clamp(1, 3) } else { 1 }
}

/// A stream's position record as this process last wrote or read it.
#[derive(Debug, Clone)]
struct Last {
    revision: u64,
    value: Bytes,
}

pub struct NatsStore {
    client: async_nats::Client,
    js: jetstream::Context,
    bucket: String,
    owner: Owner,
    last: Mutex<HashMap<String, Last>>,
    batches: AtomicU64,
    written: AtomicU64,
}

impl std::fmt::Debug for NatsStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsStore").field("bucket", &self.bucket).finish()
    }
}

fn broker(what: impl Into<String>, cause: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Broker { what: what.into(), cause: cause.to_string() }
}

#[derive(Deserialize)]
struct ApiError {
    #[serde(default)]
    err_code: u64,
    #[serde(default)]
    description: String,
}

#[derive(Deserialize)]
struct Reply {
    #[serde(default)]
    error: Option<ApiError>,
    #[serde(default)]
    seq: u64,
}

impl NatsStore {
    /// Opens (or creates) the bucket and makes sure its stream takes atomic batches.
    pub async fn open(cfg: NatsStoreConfig, owner: Owner) -> Result<Self, CheckpointError> {
        let what = format!("NATS key-value bucket {}", cfg.bucket);
        let js = jetstream::ContextBuilder::new().timeout(TIMEOUT).build(cfg.client.clone());
        match js.get_key_value(&cfg.bucket).await {
            Ok(_) => {}
            Err(e) if e.kind() == jetstream::context::KeyValueErrorKind::GetBucket && cfg.create_bucket => {
                let info = cfg.client.server_info();
                let replicas =
                    cfg.replicas.unwrap_or_else(|| default_replicas(info.cluster.is_some(), info.connect_urls.len()));
                js.create_key_value(kv::Config {
                    bucket: cfg.bucket.clone(),
                    description: "kubecast stream positions".into(),
                    history: 1,
                    storage: stream::StorageType::File,
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    broker(&what, format!("cannot be created with {replicas} replica(s): {e} (fix: create it, allow kubecast to, or set [checkpoint.nats] replicas to at most the cluster's JetStream servers)"))
                })?;
                info!(bucket = %cfg.bucket, replicas, "NATS state bucket created ([checkpoint.nats] replicas sets another count)");
            }
            Err(e) if e.kind() == jetstream::context::KeyValueErrorKind::GetBucket => {
                return Err(broker(
                    &what,
                    format!(
                        "does not exist: {e} (fix: create it with history 1, or set [checkpoint.nats] create_bucket = true)"
                    ),
                ));
            }
            Err(e) => return Err(broker(&what, e)),
        }
        let stream_name = format!("KV_{}", cfg.bucket);
        let mut s = js.get_stream(&stream_name).await.map_err(|e| broker(&what, e))?;
        let mut config = s.info().await.map_err(|e| broker(&what, e))?.config.clone();
        if config.max_messages_per_subject != 1 {
            return Err(CheckpointError::Unusable {
                what,
                why: format!(
                    "keeps {} revisions per key; kubecast needs history 1 (fix: recreate the bucket with history 1)",
                    config.max_messages_per_subject
                ),
            });
        }
        if !config.allow_atomic_publish {
            config.allow_atomic_publish = true;
            js.update_stream(&config).await.map_err(|e| {
                broker(&what, format!("cannot allow atomic batches on stream {stream_name}: {e} (fix: nats stream edit {stream_name} --allow-batch, server 2.12 or later)"))
            })?;
        }
        Ok(Self {
            client: cfg.client,
            js,
            bucket: cfg.bucket,
            owner,
            last: Mutex::default(),
            batches: AtomicU64::new(0),
            written: AtomicU64::new(0),
        })
    }

    pub fn describe(&self) -> String {
        format!("NATS bucket {}", self.bucket)
    }

    /// Bytes of keys and values stored so far.
    pub fn bytes_written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn subject(&self, key: &str) -> String {
        format!("$KV.{}.{key}", self.bucket)
    }

    /// Reads each stream's records, then claims it (its position record rewritten under this
    /// process's epoch, on condition that nobody wrote it since).
    pub async fn load(&self, keys: &[StreamKey]) -> Result<Vec<Option<Position>>, CheckpointError> {
        let mut out = Vec::new();
        for key in keys {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let (position, last) = self.load_one(key).await?;
                let record = PositionRecord::new(
                    key,
                    &self.owner,
                    position.as_ref().and_then(|p| p.resource_version.as_deref()),
                    position.as_ref().map(|p| p.acked_ahead.as_slice()).unwrap_or(&[]),
                )
                .with_snapshot(position.as_ref().is_some_and(|p| p.snapshot))
                .with_floors(position.as_ref().map(|p| p.floors.as_slice()).unwrap_or(&[]));
                let value = Bytes::from(record.encode());
                let id = key.id();
                match self
                    .batch(vec![(position_key(&id), None, Some(value.clone()))], last.map(|l| l.revision).unwrap_or(0))
                    .await
                {
                    Ok(revision) => {
                        self.last.lock().await.insert(id, Last { revision, value });
                        out.push(position);
                        break;
                    }
                    // Written meanwhile by the previous owner (it stops within its renew
                    // deadline): read again.
                    Err(CheckpointError::Fenced { .. }) if attempt < 5 => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(out)
    }

    /// One stream's records: the position records of every layout of it (its own, the other
    /// shards', another shard count's), its own records, and where another layout's state was
    /// written last, that layout's index records too (see `adopt.rs`).
    async fn load_one(&self, key: &StreamKey) -> Result<(Option<Position>, Option<Last>), CheckpointError> {
        let what = format!("NATS key-value bucket {}", self.bucket);
        let (id, base) = (key.id(), key.base_id());
        let stream = self.js.get_stream(format!("KV_{}", self.bucket)).await.map_err(|e| broker(&what, e))?;
        let keys = [key.clone()];
        let mut loader = Loader::new(format!("NATS bucket {}", self.bucket), &keys, &self.owner);
        let mut last = None;
        let position_record = position_key(&id);
        let sequence =
            |m: &async_nats::jetstream::Message| m.info().map(|i| i.stream_sequence).map_err(|e| broker(&what, e));
        // Every layout's position records (the unsharded one, each shard's of any count).
        let positions = consumer::pull::Config {
            filter_subjects: vec![self.subject(&position_key(&base)), self.subject(&format!("{base}.*.p"))],
            ..Default::default()
        };
        each_latest(&stream, &self.bucket, &what, positions, |k, deleted, m| {
            loader.apply(k, (!deleted).then_some(m.payload.as_ref()), sequence(m)?)
        })
        .await?;
        let own = consumer::pull::Config { filter_subject: format!("{}.>", self.subject(&id)), ..Default::default() };
        each_latest(&stream, &self.bucket, &what, own, |k, deleted, m| {
            let order = sequence(m)?;
            loader.apply(k, (!deleted).then_some(m.payload.as_ref()), order)?;
            if k == position_record {
                last = Some(Last { revision: order, value: m.payload.clone() });
            }
            Ok(())
        })
        .await?;
        if let Some(count) = loader.adopting().first().copied() {
            let objects = if count == 1 { format!("{base}.o.>") } else { format!("{base}.*.o.>") };
            let foreign = consumer::pull::Config { filter_subject: self.subject(&objects), ..Default::default() };
            each_latest(&stream, &self.bucket, &what, foreign, |k, deleted, m| {
                loader.apply(k, (!deleted).then_some(m.payload.as_ref()), sequence(m)?)
            })
            .await?;
        }
        let position = loader.finish()?.remove(0);
        Ok((position, last))
    }

    /// Writes each stream's delta as atomic batches.
    pub async fn write(&self, deltas: &[(StreamKey, Delta)]) -> Result<(), CheckpointError> {
        for (key, d) in deltas {
            let id = key.id();
            let mut ops: Vec<(String, Option<Bytes>)> = Vec::with_capacity(d.upserts.len() + d.removes.len());
            ops.extend(
                d.upserts
                    .iter()
                    .map(|(uid, e)| (object_key(&id, &uid.to_string()), Some(Bytes::from(encode_object(e))))),
            );
            ops.extend(d.removes.iter().map(|uid| (object_key(&id, uid), None)));
            let position = Bytes::from(
                PositionRecord::new(key, &self.owner, d.resource_version.as_deref(), &d.acked_ahead)
                    .with_snapshot(d.snapshot)
                    .with_floors(&d.floors)
                    .encode(),
            );
            let chunks: Vec<&[(String, Option<Bytes>)]> =
                if ops.is_empty() { vec![&[]] } else { ops.chunks(BATCH - 1).collect() };
            let n = chunks.len();
            for (i, chunk) in chunks.into_iter().enumerate() {
                let last = self.last.lock().await.get(&id).cloned().ok_or_else(|| CheckpointError::Fenced {
                    what: self.describe(),
                    why: format!("stream {id} was not claimed by this process"),
                })?;
                // Before the last chunk: the previous position again (it only moves with the
                // whole delta).
                let p = if i + 1 == n { position.clone() } else { last.value.clone() };
                let mut msgs: Vec<(String, Option<&'static str>, Option<Bytes>)> =
                    chunk.iter().map(|(k, v)| (k.clone(), v.is_none().then_some("DEL"), v.clone())).collect();
                msgs.push((position_key(&id), None, Some(p.clone())));
                let revision = match self.batch(msgs, last.revision).await {
                    Ok(revision) => revision,
                    Err(e @ CheckpointError::Fenced { .. }) => return Err(self.ours_after_all(&id, e).await),
                    Err(e) => return Err(e),
                };
                self.last.lock().await.insert(id.clone(), Last { revision, value: p });
            }
        }
        Ok(())
    }

    /// A batch refused because the position record moved: if this process moved it (an
    /// earlier commit whose answer was lost), take its revision and retry at the next write;
    /// else another process owns the stream now: `fenced`.
    async fn ours_after_all(&self, id: &str, fenced: CheckpointError) -> CheckpointError {
        let what = self.describe();
        let entry = match self.js.get_key_value(&self.bucket).await {
            Ok(kv) => kv.entry(position_key(id)).await,
            Err(e) => return broker(&what, format!("reading the position record of {id}: {e}")),
        };
        let entry = match entry {
            Ok(Some(entry)) => entry,
            Ok(None) => return fenced,
            Err(e) => return broker(&what, format!("reading the position record of {id}: {e}")),
        };
        let ours = serde_json::from_slice::<PositionRecord>(&entry.value)
            .is_ok_and(|p| p.writer == self.owner.writer && p.epoch == self.owner.epoch.unwrap_or(0));
        if !ours {
            return fenced;
        }
        self.last.lock().await.insert(id.to_string(), Last { revision: entry.revision, value: entry.value });
        broker(
            &what,
            format!(
                "the position record of {id} was written by this process meanwhile (an answer lost); writing again"
            ),
        )
    }

    /// Publishes `msgs` (key, KV operation, value) as one atomic batch; the last one is a
    /// stream's position record, expected at `revision` (0: none yet). Returns its new revision.
    async fn batch(
        &self,
        msgs: Vec<(String, Option<&'static str>, Option<Bytes>)>,
        revision: u64,
    ) -> Result<u64, CheckpointError> {
        let what = self.describe();
        let id = format!(
            "kc{}-{}-{}",
            std::process::id(),
            self.batches.fetch_add(1, Ordering::Relaxed),
            chrono::Utc::now().timestamp_micros()
        );
        let n = msgs.len();
        let bytes: usize = msgs.iter().map(|(k, _, v)| k.len() + v.as_ref().map_or(0, Bytes::len)).sum();
        for (i, (key, op, value)) in msgs.into_iter().enumerate() {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Batch-Id", id.as_str());
            headers.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
            if let Some(op) = op {
                headers.insert("KV-Operation", op);
            }
            let commit = i + 1 == n;
            if commit {
                headers.insert("Nats-Batch-Commit", "1");
                headers.insert("Nats-Expected-Last-Subject-Sequence", revision.to_string().as_str());
            }
            let subject = self.subject(&key);
            let payload = value.unwrap_or_default();
            if i == 0 || commit {
                // The first is confirmed (the stream takes batches), the commit answers with
                // the batch's ack or why it was refused.
                let reply = tokio::time::timeout(TIMEOUT, self.client.request_with_headers(subject, headers, payload))
                    .await
                    .map_err(|_| broker(&what, "atomic batch: no answer within 10 s"))?
                    .map_err(|e| broker(&what, format!("atomic batch: {e}")))?;
                if reply.payload.is_empty() {
                    continue;
                }
                let r: Reply = serde_json::from_slice(&reply.payload)
                    .map_err(|e| broker(&what, format!("atomic batch: unreadable answer ({e})")))?;
                if let Some(err) = r.error {
                    if err.err_code == WRONG_LAST_SEQUENCE {
                        return Err(CheckpointError::Fenced {
                            what,
                            why: format!(
                                "the position record {key:?} was written by another process ({})",
                                err.description
                            ),
                        });
                    }
                    return Err(broker(
                        &what,
                        format!("atomic batch refused: {} (code {})", err.description, err.err_code),
                    ));
                }
                if commit {
                    self.written.fetch_add(bytes as u64, Ordering::Relaxed);
                    return Ok(r.seq);
                }
            } else {
                self.client
                    .publish_with_headers(subject, headers, payload)
                    .await
                    .map_err(|e| broker(&what, format!("atomic batch: {e}")))?;
            }
        }
        Err(broker(&what, "atomic batch: no commit answer"))
    }
}

/// Every stream in the bucket (the last record of each key), read by an ephemeral consumer:
/// no position record is claimed, so nobody is fenced (for `kubecast state`). Each stream's
/// time is its position record's JetStream timestamp.
pub async fn scan(
    client: &async_nats::Client,
    bucket: &str,
) -> Result<Vec<super::record::ScannedStream>, CheckpointError> {
    let what = format!("NATS key-value bucket {bucket}");
    let js = jetstream::ContextBuilder::new().timeout(TIMEOUT).build(client.clone());
    let stream = js
        .get_stream(format!("KV_{bucket}"))
        .await
        .map_err(|e| broker(&what, format!("{e} (no kubecast wrote state there yet?)")))?;
    let mut latest = super::record::Latest::new();
    let filter = consumer::pull::Config { filter_subject: format!("$KV.{bucket}.>"), ..Default::default() };
    each_latest(&stream, bucket, &what, filter, |k, deleted, m| {
        let ms = m.info().ok().map(|i| (i.published.unix_timestamp_nanos() / 1_000_000) as i64);
        latest.insert(k.to_string(), ((!deleted).then(|| m.payload.to_vec()), ms));
        Ok(())
    })
    .await?;
    super::record::fold_all(&format!("NATS bucket {bucket}"), &latest)
}

/// Reads the latest record of each subject `filter` selects (a consumer delivering the last per
/// subject, each record within [`TIMEOUT`]) and hands `each` its key (the subject without
/// `$KV.<bucket>.`), whether it is a deletion, and the record, in stream order.
async fn each_latest(
    stream: &stream::Stream,
    bucket: &str,
    what: &str,
    filter: consumer::pull::Config,
    mut each: impl FnMut(&str, bool, &jetstream::Message) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::LastPerSubject,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(60),
            ..filter
        })
        .await
        .map_err(|e| broker(what, format!("reading it: {e}")))?;
    let pending = consumer.cached_info().num_pending;
    if pending == 0 {
        return Ok(());
    }
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(BATCH)
        .messages()
        .await
        .map_err(|e| broker(what, format!("reading it: {e}")))?;
    let prefix = format!("$KV.{bucket}.");
    for _ in 0..pending {
        let m = tokio::time::timeout(TIMEOUT, messages.next())
            .await
            .map_err(|_| broker(what, "reading it: no record within 10 s"))?
            .ok_or_else(|| broker(what, "reading it: the consumer ended"))?
            .map_err(|e| broker(what, format!("reading it: {e}")))?;
        let k = m.subject.as_str().strip_prefix(&prefix).unwrap_or(m.subject.as_str());
        let deleted = m
            .headers
            .as_ref()
            .and_then(|h| h.get("KV-Operation"))
            .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE");
        each(k, deleted, &m)?;
    }
    Ok(())
}

#[cfg(test)]
mod replica_tests {
    #[test]
    fn a_created_bucket_has_up_to_three_replicas_in_a_cluster_and_one_outside() {
        use super::default_replicas;
        assert_eq!(default_replicas(false, 0), 1);
        assert_eq!(default_replicas(false, 5), 1, "a server outside a cluster keeps one copy");
        assert_eq!(default_replicas(true, 0), 1);
        assert_eq!(default_replicas(true, 2), 2);
        assert_eq!(default_replicas(true, 5), 3);
    }
}
