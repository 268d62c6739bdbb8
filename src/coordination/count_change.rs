//! A change of `[coordination] shards` while replicas run (a `helm upgrade` of the count, a
//! rollback): two counts must never run at once. Their shards overlap (the same object in a
//! shard of each), so both would publish its changes (twice, under two transactional ids with
//! exactly-once), and a range neither count's running shards cover would be missed.
//!
//! Every replica's member Lease says its count. The count of the replica that joined last
//! (its member Lease's creation, on the apiserver's clock) is the one the deployment changes
//! to:
//! - a replica that sees a live replica of another count that joined after it **yields**: it
//!   gives every shard up (each drains and writes its last positions) and takes none; not
//!   ready, so a rollout replaces it;
//! - a replica that sees shards of another count still held by live replicas **waits**: it
//!   takes none of its own until they are all released; not ready meanwhile.
//!
//! The new count then resumes from the old count's positions (`state/store/adopt.rs`).
//!
//! A replica without shards (count 1) takes part through `count_guard`: its member Lease says
//! 1, and its one Lease, `<lease_name>`, is count 1's.

use std::collections::BTreeSet;

use super::members::{Group, OtherCount};
use crate::model::Shard;

/// What a replica does about another count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CountChange {
    /// Give every shard up and take none: replicas of another count joined after this one.
    Yield { to: Vec<OtherCount> },
    /// Take none yet: these Leases of another count are still held by live replicas.
    Wait { held: Vec<String> },
}

impl CountChange {
    /// Why the replica is not ready, in words.
    pub fn reason(&self, count: u32) -> String {
        match self {
            CountChange::Yield { to } => {
                let who: Vec<String> = to.iter().map(|o| format!("{} (shards = {})", o.identity, o.shards)).collect();
                let what = if count == 1 { "the lease" } else { "its shards" };
                format!(
                    "the shard count is changing: replicas of another [coordination] shards joined after this one ({}); this replica (shards = {count}) gives {what} up and takes none, so that two counts never run at once",
                    who.join(", ")
                )
            }
            CountChange::Wait { held } => format!(
                "the shard count is changing: waiting until the replicas of the old count give their leases up (still held: {}); this replica (shards = {count}) takes none until then, then resumes from their positions",
                held.join(", ")
            ),
        }
    }
}

/// The change replica `me` (joined at `joined`, running `count` shards of Leases named after
/// `lease_name`) takes part in, if any: `others`, the live replicas of other counts;
/// `shard_leases`, every shard Lease of the group with its holder; `live`, every live
/// replica.
pub fn count_change<'a>(
    me: &str,
    joined: Option<k8s_openapi::jiff::Timestamp>,
    count: u32,
    lease_name: &str,
    others: &[OtherCount],
    shard_leases: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
    live: &BTreeSet<String>,
) -> Option<CountChange> {
    let newer: Vec<OtherCount> = others.iter().filter(|o| o.joined_after(joined, me)).cloned().collect();
    if !newer.is_empty() {
        return Some(CountChange::Yield { to: newer });
    }
    let mut held: Vec<String> = shard_leases
        .into_iter()
        .filter(|(name, holder)| {
            let other = lease_count(name, lease_name).is_some_and(|c| c != count);
            other && holder.is_some_and(|h| h != me && live.contains(h))
        })
        .map(|(name, _)| name.to_string())
        .collect();
    held.sort();
    (!held.is_empty()).then_some(CountChange::Wait { held })
}

impl Group {
    /// The change replica `me` (running `count` shards of Leases named after `lease_name`)
    /// takes part in, from this list of its group (see [`count_change`]).
    pub fn count_change(&self, me: &str, count: u32, lease_name: &str) -> Option<CountChange> {
        let leases = self.shards.iter().map(|(name, l)| {
            let holder = l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()).filter(|h| !h.is_empty());
            (name.as_str(), holder)
        });
        count_change(me, self.joined, count, lease_name, &self.other_counts, leases, &self.members)
    }
}

/// The shard count a Lease of the group `lease_name` belongs to: `<lease_name>-<i>-of-<N>`
/// is a shard's of `N`; `<lease_name>` itself is the one Lease of a replica without shards (1).
fn lease_count(name: &str, lease_name: &str) -> Option<u32> {
    if name == lease_name {
        return Some(1);
    }
    name.strip_prefix(lease_name)?.strip_prefix('-').and_then(Shard::parse_label).map(|s| s.count())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(s: i64) -> Option<k8s_openapi::jiff::Timestamp> {
        Some(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    fn other(id: &str, shards: u32, joined: i64) -> OtherCount {
        OtherCount { identity: id.into(), shards, joined: at(joined) }
    }

    #[test]
    fn a_lease_says_its_count() {
        assert_eq!(lease_count("k", "k"), Some(1));
        assert_eq!(lease_count("k-2-of-4", "k"), Some(4));
        assert_eq!(lease_count("k-member-ab12", "k"), None);
        assert_eq!(lease_count("kk-0-of-2", "k"), None, "another group's name that starts alike");
        assert_eq!(lease_count("k-0-of-2", "k-0"), None);
    }

    #[test]
    fn the_count_that_joined_last_runs_and_the_other_yields() {
        let live: BTreeSet<String> = ["old-a", "old-b", "new-a"].map(String::from).into();
        // An old replica (2 shards) sees a replica of 4 that joined after it: it yields.
        let c = count_change("old-a", at(100), 2, "k", &[other("new-a", 4, 200)], [], &live);
        assert!(matches!(&c, Some(CountChange::Yield { to }) if to[0].identity == "new-a"), "{c:?}");
        assert!(c.unwrap().reason(2).contains("gives its shards up"));
        // The new one waits while the old count's Leases are held by live replicas ...
        let leases =
            [("k-0-of-2", Some("old-a")), ("k-1-of-2", Some("gone")), ("k-0-of-4", None), ("k-1-of-4", Some("new-a"))];
        let c = count_change("new-a", at(200), 4, "k", &[other("old-a", 2, 100), other("old-b", 2, 90)], leases, &live);
        assert_eq!(
            c,
            Some(CountChange::Wait { held: vec!["k-0-of-2".into()] }),
            "a dead holder's Lease is not waited for"
        );
        // ... and runs once they are released.
        let released = [("k-0-of-2", None), ("k-1-of-2", Some("")), ("other-0-of-2", Some("old-b"))];
        assert_eq!(
            count_change(
                "new-a",
                at(200),
                4,
                "k",
                &[other("old-a", 2, 100)],
                released.map(|(n, h)| (n, h.filter(|h| !h.is_empty()))),
                &live
            ),
            None
        );
        // The same second: the identity decides, the same way on both sides.
        let a = count_change("a", at(5), 2, "k", &[other("b", 4, 5)], [], &live);
        let b = count_change("b", at(5), 4, "k", &[other("a", 2, 5)], [], &live);
        assert!(matches!(a, Some(CountChange::Yield { .. })) && !matches!(b, Some(CountChange::Yield { .. })));
        // From 2 shards to none: the one Lease `k` is count 1's, and the other way round.
        let live: BTreeSet<String> = ["one", "two"].map(String::from).into();
        let c = count_change("two", at(9), 2, "k", &[other("one", 1, 5)], [("k", Some("one"))], &live);
        assert_eq!(c, Some(CountChange::Wait { held: vec!["k".into()] }), "the unsharded Lease is waited for");
        let c = count_change("one", at(5), 1, "k", &[other("two", 2, 9)], [("k", Some("one"))], &live);
        assert!(matches!(c, Some(CountChange::Yield { .. })), "{c:?}");
        let c = count_change("one", at(9), 1, "k", &[other("two", 2, 5)], [("k-1-of-2", Some("two"))], &live);
        assert_eq!(c, Some(CountChange::Wait { held: vec!["k-1-of-2".into()] }));
        assert_eq!(
            count_change("one", at(9), 1, "k", &[], [("k", Some("two")), ("kk-0-of-2", Some("two"))], &live),
            None
        );
        // Nobody of another count: nothing to do.
        assert_eq!(count_change("a", at(5), 2, "k", &[], [("k-0-of-2", Some("b"))], &live), None);
    }
}
