//! The reflector: one list+watch loop per stream (resource + namespace scope + selectors),
//! written as an explicit state machine.
//!
//! ```text
//!            start
//!              |
//!              v
//!   +------> Listing { origin } --(list done, diffed against the index)--> Watching { rv }
//!   |          |  ^                                                          |   |   |
//!   |  list error  |                                                         |   |   |
//!   |          v  |                                        stream ended or idle  |   |
//!   |        Backoff { then: Listing }                     (re-watch same rv) <--+   |
//!   |                                                                            |   |
//!   +---- 410 Gone (in-stream ERROR event, or HTTP 410 at request time) ---------+   |
//!                                                                                    |
//!          Backoff { then: Watching { rv } } <--- any other watch error -------------+
//! ```
//!
//! * `Listing` pages through a consistent LIST (resourceVersion unset, `limit = page_size`). A
//!   410 on a continue token restarts the list from scratch (the token the server offers with
//!   it would give an inconsistent list). The result is diffed against the stream's index of
//!   delivered objects (uid -> resourceVersion, namespace/name): new uid -> `added`, changed
//!   resourceVersion -> `modified`, uid missing from the list -> `deleted` with the last known
//!   identity, unchanged -> nothing. The first list of a stream emits with `origin = snapshot`,
//!   later ones (after 410) with `origin = resync`. The watch then starts at the *list's*
//!   resourceVersion, never an item's.
//! * `Watching` streams `watch?resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=290`.
//!   Every event moves `rv`; bookmarks move it without emitting. The client has no read
//!   timeout, so `next()` is bounded by an idle timeout; a closed or idle stream re-watches the
//!   same `rv` at once (no relist).
//! * `Backoff` sleeps a jittered exponential delay (0.8 s .. 30 s), reset after a healthy
//!   period, then goes to its `then` state.
//! * Resource versions are opaque: compared for equality only.
//!
//! Fatal (the stream returns an error): the resource is forbidden (403) or no longer served
//! (404) on the first list.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::TryStreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, ObjectMeta, WatchEvent, WatchParams};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::Verb;
use crate::event::{Change, Origin};

/// Server-side watch timeout; the apiserver closes the watch cleanly after it.
const WATCH_TIMEOUT_SECS: u32 = 290;
/// Client-side idle timeout around each `next()`: the server timeout plus a margin.
const IDLE_TIMEOUT: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 5);
/// A watch that lived this long resets the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(120);

/// What one stream watches.
#[derive(Clone)]
pub struct StreamSpec {
    /// Carried with every change this stream sends (the index of its `[[resources]]` entry).
    pub tag: usize,
    /// Human-readable id, e.g. `v1 ConfigMap in namespace shop`.
    pub name: String,
    pub api: Api<DynamicObject>,
    pub resource: ApiResource,
    pub label_selector: String,
    pub field_selector: String,
    pub page_size: u32,
}

/// What the stream knows about one delivered object (never the whole object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub namespace: Option<String>,
    pub name: String,
    pub resource_version: String,
}

/// The states of one stream; see the module documentation for the transitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Listing { origin: Origin },
    Watching { rv: String },
    Backoff { then: Box<State> },
}

#[derive(Debug, thiserror::Error)]
pub enum ReflectorError {
    #[error("{stream}: forbidden: {message} (fix: grant get/list/watch on {resource} to kubecast's identity)")]
    Forbidden { stream: String, resource: String, message: String },
    #[error("{stream}: not found on the server: {message}")]
    NotFound { stream: String, message: String },
}

pub struct Reflector {
    spec: StreamSpec,
    index: HashMap<String, IndexEntry>,
    state: State,
    /// Whether any list has completed (the first one is the snapshot).
    synced_once: bool,
    backoff: ExponentialBackoff,
}

impl Reflector {
    pub fn new(spec: StreamSpec) -> Self {
        Self {
            spec,
            index: HashMap::new(),
            state: State::Listing { origin: Origin::Snapshot },
            synced_once: false,
            backoff: new_backoff(),
        }
    }

    /// Runs the stream until `cancel` fires or the receiver of `tx` is gone.
    pub async fn run(
        mut self,
        tx: mpsc::Sender<(usize, Change)>,
        cancel: CancellationToken,
    ) -> Result<(), ReflectorError> {
        loop {
            let state = std::mem::replace(&mut self.state, State::Listing { origin: Origin::Resync });
            let next = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Ok(()),
                next = self.step(state, &tx) => next?,
            };
            match next {
                Some(s) => self.state = s,
                None => return Ok(()), // receiver gone: shutting down
            }
        }
    }

    /// Executes one state and returns the next one (`None`: the receiver is gone).
    async fn step(
        &mut self,
        state: State,
        tx: &mpsc::Sender<(usize, Change)>,
    ) -> Result<Option<State>, ReflectorError> {
        match state {
            State::Listing { origin } => self.list_and_diff(origin, tx).await,
            State::Watching { rv } => self.watch(rv, tx).await,
            State::Backoff { then } => {
                let delay = self.backoff.next().unwrap_or(Duration::from_secs(30));
                debug!(stream = %self.spec.name, ?delay, "backing off");
                tokio::time::sleep(delay).await;
                Ok(Some(*then))
            }
        }
    }

    async fn list_and_diff(
        &mut self,
        origin: Origin,
        tx: &mpsc::Sender<(usize, Change)>,
    ) -> Result<Option<State>, ReflectorError> {
        let started = Instant::now();
        let (items, list_rv) = match self.list_all().await {
            Ok(v) => v,
            Err(e) => {
                if !self.synced_once {
                    self.fatal_if_permanent(&e)?;
                }
                warn!(stream = %self.spec.name, error = %e, "list failed; retrying after backoff");
                return Ok(Some(State::Backoff { then: Box::new(State::Listing { origin }) }));
            }
        };
        let origin = if self.synced_once { Origin::Resync } else { origin };
        let mut fresh = HashMap::with_capacity(items.len());
        let mut emitted = 0usize;
        for obj in items {
            let Some((uid, entry)) = index_entry(&obj.metadata) else {
                warn!(stream = %self.spec.name, "listed object without uid/name/resourceVersion skipped");
                continue;
            };
            let verb = match self.index.get(&uid) {
                None => Some(Verb::Added),
                Some(old) if old.resource_version != entry.resource_version => Some(Verb::Modified),
                Some(_) => None,
            };
            fresh.insert(uid, entry);
            if let Some(verb) = verb {
                emitted += 1;
                if tx.send((self.spec.tag, Change { verb, origin, object: obj })).await.is_err() {
                    return Ok(None);
                }
            }
        }
        // Objects the stream delivered that are gone now: deleted while we were not watching.
        let gone: Vec<(String, IndexEntry)> = self
            .index
            .iter()
            .filter(|(uid, _)| !fresh.contains_key(*uid))
            .map(|(u, e)| (u.clone(), e.clone()))
            .collect();
        for (uid, entry) in gone {
            emitted += 1;
            let object = tombstone(&self.spec.resource, &uid, &entry);
            if tx.send((self.spec.tag, Change { verb: Verb::Deleted, origin: Origin::Resync, object })).await.is_err() {
                return Ok(None);
            }
        }
        info!(
            stream = %self.spec.name,
            objects = fresh.len(),
            events = emitted,
            origin = origin.as_str(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "list complete; watching"
        );
        self.index = fresh;
        self.synced_once = true;
        Ok(Some(State::Watching { rv: list_rv }))
    }

    /// A consistent, paginated LIST. A 410 on a continue token restarts from the first page.
    async fn list_all(&self) -> Result<(Vec<DynamicObject>, String), kube::Error> {
        'restart: loop {
            let mut items = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let mut lp = ListParams::default().limit(self.spec.page_size);
                lp = self.selectors(lp);
                if let Some(t) = &token {
                    lp = lp.continue_token(t);
                }
                let page = match self.spec.api.list(&lp).await {
                    Ok(p) => p,
                    Err(e) if token.is_some() && is_gone(&e) => {
                        info!(stream = %self.spec.name, "continue token expired; restarting the list");
                        continue 'restart;
                    }
                    Err(e) => return Err(e),
                };
                items.extend(page.items);
                match page.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(next) => token = Some(next),
                    None => return Ok((items, page.metadata.resource_version.unwrap_or_default())),
                }
            }
        }
    }

    fn selectors(&self, mut lp: ListParams) -> ListParams {
        if !self.spec.label_selector.is_empty() {
            lp = lp.labels(&self.spec.label_selector);
        }
        if !self.spec.field_selector.is_empty() {
            lp = lp.fields(&self.spec.field_selector);
        }
        lp
    }

    async fn watch(
        &mut self,
        mut rv: String,
        tx: &mpsc::Sender<(usize, Change)>,
    ) -> Result<Option<State>, ReflectorError> {
        let mut wp = WatchParams::default().timeout(WATCH_TIMEOUT_SECS);
        if !self.spec.label_selector.is_empty() {
            wp = wp.labels(&self.spec.label_selector);
        }
        if !self.spec.field_selector.is_empty() {
            wp = wp.fields(&self.spec.field_selector);
        }
        let started = Instant::now();
        let stream = match self.spec.api.watch(&wp, &rv).await {
            Ok(s) => s,
            Err(e) if is_gone(&e) => return Ok(Some(self.relist_after_gone(&rv))),
            Err(e) => {
                warn!(stream = %self.spec.name, error = %e, "watch request failed; re-watching after backoff");
                return Ok(Some(State::Backoff { then: Box::new(State::Watching { rv }) }));
            }
        };
        let mut stream = std::pin::pin!(stream);
        loop {
            let item = match tokio::time::timeout(IDLE_TIMEOUT, stream.try_next()).await {
                Err(_) => {
                    debug!(stream = %self.spec.name, "watch idle; re-watching");
                    break;
                }
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    warn!(stream = %self.spec.name, error = %e, "watch stream failed; re-watching after backoff");
                    return Ok(Some(State::Backoff { then: Box::new(State::Watching { rv }) }));
                }
                Ok(Ok(Some(ev))) => ev,
            };
            let (verb, obj) = match item {
                WatchEvent::Added(o) => (Verb::Added, o),
                WatchEvent::Modified(o) => (Verb::Modified, o),
                WatchEvent::Deleted(o) => (Verb::Deleted, o),
                WatchEvent::Bookmark(b) => {
                    rv = b.metadata.resource_version;
                    continue;
                }
                WatchEvent::Error(status)
                    if status.code == 410 || status.reason == "Expired" || status.reason == "Gone" =>
                {
                    return Ok(Some(self.relist_after_gone(&rv)));
                }
                WatchEvent::Error(status) => {
                    warn!(stream = %self.spec.name, code = status.code, reason = %status.reason, message = %status.message, "watch error event; re-watching after backoff");
                    return Ok(Some(State::Backoff { then: Box::new(State::Watching { rv }) }));
                }
            };
            let Some((uid, entry)) = index_entry(&obj.metadata) else {
                warn!(stream = %self.spec.name, "watch event for an object without uid/name/resourceVersion skipped");
                continue;
            };
            rv = entry.resource_version.clone();
            match verb {
                Verb::Deleted => {
                    self.index.remove(&uid);
                }
                _ => {
                    self.index.insert(uid, entry);
                }
            }
            if tx.send((self.spec.tag, Change { verb, origin: Origin::Watch, object: obj })).await.is_err() {
                return Ok(None);
            }
        }
        if started.elapsed() >= HEALTHY_AFTER {
            self.backoff = new_backoff();
        }
        Ok(Some(State::Watching { rv }))
    }

    fn relist_after_gone(&self, rv: &str) -> State {
        info!(stream = %self.spec.name, resource_version = rv, "resourceVersion expired (410 Gone); relisting and diffing");
        State::Listing { origin: Origin::Resync }
    }

    fn fatal_if_permanent(&self, e: &kube::Error) -> Result<(), ReflectorError> {
        if let kube::Error::Api(status) = e {
            match status.code {
                403 => {
                    return Err(ReflectorError::Forbidden {
                        stream: self.spec.name.clone(),
                        resource: self.spec.resource.plural.clone(),
                        message: status.message.clone(),
                    });
                }
                404 => {
                    return Err(ReflectorError::NotFound {
                        stream: self.spec.name.clone(),
                        message: status.message.clone(),
                    });
                }
                _ => {}
            }
        }
        Ok(())
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

fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
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
fn tombstone(ar: &ApiResource, uid: &str, entry: &IndexEntry) -> DynamicObject {
    let mut obj = DynamicObject::new(&entry.name, ar);
    obj.metadata.namespace = entry.namespace.clone();
    obj.metadata.uid = Some(uid.to_string());
    obj.metadata.resource_version = Some(entry.resource_version.clone());
    obj
}
