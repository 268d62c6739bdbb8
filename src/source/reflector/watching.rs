//! The `Watching` state: a watch from a resourceVersion, read event by event until it ends,
//! goes idle, fails or says 410 Gone (see [`super::diff::watched`] for what an event does).

use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use kube::api::WatchEvent;
use tracing::{debug, info, warn};

use super::diff;
use super::spec::ReflectorError;
use super::state::{Closed, OpenWatch, Reflector, State, answered, is_gone, new_backoff};
use crate::model::{Effect, Origin, RawObject, Verb};
use crate::observe::kube_error::in_words;

/// A watch that lived this long resets the backoff.
const HEALTHY_AFTER: Duration = Duration::from_secs(120);
/// A watch that ends this soon without a single event (an empty answer, a proxy that closes
/// at once) is opened again after the backoff, not at once: as client-go does, so that one
/// broken path does not spend the apiserver rate limit all streams share.
const QUICK_END: Duration = Duration::from_millis(500);
/// A stream resumed from its checkpoint counts as synced once its first watch delivered an
/// event or a bookmark, or stayed this long without an error: the 410 of an expired
/// resourceVersion can come as the first event of an accepted watch.
const RESUME_CONFIRM: Duration = Duration::from_secs(1);

impl Reflector {
    /// `Watching { rv, open: None }`: a new watch request from `rv`, read until it ends.
    pub(super) async fn watch(&mut self, rv: String) -> Result<Result<State, Closed>, ReflectorError> {
        if self.metrics.watched_once {
            self.metrics.watch_restarts.inc();
        }
        self.metrics.watched_once = true;
        let wp = self.watch_params();
        let started = Instant::now();
        self.spec.limiter.until_ready().await;
        let request = crate::source::watch::start(&self.target().api, &wp, &rv, self.selector_shard());
        let stream = match answered(self.idle_timeout(), "watch request", request).await {
            Ok(s) => s,
            Err(e) if is_gone(&e) || is_too_large(&e) => return Ok(Ok(self.relist_after_gone(&rv))),
            Err(kube::Error::Api(s)) if s.code == 404 => {
                warn!(stream = %self.spec.name, "the kind is no longer served; rediscovering");
                return Ok(Ok(State::WaitForKind));
            }
            Err(e) if let Some(fatal) = self.spec.refused_selector(&e) => return Err(fatal),
            Err(e) => {
                warn!(stream = %self.spec.name, error = %in_words(&e), "watch request failed; re-watching after backoff");
                return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv, open: None }) }));
            }
        };
        // Resumed (a checkpoint or an earlier list) but not yet synced in this process: ready
        // once this watch proves the resourceVersion still valid.
        let confirm = (self.listed_once && !self.synced).then(|| tokio::time::Instant::now() + RESUME_CONFIRM);
        self.consume_watch(std::pin::pin!(stream), rv, started, confirm).await
    }

    /// `Watching { rv, open: Some }`: reads on the connection a streaming list handed over once its initial state was
    /// complete: no new request (not counted as a watch restart), and the list made the
    /// stream ready already.
    pub(super) async fn read_on(
        &mut self,
        rv: String,
        open: OpenWatch,
    ) -> Result<Result<State, Closed>, ReflectorError> {
        let OpenWatch { mut events, since } = open;
        self.consume_watch(Pin::new(&mut events), rv, since, None).await
    }

    /// Reads watch events until the stream ends, fails, goes idle or says 410.
    pub(super) async fn consume_watch<S>(
        &mut self,
        mut stream: Pin<&mut S>,
        mut rv: String,
        started: Instant,
        mut confirm: Option<tokio::time::Instant>,
    ) -> Result<Result<State, Closed>, ReflectorError>
    where
        S: futures::Stream<Item = Result<WatchEvent<RawObject>, kube::Error>>,
    {
        let idle = self.idle_timeout();
        let mut events = 0u64;
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
            if let Ok(Ok(Some(ev))) = &next
                && confirm.is_some()
                && !matches!(ev, WatchEvent::Error(_))
            {
                confirm = None;
                self.set_synced();
            }
            let event = match next {
                Err(_) => {
                    debug!(stream = %self.spec.name, "watch idle; re-watching");
                    break;
                }
                Ok(Ok(None)) => break,
                // A 410 written as a bare Status line rather than an ERROR event: the same.
                Ok(Err(e)) if is_gone(&e) || is_too_large(&e) => return Ok(Ok(self.relist_after_gone(&rv))),
                Ok(Err(e)) => {
                    warn!(stream = %self.spec.name, error = %in_words(&e), "watch stream failed; re-watching after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv, open: None }) }));
                }
                Ok(Ok(Some(ev))) => ev,
            };
            if !matches!(event, WatchEvent::Error(_)) {
                events += 1;
                self.fresh_list = false;
            }
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
                    return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv, open: None }) }));
                }
            };
            let Some((uid, entry)) = diff::index_entry(&obj.metadata) else {
                warn!(stream = %self.spec.name, "watch event for an object without uid/name/resourceVersion skipped");
                continue;
            };
            if self.foreign(&uid) {
                if self.take_relist() {
                    return Ok(Ok(State::Listing { origin: Origin::Resync }));
                }
                // Another shard's object (the apiserver did not filter): the watch moves on
                // past it, nothing is emitted.
                rv = entry.resource_version.clone();
                continue;
            }
            // Resumed from another shard count: delivered by the object's old shard already?
            let below_floor = !self.floors.is_empty() && self.below_floor(&uid, &entry.resource_version);
            let mut watched = diff::watched(&mut self.acked_ahead, verb, uid, entry);
            watched.already_sent |= below_floor;
            rv = watched.rv;
            // A change delivered before the restart is not sent again; it still goes to shaping
            // (its per-object state must follow the object).
            let change = Some(self.change(verb, Origin::Watch, obj));
            if watched.already_sent {
                debug!(stream = %self.spec.name, resource_version = %rv, "change delivered before the restart; not sent again");
            }
            if self.emit_item(watched.effect, change, watched.already_sent).await.is_err() {
                return Ok(Err(Closed));
            }
        }
        if events == 0 && started.elapsed() < QUICK_END {
            debug!(stream = %self.spec.name, "watch ended at once without an event; re-watching after backoff");
            return Ok(Ok(State::Backoff { then: Box::new(State::Watching { rv, open: None }) }));
        }
        // Progress (events, or a watch that lasted) ends a series of failures.
        if events > 0 || started.elapsed() >= HEALTHY_AFTER {
            self.backoff = new_backoff();
        }
        Ok(Ok(State::Watching { rv, open: None }))
    }

    /// 410 Gone (or a too large resourceVersion): the watch cannot resume; list and diff. At
    /// once, unless the position is the last list's and nothing came from it: then after the
    /// backoff (which grows while that repeats), as a list that keeps outliving the apiserver's
    /// history would otherwise be repeated in a loop.
    fn relist_after_gone(&self, rv: &str) -> State {
        self.metrics.gone.inc();
        let listing = State::Listing { origin: if self.listed_once { Origin::Resync } else { Origin::Snapshot } };
        if self.fresh_list {
            warn!(stream = %self.spec.name, resource_version = rv, "the list's resourceVersion was no longer available when its watch began (410 Gone); listing again after backoff");
            return State::Backoff { then: Box::new(listing) };
        }
        info!(stream = %self.spec.name, resource_version = rv, "resourceVersion no longer available (410 Gone); relisting and diffing");
        listing
    }
}

/// "Too large resource version" (a lagging apiserver): relist with a consistent read.
fn is_too_large(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 504 && s.message.contains("Too large resource version"))
}
