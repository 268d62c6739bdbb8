//! The reflector: one list+watch loop per stream (resource + namespace scope + selectors),
//! written as an explicit state machine. It never loses a change and never re-emits an
//! unchanged object, across restarts (it resumes from the persisted checkpoint) and 410 Gone
//! (it relists and diffs against the index of what it delivered).
//!
//! ```text
//!   Discover --kind served--> (checkpoint has rv?) --yes--> Watching { rv, open: None }
//!      ^  |                          |no
//!      |  +--not served--> WaitForKind --backoff--> Discover
//!      |                             v
//!      |                   Listing { origin } --paginated list done, diffed--> Watching { list rv, open: None }
//!      |                        ^  |
//!      |                        |  +--streaming list's initial state done--> Watching { list rv, open: Some }
//!      |                        |     (diffed; its connection goes on)
//!      |                        |                                                     any Watching
//!      |                        |   closed or idle: Watching { last rv, open: None } <--+  |  |  |
//!      +--- kind gone (404) ----|----------------------------------------------------------+  |  |
//!                               +--- 410 Gone / too large rv ---------------------------------+  |
//!                                      (in-stream ERROR or HTTP status)                          |
//!           Backoff { then } <--- other errors (429, refused, 5xx...) ---------------------------+
//! ```
//!
//! * `Discover` resolves the kind by discovery. Not served: `WaitForKind` (rediscovers with
//!   backoff; `missing_kind = "fail"` makes it fatal instead).
//! * `Listing` reads the current state with a consistent read: a streaming list
//!   (`watch?sendInitialEvents=true&resourceVersionMatch=NotOlderThan`, whose initial state
//!   ends with a bookmark annotated `k8s.io/initial-events-end`, after which the same
//!   connection goes on as the watch: it is handed over as `Watching { list rv, open: Some }`),
//!   or, where the apiserver rejects that (WatchList gate off, e.g. 1.33; then for good), a
//!   paginated LIST (resourceVersion unset, `limit = page_size`; an expired continue token
//!   restarts the list, because the token offered with the 410 gives an inconsistent list),
//!   followed by `Watching { list rv, open: None }`. Objects are diffed one by one as they
//!   arrive (never all held at once) against the index (`diff.rs`): new uid -> `added`,
//!   changed resourceVersion -> `modified`, uid missing from the list -> `deleted` with the
//!   last known uid, namespace, name and resourceVersion, unchanged -> nothing. `origin` is
//!   `snapshot` until the stream's first list was acknowledged, `resync` after. With
//!   `initial = "now"` the first list emits nothing. The list ends with an item that sets the
//!   checkpoint to the *list's* resourceVersion (the items before it changed the index;
//!   with `initial = "now"` they carry no change).
//! * `Watching { rv, open: None }` streams
//!   `watch?resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=..`; starting from a
//!   checkpoint's rv this replays exactly the changes after it. `Watching { rv, open: Some }`
//!   reads on the connection a streaming list handed over, without a new request. Each event
//!   and bookmark moves `rv`. The client has no read timeout, so each `next()` is bounded by
//!   an idle timeout; a closed or idle stream re-watches the same rv at once (no relist),
//!   unless it ended within half a second without an event: then after the backoff. A 410
//!   relists at once, unless the watch was the first from a list's rv and nothing came from
//!   it (the list outlived the apiserver's history): then after the backoff, not in a loop.
//! * `Backoff` sleeps a jittered exponential delay (0.8 s .. 30 s, reset after a watch that
//!   delivered events or stayed open for 2 minutes), then goes to `then`. 429 and refused connections re-watch
//!   the same rv: no relist.
//! * Resource versions are opaque: compared for equality only.
//! * Readiness (`/readyz`): a stream is synced after a list, or, resumed from a checkpoint,
//!   once its first watch delivered an event or bookmark or ran 1 s without an error. An
//!   accepted watch can still answer 410 as its first event (an expired checkpoint): the
//!   stream stays not ready until the relist-diff that follows is done.
//!
//! Every emitted [`Item`] carries a stream-local sequence number and its effect on the
//! checkpoint; see `src/state/watermark.rs` for how acknowledgements turn into checkpoints.
//! Fatal (the stream returns an error): the resource is forbidden (403) on the first list, or
//! is missing with `missing_kind = "fail"`, or `namespaces` is set for a cluster-scoped kind.
//!
//! The index of delivered objects is held once per stream: the watermark's acknowledged
//! index, which the reflector reads under an overlay of the changes it emitted that are not
//! acknowledged yet (`view`; the invariant is there).
//!
//! The files: `spec` (what a stream watches and emits, its error), `state` (the `State`s
//! and the [`Reflector`] that carries them), `view` (the index as the reflector sees it),
//! `diff` (the decisions, as pure functions), `list` (`Listing`), `watching` (`Watching`);
//! here: `run`, `step` and `Discover`.

mod diff;
mod list;
mod shard;
mod spec;
mod state;
mod view;
mod watching;

use std::sync::Arc;

use kube::api::{Api, GroupVersionKind};
use kube::discovery::{self, Scope};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

pub use self::spec::{Initial, Item, MissingKind, ReflectorError, Start, StreamSpec};
pub use self::state::Reflector;
use self::state::{Closed, State, Target};
use crate::model::{EventSource, Origin};
use crate::observe::health::StreamPhase;
use crate::observe::kube_error::in_words;

/// The longest wait for a discovery answer (a few small documents).
const DISCOVERY_ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

impl Reflector {
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

    /// One state of the machine, to the next. Every transition is taken here or in the
    /// function named:
    ///
    /// * `Discover` (`discover`): the kind is served -> `Watching { checkpoint rv }` when
    ///   resuming, else `Listing`; not served -> `WaitForKind` (fatal with
    ///   `missing_kind = "fail"`); discovery failed -> `Backoff { Discover }`; not listable or
    ///   watchable, or `namespaces` set for a cluster-scoped kind -> fatal.
    /// * `WaitForKind`: -> `Discover` after a backoff delay.
    /// * `Listing` (`list_and_diff`): a streaming list whose initial state is complete and
    ///   diffed -> `Watching { list rv, open: Some(its connection) }`; a paginated list
    ///   complete and diffed -> `Watching { list rv, open: None }`; streaming lists rejected
    ///   (422/400) -> `Listing` (paginated from now on); a streaming list that ended early or
    ///   sent DELETED -> `Backoff { Listing }` (ended early twice in a row: paginated from now
    ///   on); another error -> `Backoff { Listing }`, or `WaitForKind`
    ///   (404), or fatal (403 before the first list completed).
    /// * `Watching { open: None }` (`watch`) starts a watch request from `rv`; `Watching {
    ///   open: Some }` (`read_on`) reads on the streaming list's connection. Both read it
    ///   (`consume_watch`) until: closed or idle -> `Watching { last rv, open: None }` (closed
    ///   within half a second without an event: `Backoff { Watching { .. } }`); 410 Gone
    ///   or too large rv -> `Listing` (`Backoff { Listing }` if the rv is the last list's and
    ///   no event or bookmark came from it); 404 to the request -> `WaitForKind`; another error ->
    ///   `Backoff { Watching { last rv, open: None } }`.
    /// * `Backoff { then }`: -> `then` after a backoff delay.
    ///
    /// `Err(Closed)`: the pipeline is gone; `Err(ReflectorError)`: fatal.
    async fn step(&mut self, state: State) -> Result<Result<State, Closed>, ReflectorError> {
        match state {
            State::Discover => self.discover().await.map(Ok),
            State::WaitForKind => {
                tokio::time::sleep(self.next_delay()).await;
                Ok(Ok(State::Discover))
            }
            State::Listing { origin } => self.list_and_diff(origin).await,
            State::Watching { rv, open: None } => self.watch(rv).await,
            State::Watching { rv, open: Some(open) } => self.read_on(rv, open).await,
            State::Backoff { then } => {
                tokio::time::sleep(self.next_delay()).await;
                Ok(Ok(*then))
            }
        }
    }

    async fn discover(&mut self) -> Result<State, ReflectorError> {
        self.spec.limiter.until_ready().await;
        let request = discovery::pinned_kind(&self.spec.client, &self.spec.gvk);
        let (ar, caps) = match state::answered(DISCOVERY_ANSWER_TIMEOUT, "discovery request", request).await {
            Ok(found) => found,
            Err(e) if is_not_served(&e) => {
                let message = format!(
                    "kind {:?} is not served in {:?} ({})",
                    self.spec.gvk.kind,
                    gv_string(&self.spec.gvk),
                    not_served_reason(&e)
                );
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
            Err(kube::Error::Api(s)) if s.code == 401 => {
                warn!(stream = %self.spec.name, error = %s.message, "discovery failed: the apiserver does not accept kubecast's credentials (401); retrying after backoff (fix: check the kubeconfig's user, or the service account token: expired, revoked or of another cluster)");
                return Ok(State::Backoff { then: Box::new(State::Discover) });
            }
            Err(e) => {
                warn!(stream = %self.spec.name, error = %in_words(&e), "discovery failed; retrying after backoff");
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
        let selected = !self.spec.label_selector.is_empty() || !self.spec.field_selector.is_empty();
        let source = Arc::new(EventSource::new(&self.spec.cluster, &ar).with_selector(selected));
        self.target = Some(Target { api, source });
        Ok(match self.resume.take() {
            Some(rv) => {
                info!(stream = %self.spec.name, resource_version = %rv, objects = self.index.len(), "resuming from checkpoint");
                State::Watching { rv, open: None }
            }
            // A known kind that came back (CRD re-created), or a first start.
            None => State::Listing { origin: if self.listed_once { Origin::Resync } else { Origin::Snapshot } },
        })
    }
}

fn gv_string(gvk: &GroupVersionKind) -> String {
    if gvk.group.is_empty() { gvk.version.clone() } else { format!("{}/{}", gvk.group, gvk.version) }
}

/// Why discovery found no such kind, in the apiserver's words.
fn not_served_reason(e: &kube::Error) -> String {
    match e {
        kube::Error::Discovery(d) => d.to_string(),
        other => in_words(other).to_string(),
    }
}

/// The group/version is not served (404), or it is but without this kind.
fn is_not_served(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404) || matches!(e, kube::Error::Discovery(_))
}
