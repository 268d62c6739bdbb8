//! The reflector: one list+watch loop per stream (resource + namespace scope + selectors),
//! written as an explicit state machine. It never loses a change and never re-emits an
//! unchanged object, across restarts (it resumes from the persisted checkpoint) and 410 Gone
//! (it relists and diffs against the index of what it delivered).
//!
//! ```text
//!   Discover --kind served--> (checkpoint has rv?) --yes--> Watching { rv }
//!      ^  |                          |no
//!      |  +--not served--> WaitForKind --backoff--> Discover
//!      |                             v
//!      |                   Listing { origin } --list done, diffed--> Watching { list rv }
//!      |                        ^                                       |  |  |
//!      +--- kind gone (404) ----|---------------------------------------+  |  |
//!                               +--- 410 Gone / too large rv --------------+  |
//!                                      (in-stream ERROR or HTTP status)       |
//!           Backoff { then } <--- other errors (429, refused, 5xx...) ---------+
//! ```
//!
//! * `Discover` resolves the kind by discovery. Not served: `WaitForKind` (rediscovers with
//!   backoff; `missing_kind = "fail"` makes it fatal instead).
//! * `Listing` reads the current state with a consistent read: a streaming list
//!   (`watch?sendInitialEvents=true&resourceVersionMatch=NotOlderThan`, whose initial state
//!   ends with a bookmark annotated `k8s.io/initial-events-end`, after which the same
//!   connection goes on as the watch), or, where the apiserver rejects that (WatchList gate
//!   off, e.g. 1.33), a paginated LIST (resourceVersion unset, `limit = page_size`; an expired
//!   continue token restarts the list, because the token offered with the 410 gives an
//!   inconsistent list). Objects are diffed one by one as they arrive (never all held at
//!   once) against the index: new uid -> `added`, changed
//!   resourceVersion -> `modified`, uid missing from the list -> `deleted` with the last known
//!   uid, namespace, name and resourceVersion, unchanged -> nothing. `origin` is `snapshot`
//!   until the stream's first list was acknowledged, `resync` after. With `initial = "now"`
//!   the first list emits nothing. The list ends with an item that sets the checkpoint to the
//!   *list's* resourceVersion and the new index.
//! * `Watching` streams `watch?resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=..`;
//!   starting from a checkpoint's rv this replays exactly the changes after it. Each event and
//!   bookmark moves `rv`. The client has no read timeout, so each `next()` is bounded by an idle
//!   timeout; a closed or idle stream re-watches the same rv at once (no relist).
//! * `Backoff` sleeps a jittered exponential delay (0.8 s .. 30 s, reset after a watch that
//!   stayed healthy for 2 minutes), then goes to `then`. 429 and refused connections re-watch
//!   the same rv: no relist.
//! * Resource versions are opaque: compared for equality only.
//! * Readiness (`/readyz`): a stream is synced after a list, or, resumed from a checkpoint,
//!   once its first watch delivered an event or bookmark or ran 1 s without an error. An
//!   accepted watch can still answer 410 as its first event (an expired checkpoint): the
//!   stream stays not ready until the relist-diff that follows is done.
//!
//! Every emitted [`Item`] carries a stream-local sequence number and its effect on the
//! checkpoint; see `ack.rs` for how acknowledgements turn into checkpoints. Fatal (the stream
//! returns an error): the resource is forbidden (403) on the first list, or is missing with
//! `missing_kind = "fail"`, or `namespaces` is set for a cluster-scoped kind.

use prometheus_client::metrics::counter::Counter;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::TryStreamExt;
use kube::Client;
use kube::api::{Api, ApiResource, GroupVersionKind, ListParams, ObjectMeta, WatchEvent, WatchParams};
use kube::discovery::{self, Scope};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use serde::{Deserialize, Serialize};

use super::client::ApiLimiter;
use crate::model::{Change, Effect, EventSource, Index, IndexEntry, IndexOp, Origin, Position, RawObject, Verb};
use crate::observe::health::{Health, StreamPhase};

/// Client-side idle timeout around each `next()`: the server-side watch timeout plus this.
const IDLE_MARGIN: Duration = Duration::from_secs(5);
/// Annotation of the bookmark that ends a streaming list's initial state.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// A watch that lived this long resets the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(120);
/// A stream resumed from its checkpoint counts as synced once its first watch delivered an
/// event or a bookmark, or stayed this long without an error: the 410 of an expired
/// resourceVersion can come as the first event of an accepted watch.
const RESUME_CONFIRM: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
/// `initial`: what a stream without a checkpoint emits first: every existing object once
/// (`snapshot`), or only the changes from then on (`now`).
pub enum Initial {
    #[default]
    Snapshot,
    Now,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
/// `missing_kind`: a kind that is not served (CRD not installed yet) is waited for (`wait`),
/// or stops kubecast (`fail`).
pub enum MissingKind {
    #[default]
    Wait,
    Fail,
}

/// What one stream watches.
#[derive(Clone)]
pub struct StreamSpec {
    /// Index of the stream in the pipeline; carried by every item.
    pub id: usize,
    /// Human-readable, e.g. `v1 ConfigMap in namespace shop`.
    pub name: String,
    /// `[[resources]]` index, for messages.
    pub resource_index: usize,
    pub cluster: String,
    pub client: Client,
    pub limiter: ApiLimiter,
    pub gvk: GroupVersionKind,
    /// `None`: cluster-wide.
    pub namespace: Option<String>,
    pub label_selector: String,
    pub field_selector: String,
    pub page_size: u32,
    /// Server-side timeout of each watch request (`timeoutSeconds`).
    pub watch_timeout_seconds: u32,
    pub initial: Initial,
    pub missing_kind: MissingKind,
    /// Try streaming lists first (falling back to paginated lists when rejected).
    pub streaming_lists: bool,
    /// Where the stream reports its phase for readiness.
    pub health: Arc<Health>,
}

/// One unit the reflector hands to the pipeline. `change` is `None` for items that only move
/// the checkpoint (bookmarks, end of a list).
#[derive(Debug)]
pub struct Item {
    pub stream: usize,
    pub seq: u64,
    pub effect: Effect,
    pub change: Option<Change>,
}

/// The states of one stream; see the module documentation for the transitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Discover,
    WaitForKind,
    Listing { origin: Origin },
    Watching { rv: String },
    Backoff { then: Box<State> },
}

#[derive(Debug, thiserror::Error)]
pub enum ReflectorError {
    #[error(
        "resources[{index}] ({stream}): forbidden: {message} (fix: grant get, list and watch on {resource} to kubecast's identity)"
    )]
    Forbidden { index: usize, stream: String, resource: String, message: String },
    #[error("resources[{index}] ({stream}): {message}")]
    Kind { index: usize, stream: String, message: String },
}

/// Resolved once the kind is served.
struct Target {
    api: Api<RawObject>,
    source: Arc<EventSource>,
}

pub struct Reflector {
    spec: StreamSpec,
    target: Option<Target>,
    /// The live index: every object the stream has emitted (or, with `initial = "now"`, seen).
    index: Index,
    /// The resume point loaded at start (consumed by the first `Discover`).
    resume: Option<String>,
    /// Whether a list of this stream was ever completed (here or before a restart).
    listed_once: bool,
    /// Marked synced (ready) in this process: after a list, or a resumed watch that proved
    /// its resourceVersion valid.
    synced: bool,
    state: State,
    /// Whether the apiserver accepts streaming lists: unknown until tried.
    streaming: Option<bool>,
    seq: u64,
    backoff: ExponentialBackoff,
    tx: mpsc::Sender<Item>,
    metrics: ReflectorMetrics,
    /// Changes after the resume point already delivered before a restart (out of order): the
    /// resumed watch acknowledges them without sending them again.
    acked_ahead: HashSet<(String, String)>,
}

/// The stream's counters (`src/metrics.rs`), resolved once.
struct ReflectorMetrics {
    relists: Counter,
    gone: Counter,
    resync_events: Counter,
    watch_restarts: Counter,
    watched_once: bool,
}

/// How often a long list logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The progress of one list (paginated or streaming) being diffed against the index.
struct ListDiff {
    origin: Origin,
    /// `initial = "now"` on the first list: index, but emit nothing.
    silent: bool,
    /// Uids the list contained so far.
    seen: HashSet<String>,
    emitted: usize,
    started: Instant,
    /// When progress was last logged.
    reported: Instant,
}

/// The receiver is gone: the pipeline is shutting down.
struct Closed;

impl Reflector {
    pub fn new(spec: StreamSpec, start: Option<Position>, tx: mpsc::Sender<Item>) -> Self {
        let listed_once = start.as_ref().is_some_and(|c| c.resource_version.is_some());
        let spec_name = spec.name.clone();
        let streaming = if spec.streaming_lists { None } else { Some(false) };
        let (resume, index, acked_ahead) = match start {
            Some(cp) => (cp.resource_version, cp.objects, cp.acked_ahead.into_iter().collect()),
            None => (None, Index::default(), HashSet::new()),
        };
        Self {
            spec,
            target: None,
            index,
            resume,
            listed_once,
            synced: false,
            state: State::Discover,
            streaming,
            seq: 0,
            backoff: new_backoff(),
            tx,
            acked_ahead,
            metrics: {
                let m = crate::observe::metrics::get();
                let name = &spec_name;
                ReflectorMetrics {
                    relists: crate::observe::metrics::stream_counter(&m.relists, name),
                    gone: crate::observe::metrics::stream_counter(&m.gone, name),
                    resync_events: crate::observe::metrics::stream_counter(&m.resync_events, name),
                    watch_restarts: crate::observe::metrics::stream_counter(&m.watch_restarts, name),
                    watched_once: false,
                }
            },
        }
    }

    /// Runs the stream until `cancel` fires or the pipeline is gone.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), ReflectorError> {
        loop {
            let state = std::mem::replace(&mut self.state, State::Discover);
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                next = self.step(state) => next?,
            };
            match next {
                Ok(s) => {
                    debug!(stream = %self.spec.name, state = ?s, "transition");
                    self.state = s;
                }
                Err(Closed) => return Ok(()),
            }
        }
    }

    async fn step(&mut self, state: State) -> Result<Result<State, Closed>, ReflectorError> {
        match state {
            State::Discover => self.discover().await.map(Ok),
            State::WaitForKind => {
                tokio::time::sleep(self.next_delay()).await;
                Ok(Ok(State::Discover))
            }
            State::Listing { origin } => self.list_and_diff(origin).await,
            State::Watching { rv } => self.watch(rv).await,
            State::Backoff { then } => {
                tokio::time::sleep(self.next_delay()).await;
                Ok(Ok(*then))
            }
        }
    }

    fn next_delay(&mut self) -> Duration {
        self.backoff.next().unwrap_or(Duration::from_secs(30))
    }

    async fn discover(&mut self) -> Result<State, ReflectorError> {
        self.spec.limiter.until_ready().await;
        let (ar, caps) = match discovery::pinned_kind(&self.spec.client, &self.spec.gvk).await {
            Ok(found) => found,
            Err(e) if is_not_served(&e) => {
                let message =
                    format!("kind {:?} is not served in {:?} ({e})", self.spec.gvk.kind, gv_string(&self.spec.gvk));
                if self.spec.missing_kind == MissingKind::Fail {
                    return Err(self.kind_error(format!(
                        "{message} (fix: check api_version and kind with `kubectl api-resources`, install the CRD first, or set missing_kind = \"wait\")"
                    )));
                }
                error!(stream = %self.spec.name, resource = %format!("resources[{}]", self.spec.resource_index), "{message}; waiting for it to be served (missing_kind = \"wait\")");
                self.synced = false;
                self.spec.health.set_phase(self.spec.id, StreamPhase::WaitingForKind);
                return Ok(State::WaitForKind);
            }
            Err(e) => {
                warn!(stream = %self.spec.name, error = %e, "discovery failed; retrying after backoff");
                return Ok(State::Backoff { then: Box::new(State::Discover) });
            }
        };
        if !caps.supports_operation(discovery::verbs::LIST) || !caps.supports_operation(discovery::verbs::WATCH) {
            return Err(self.kind_error(
                "the server does not allow list and watch on this kind (fix: choose a watchable kind)".into(),
            ));
        }
        let api = match (&self.spec.namespace, &caps.scope) {
            (Some(_), Scope::Cluster) => {
                return Err(self.kind_error(format!(
                    "namespaces is set, but {} is cluster-scoped (fix: remove namespaces)",
                    ar.kind
                )));
            }
            (Some(ns), Scope::Namespaced) => Api::namespaced_with(self.spec.client.clone(), ns, &ar),
            (None, _) => Api::all_with(self.spec.client.clone(), &ar),
        };
        let source = Arc::new(EventSource::new(&self.spec.cluster, &ar));
        self.target = Some(Target { api, source });
        Ok(match self.resume.take() {
            Some(rv) => {
                info!(stream = %self.spec.name, resource_version = %rv, objects = self.index.len(), "resuming from checkpoint");
                State::Watching { rv }
            }
            // A known kind that came back (CRD re-created), or a first start.
            None => State::Listing { origin: if self.listed_once { Origin::Resync } else { Origin::Snapshot } },
        })
    }

    fn kind_error(&self, message: String) -> ReflectorError {
        ReflectorError::Kind { index: self.spec.resource_index, stream: self.spec.name.clone(), message }
    }

    fn target(&self) -> &Target {
        self.target.as_ref().expect("discovered before listing or watching")
    }

    async fn emit(&mut self, effect: Effect, change: Option<Change>) -> Result<(), Closed> {
        if change.as_ref().is_some_and(|c| c.origin == Origin::Resync) {
            self.metrics.resync_events.inc();
        }
        let item = Item { stream: self.spec.id, seq: self.seq, effect, change };
        self.seq += 1;
        self.tx.send(item).await.map_err(|_| Closed)
    }

    fn change(&self, verb: Verb, origin: Origin, object: RawObject) -> Change {
        Change { verb, origin, object, source: self.target().source.clone() }
    }

    async fn list_and_diff(&mut self, origin: Origin) -> Result<Result<State, Closed>, ReflectorError> {
        let started = Instant::now();
        let mut diff = ListDiff {
            origin,
            silent: !self.listed_once && self.spec.initial == Initial::Now,
            seen: HashSet::new(),
            emitted: 0,
            started,
            reported: started,
        };
        if self.listed_once {
            self.metrics.relists.inc();
        }
        // A list diffs against the index; changes delivered before a restart are no longer
        // replayed one by one.
        self.acked_ahead.clear();
        if self.streaming != Some(false) {
            return self.streaming_list(diff, started).await;
        }
        let list_rv = match self.paginated_list(&mut diff).await {
            Ok(Ok(rv)) => rv,
            Ok(Err(Closed)) => return Ok(Err(Closed)),
            Err(e) => return Ok(Ok(self.after_list_error(e, origin)?)),
        };
        if self.finish_diff(diff, list_rv.clone(), started, "paginated").await.is_err() {
            return Ok(Err(Closed));
        }
        Ok(Ok(State::Watching { rv: list_rv }))
    }

    /// Diffs one listed object against the index and emits its change, if any.
    async fn diff_item(&mut self, diff: &mut ListDiff, obj: RawObject) -> Result<(), Closed> {
        let Some((uid, entry)) = index_entry(&obj.metadata) else {
            warn!(stream = %self.spec.name, "listed object without uid/name/resourceVersion skipped");
            return Ok(());
        };
        diff.seen.insert(uid.clone());
        if diff.reported.elapsed() >= PROGRESS_EVERY {
            diff.reported = Instant::now();
            let secs = diff.started.elapsed().as_secs_f64();
            info!(
                stream = %self.spec.name,
                objects = diff.seen.len(),
                events = diff.emitted,
                per_second = (diff.seen.len() as f64 / secs.max(1e-3)) as u64,
                origin = diff.origin.as_str(),
                "listing: {} objects so far", diff.seen.len()
            );
        }
        let verb = match self.index.get(&uid) {
            None => Verb::Added,
            Some(old) if old.resource_version != entry.resource_version => Verb::Modified,
            Some(_) => return Ok(()),
        };
        self.index.insert(uid.clone(), entry.clone());
        if diff.silent {
            return Ok(());
        }
        diff.emitted += 1;
        let change = self.change(verb, diff.origin, obj);
        self.emit(Effect::Diffed(IndexOp::Upsert(uid, entry)), Some(change)).await
    }

    /// After the last listed object: objects the index has but the list had not were deleted
    /// while the stream was not watching. Then the item that moves the checkpoint to `rv`.
    async fn finish_diff(&mut self, diff: ListDiff, rv: String, started: Instant, mode: &str) -> Result<(), Closed> {
        let gone: Vec<String> = self.index.keys().filter(|uid| !diff.seen.contains(*uid)).cloned().collect();
        let deleted = gone.len();
        for uid in gone {
            let entry = self.index.remove(&uid).expect("listed from the index");
            let object = tombstone(self.target().source.api_resource(), &uid, &entry);
            let change = self.change(Verb::Deleted, Origin::Resync, object);
            self.emit(Effect::Diffed(IndexOp::Remove(uid)), Some(change)).await?;
        }
        info!(
            stream = %self.spec.name,
            objects = self.index.len(),
            events = diff.emitted + deleted,
            origin = diff.origin.as_str(),
            mode,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "list complete; watching"
        );
        self.listed_once = true;
        self.set_synced();
        self.emit(Effect::Listed { rv, objects: self.index.clone() }, None).await
    }

    fn after_list_error(&self, e: kube::Error, origin: Origin) -> Result<State, ReflectorError> {
        match &e {
            kube::Error::Api(s) if s.code == 403 && !self.listed_once => {
                return Err(ReflectorError::Forbidden {
                    index: self.spec.resource_index,
                    stream: self.spec.name.clone(),
                    resource: self.target().source.api_resource().plural.clone(),
                    message: s.message.clone(),
                });
            }
            kube::Error::Api(s) if s.code == 404 => {
                warn!(stream = %self.spec.name, "the kind is no longer served; rediscovering");
                return Ok(State::WaitForKind);
            }
            _ => {}
        }
        warn!(stream = %self.spec.name, error = %e, "list failed; retrying after backoff");
        Ok(State::Backoff { then: Box::new(State::Listing { origin }) })
    }

    /// A consistent, paginated LIST, diffed page by page (objects are not all held at once).
    /// A 410 on a continue token restarts from the first page. Returns the list's
    /// resourceVersion.
    async fn paginated_list(&mut self, diff: &mut ListDiff) -> Result<Result<String, Closed>, kube::Error> {
        let api = self.target().api.clone();
        let mut token: Option<String> = None;
        loop {
            let mut lp = ListParams::default().limit(self.spec.page_size);
            if !self.spec.label_selector.is_empty() {
                lp = lp.labels(&self.spec.label_selector);
            }
            if !self.spec.field_selector.is_empty() {
                lp = lp.fields(&self.spec.field_selector);
            }
            if let Some(t) = &token {
                lp = lp.continue_token(t);
            }
            self.spec.limiter.until_ready().await;
            let page = match api.list(&lp).await {
                Ok(p) => p,
                Err(e) if token.is_some() && is_gone(&e) => {
                    info!(stream = %self.spec.name, "continue token expired; restarting the list");
                    token = None;
                    diff.seen.clear();
                    continue;
                }
                Err(e) => return Err(e),
            };
            for obj in page.items {
                if self.diff_item(diff, obj).await.is_err() {
                    return Ok(Err(Closed));
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(next) => token = Some(next),
                None => return Ok(Ok(page.metadata.resource_version.unwrap_or_default())),
            }
        }
    }

    fn watch_params(&self) -> WatchParams {
        let mut wp = WatchParams::default().timeout(self.spec.watch_timeout_seconds);
        if !self.spec.label_selector.is_empty() {
            wp = wp.labels(&self.spec.label_selector);
        }
        if !self.spec.field_selector.is_empty() {
            wp = wp.fields(&self.spec.field_selector);
        }
        wp
    }

    fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.spec.watch_timeout_seconds.into()) + IDLE_MARGIN
    }

    /// A streaming list (`sendInitialEvents`, consistent read): the current objects arrive as
    /// ADDED events, then a bookmark marks the end of the initial state; the same connection
    /// then goes on as a normal watch. A server that rejects it switches the stream to
    /// paginated lists for good.
    async fn streaming_list(
        &mut self,
        mut diff: ListDiff,
        started: Instant,
    ) -> Result<Result<State, Closed>, ReflectorError> {
        let mut wp = self.watch_params();
        wp.send_initial_events = true;
        self.spec.limiter.until_ready().await;
        let stream = match super::watch::start(&self.target().api, &wp, "").await {
            Ok(s) => s,
            Err(kube::Error::Api(s)) if s.code == 422 || s.code == 400 => {
                info!(stream = %self.spec.name, reason = %s.message, "streaming lists not available on this apiserver; using paginated lists");
                self.streaming = Some(false);
                return Ok(Ok(State::Listing { origin: diff.origin }));
            }
            Err(e) => return Ok(Ok(self.after_list_error(e, diff.origin)?)),
        };
        let mut stream = std::pin::pin!(stream);
        let idle = self.idle_timeout();
        loop {
            let event = match tokio::time::timeout(idle, stream.try_next()).await {
                Ok(Ok(Some(ev))) => ev,
                Err(_) | Ok(Ok(None)) => {
                    warn!(stream = %self.spec.name, "streaming list ended before its initial state was complete; listing again");
                    return Ok(Ok(State::Listing { origin: diff.origin }));
                }
                Ok(Err(e)) => {
                    warn!(stream = %self.spec.name, error = %e, "streaming list failed; listing again after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: diff.origin }) }));
                }
            };
            match event {
                WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                    if self.diff_item(&mut diff, obj).await.is_err() {
                        return Ok(Err(Closed));
                    }
                }
                WatchEvent::Bookmark(b)
                    if b.metadata.annotations.get(INITIAL_EVENTS_END).is_some_and(|v| v == "true") =>
                {
                    self.streaming = Some(true);
                    let rv = b.metadata.resource_version;
                    if self.finish_diff(diff, rv.clone(), started, "streaming").await.is_err() {
                        return Ok(Err(Closed));
                    }
                    return self.consume_watch(stream, rv, Instant::now(), None).await;
                }
                WatchEvent::Bookmark(_) => {}
                WatchEvent::Deleted(_) => {
                    warn!(stream = %self.spec.name, "DELETED during a streaming list's initial state; listing again");
                    return Ok(Ok(State::Listing { origin: diff.origin }));
                }
                WatchEvent::Error(s) if s.code == 422 || s.code == 400 => {
                    info!(stream = %self.spec.name, reason = %s.message, "streaming lists not available on this apiserver; using paginated lists");
                    self.streaming = Some(false);
                    return Ok(Ok(State::Listing { origin: diff.origin }));
                }
                WatchEvent::Error(s) => {
                    warn!(stream = %self.spec.name, code = s.code, message = %s.message, "streaming list error; listing again after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: diff.origin }) }));
                }
            }
        }
    }

    async fn watch(&mut self, rv: String) -> Result<Result<State, Closed>, ReflectorError> {
        if self.metrics.watched_once {
            self.metrics.watch_restarts.inc();
        }
        self.metrics.watched_once = true;
        let wp = self.watch_params();
        let started = Instant::now();
        self.spec.limiter.until_ready().await;
        let stream = match super::watch::start(&self.target().api, &wp, &rv).await {
            Ok(s) => s,
            Err(e) if is_gone(&e) || is_too_large(&e) => return Ok(Ok(self.relist_after_gone(&rv))),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                warn!(stream = %self.spec.name, "the kind is no longer served; rediscovering");
                return Ok(Ok(State::WaitForKind));
            }
            Err(e) => {
                warn!(stream = %self.spec.name, error = %e, "watch request failed; re-watching after backoff");
                return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv }) }));
            }
        };
        // Resumed (a checkpoint or an earlier list) but not yet synced in this process: ready
        // once this watch proves the resourceVersion still valid.
        let confirm = (self.listed_once && !self.synced).then(|| tokio::time::Instant::now() + RESUME_CONFIRM);
        self.consume_watch(std::pin::pin!(stream), rv, started, confirm).await
    }

    /// Reads watch events until the stream ends, fails, goes idle or says 410.
    async fn consume_watch<S>(
        &mut self,
        mut stream: std::pin::Pin<&mut S>,
        mut rv: String,
        started: Instant,
        mut confirm: Option<tokio::time::Instant>,
    ) -> Result<Result<State, Closed>, ReflectorError>
    where
        S: futures::Stream<Item = Result<WatchEvent<RawObject>, kube::Error>>,
    {
        let idle = self.idle_timeout();
        loop {
            let next = tokio::time::timeout(idle, stream.try_next());
            let next = match confirm {
                Some(at) => tokio::select! {
                    next = next => next,
                    _ = tokio::time::sleep_until(at) => {
                        // No error within RESUME_CONFIRM: the resourceVersion is valid.
                        confirm = None;
                        self.set_synced();
                        continue;
                    }
                },
                None => next.await,
            };
            if let Ok(Ok(Some(ev))) = &next {
                if confirm.is_some() && !matches!(ev, WatchEvent::Error(_)) {
                    confirm = None;
                    self.set_synced();
                }
            }
            let event = match next {
                Err(_) => {
                    debug!(stream = %self.spec.name, "watch idle; re-watching");
                    break;
                }
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    warn!(stream = %self.spec.name, error = %e, "watch stream failed; re-watching after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv }) }));
                }
                Ok(Ok(Some(ev))) => ev,
            };
            let (verb, obj) = match event {
                WatchEvent::Added(o) => (Verb::Added, o),
                WatchEvent::Modified(o) => (Verb::Modified, o),
                WatchEvent::Deleted(o) => (Verb::Deleted, o),
                WatchEvent::Bookmark(b) => {
                    rv = b.metadata.resource_version;
                    if self.emit(Effect::Bookmark(rv.clone()), None).await.is_err() {
                        return Ok(Err(Closed));
                    }
                    continue;
                }
                WatchEvent::Error(s) if s.code == 410 || s.reason == "Expired" || s.reason == "Gone" => {
                    return Ok(Ok(self.relist_after_gone(&rv)));
                }
                WatchEvent::Error(s) => {
                    warn!(stream = %self.spec.name, code = s.code, reason = %s.reason, message = %s.message, "watch error event; re-watching after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv }) }));
                }
            };
            let Some((uid, entry)) = index_entry(&obj.metadata) else {
                warn!(stream = %self.spec.name, "watch event for an object without uid/name/resourceVersion skipped");
                continue;
            };
            rv = entry.resource_version.clone();
            let already_sent = !self.acked_ahead.is_empty() && self.acked_ahead.remove(&(uid.clone(), rv.clone()));
            let op = if verb == Verb::Deleted {
                self.index.remove(&uid);
                IndexOp::Remove(uid)
            } else {
                self.index.insert(uid.clone(), entry.clone());
                IndexOp::Upsert(uid, entry)
            };
            let change = (!already_sent).then(|| self.change(verb, Origin::Watch, obj));
            if already_sent {
                debug!(stream = %self.spec.name, resource_version = %rv, "change delivered before the restart; not sent again");
            }
            if self.emit(Effect::Watched { op, rv: rv.clone() }, change).await.is_err() {
                return Ok(Err(Closed));
            }
        }
        if started.elapsed() >= HEALTHY_AFTER {
            self.backoff = new_backoff();
        }
        Ok(Ok(State::Watching { rv }))
    }

    /// Ready, as far as this stream goes (`/readyz`).
    fn set_synced(&mut self) {
        self.synced = true;
        self.spec.health.set_phase(self.spec.id, StreamPhase::Synced);
    }

    fn relist_after_gone(&self, rv: &str) -> State {
        self.metrics.gone.inc();
        info!(stream = %self.spec.name, resource_version = rv, "resourceVersion no longer available (410 Gone); relisting and diffing");
        State::Listing { origin: if self.listed_once { Origin::Resync } else { Origin::Snapshot } }
    }
}

fn new_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(800))
        .with_max_delay(Duration::from_secs(30))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

fn gv_string(gvk: &GroupVersionKind) -> String {
    if gvk.group.is_empty() { gvk.version.clone() } else { format!("{}/{}", gvk.group, gvk.version) }
}

fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

/// "Too large resource version" (a lagging apiserver): relist with a consistent read.
fn is_too_large(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 504 && s.message.contains("Too large resource version"))
}

/// The group/version is not served (404), or it is but without this kind.
fn is_not_served(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404) || matches!(e, kube::Error::Discovery(_))
}

fn index_entry(meta: &ObjectMeta) -> Option<(String, IndexEntry)> {
    Some((
        meta.uid.clone().filter(|u| !u.is_empty())?,
        IndexEntry {
            namespace: meta.namespace.clone().filter(|n| !n.is_empty()),
            name: meta.name.clone()?,
            resource_version: meta.resource_version.clone().filter(|r| !r.is_empty())?,
        },
    ))
}

/// The last known identity of an object deleted while the stream was not watching.
fn tombstone(ar: &ApiResource, uid: &str, entry: &IndexEntry) -> RawObject {
    let mut metadata = serde_json::json!({"name": entry.name, "uid": uid, "resourceVersion": entry.resource_version});
    if let Some(ns) = &entry.namespace {
        metadata["namespace"] = ns.clone().into();
    }
    RawObject::from_value(&serde_json::json!({"apiVersion": ar.api_version, "kind": ar.kind, "metadata": metadata}))
        .expect("a tombstone is valid JSON")
}
