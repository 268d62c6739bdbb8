//! `kubecast state`: see, reset and move the stored state of the streams (issue #21), on every
//! store (file, Kafka, NATS).
//!
//! - `list` / `show` / `export` only read: the file store's directory is read without its lock
//!   (a torn last journal line is skipped, not cut off), the Kafka topic by a plain
//!   `read_committed` consumer (no transactional producer: nobody is fenced), the NATS bucket by
//!   an ephemeral consumer (no position record is claimed). They work while kubecast runs.
//! - `reset` / `import` write: first the Lease of `[coordination]` is read, and a write is
//!   refused while another process holds it (renewed within its duration), naming the holder,
//!   unless `--force`. Then the store is opened exactly as `kubecast run` opens it (the file
//!   store's lock, the Kafka store's `transactional.id`, whose `init_transactions` fences a
//!   running kubecast; the NATS store claims the stream's position record), so a kubecast that
//!   runs anyway stops writing instead of overwriting the change.
//!
//! Writes go through [`Store::write`], as kubecast's own: a full delta per stream (its whole
//! index, the index records no longer in it deleted, and the position).

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Subcommand, ValueEnum};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DynamicObject, GroupVersionKind, ListParams};
use tokio_util::sync::CancellationToken;

use super::store;
use super::wiring::{StreamPlan, plan};
use crate::config::Config;
use crate::model::{IndexEntry, ObjectIndex, Position};
use crate::observe::kube_error::in_words;
use crate::sink::{Sink, SinkError};
use crate::source::client::{self, ClientError};
use crate::state::StoreKind;
use crate::state::store::{CheckpointError, Delta, Owner, StreamKey, file, kafka, nats};

mod export;

pub use export::{EXPORT_FORMAT, Export, ExportedStream};

/// The `kubecast state` subcommands.
#[derive(Debug, Subcommand)]
pub enum StateCommand {
    /// Every stream in the store: its query, resume position, objects indexed, last write, epoch.
    List {
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
    /// One stream (its id or a unique prefix of it), with its first index entries.
    Show {
        /// The stream id (`kubecast state list`) or a unique prefix of it.
        stream: String,
        #[arg(long, short, value_enum, default_value_t = Output::Table)]
        output: Output,
        /// How many index entries to show.
        #[arg(long, default_value_t = 20)]
        entries: usize,
    },
    /// Starts a stream of the config over.
    Reset {
        /// The stream id (of the config's streams) or a unique prefix of it.
        stream: String,
        /// `now`: index the current objects at the current resourceVersion (nothing emitted,
        /// later changes and deletes are); `snapshot`: forget everything (every object is
        /// emitted again, also where the resource has `initial = "now"`).
        #[arg(long, value_enum)]
        to: ResetTo,
        /// Write even while another process holds the Lease.
        #[arg(long)]
        force: bool,
    },
    /// Writes every stream of the store as one JSON document to standard output.
    Export,
    /// Writes the streams of an exported document into the configured store.
    Import {
        /// A document written by `kubecast state export`.
        file: PathBuf,
        /// Write even while another process holds the Lease.
        #[arg(long)]
        force: bool,
        /// Also import streams the config does not watch.
        #[arg(long)]
        all: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ResetTo {
    Now,
    Snapshot,
}

/// Why a `kubecast state` command failed (the process exits with 1).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error("no stream {stream:?} in {place} (fix: one of the ids `kubecast state list` shows: {known})")]
    NoSuchStream { stream: String, place: String, known: String },
    #[error("{stream:?} is the start of several stream ids ({matches}) (fix: give more of the id)")]
    Ambiguous { stream: String, matches: String },
    #[error(
        "lease {lease} is held by {holder} (renewed {renewed}, valid until {until}): a kubecast is running on this state (fix: stop it first, or pass --force; its next state write then fails and it stops)"
    )]
    LeaseHeld { lease: String, holder: String, renewed: String, until: String },
    #[error(
        "lease {lease} cannot be read: {cause} (fix: grant get on leases.coordination.k8s.io, or pass --force to skip the check)"
    )]
    Lease { lease: String, cause: String },
    #[error("resources[{index}] ({stream}): listing it failed: {cause}")]
    List { index: usize, stream: String, cause: String },
    #[error("{file}: {cause}")]
    Document { file: String, cause: String },
    #[error(
        "{file} was exported from another cluster: its {what} is {exported}, this cluster's is {live} (fix: import it into the cluster it came from; state of one cluster would miss or repeat the other's changes)"
    )]
    OtherCluster { file: String, what: String, exported: String, live: String },
    #[error(
        "{file}: {count} stream(s) the config does not watch: {streams} (fix: pass --all to import them anyway, or check [cluster] name and [[resources]])"
    )]
    NotWatched { file: String, count: usize, streams: String },
    #[error(
        "the cluster's identity (uid of namespace kube-system) cannot be read; it is needed to check the state's cluster (fix: grant get on namespaces/kube-system)"
    )]
    NoClusterUid,
    #[error(
        "reset and import write the state of the streams as one active process keeps it, and this config has [coordination] shards = {shards}, whose positions are kept per shard (fix: list, show and export work on it; to start the streams over, follow the change of shard count in docs/sharding.md)"
    )]
    Sharded { shards: u32 },
    #[error(
        "standard output is closed or /dev/null: the export would go nowhere (fix: send it to a file, e.g. `kubecast state export > state.json`)"
    )]
    NoOutput,
    // The cause follows as the source (main prints the chain).
    #[error("writing the output")]
    Output(#[from] std::io::Error),
}

/// One stream as stored.
#[derive(Debug)]
struct Stored {
    key: StreamKey,
    position: Position,
    cluster_uid: Option<String>,
    /// The file store keeps no epoch or writer.
    epoch: Option<i64>,
    writer: Option<String>,
    written: Option<chrono::DateTime<chrono::Utc>>,
}

impl Stored {
    fn rows(&self, limit: usize) -> Vec<(String, String, String, String)> {
        self.position
            .objects
            .iter()
            .take(limit)
            .map(|(uid, e)| {
                (
                    uid.to_string(),
                    e.namespace.unwrap_or("").to_string(),
                    e.name.to_string(),
                    e.resource_version.to_string(),
                )
            })
            .collect()
    }

    fn json(&self, entries: Option<usize>) -> serde_json::Value {
        let mut v = serde_json::json!({
            "stream": self.key.id(),
            "query": self.key,
            "resource_version": self.position.resource_version,
            "objects": self.position.objects.len(),
            "acked_ahead": self.position.acked_ahead.len(),
            "written_at": self.written.map(|t| t.to_rfc3339()),
            "epoch": self.epoch,
            "writer": self.writer,
            "cluster_uid": self.cluster_uid,
        });
        if let Some(n) = entries {
            v["entries"] = serde_json::json!(self.rows(n));
        }
        v
    }
}

/// `v1 ConfigMap in shop labels=app=x fields=..`
fn query(k: &StreamKey) -> String {
    let gv = if k.group.is_empty() { k.version.clone() } else { format!("{}/{}", k.group, k.version) };
    let mut q = format!("{gv} {}", k.kind);
    match &k.namespace {
        Some(ns) => q.push_str(&format!(" in {ns}")),
        None => q.push_str(" (cluster-wide)"),
    }
    if !k.label_selector.is_empty() {
        q.push_str(&format!(" labels={}", k.label_selector));
    }
    if !k.field_selector.is_empty() {
        q.push_str(&format!(" fields={}", k.field_selector));
    }
    if k.cluster.is_empty() { q } else { format!("[{}] {q}", k.cluster) }
}

/// Runs one `kubecast state` command.
pub async fn run(config: Config, cmd: StateCommand) -> Result<(), StateError> {
    match cmd {
        StateCommand::List { output } => {
            let (place, streams) = scan(&config).await?;
            let mut out = std::io::stdout().lock();
            match output {
                Output::Json => {
                    let v: Vec<_> = streams.iter().map(|s| s.json(None)).collect();
                    writeln!(out, "{}", serde_json::to_string_pretty(&v).expect("json"))?;
                }
                Output::Table => {
                    if streams.is_empty() {
                        eprintln!("no stream state in {place}");
                    }
                    table(&mut out, &streams)?;
                }
            }
            Ok(())
        }
        StateCommand::Show { stream, output, entries } => {
            let (place, streams) = scan(&config).await?;
            let ids: Vec<String> = streams.iter().map(|s| s.key.id()).collect();
            let i = pick(&stream, &ids, &place)?;
            let s = &streams[i];
            let mut out = std::io::stdout().lock();
            match output {
                Output::Json => {
                    writeln!(out, "{}", serde_json::to_string_pretty(&s.json(Some(entries))).expect("json"))?
                }
                Output::Table => {
                    let dash = |o: Option<String>| o.unwrap_or_else(|| "-".into());
                    writeln!(out, "stream:           {}", s.key.id())?;
                    writeln!(out, "query:            {}", query(&s.key))?;
                    writeln!(out, "resume at:        {}", dash(s.position.resource_version.clone()))?;
                    writeln!(out, "objects:          {}", s.position.objects.len())?;
                    writeln!(out, "acked ahead:      {}", s.position.acked_ahead.len())?;
                    writeln!(out, "written:          {}", dash(s.written.map(|t| t.to_rfc3339())))?;
                    writeln!(out, "epoch:            {}", dash(s.epoch.map(|e| e.to_string())))?;
                    writeln!(out, "writer:           {}", dash(s.writer.clone()))?;
                    writeln!(out, "cluster uid:      {}", dash(s.cluster_uid.clone()))?;
                    writeln!(out, "entries (first {entries}):")?;
                    writeln!(out, "  {:<38} {:<24} {:<40} RESOURCEVERSION", "UID", "NAMESPACE", "NAME")?;
                    for (uid, ns, name, rv) in s.rows(entries) {
                        writeln!(out, "  {uid:<38} {ns:<24} {name:<40} {rv}")?;
                    }
                }
            }
            Ok(())
        }
        StateCommand::Export => {
            let (client, _) = client::client(&config.cluster).await?;
            let uid = store::cluster_uid(&client).await;
            let (place, streams) = scan(&config).await?;
            let doc = Export {
                format: EXPORT_FORMAT,
                cluster_name: config.cluster.name.clone(),
                cluster_uid: uid,
                source: place,
                exported_at: chrono::Utc::now().to_rfc3339(),
                streams: streams
                    .iter()
                    .map(|s| ExportedStream {
                        id: s.key.id(),
                        key: s.key.clone(),
                        cluster_uid: s.cluster_uid.clone(),
                        resource_version: s.position.resource_version.clone(),
                        acked_ahead: s.position.acked_ahead.clone(),
                        objects: s.rows(usize::MAX),
                        snapshot: s.position.snapshot,
                    })
                    .collect(),
            };
            let file = standard_output()?;
            let mut out = std::io::BufWriter::new(&file);
            serde_json::to_writer_pretty(&mut out, &doc).map_err(std::io::Error::from)?;
            writeln!(out)?;
            out.flush()?;
            drop(out);
            // A backup: on the disk before the command says it is done.
            if file.metadata().is_ok_and(|m| m.is_file()) {
                file.sync_all()?;
            }
            eprintln!("exported {} stream(s) from {}", doc.streams.len(), doc.source);
            Ok(())
        }
        StateCommand::Reset { .. } | StateCommand::Import { .. } if config.coordination.sharded().is_some() => {
            Err(StateError::Sharded { shards: config.coordination.shards })
        }
        StateCommand::Reset { stream, to, force } => reset(&config, &stream, to, force).await,
        StateCommand::Import { file, force, all } => import(&config, &file, force, all).await,
    }
}

/// Standard output as a file of its own, for the export. A closed standard output is
/// `/dev/null` by the time kubecast runs (Rust's runtime opens it there), and a backup that
/// went nowhere must not end with success: `/dev/null` is refused.
fn standard_output() -> Result<std::fs::File, StateError> {
    use std::os::fd::AsFd;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let file = std::fs::File::from(std::io::stdout().as_fd().try_clone_to_owned().map_err(StateError::Output)?);
    let null = std::fs::metadata("/dev/null").ok().map(|m| m.rdev());
    let meta = file.metadata().map_err(StateError::Output)?;
    if meta.file_type().is_char_device() && Some(meta.rdev()) == null {
        return Err(StateError::NoOutput);
    }
    Ok(file)
}

fn table(out: &mut impl Write, streams: &[Stored]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<56} {:<48} {:<12} {:>8} {:<26} {:>5}",
        "STREAM", "QUERY", "RESUME AT", "OBJECTS", "WRITTEN", "EPOCH"
    )?;
    for s in streams {
        writeln!(
            out,
            "{:<56} {:<48} {:<12} {:>8} {:<26} {:>5}",
            s.key.id(),
            query(&s.key),
            s.position.resource_version.as_deref().unwrap_or("-"),
            s.position.objects.len(),
            s.written.map(|t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string()).unwrap_or_else(|| "-".into()),
            s.epoch.map(|e| e.to_string()).unwrap_or_else(|| "-".into()),
        )?;
    }
    Ok(())
}

/// `stream` is an id of `ids` or the start of exactly one.
fn pick(stream: &str, ids: &[String], place: &str) -> Result<usize, StateError> {
    if let Some(i) = ids.iter().position(|id| id == stream) {
        return Ok(i);
    }
    // An empty id (an unset shell variable) is the start of every id: never a choice.
    let matches: Vec<usize> =
        (0..ids.len()).filter(|&i| !stream.trim().is_empty() && ids[i].starts_with(stream)).collect();
    match matches.as_slice() {
        [i] => Ok(*i),
        [] => Err(StateError::NoSuchStream {
            stream: stream.to_string(),
            place: place.to_string(),
            known: if ids.is_empty() { "none".into() } else { ids.join(", ") },
        }),
        _ => Err(StateError::Ambiguous {
            stream: stream.to_string(),
            matches: matches.iter().map(|&i| ids[i].as_str()).collect::<Vec<_>>().join(", "),
        }),
    }
}

fn time_ms(ms: Option<i64>) -> Option<chrono::DateTime<chrono::Utc>> {
    ms.filter(|&m| m > 0).and_then(chrono::DateTime::from_timestamp_millis)
}

/// Every stream of the configured store, read only. Returns where they were read.
async fn scan(config: &Config) -> Result<(String, Vec<Stored>), StateError> {
    let c = &config.checkpoint;
    let (place, mut streams) = match c.store {
        StoreKind::File => {
            let found = file::scan(&c.dir)?;
            let streams: Vec<Stored> = found
                .into_iter()
                .map(|f| Stored {
                    key: f.key,
                    position: f.position,
                    cluster_uid: f.cluster_uid,
                    epoch: None,
                    writer: None,
                    written: f.modified.map(chrono::DateTime::<chrono::Utc>::from),
                })
                .collect();
            (format!("directory {}", c.dir.display()), streams)
        }
        StoreKind::Kafka | StoreKind::Nats => {
            let sink = Sink::open(&config.sink, config.delivery.max_in_flight).await?;
            let (place, found) = if c.store == StoreKind::Kafka {
                let client = store::kafka_client(config, &sink)?;
                (format!("Kafka topic {}", c.kafka.topic), kafka::scan(&client, &c.kafka.topic).await?)
            } else {
                let client = store::nats_client(config, &sink).await?;
                (format!("NATS bucket {}", c.nats.bucket), nats::scan(&client, &c.nats.bucket).await?)
            };
            let streams = found
                .into_iter()
                .map(|s| Stored {
                    key: s.record.stream,
                    position: s.position,
                    cluster_uid: s.record.cluster_uid,
                    epoch: Some(s.record.epoch),
                    writer: Some(s.record.writer),
                    written: time_ms(s.written_ms),
                })
                .collect();
            (place, streams)
        }
    };
    streams.sort_by_key(|s| s.key.id());
    Ok((place, streams))
}

/// Refuses while another process holds the config's Lease (unless `force`); returns the
/// Lease's epoch (`leaseTransitions`; `None` without `[coordination]`, without a Lease or when
/// `--force` writes without reading it).
async fn check_lease(config: &Config, client: &kube::Client, force: bool) -> Result<Option<i64>, StateError> {
    let c = &config.coordination;
    if !c.enabled {
        eprintln!(
            "note: no [coordination] in the config: whether a kubecast is running on this state cannot be checked (the file store's directory lock still refuses a second process)"
        );
        return Ok(None);
    }
    let ns = c.namespace();
    let lease = format!("{ns}/{}", c.lease_name);
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let found = match api.get_opt(&c.lease_name).await {
        Ok(l) => l,
        Err(e) if force => {
            eprintln!("warning: lease {lease} cannot be read ({e}); --force: writing anyway");
            return Ok(None);
        }
        Err(e) => return Err(StateError::Lease { lease, cause: e.to_string() }),
    };
    let Some(spec) = found.and_then(|l| l.spec) else { return Ok(None) };
    let epoch = Some(i64::from(spec.lease_transitions.unwrap_or(0)));
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
    let (Some(holder), Some(renewed)) = (holder, spec.renew_time.clone()) else { return Ok(epoch) };
    let duration_ms = i64::from(spec.lease_duration_seconds.unwrap_or(0).max(0)) * 1000;
    let until_ms = renewed.0.as_millisecond() + duration_ms;
    let now_ms = chrono::Utc::now().timestamp_millis();
    if until_ms <= now_ms {
        eprintln!("note: lease {lease} was held by {holder}, expired since {}", renewed.0);
        return Ok(epoch);
    }
    let until = time_ms(Some(until_ms)).map(|t| t.to_rfc3339()).unwrap_or_default();
    if force {
        eprintln!("warning: lease {lease} is held by {holder} (until {until}); --force: writing anyway");
        return Ok(epoch);
    }
    Err(StateError::LeaseHeld { lease, holder, renewed: renewed.0.to_string(), until })
}

/// The store, opened as `kubecast run` opens it, after the Lease check.
async fn open_for_write(
    config: &Config,
    client: &kube::Client,
    force: bool,
    what: &str,
) -> Result<(crate::state::store::Store, Option<String>), StateError> {
    let epoch = check_lease(config, client, force).await?;
    let uid = store::cluster_uid(client).await;
    let identity = config.coordination.identity();
    let owner = Owner { cluster_uid: uid.clone(), epoch, writer: format!("kubecast state {what} ({identity})") };
    let sink = Sink::open(&config.sink, config.delivery.max_in_flight).await?;
    let keys: Vec<StreamKey> = plan(config).into_iter().map(|s| s.key).collect();
    // `run` waits for an unreachable broker; a command gives up after 30 s.
    let give_up = CancellationToken::new();
    let timer = give_up.clone();
    let timer = tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(30)).await;
        timer.cancel();
    });
    let health = crate::observe::health::Health::new(Vec::new());
    let bounds = super::bounds::Bounds::of(config);
    let opened = store::open(config, &sink, &keys, owner, &health, &bounds, &give_up).await;
    timer.abort();
    match opened? {
        Some(store) => Ok((store, uid)),
        None => Err(CheckpointError::Broker {
            what: format!("[checkpoint] store {:?}", config.checkpoint.store),
            cause: match health.state_problem() {
                Some(refused) => format!("not usable within 30 s: {refused}"),
                None => "not reachable within 30 s (see the warnings above)".into(),
            },
        }
        .into()),
    }
}

async fn reset(config: &Config, stream: &str, to: ResetTo, force: bool) -> Result<(), StateError> {
    let streams = plan(config);
    let ids: Vec<String> = streams.iter().map(|s| s.key.id()).collect();
    let s = &streams[pick(stream, &ids, "the config's streams")?];
    let rc = &config.resources[s.resource_index];
    let (client, _) = client::client(&config.cluster).await?;
    let (state, _) = open_for_write(config, &client, force, "reset").await?;
    let stored = state.load(std::slice::from_ref(&s.key)).await?.remove(0);
    let old: Vec<String> =
        stored.as_ref().map(|p| p.objects.iter().map(|(uid, _)| uid.to_string()).collect()).unwrap_or_default();
    let delta = match to {
        // Marked: the next list emits every object also where `initial = "now"`.
        ResetTo::Snapshot => Delta { removes: old, full: true, snapshot: true, ..Default::default() },
        ResetTo::Now => {
            let (objects, rv) = list_now(&client, s, rc).await?;
            let removes = old.into_iter().filter(|u| !objects.contains(u)).collect();
            Delta {
                upserts: objects,
                removes,
                full: true,
                resource_version: Some(rv),
                acked_ahead: Vec::new(),
                snapshot: false,
                floors: Vec::new(),
            }
        }
    };
    let (n, rv) = (delta.upserts.len(), delta.resource_version.clone());
    state.write(&[(s.key.clone(), delta)]).await?;
    match to {
        ResetTo::Now => eprintln!(
            "reset {} to now: {n} objects indexed at resourceVersion {}; the next run emits only later changes",
            s.key.id(),
            rv.unwrap_or_default()
        ),
        ResetTo::Snapshot => eprintln!(
            "reset {} to snapshot: index and resume position removed; the next run lists and emits every object",
            s.key.id()
        ),
    }
    Ok(())
}

/// The stream's objects now, by one paginated list (its pages at the first page's
/// resourceVersion), and that resourceVersion.
async fn list_now(
    client: &kube::Client,
    s: &StreamPlan,
    rc: &crate::config::ResourceConfig,
) -> Result<(ObjectIndex, String), StateError> {
    let err = |cause: String| StateError::List { index: s.resource_index, stream: s.name.clone(), cause };
    let gvk = GroupVersionKind::gvk(&s.key.group, &s.key.version, &s.key.kind);
    let (ar, _) = kube::discovery::pinned_kind(client, &gvk).await.map_err(|e| err(in_words(&e).to_string()))?;
    let api: Api<DynamicObject> = match &s.key.namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    let mut lp = ListParams::default().limit(rc.page_size.max(1));
    if !s.key.label_selector.is_empty() {
        lp = lp.labels(&s.key.label_selector);
    }
    if !s.key.field_selector.is_empty() {
        lp = lp.fields(&s.key.field_selector);
    }
    let mut index = ObjectIndex::new();
    let mut rv = None;
    loop {
        let page = api.list_metadata(&lp).await.map_err(|e| err(in_words(&e).to_string()))?;
        if rv.is_none() {
            rv = page.metadata.resource_version.clone();
        }
        for o in &page.items {
            let m = &o.metadata;
            if let (Some(uid), Some(name), Some(orv)) = (&m.uid, &m.name, &m.resource_version) {
                let e =
                    IndexEntry { namespace: m.namespace.clone(), name: name.clone(), resource_version: orv.clone() };
                index.insert(uid, &e);
            }
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp.continue_token = Some(token),
            None => break,
        }
    }
    Ok((index, rv.ok_or_else(|| err("the list carried no resourceVersion".into()))?))
}

async fn import(config: &Config, path: &Path, force: bool, all: bool) -> Result<(), StateError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| StateError::Document { file: file.clone(), cause: e.to_string() })?;
    let doc = Export::parse(&bytes).map_err(|cause| StateError::Document { file: file.clone(), cause })?;
    let watched: Vec<StreamKey> = plan(config).into_iter().map(|s| s.key).collect();
    let foreign: Vec<&ExportedStream> = doc.streams.iter().filter(|s| !watched.contains(&s.key)).collect();
    if !foreign.is_empty() && !all {
        return Err(StateError::NotWatched {
            file,
            count: foreign.len(),
            streams: foreign.iter().map(|s| s.id.as_str()).collect::<Vec<_>>().join(", "),
        });
    }
    let (client, _) = client::client(&config.cluster).await?;
    let live = store::cluster_uid(&client).await.ok_or(StateError::NoClusterUid)?;
    let differs = |what: &str, exported: &Option<String>| match exported {
        Some(e) if *e != live => Err(StateError::OtherCluster {
            file: file.clone(),
            what: what.to_string(),
            exported: e.clone(),
            live: live.clone(),
        }),
        _ => Ok(()),
    };
    differs("cluster uid (kube-system namespace)", &doc.cluster_uid)?;
    for s in &doc.streams {
        differs(&format!("stream {}'s cluster uid", s.id), &s.cluster_uid)?;
    }
    let (state, _) = open_for_write(config, &client, force, "import").await?;
    let keys: Vec<StreamKey> = doc.streams.iter().map(|s| s.key.clone()).collect();
    // Read (and, NATS, claimed) first: what the target holds now is replaced, not merged.
    let before = state.load(&keys).await?;
    let mut deltas = Vec::new();
    for (s, old) in doc.streams.iter().zip(before) {
        let p = s.position();
        let keep: HashSet<&str> = s.objects.iter().map(|o| o.0.as_str()).collect();
        let removes = old
            .map(|o| o.objects.iter().map(|(u, _)| u.to_string()).filter(|u| !keep.contains(u.as_str())).collect())
            .unwrap_or_default();
        deltas.push((
            s.key.clone(),
            Delta {
                upserts: p.objects,
                removes,
                full: true,
                resource_version: p.resource_version,
                acked_ahead: p.acked_ahead,
                snapshot: p.snapshot,
                floors: p.floors,
            },
        ));
    }
    state.write(&deltas).await?;
    eprintln!("imported {} stream(s) from {file} into {}", deltas.len(), state.describe());
    Ok(())
}

#[cfg(test)]
mod tests;
