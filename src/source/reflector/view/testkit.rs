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
    /// A stream whose acknowledged index starts as `start`; its overlay is pruned from
    /// `floor` entries on.
    pub fn new(start: Index, floor: usize) -> Self {
        let acked = SharedIndex::new(ObjectIndex::from(start));
        Self {
            view: IndexView::with_floor(acked.clone(), floor),
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
            effect.apply(&mut self.resume, &mut acked.objects);
            acked.applied += 1;
        }
    }

    pub fn ack_all(&mut self) {
        self.ack(self.in_flight.len());
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The bound of the view's overlay: twice the most items in flight at once (and not
    /// below the floor it is pruned from).
    pub fn overlay_bound(&self, floor: usize) -> usize {
        (2 * self.most_in_flight).max(floor)
    }

    /// The acknowledged index.
    pub fn acked(&self) -> Index {
        self.acked.lock().objects.to_index()
    }
}
