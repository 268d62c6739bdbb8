//! A shard's stream (`StreamSpec::shard`): its lists and watches carry the shard's
//! `shardSelector`; where the apiserver applies it (a list's `metadata.shardInfo` echoes it)
//! the objects of other shards never arrive, and where it does not (an older apiserver, the
//! `ShardedListAndWatch` gate off, a streaming list, which echoes nothing) the reflector skips
//! them by the same hash. It always checks, so the items are the same either way.

use tracing::info;

use super::state::Reflector;

impl Reflector {
    /// Whether the object of `uid` belongs to another shard than this stream's (skipped).
    pub(super) fn foreign(&mut self, uid: &str) -> bool {
        let Some(shard) = &self.spec.shard else { return false };
        if shard.owns(uid) {
            return false;
        }
        if let Some(w) = &self.shard_watch {
            w.skipped.inc();
        }
        true
    }

    /// A list page said whether the apiserver applied the shard selector: logged when that
    /// changes, and kept in `kubecast_shard_server_side`.
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
        w.server_side.set(i64::from(applied));
    }
}
