//! A bound of the whole process, shared by the shards it runs (`[coordination] shards`): the
//! delivery queue's `queue_capacity` and `max_in_flight`, exactly-once's
//! `max_uncommitted_events` and `max_uncommitted_bytes`. Without shards the one part is the
//! whole bound. (A contract shared by `delivery` and `sink`, so it lives here.)
//!
//! Each shard running holds a [`Part`] of each [`Budget`]. A part's share is the bound divided
//! by the parts alive: it shrinks when a shard comes and grows when one goes. A part takes
//! more only while both its share and the whole bound have room, so what the shards hold
//! together stays within the bound even when a shard arrives while the others hold it all
//! (during a broker outage, say): the newcomer takes room as the others free it, and they take
//! no more than their new, smaller share meanwhile. A part that holds nothing may always take
//! one (every shard makes progress; the bound is passed by at most one unit per shard).
//!
//! Invariant: the budget's `used` is the sum of its parts' uses; a part dropped gives its use
//! back and leaves the share to the others.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// One bound of the process (events, bytes or requests), shared by its [`Part`]s.
#[derive(Debug)]
pub struct Budget {
    total: usize,
    used: AtomicUsize,
    parts: AtomicUsize,
    /// Fired when room was given back or a part left (the others' shares grew).
    freed: Notify,
}

impl Budget {
    /// A bound of `total` (at least 1).
    pub fn new(total: usize) -> Arc<Self> {
        Arc::new(Self {
            total: total.max(1),
            used: AtomicUsize::new(0),
            parts: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// A part of this bound for one shard (the others' shares shrink now).
    pub fn part(self: &Arc<Self>) -> Part {
        self.parts.fetch_add(1, Ordering::Relaxed);
        Part { budget: self.clone(), mine: AtomicUsize::new(0) }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// What every part holds together.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// How many parts are alive.
    pub fn parts(&self) -> usize {
        self.parts.load(Ordering::Relaxed)
    }
}

/// One shard's part of a [`Budget`]: what it holds, and how much more it may take.
#[derive(Debug)]
pub struct Part {
    budget: Arc<Budget>,
    mine: AtomicUsize,
}

impl Part {
    /// The bound divided by the parts alive (at least 1).
    pub fn share(&self) -> usize {
        (self.budget.total / self.budget.parts().max(1)).max(1)
    }

    /// What this part holds.
    pub fn used(&self) -> usize {
        self.mine.load(Ordering::Relaxed)
    }

    /// How much more this part may take now: what is left of its share and of the whole bound,
    /// and 1 while it holds nothing.
    pub fn available(&self) -> usize {
        let mine = self.used();
        let left = self.share().saturating_sub(mine).min(self.budget.total.saturating_sub(self.budget.used()));
        if mine == 0 { left.max(1) } else { left }
    }

    /// Whether `more` fits: within this part's share and the whole bound; always while this part
    /// holds nothing (a unit larger than the bound goes alone).
    pub fn fits(&self, more: usize) -> bool {
        let mine = self.used();
        mine == 0 || (mine + more <= self.share() && self.budget.used() + more <= self.budget.total)
    }

    /// This part now holds `value`. Room given back wakes the parts waiting for it.
    pub fn set(&self, value: usize) {
        let old = self.mine.swap(value, Ordering::Relaxed);
        if value > old {
            self.budget.used.fetch_add(value - old, Ordering::Relaxed);
        } else if value < old {
            let before = self.budget.used.fetch_sub(old - value, Ordering::Relaxed);
            // Another part waits on this one only for room of the whole bound, and only while
            // less than its next batch (at most an eighth of the bound) was left: a wake-up
            // per event given back otherwise would cost every waiting part a turn for nothing.
            // (Alone, no other part can be waiting.)
            if self.budget.parts() > 1 && before + (self.budget.total / 8).max(1) > self.budget.total {
                self.budget.freed.notify_waiters();
            }
        }
    }

    /// Resolves once room of the whole bound may have been given back by another part (while
    /// less than an eighth of it was left), or a part left. Created before the room is looked
    /// at, so a change in between is not missed. A part that waits for room of its own share
    /// is woken by its own work.
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.budget.freed.notified()
    }

    /// The whole bound this is a part of.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }
}

impl Drop for Part {
    fn drop(&mut self) {
        self.set(0);
        self.budget.parts.fetch_sub(1, Ordering::Relaxed);
        self.budget.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alone_a_part_has_the_whole_bound() {
        let b = Budget::new(100);
        let p = b.part();
        assert_eq!(p.share(), 100);
        assert!(p.fits(100));
        p.set(60);
        assert!(p.fits(40) && !p.fits(41));
        assert_eq!(p.available(), 40);
    }

    #[test]
    fn shares_shrink_and_grow_as_parts_come_and_go() {
        let b = Budget::new(100);
        let (p, q) = (b.part(), b.part());
        assert_eq!((p.share(), q.share()), (50, 50));
        let r = b.part();
        assert_eq!(r.share(), 33);
        drop(q);
        assert_eq!((p.share(), r.share()), (50, 50));
        drop(r);
        assert_eq!(p.share(), 100);
        assert_eq!(b.parts(), 1);
    }

    #[test]
    fn a_newcomer_waits_for_room_the_others_hold_and_they_take_no_more_than_their_new_share() {
        let b = Budget::new(100);
        let old = b.part();
        old.set(100);
        let new = b.part();
        // The whole is held: the newcomer may take one (it holds nothing), not more.
        assert_eq!(new.available(), 1);
        assert!(new.fits(1), "a part that holds nothing always takes one");
        new.set(1);
        assert!(!new.fits(1), "the whole bound is held");
        assert_eq!(old.available(), 0, "the old part is past its new share of 50");
        old.set(60);
        assert_eq!(new.available(), 39, "what the old part gave back, up to the new share");
        assert_eq!(old.available(), 0, "still past 50");
        old.set(20);
        assert_eq!(old.available(), 30, "back under its share of 50: up to it (the whole has 79 left)");
        assert_eq!(b.used(), 21);
    }

    #[test]
    fn a_part_dropped_gives_its_use_back() {
        let b = Budget::new(10);
        let (p, q) = (b.part(), b.part());
        p.set(5);
        q.set(4);
        assert_eq!(b.used(), 9);
        drop(p);
        assert_eq!(b.used(), 4);
        assert_eq!(q.share(), 10);
        q.set(0);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test]
    async fn room_given_back_wakes_a_waiting_part() {
        let b = Budget::new(10);
        let (p, q) = (b.part(), b.part());
        p.set(10);
        q.set(1);
        let freed = q.freed();
        p.set(3);
        tokio::time::timeout(std::time::Duration::from_secs(5), freed).await.expect("woken when room is given back");
        // Far from full: giving more back wakes nobody (a part waiting for the whole bound
        // would have had room already).
        let mut freed = Box::pin(q.freed());
        p.set(1);
        assert!(futures::poll!(freed.as_mut()).is_pending(), "no wake-up while the whole bound has room");
        let freed = q.freed();
        drop(p);
        tokio::time::timeout(std::time::Duration::from_secs(5), freed).await.expect("woken when a part leaves");
    }

    proptest::proptest! {
        /// Whatever the parts take (each only what `available` allows, one at a time) and
        /// give back, as parts come, what they hold together stays within the bound plus one
        /// per part, and is the sum of their uses.
        #[test]
        fn what_parts_take_stays_within_the_bound(
            total in 1usize..500,
            steps in proptest::collection::vec((0usize..6, 0usize..300, proptest::bool::ANY), 1..200),
        ) {
            let b = Budget::new(total);
            let mut parts: Vec<Part> = Vec::new();
            for (which, amount, give_back) in steps {
                if parts.len() < 6 && which >= parts.len() {
                    parts.push(b.part());
                    continue;
                }
                if parts.is_empty() { continue; }
                let p = &parts[which % parts.len()];
                if give_back {
                    p.set(p.used().saturating_sub(amount));
                } else {
                    let take = amount.min(p.available());
                    p.set(p.used() + take);
                }
                proptest::prop_assert!(b.used() <= total + parts.len(), "used {} of {}", b.used(), total);
                proptest::prop_assert_eq!(b.used(), parts.iter().map(Part::used).sum::<usize>());
            }
        }
    }
}
