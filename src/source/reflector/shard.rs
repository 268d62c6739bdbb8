//! A shard's stream (`StreamSpec::shard`): its lists and watches carry the shard's
//! `shardSelector`; where the apiserver applies it (a list's `metadata.shardInfo` echoes it)
//! the objects of other shards never arrive, and where it does not (an older apiserver, the
//! `ShardedListAndWatch` gate off, a streaming list, which echoes nothing) the reflector skips
//! them by the same hash. It always checks, so the items are the same either way.

use tracing::{info, warn};

use super::state::Reflector;

impl Reflector {
    /// Whether the object of `uid` belongs to another shard than this stream's (skipped).
    pub(super) fn foreign(&mut self, uid: &str) -> bool {
        let Some(shard) = &self.spec.shard else { return false };
        if shard.owns(uid) {
            return false;
        }
        let Some(w) = self.shard_watch.as_mut() else { return true };
        w.skipped.inc();
        match w.applied {
            // Known already: the apiserver does not filter.
            Some(false) => {}
            // A list said the apiserver filters, yet an object of another shard came: a watch
            // served by another apiserver without the feature gate (skew, during a control
            // plane's rollout), or a shard hash that differs from kubecast's, whose objects
            // for this shard kubecast gives another would reach no shard. Either way: the
            // selector is no longer sent, and a list without it (diffed against the index)
            // brings back what the apiserver kept from this shard.
            Some(true) => {
                warn!(stream = %self.spec.name, uid, "an apiserver that applied the shard selector sent an object of another shard (a watch on an apiserver without the ShardedListAndWatch feature gate, or a shard hash that differs from kubecast's): this stream stops sending the selector and lists again, filtering on its own side; nothing is missed either way");
                w.dropped.inc();
                w.selector_off = true;
                w.relist = true;
                self.note_server_side(false);
            }
            // A streaming list echoes nothing: an object of another shard shows the apiserver
            // does not filter.
            None => self.note_server_side(false),
        }
        true
    }

    /// The shard whose selector this stream's requests carry: none once it stopped sending it.
    pub(super) fn selector_shard(&self) -> Option<&crate::model::Shard> {
        self.spec.shard.as_ref().filter(|_| !self.shard_watch.as_ref().is_some_and(|w| w.selector_off))
    }

    /// Whether a list without the selector is due (see [`Self::foreign`]); taken once.
    pub(super) fn take_relist(&mut self) -> bool {
        self.shard_watch.as_mut().is_some_and(|w| std::mem::take(&mut w.relist))
    }

    /// A list page (or an object of another shard) said whether the apiserver applied the
    /// shard selector: logged when that changes, and kept in `kubecast_shard_server_side`.
    pub(super) fn note_server_side(&mut self, applied: bool) {
        let Some(w) = self.shard_watch.as_mut() else { return };
        if w.applied != Some(applied) {
            let shard = self.spec.shard.map(|s| s.to_string()).unwrap_or_default();
            if applied {
                info!(stream = %self.spec.name, %shard, "the apiserver applies the shard selector: only this shard's objects arrive");
            } else {
                info!(stream = %self.spec.name, %shard, "the apiserver does not apply the shard selector (no metadata.shardInfo: the ShardedListAndWatch feature gate is off, or it predates it): kubecast skips the other shards' objects itself");
            }
            w.applied = Some(applied);
        }
        let m = crate::observe::metrics::get();
        m.shard_server_side.get_or_create(&w.label).set(i64::from(applied));
    }

    /// Whether the change of `uid` at `rv` was delivered by the object's shard of the count
    /// this stream resumed from (its floor). Floors are dropped once the watch passed them all.
    pub(super) fn below_floor(&mut self, uid: &str, rv: &str) -> bool {
        let Ok(at) = rv.parse::<u64>() else { return false };
        let covered = self.floors.iter().find(|(s, _)| s.owns(uid)).is_some_and(|(_, floor)| at <= *floor);
        if self.floors.iter().all(|(_, floor)| at > *floor) {
            info!(stream = %self.spec.name, resource_version = rv, "the watch passed every old shard's position: resumed from the other shard count");
            self.floors.clear();
        }
        covered
    }
}
