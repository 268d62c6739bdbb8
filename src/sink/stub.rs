//! A sink for unit tests only (compiled under `#[cfg(test)]`, as its `Sink::Stub` variant and
//! match arms: the production build has neither). It records every send and answers each
//! attempt as the test scripted it: at once, after a delay (under tokio's paused time, no wall
//! time), or when the test releases it, with `Ok` or any `SendError`. Tests of the queue and
//! the dead letter use it to make sends overlap and acknowledgements arrive out of order.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

use super::outbound::{Outbound, SendError};

/// What one attempt to send an event returns, and when. An attempt with nothing scripted
/// returns `Ok` at once.
pub enum Reply {
    /// At once.
    Now(Result<(), SendError>),
    /// After this long (tokio time: paused in the tests).
    After(Duration, Result<(), SendError>),
    /// When the test sends the outcome on the sender [`StubSink::hold`] returned. A sender
    /// dropped without sending counts as a retriable failure.
    Held(oneshot::Receiver<Result<(), SendError>>),
}

/// One step of one attempt, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Started,
    Finished(Result<(), SendError>),
}

/// One entry of the stub's log.
#[derive(Debug, Clone)]
pub struct Record {
    /// The event's id.
    pub id: String,
    /// Its ordering key (the object's uid).
    pub key: String,
    /// 1-based, per event id.
    pub attempt: u32,
    pub step: Step,
    /// tokio time (virtual under paused time).
    pub at: Instant,
}

/// A scripted sink; clones share their script and log (a test keeps one, the `Sink` another).
#[derive(Clone, Default)]
pub struct StubSink {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    /// Woken at every log entry.
    changed: Notify,
}

#[derive(Default)]
struct State {
    script: HashMap<String, VecDeque<Reply>>,
    attempts: HashMap<String, u32>,
    log: Vec<Record>,
    in_flight: usize,
    max_in_flight: usize,
}

impl StubSink {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `reply` to the answers of the attempts of event `id` (first scripted, first used).
    pub fn reply(&self, id: &str, reply: Reply) {
        self.state().script.entry(id.to_string()).or_default().push_back(reply);
    }

    /// The next scripted attempt of `id` returns `result` at once.
    pub fn answer(&self, id: &str, result: Result<(), SendError>) {
        self.reply(id, Reply::Now(result));
    }

    /// The next scripted attempt of `id` waits until the test sends its outcome.
    pub fn hold(&self, id: &str) -> oneshot::Sender<Result<(), SendError>> {
        let (tx, rx) = oneshot::channel();
        self.reply(id, Reply::Held(rx));
        tx
    }

    /// Every start and end of an attempt, in the order they happened.
    pub fn log(&self) -> Vec<Record> {
        self.state().log.clone()
    }

    /// Ids of the attempts started, in order (an event retried appears once per attempt).
    pub fn started(&self) -> Vec<String> {
        self.ids(|s| *s == Step::Started)
    }

    /// Ids of the events accepted (an attempt returned `Ok`), in order.
    pub fn accepted(&self) -> Vec<String> {
        self.ids(|s| *s == Step::Finished(Ok(())))
    }

    /// Attempts started and not finished now.
    pub fn in_flight(&self) -> usize {
        self.state().in_flight
    }

    /// The most attempts that were in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.state().max_in_flight
    }

    /// Waits until `done` holds for the log. Panics after an hour of tokio time (at once under
    /// paused time, when nothing else can happen) rather than hang a test.
    pub async fn wait_until(&self, done: impl Fn(&[Record]) -> bool) {
        let wait = async {
            loop {
                let changed = self.inner.changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if done(&self.state().log) {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(3600), wait).await.is_err() {
            panic!("the stub sink's log never got there: {:#?}", self.log());
        }
    }

    /// One attempt: recorded, then answered as scripted.
    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        let id = msg.event.id().to_string();
        let (attempt, reply) = {
            let mut s = self.state();
            let attempt = s.attempts.entry(id.clone()).or_default();
            *attempt += 1;
            let attempt = *attempt;
            let reply = s.script.get_mut(&id).and_then(VecDeque::pop_front).unwrap_or(Reply::Now(Ok(())));
            s.in_flight += 1;
            s.max_in_flight = s.max_in_flight.max(s.in_flight);
            self.record(&mut s, msg, attempt, Step::Started);
            (attempt, reply)
        };
        let result = match reply {
            Reply::Now(r) => r,
            Reply::After(d, r) => {
                tokio::time::sleep(d).await;
                r
            }
            Reply::Held(rx) => {
                rx.await.unwrap_or_else(|_| Err(SendError::Retriable("released without an outcome".into())))
            }
        };
        let mut s = self.state();
        s.in_flight -= 1;
        self.record(&mut s, msg, attempt, Step::Finished(result.clone()));
        result
    }

    fn record(&self, s: &mut State, msg: &Outbound, attempt: u32, step: Step) {
        s.log.push(Record {
            id: msg.event.id().to_string(),
            key: msg.key().to_string(),
            attempt,
            step,
            at: Instant::now(),
        });
        self.inner.changed.notify_waiters();
    }

    fn ids(&self, step: impl Fn(&Step) -> bool) -> Vec<String> {
        self.state().log.iter().filter(|r| step(&r.step)).map(|r| r.id.clone()).collect()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().expect("stub sink lock")
    }
}
