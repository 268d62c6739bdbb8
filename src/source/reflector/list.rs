//! The `Listing` state: a consistent read of the current objects, diffed object by object
//! against the index as they arrive (see [`super::diff`] for the decisions), by a streaming
//! list where the apiserver offers one, else by a paginated LIST.

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::api::{ListParams, WatchEvent};
use kube::core::Status;
use tracing::{info, warn};

use super::diff;
use super::spec::{Initial, ReflectorError};
use super::state::{Closed, LIST_ANSWER_TIMEOUT, OpenWatch, Reflector, State, answered, is_gone};
use crate::model::{Effect, IndexOp, Origin, RawObject, UidList, Verb};
use crate::observe::kube_error::in_words;

/// Streaming lists in a row cut before their initial state was complete, after which a stream
/// uses paginated lists.
const STREAMING_CUTS: u32 = 2;

/// Annotation of the bookmark that ends a streaming list's initial state.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";
/// How often a long list logs its progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The progress of one list (paginated or streaming) being diffed against the index.
struct ListDiff {
    origin: Origin,
    /// `initial = "now"` on the first list: index, but emit no change (items without one).
    silent: bool,
    /// Uids the list contained so far; `None` when the index held no object as the list
    /// began (a first list: nothing can be missing from it).
    seen: Option<UidList>,
    /// Objects the list contained so far.
    objects: usize,
    emitted: usize,
    started: Instant,
    /// When progress was last logged.
    reported: Instant,
}

impl Reflector {
    pub(super) async fn list_and_diff(&mut self, origin: Origin) -> Result<Result<State, Closed>, ReflectorError> {
        let started = Instant::now();
        let mut list = ListDiff {
            origin,
            silent: !self.listed_once && self.spec.initial == Initial::Now && !self.snapshot_requested,
            seen: self.seen_list(),
            objects: 0,
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
            return self.streaming_list(list, started).await;
        }
        let list_rv = match self.paginated_list(&mut list).await {
            Ok(Ok(rv)) => rv,
            Ok(Err(Closed)) => return Ok(Err(Closed)),
            Err(e) => return Ok(Ok(self.after_list_error(e, origin)?)),
        };
        // The apiserver's filter disagreed with kubecast's hash during this list: the objects
        // it left out would be taken for deleted. Listed again without the selector instead.
        if self.take_relist() {
            return Ok(Ok(State::Listing { origin }));
        }
        if self.finish_diff(list, list_rv.clone(), started, "paginated").await.is_err() {
            return Ok(Err(Closed));
        }
        self.fresh_list = true;
        Ok(Ok(State::Watching { rv: list_rv, open: None }))
    }

    /// Where a list starting now collects its uids: room for the objects the index holds;
    /// none when it holds none (no object can be missing from the list).
    fn seen_list(&self) -> Option<UidList> {
        let held = self.index.len();
        (held > 0).then(|| UidList::with_capacity(held + held / 16))
    }

    /// Diffs one listed object against the index and emits its change, if any.
    async fn diff_item(&mut self, list: &mut ListDiff, obj: RawObject) -> Result<(), Closed> {
        let Some((uid, entry)) = diff::index_entry(&obj.metadata) else {
            warn!(stream = %self.spec.name, "listed object without uid/name/resourceVersion skipped");
            return Ok(());
        };
        if self.foreign(&uid) {
            return Ok(());
        }
        if let Some(seen) = &mut list.seen {
            seen.insert(&uid);
        }
        list.objects += 1;
        if list.reported.elapsed() >= PROGRESS_EVERY {
            list.reported = Instant::now();
            let secs = list.started.elapsed().as_secs_f64();
            info!(
                stream = %self.spec.name,
                objects = list.objects,
                events = list.emitted,
                per_second = (list.objects as f64 / secs.max(1e-3)) as u64,
                origin = list.origin.as_str(),
                "listing: {} objects so far", list.objects
            );
        }
        let Some(verb) = diff::listed(&self.index, &uid, &entry) else {
            return Ok(());
        };
        let effect = Effect::Diffed(IndexOp::Upsert(uid, entry));
        if list.silent {
            return self.emit(effect, None).await;
        }
        list.emitted += 1;
        let change = self.change(verb, list.origin, obj);
        self.emit(effect, Some(change)).await
    }

    /// After the last listed object: objects the index has but the list had not were deleted
    /// while the stream was not watching. Then the item that moves the checkpoint to `rv`.
    async fn finish_diff(&mut self, list: ListDiff, rv: String, started: Instant, mode: &str) -> Result<(), Closed> {
        let gone = match list.seen {
            Some(seen) => self.index.absent_from(&seen.into_set()),
            None => Vec::new(),
        };
        let deleted = gone.len();
        for (uid, entry) in gone {
            let object = diff::tombstone(self.target().source.api_resource(), &uid, &entry);
            let change = self.change(Verb::Deleted, Origin::Resync, object);
            self.emit(Effect::Diffed(IndexOp::Remove(uid)), Some(change)).await?;
        }
        info!(
            stream = %self.spec.name,
            objects = self.index.len(),
            events = list.emitted + deleted,
            origin = list.origin.as_str(),
            mode,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "list complete; watching"
        );
        self.listed_once = true;
        self.set_synced();
        self.emit(Effect::Listed { rv }, None).await
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
        if let Some(fatal) = self.spec.refused_selector(&e) {
            return Err(fatal);
        }
        warn!(stream = %self.spec.name, error = %in_words(&e), "list failed; retrying after backoff");
        Ok(State::Backoff { then: Box::new(State::Listing { origin }) })
    }

    /// A consistent, paginated LIST, diffed page by page (objects are not all held at once).
    /// A 410 on a continue token (the apiserver compacted the list's resourceVersion before
    /// its last page: on a large list or a busy etcd, every new start could expire too) is
    /// answered as client-go's pager does: the list starts over as one unpaginated request,
    /// which always finishes (it holds one response of all objects at once). Returns the
    /// list's resourceVersion.
    async fn paginated_list(&mut self, list: &mut ListDiff) -> Result<Result<String, Closed>, kube::Error> {
        let api = self.target().api.clone();
        let mut token: Option<String> = None;
        let mut paginated = true;
        let mut pages = 0u32;
        loop {
            let (label_selector, field_selector) = self.spec.selectors();
            let mut lp = ListParams { label_selector, field_selector, ..ListParams::default() };
            if paginated {
                lp = lp.limit(self.spec.page_size);
            }
            if let Some(t) = &token {
                lp = lp.continue_token(t);
            }
            self.spec.limiter.until_ready().await;
            let request = crate::source::sharding::list_page(&api, &lp, self.selector_shard());
            let page = match answered(LIST_ANSWER_TIMEOUT, "list request", request).await {
                Ok(p) => p,
                Err(e) if token.is_some() && is_gone(&e) => {
                    warn!(
                        stream = %self.spec.name,
                        pages,
                        objects = list.objects,
                        "continue token expired (the apiserver compacted the list's resourceVersion); listing again in one unpaginated request"
                    );
                    self.metrics.full_lists.inc();
                    token = None;
                    paginated = false;
                    // The pages read so far are in the index now: what they held is
                    // compared with the new list too.
                    list.seen = self.seen_list();
                    list.objects = 0;
                    continue;
                }
                Err(e) => return Err(e),
            };
            pages += 1;
            if let Some(shard) = self.spec.shard {
                self.note_server_side(page.filtered_for(&shard));
            }
            for obj in page.items.unwrap_or_default() {
                if self.diff_item(list, obj).await.is_err() {
                    return Ok(Err(Closed));
                }
            }
            release_freed_memory();
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(next) => token = Some(next),
                // A list without its resourceVersion (no conforming apiserver sends one) would
                // make the watch after it replay every object as new: listed again instead.
                None => match page.metadata.resource_version.filter(|rv| !rv.is_empty()) {
                    Some(rv) => return Ok(Ok(rv)),
                    None => {
                        let s =
                            Status::failure("the list's answer carries no resourceVersion", "Invalid").with_code(500);
                        return Err(kube::Error::Api(s.boxed()));
                    }
                },
            }
        }
    }

    /// A streaming list (`sendInitialEvents`, consistent read): the current objects arrive as
    /// ADDED events, then a bookmark marks the end of the initial state; the same connection
    /// then goes on as a normal watch: it is handed over as `Watching { list rv, open: Some }`.
    /// A server that rejects it switches the stream to paginated lists for good.
    async fn streaming_list(
        &mut self,
        mut list: ListDiff,
        started: Instant,
    ) -> Result<Result<State, Closed>, ReflectorError> {
        let mut wp = self.watch_params();
        wp.send_initial_events = true;
        self.spec.limiter.until_ready().await;
        // Boxed: the connection outlives this step when it is handed over to `Watching`.
        let request = crate::source::watch::start(&self.target().api, &wp, "", self.selector_shard());
        let mut stream = match answered(self.idle_timeout(), "streaming list request", request).await {
            Ok(s) => s.boxed(),
            // A selector the apiserver refuses is refused by every list: fatal, not a reason to
            // fall back to paginated lists.
            Err(e) if let Some(fatal) = self.spec.refused_selector(&e) => return Err(fatal),
            Err(kube::Error::Api(s)) if rejects_streaming(&s) => {
                return Ok(Ok(self.streaming_unavailable(&s, list.origin)));
            }
            Err(e) => return Ok(Ok(self.after_list_error(e, list.origin)?)),
        };
        let idle = self.idle_timeout();
        let mut objects = 0usize;
        loop {
            let event = match tokio::time::timeout(idle, stream.try_next()).await {
                Ok(Ok(Some(ev))) => ev,
                Err(_) | Ok(Ok(None)) => {
                    // After the backoff. Cut twice (a watch timeout shorter than sending the
                    // whole state takes, a proxy that ends the response): paginated lists for
                    // this stream from now on, which no such cut stops.
                    self.streaming_cut += 1;
                    if self.streaming_cut >= STREAMING_CUTS {
                        warn!(stream = %self.spec.name, objects, "streaming list ended before its initial state was complete, again; using paginated lists for this stream");
                        self.streaming = Some(false);
                    } else {
                        warn!(stream = %self.spec.name, objects, "streaming list ended before its initial state was complete; listing again after backoff");
                    }
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: list.origin }) }));
                }
                Ok(Err(e)) => {
                    warn!(stream = %self.spec.name, error = %in_words(&e), "streaming list failed; listing again after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: list.origin }) }));
                }
            };
            match event {
                WatchEvent::Added(obj) | WatchEvent::Modified(obj) => {
                    if self.diff_item(&mut list, obj).await.is_err() {
                        return Ok(Err(Closed));
                    }
                    objects += 1;
                    if objects.is_multiple_of(self.spec.page_size.max(1) as usize) {
                        release_freed_memory();
                    }
                }
                WatchEvent::Bookmark(b)
                    if b.metadata.annotations.get(INITIAL_EVENTS_END).is_some_and(|v| v == "true") =>
                {
                    self.streaming = Some(true);
                    self.streaming_cut = 0;
                    let rv = b.metadata.resource_version;
                    if self.finish_diff(list, rv.clone(), started, "streaming").await.is_err() {
                        return Ok(Err(Closed));
                    }
                    // The same connection goes on as the watch from the list's rv.
                    self.fresh_list = true;
                    let open = OpenWatch { events: stream, since: Instant::now() };
                    return Ok(Ok(State::Watching { rv, open: Some(open) }));
                }
                WatchEvent::Bookmark(_) => {}
                WatchEvent::Deleted(_) => {
                    warn!(stream = %self.spec.name, "DELETED during a streaming list's initial state; listing again after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: list.origin }) }));
                }
                WatchEvent::Error(s) if let Some(fatal) = self.spec.refused_selector(&kube::Error::Api(s.clone())) => {
                    return Err(fatal);
                }
                WatchEvent::Error(s) if rejects_streaming(&s) => {
                    return Ok(Ok(self.streaming_unavailable(&s, list.origin)));
                }
                WatchEvent::Error(s) => {
                    warn!(stream = %self.spec.name, code = s.code, message = %s.message, "streaming list error; listing again after backoff");
                    return Ok(Ok(State::Backoff { then: Box::new(State::Listing { origin: list.origin }) }));
                }
            }
        }
    }

    /// The apiserver rejected a streaming list (see [`rejects_streaming`]): the stream uses
    /// paginated lists from now on, starting with this one.
    fn streaming_unavailable(&mut self, s: &Status, origin: Origin) -> State {
        info!(stream = %self.spec.name, reason = %s.message, "streaming lists not available on this apiserver; using paginated lists");
        self.streaming = Some(false);
        State::Listing { origin }
    }
}

/// Gives the memory a list page held (its body, ~1 KB per object, in the allocator's large
/// segments; a streaming list: every `page_size` objects) back to the system at once. kubecast's allocator keeps freed memory for its
/// 10 s purge epoch (`app/allocator.rs`, chosen for the CPU cost of faulting pages in again
/// at high event rates); a 100k-object relist of 200 pages would hold its pages' memory for
/// the whole list (a peak of ~2.5x the resumed RSS without this, 1.79x with it: `docs/performance.md`).
/// Once per page: a fraction of a millisecond against the page's own request.
fn release_freed_memory() {
    // SAFETY: mi_collect may be called from any thread at any time; with the system
    // allocator (tests, benchmarks without mimalloc) it only visits mimalloc's empty heap.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

/// A streaming list answered 422 or 400, as the response's status or as an ERROR event in
/// its stream: the apiserver does not offer streaming lists (WatchList gate off, e.g. 1.33).
fn rejects_streaming(s: &Status) -> bool {
    s.code == 422 || s.code == 400
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_lists_are_unavailable_on_422_and_400_only() {
        let status = |code| Status::failure("no", "Invalid").with_code(code);
        assert!(rejects_streaming(&status(422)));
        assert!(rejects_streaming(&status(400)));
        for code in [403, 404, 410, 429, 500, 504] {
            assert!(!rejects_streaming(&status(code)), "{code}");
        }
    }
}
