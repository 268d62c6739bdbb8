//! A gate between the delivery queue and a commit (exactly-once into Kafka; a contract shared
//! by `delivery`, `sink` and `state`, so it lives here): each event holds
//! a [`Pass`] from before its send until its acknowledgement; [`Gate::seal`] stops new passes
//! and waits until the last one is dropped. While sealed, every event sent is acknowledged,
//! so the state taken then covers exactly the events in the transaction being committed.
//!
//! A pass is given back with [`Pass::settle`] once its event is acknowledged. A pass dropped
//! unsettled (the queue stopped between a send and its acknowledgement: a fatal delivery
//! error, the shutdown deadline) leaves the gate *broken* for good: the open transaction may
//! hold records (or half of an event's records) that no state covers, so it must never be
//! committed; [`Sealed::broken`] tells the commit to abort instead.
//!
//! A send that must wait before it puts anything into the transaction (exactly-once: the
//! transaction holds as many uncommitted events as it may, and only a commit frees room)
//! waits [`Gate::outside`]: its pass is given back meanwhile, so the commit that frees the
//! room can seal the gate; it passes again (after that commit) before it puts its event in.
//!
//! Invariant: while a [`Sealed`] lives, no [`Pass`] does (a pass waiting outside is not
//! counted; it comes back only once the seal ended).

use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Notify,
}

#[derive(Debug, Default)]
struct GateState {
    passes: usize,
    sealed: bool,
    /// A pass was dropped before its event was acknowledged.
    broken: bool,
}

/// Held by one event from before its send until its acknowledgement; given back with
/// [`Pass::settle`]. Dropped without it, the gate is broken.
#[derive(Debug)]
pub struct Pass {
    gate: Arc<Gate>,
    settled: bool,
}

/// Held by a commit: no event is between its send and its acknowledgement.
#[derive(Debug)]
pub struct Sealed(Arc<Gate>);

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().expect("gate lock")
    }

    /// Waits while the gate is sealed, then passes.
    pub async fn pass(self: &Arc<Self>) -> Pass {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut s = self.lock();
                if !s.sealed {
                    s.passes += 1;
                    return Pass { gate: self.clone(), settled: false };
                }
            }
            changed.await;
        }
    }

    /// Stops new passes, then waits until every pass is dropped. One seal at a time.
    pub async fn seal(self: &Arc<Self>) -> Sealed {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut s = self.lock();
                if !s.sealed {
                    s.sealed = true;
                }
                if s.passes == 0 {
                    return Sealed(self.clone());
                }
            }
            changed.await;
        }
    }

    /// Runs `wait` with the caller's pass given back, then passes again (waiting while the
    /// gate is sealed). For a send that put nothing of its event into the transaction yet and
    /// waits for something only a commit brings (room): a seal does not wait for it, so that
    /// commit can happen. The caller holds a pass (the delivery queue's, for this event).
    ///
    /// Cancelled (the send's future dropped), the pass is counted again at once: the caller's
    /// [`Pass`] is dropped with it, unsettled, and breaks the gate as it would have anyway.
    pub async fn outside<T>(self: &Arc<Self>, wait: impl Future<Output = T>) -> T {
        /// Counts the pass again if the wait is cancelled (the caller's pass is dropped next).
        struct Away<'a> {
            gate: &'a Gate,
            back: bool,
        }
        impl Drop for Away<'_> {
            fn drop(&mut self) {
                if !self.back {
                    self.gate.lock().passes += 1;
                }
            }
        }
        {
            let mut s = self.lock();
            s.passes = s.passes.checked_sub(1).expect("Gate::outside: the caller holds a pass");
            if s.passes == 0 && s.sealed {
                drop(s);
                self.changed.notify_waiters();
            }
        }
        let mut away = Away { gate: self, back: false };
        let out = wait.await;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut s = self.lock();
                if !s.sealed {
                    s.passes += 1;
                    away.back = true;
                    return out;
                }
            }
            changed.await;
        }
    }

    /// Events between their send and their acknowledgement.
    pub fn passes(&self) -> usize {
        self.lock().passes
    }

    /// Whether a pass was dropped before its event was acknowledged.
    pub fn broken(&self) -> bool {
        self.lock().broken
    }
}

impl Pass {
    /// The event was acknowledged (or its send failed and left nothing in the transaction).
    pub fn settle(mut self) {
        self.settled = true;
    }
}

impl Sealed {
    /// A pass was dropped before its event was acknowledged: the open transaction may hold
    /// records no state covers; it must be aborted, never committed.
    pub fn broken(&self) -> bool {
        self.0.broken()
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        let mut s = self.gate.lock();
        s.passes -= 1;
        s.broken |= !self.settled;
        if s.passes == 0 && s.sealed {
            drop(s);
            self.gate.changed.notify_waiters();
        }
    }
}

impl Drop for Sealed {
    fn drop(&mut self) {
        self.0.lock().sealed = false;
        self.0.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_seal_waits_for_every_pass_and_holds_new_ones() {
        let gate = Arc::new(Gate::default());
        let a = gate.pass().await;
        let b = gate.pass().await;
        let g = gate.clone();
        let seal = tokio::spawn(async move { g.seal().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!seal.is_finished(), "two passes out");
        // A new pass waits for the seal to end.
        let g = gate.clone();
        let late = tokio::spawn(async move { g.pass().await });
        a.settle();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!seal.is_finished(), "one pass out");
        b.settle();
        let sealed = tokio::time::timeout(Duration::from_secs(5), seal).await.expect("sealed").unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!late.is_finished(), "no pass while sealed");
        assert_eq!(gate.passes(), 0);
        drop(sealed);
        let late = tokio::time::timeout(Duration::from_secs(5), late).await.expect("passed after the seal").unwrap();
        assert_eq!(gate.passes(), 1);
        late.settle();
        assert_eq!(gate.passes(), 0);
        assert!(!gate.broken(), "every pass was settled");
    }

    #[tokio::test]
    async fn a_pass_dropped_unsettled_breaks_the_gate_for_good() {
        let gate = Arc::new(Gate::default());
        gate.pass().await.settle();
        assert!(!gate.seal().await.broken());
        let unsettled = gate.pass().await;
        drop(unsettled);
        assert!(gate.seal().await.broken(), "the next seal sees it");
        gate.pass().await.settle();
        assert!(gate.seal().await.broken(), "and every one after");
    }

    #[tokio::test]
    async fn a_seal_does_not_wait_for_a_pass_waiting_outside_which_passes_again_after_it() {
        let gate = Arc::new(Gate::default());
        let pass = gate.pass().await;
        let room = Arc::new(tokio::sync::Notify::new());
        let (g, r) = (gate.clone(), room.clone());
        // The send: waits outside until the commit frees room, then is back in.
        let send = tokio::spawn(async move {
            g.outside(r.notified()).await;
            pass
        });
        // The commit seals although the send still holds its pass.
        let sealed =
            tokio::time::timeout(Duration::from_secs(5), gate.seal()).await.expect("sealed while a send waits");
        assert_eq!(gate.passes(), 0);
        room.notify_one();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!send.is_finished(), "not back in while sealed");
        drop(sealed);
        let pass = tokio::time::timeout(Duration::from_secs(5), send).await.expect("back after the seal").unwrap();
        assert_eq!(gate.passes(), 1);
        pass.settle();
        assert_eq!(gate.passes(), 0);
        assert!(!gate.broken());
    }

    #[tokio::test]
    async fn a_wait_outside_cut_short_leaves_the_count_whole_and_the_gate_broken() {
        let gate = Arc::new(Gate::default());
        let pass = gate.pass().await;
        let g = gate.clone();
        let send = tokio::spawn(async move {
            let _pass = pass;
            g.outside(std::future::pending::<()>()).await;
        });
        tokio::time::timeout(Duration::from_secs(5), async {
            while gate.passes() != 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("outside");
        send.abort();
        assert!(send.await.unwrap_err().is_cancelled());
        assert_eq!(gate.passes(), 0, "counted again, then dropped");
        assert!(gate.broken(), "the pass was dropped unsettled");
        tokio::time::timeout(Duration::from_secs(5), gate.seal()).await.expect("sealed");
    }
}
