//! The reflector's state between steps: the [`State`] of its machine (see the module
//! documentation for the transitions) and the [`Reflector`] that carries it with what
//! outlives a state (the index, the resume point, the sequence number, the backoff), and the
//! few things every state uses (emitting an item, readiness, the idle timeout).

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use futures::stream::BoxStream;
use kube::api::{Api, WatchEvent, WatchParams};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;

use super::spec::{Item, ReflectorError, Start, StreamSpec};
use super::view::IndexView;
use crate::model::{Change, Effect, EventSource, Origin, RawObject, Verb};
use crate::observe::health::StreamPhase;

/// Client-side idle timeout around each `next()`: the server-side watch timeout plus this.
const IDLE_MARGIN: Duration = Duration::from_secs(5);

/// The states of one stream; see the module documentation for the transitions, and
/// `step` in `mod.rs` for where each one is taken.
#[derive(Debug)]
pub(super) enum State {
    /// Resolve the kind by discovery.
    Discover,
    /// The kind is not served: discover again after a backoff delay.
    WaitForKind,
    /// List the current objects and diff them against the index.
    Listing { origin: Origin },
    /// Read a watch from `rv`: a new watch request (`open: None`), or the connection of a
    /// streaming list whose initial state is complete (`open: Some`), read on as the watch.
    Watching { rv: String, open: Option<OpenWatch> },
    /// Sleep a backoff delay, then go to `then`.
    Backoff { then: Box<State> },
}

/// The events of a watch connection.
pub(super) type Events = BoxStream<'static, Result<WatchEvent<RawObject>, kube::Error>>;

/// A watch connection still open: a streaming list hands its connection over to `Watching`
/// once its initial state is complete.
pub(super) struct OpenWatch {
    pub(super) events: Events,
    /// When it was handed over (a watch that stays healthy long enough resets the backoff).
    pub(super) since: Instant,
}

impl fmt::Debug for OpenWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<open>")
    }
}

/// Resolved once the kind is served.
pub(super) struct Target {
    pub(super) api: Api<RawObject>,
    pub(super) source: Arc<EventSource>,
}

/// One stream's list+watch loop: [`Reflector::run`] steps its [`State`] until cancelled.
pub struct Reflector {
    pub(super) spec: StreamSpec,
    pub(super) target: Option<Target>,
    /// The index after every item emitted: every object the stream has emitted (or, with
    /// `initial = "now"`, seen), read through to the acknowledged index.
    pub(super) index: IndexView,
    /// The resume point loaded at start (consumed by the first `Discover`).
    pub(super) resume: Option<String>,
    /// Whether a list of this stream was ever completed (here or before a restart).
    pub(super) listed_once: bool,
    /// The first list emits every object, whatever `initial` says (see `Start::snapshot`).
    pub(super) snapshot_requested: bool,
    /// Marked synced (ready) in this process: after a list, or a resumed watch that proved
    /// its resourceVersion valid.
    pub(super) synced: bool,
    pub(super) state: State,
    /// Whether the apiserver accepts streaming lists: unknown until tried.
    pub(super) streaming: Option<bool>,
    /// Streaming lists in a row that ended before their initial state was complete.
    pub(super) streaming_cut: u32,
    /// The watch position is a list's resourceVersion and no watch from it has delivered an
    /// event or bookmark yet: a 410 then means the list was out of the apiserver's history
    /// before its watch began (a list slower than the history it keeps), and listing again at
    /// once could repeat that in a loop.
    pub(super) fresh_list: bool,
    pub(super) seq: u64,
    pub(super) backoff: ExponentialBackoff,
    pub(super) tx: mpsc::Sender<Item>,
    pub(super) metrics: ReflectorMetrics,
    /// Changes after the resume point already delivered before a restart (out of order): the
    /// resumed watch acknowledges them without sending them again.
    pub(super) acked_ahead: HashSet<(String, String)>,
    /// Resumed from another shard count's positions: each old shard's floor (see
    /// `Position::floors`); emptied once the watch passed them all.
    pub(super) floors: Vec<(crate::model::Shard, u64)>,
    /// A shard's stream: what the apiserver does with its selector (`shard.rs`).
    pub(super) shard_watch: Option<ShardWatch>,
}

/// The stream's counters (`src/metrics.rs`), resolved once.
pub(super) struct ReflectorMetrics {
    pub(super) relists: Counter,
    pub(super) full_lists: Counter,
    pub(super) gone: Counter,
    pub(super) resync_events: Counter,
    pub(super) watch_restarts: Counter,
    pub(super) watched_once: bool,
}

/// A shard stream's gauges and counters, and what the apiserver was last seen to do.
pub(super) struct ShardWatch {
    /// The stream's label of `kubecast_shard_server_side`, set once known (absent until then).
    pub(super) label: crate::observe::metrics::Stream,
    pub(super) skipped: Counter,
    pub(super) dropped: Counter,
    /// Whether the apiserver applied the selector to the last list page; `None` until one.
    pub(super) applied: Option<bool>,
    /// The stream no longer sends the shard selector (an apiserver that applied it sent an
    /// object of another shard): kubecast filters on its side from then on.
    pub(super) selector_off: bool,
    /// A list without the selector is due (the objects the apiserver kept from this shard may
    /// be missing from the index); taken by the step that lists.
    pub(super) relist: bool,
}

impl ShardWatch {
    pub(super) fn new(stream: &str) -> Self {
        let m = crate::observe::metrics::get();
        let label = crate::observe::metrics::Stream { stream: stream.to_string() };
        Self {
            skipped: m.shard_skipped.get_or_create(&label).clone(),
            dropped: m.shard_selector_dropped.get_or_create(&label).clone(),
            label,
            applied: None,
            selector_off: false,
            relist: false,
        }
    }
}

/// The receiver is gone: the pipeline is shutting down.
pub(super) struct Closed;

impl Reflector {
    /// A stream that starts from `start` (its persisted position and index) and emits into
    /// `tx`.
    pub fn new(spec: StreamSpec, start: Start, tx: mpsc::Sender<Item>) -> Self {
        let listed_once = start.resume.is_some() || start.relist;
        let spec_name = spec.name.clone();
        let streaming = if spec.streaming_lists { None } else { Some(false) };
        let acked_ahead = start.acked_ahead.into_iter().collect();
        let shard_watch = spec.shard.map(|_| ShardWatch::new(&spec.name));
        Self {
            spec,
            target: None,
            index: IndexView::new(start.index),
            resume: start.resume,
            listed_once,
            snapshot_requested: start.snapshot,
            synced: false,
            state: State::Discover,
            streaming,
            streaming_cut: 0,
            fresh_list: false,
            seq: 0,
            backoff: new_backoff(),
            tx,
            acked_ahead,
            floors: start.floors,
            shard_watch,
            metrics: {
                let m = crate::observe::metrics::get();
                let name = &spec_name;
                ReflectorMetrics {
                    relists: crate::observe::metrics::stream_counter(&m.relists, name),
                    full_lists: crate::observe::metrics::stream_counter(&m.full_lists, name),
                    gone: crate::observe::metrics::stream_counter(&m.gone, name),
                    resync_events: crate::observe::metrics::stream_counter(&m.resync_events, name),
                    watch_restarts: crate::observe::metrics::stream_counter(&m.watch_restarts, name),
                    watched_once: false,
                }
            },
        }
    }

    /// The next backoff delay.
    pub(super) fn next_delay(&mut self) -> Duration {
        self.backoff.next().unwrap_or(Duration::from_secs(30))
    }

    pub(super) fn kind_error(&self, message: String) -> ReflectorError {
        ReflectorError::Kind { index: self.spec.resource_index, stream: self.spec.name.clone(), message }
    }

    /// The kind's API and event source.
    pub(super) fn target(&self) -> &Target {
        self.target.as_ref().expect("discovered before listing or watching")
    }

    /// Numbers an item and hands it to the pipeline (waits while the channel is full).
    pub(super) async fn emit(&mut self, effect: Effect, change: Option<Change>) -> Result<(), Closed> {
        self.emit_item(effect, change, false).await
    }

    /// [`Self::emit`]; `delivered_before`: see [`Item::delivered_before`].
    pub(super) async fn emit_item(
        &mut self,
        effect: Effect,
        change: Option<Change>,
        delivered_before: bool,
    ) -> Result<(), Closed> {
        if change.as_ref().is_some_and(|c| c.origin == Origin::Resync) {
            self.metrics.resync_events.inc();
        }
        // The index holds the change from now on (acknowledged or not).
        self.index.emitted(self.seq, &effect);
        let item = Item { stream: self.spec.id, seq: self.seq, effect, change, delivered_before };
        self.seq += 1;
        self.tx.send(item).await.map_err(|_| Closed)
    }

    /// A change of an object of this stream's kind.
    pub(super) fn change(&self, verb: Verb, origin: Origin, object: RawObject) -> Change {
        Change { verb, origin, object, source: self.target().source.clone() }
    }

    /// Ready, as far as this stream goes (`/readyz`).
    pub(super) fn set_synced(&mut self) {
        self.synced = true;
        self.spec.health.set_phase(self.spec.id, StreamPhase::Synced);
    }

    /// The parameters of a watch request (and of a streaming list, which is one).
    pub(super) fn watch_params(&self) -> WatchParams {
        let (label_selector, field_selector) = self.spec.selectors();
        WatchParams {
            label_selector,
            field_selector,
            ..WatchParams::default().timeout(self.spec.watch_timeout_seconds)
        }
    }

    /// How long a watch may stay silent before it is given up (no read timeout in the client).
    pub(super) fn idle_timeout(&self) -> Duration {
        Duration::from_secs(self.spec.watch_timeout_seconds.into()) + IDLE_MARGIN
    }
}

/// The longest wait for a list page's answer: the apiserver's own request timeout is a
/// minute, an unpaginated list of a large collection may take several.
pub(super) const LIST_ANSWER_TIMEOUT: Duration = Duration::from_secs(600);

/// `request`, failed with a timeout when no answer comes `within` (the client has no read
/// timeout: a server or proxy that accepts the connection and never answers would hold the
/// stream forever, silently).
pub(super) async fn answered<T>(
    within: Duration,
    what: &str,
    request: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, kube::Error> {
    tokio::time::timeout(within, request).await.unwrap_or_else(|_| {
        Err(kube::Error::Service(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no answer to the {what} within {} s", within.as_secs()),
        ))))
    })
}

pub(super) fn new_backoff() -> ExponentialBackoff {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(800))
        .with_max_delay(Duration::from_secs(30))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
}

/// The resourceVersion or continue token asked for is no longer available.
pub(super) fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_request_never_answered_fails_after_its_timeout_naming_it() {
        let never = std::future::pending::<Result<(), kube::Error>>();
        let e = answered(Duration::from_secs(300), "watch request", never).await.unwrap_err();
        let text = crate::observe::kube_error::in_words(&e).to_string();
        assert!(text.contains("no answer to the watch request within 300 s"), "{text}");
        let quick = async { Ok::<_, kube::Error>(7) };
        assert_eq!(answered(Duration::from_secs(1), "list request", quick).await.unwrap(), 7);
    }
}
