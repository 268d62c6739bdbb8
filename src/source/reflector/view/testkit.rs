//! A stream without I/O for the tests of the view and the diff: a reflector's view and the
//! acknowledged index it reads, with the watermark's part played by [`Stream::ack`] (items
//! acknowledged in order, their changes applied to the shared index).

use std::collections::VecDeque;

use super::IndexView;
use crate::model::{Effect, Index, ObjectIndex, SharedIndex};

pub(in crate::source::reflector) struct Stream {
    pub view: IndexView,
    acked: SharedIndex,
    in_flight: VecDeque<Effect>,
    seq: u64,
    /// The most items in flight at once so far.
    most_in_flight: usize,
    pub resume: Option<String>,
}

impl Stream {
    /// A stream whose acknowledged index starts as `start`.
    pub fn new(start: Index) -> Self {
        let acked = SharedIndex::new(ObjectIndex::from(start));
        Self {
            view: IndexView::new(acked.clone()),
            acked,
            in_flight: VecDeque::new(),
            seq: 0,
            most_in_flight: 0,
            resume: None,
        }
    }

    /// Emits an item carrying `effect` (as `Reflector::emit_item` does).
    pub fn emit(&mut self, effect: Effect) {
        self.view.emitted(self.seq, &effect);
        self.seq += 1;
        self.in_flight.push_back(effect);
        self.most_in_flight = self.most_in_flight.max(self.in_flight.len());
    }

    /// Acknowledges the `n` oldest items in flight (or all there are).
    pub fn ack(&mut self, n: usize) {
        let mut acked = self.acked.lock();
        for _ in 0..n {
            let Some(effect) = self.in_flight.pop_front() else { break };
            acked.apply(effect, &mut self.resume);
        }
    }

    pub fn ack_all(&mut self) {
        self.ack(self.in_flight.len());
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The most items in flight at once so far.
    pub fn most_in_flight(&self) -> usize {
        self.most_in_flight
    }

    /// The acknowledged index.
    pub fn acked(&self) -> Index {
        self.acked.lock().objects.to_index()
    }
}
