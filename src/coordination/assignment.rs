//! Which shards a replica should take or give up (`[coordination] shards`), decided from what
//! it sees of the Leases: the live replicas (each renews a member Lease) and the live holder
//! of each shard's Lease. A pure function: every replica decides from its own view, and the
//! Leases' conditional writes settle races.
//!
//! The rule, with `N` shards and `R` live replicas (`ceil = ceil(N / R)`):
//! - while no shard is free (a replica that can take it is there, or will take it), a
//!   replica holding more than `ceil` gives one up, and the busiest replica (most shards; of those, the smallest
//!   identity) gives one up when it holds more than one shard more than the least busy
//!   replica: a new replica gets its shards by a clean handover, without waiting for a crash;
//! - a replica takes free shards while it holds fewer than `ceil` and no more than any other
//!   live replica: the least busy take first. Replicas holding as many shards as each other
//!   start at different free shards (the k-th of them by identity at the k-th), so replicas
//!   starting together take different shards in the same round instead of racing for one.
//!
//! One release per decision (the next waits until the others have seen it), so the replicas
//! converge to holding `floor(N / R)` or `ceil(N / R)` shards each (2/1/1 for 4 shards on 3
//! replicas), without two replicas giving up shards for the same newcomer.

use std::collections::{BTreeMap, BTreeSet};

use crate::model::Shard;

/// What one replica sees.
#[derive(Debug, Clone, Default)]
pub struct View {
    /// Live replicas (member Leases renewed within the lease duration), this one included.
    pub members: BTreeSet<String>,
    /// Per shard index: its live holder (`None`: free, given up or expired).
    pub holders: Vec<Option<String>>,
}

/// What a replica should do now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decision {
    /// Free shards to try to take (in order).
    pub acquire: Vec<Shard>,
    /// A shard to give up cleanly (final checkpoint, then the Lease released).
    pub release: Option<Shard>,
}

/// What the coordinator sees of one shard: it runs here, or its Lease names this live holder
/// (`None`: no holder, or one that did not renew it in time).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    RunningHere,
    Lease(Option<String>),
}

impl View {
    /// Replica `me`'s view: the live `members` of its own shard count (`other_counts`' replicas
    /// take none of this count's shards; `me` always counts) and each shard's holder by `seen`
    /// (in shard order). A Lease that still names `me` while the shard does not run here (lost
    /// at a missed renew deadline, or taken by an attempt that timed out after its write) is
    /// free: taken back like any other.
    pub fn of<'a>(
        me: &str,
        mut members: BTreeSet<String>,
        other_counts: impl IntoIterator<Item = &'a str>,
        seen: impl IntoIterator<Item = Seen>,
    ) -> View {
        for other in other_counts {
            members.remove(other);
        }
        members.insert(me.to_string());
        let holders = seen
            .into_iter()
            .map(|s| match s {
                Seen::RunningHere => Some(me.to_string()),
                Seen::Lease(holder) => holder.filter(|h| h != me),
            })
            .collect();
        View { members, holders }
    }
}

/// The decision of replica `me` with `count` shards, from `view`.
pub fn decide(me: &str, count: u32, view: &View) -> Decision {
    let shards: Vec<Shard> = Shard::all(count).collect();
    let mut held: BTreeMap<&str, Vec<Shard>> = BTreeMap::new();
    for m in &view.members {
        held.entry(m.as_str()).or_default();
    }
    held.entry(me).or_default();
    let mut free = Vec::new();
    for shard in &shards {
        match view.holders.get(shard.index() as usize).and_then(Option::as_deref) {
            // A holder without a member Lease in view still counts as a live replica.
            Some(holder) => held.entry(holder).or_default().push(*shard),
            None => free.push(*shard),
        }
    }
    let replicas = held.len() as u32;
    let ceil = count.div_ceil(replicas.max(1)) as usize;
    let mine = held[me].clone();
    let min_other = held.iter().filter(|(k, _)| **k != me).map(|(_, v)| v.len()).min();
    let min_all = held.values().map(Vec::len).min().unwrap_or(0);

    let mut decision = Decision::default();
    if free.is_empty() {
        let max = held.values().map(Vec::len).max().unwrap_or(0);
        let busiest = held.iter().find(|(_, v)| v.len() == max).map(|(k, _)| *k);
        if mine.len() > ceil || (busiest == Some(me) && mine.len() > min_all + 1) {
            decision.release = mine.last().copied();
        }
        return decision;
    }
    let peers = held.iter().filter(|(_, v)| v.len() == mine.len()).map(|(k, _)| *k);
    let rank = peers.take_while(|k| *k != me).count();
    // Each of them takes one shard per round (no more than any other), so the k-th starts at
    // the k-th free one.
    let start = rank % free.len();
    free.rotate_left(start);
    for (have, shard) in (mine.len()..).zip(free) {
        if have >= ceil || min_other.is_some_and(|m| have > m) {
            break;
        }
        decision.acquire.push(shard);
    }
    decision
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view(members: &[&str], holders: &[Option<&str>]) -> View {
        View {
            members: members.iter().map(|m| m.to_string()).collect(),
            holders: holders.iter().map(|h| h.map(str::to_string)).collect(),
        }
    }

    fn indexes(shards: &[Shard]) -> Vec<u32> {
        shards.iter().map(Shard::index).collect()
    }

    #[test]
    fn the_view_frees_a_lease_naming_this_replica_where_the_shard_does_not_run_and_leaves_other_counts_out() {
        let members: BTreeSet<String> = ["b", "old"].iter().map(|m| m.to_string()).collect();
        let seen = [Seen::RunningHere, Seen::Lease(Some("a".into())), Seen::Lease(Some("b".into())), Seen::Lease(None)];
        let v = View::of("a", members, ["old"], seen);
        assert_eq!(v.members.iter().map(String::as_str).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(v.holders, [Some("a".to_string()), None, Some("b".to_string()), None]);
        // Decided on: the freed shard is taken back (a holds 1, b 1, two free).
        assert_eq!(indexes(&decide("a", 4, &v).acquire), [1]);
    }

    #[test]
    fn a_lone_replica_takes_every_shard_at_once() {
        let d = decide("a", 4, &view(&["a"], &[None, None, None, None]));
        assert_eq!(indexes(&d.acquire), [0, 1, 2, 3]);
        assert_eq!(d.release, None);
    }

    #[test]
    fn replicas_starting_together_take_one_different_shard_each_first() {
        let v = view(&["a", "b", "c"], &[None, None, None, None]);
        for (me, shard) in [("a", 0), ("b", 1), ("c", 2)] {
            assert_eq!(indexes(&decide(me, 4, &v).acquire), [shard], "{me}");
        }
        // Two of them hold one each: the third, alone with none, takes from the first free.
        let v = view(&["a", "b", "c"], &[Some("a"), Some("b"), None, None]);
        assert_eq!(indexes(&decide("c", 4, &v).acquire), [2, 3]);
        // 8 shards on 4 replicas: one each per round, different ones.
        let v = view(&["a", "b", "c", "d"], &[None; 8]);
        let all: Vec<u32> = ["a", "b", "c", "d"].iter().flat_map(|me| indexes(&decide(me, 8, &v).acquire)).collect();
        assert_eq!(all, [0, 1, 2, 3]);
        let v = view(&["a", "b", "c", "d"], &[Some("a"), Some("b"), Some("c"), Some("d"), None, None, None, None]);
        let all: Vec<u32> = ["a", "b", "c", "d"].iter().flat_map(|me| indexes(&decide(me, 8, &v).acquire)).collect();
        assert_eq!(all, [4, 5, 6, 7]);
    }

    #[test]
    fn a_newcomer_gets_a_shard_from_the_busiest_by_a_handover() {
        let v = view(&["a", "b"], &[Some("a"), Some("a"), Some("a"), Some("a")]);
        assert_eq!(decide("a", 4, &v).release.map(|s| s.index()), Some(3));
        assert_eq!(decide("b", 4, &v), Decision::default(), "nothing free yet");
        let v = view(&["a", "b"], &[Some("a"), Some("a"), Some("a"), None]);
        assert_eq!(decide("a", 4, &v), Decision::default(), "the free shard is the newcomer's");
        assert_eq!(indexes(&decide("b", 4, &v).acquire), [3]);
        // 2/2/0 when a third comes: only the busiest with the smallest identity gives one up.
        let v = view(&["a", "b", "c"], &[Some("a"), Some("a"), Some("b"), Some("b")]);
        assert_eq!(decide("a", 4, &v).release.map(|s| s.index()), Some(1));
        assert_eq!(decide("b", 4, &v).release, None);
    }

    #[test]
    fn a_dead_replica_s_shards_are_taken_by_the_least_busy() {
        // c died: its shard's Lease expired and its member Lease is gone.
        let v = view(&["a", "b"], &[Some("a"), Some("a"), Some("b"), None]);
        assert_eq!(decide("a", 4, &v), Decision::default());
        assert_eq!(indexes(&decide("b", 4, &v).acquire), [3]);
    }

    /// Runs every replica's decision in turn, applying it to the shared state (the Leases),
    /// until nothing changes; the number of rounds it took.
    fn converge(members: &[String], holders: &mut [Option<String>], count: u32) -> usize {
        for round in 0..(4 * count as usize + 8) {
            let mut changed = false;
            for me in members {
                let v = View { members: members.iter().cloned().collect(), holders: holders.to_vec() };
                let d = decide(me, count, &v);
                if let Some(s) = d.release {
                    holders[s.index() as usize] = None;
                    changed = true;
                }
                for s in d.acquire {
                    let slot = &mut holders[s.index() as usize];
                    if slot.is_none() {
                        *slot = Some(me.clone());
                        changed = true;
                    }
                }
            }
            if !changed {
                return round;
            }
        }
        panic!("no convergence: {holders:?}");
    }

    proptest! {
        #[test]
        fn replicas_converge_to_an_even_spread_from_any_state(
            count in 1u32..=16,
            replicas in 1usize..=6,
            start in proptest::collection::vec(proptest::option::of(0usize..8), 16),
        ) {
            let members: Vec<String> = (0..replicas).map(|i| format!("r{i}")).collect();
            // Any start: free shards, shards of live replicas, shards of dead ones (expired,
            // so free as far as the view goes).
            let mut holders: Vec<Option<String>> = (0..count as usize)
                .map(|i| start[i].filter(|r| *r < replicas).map(|r| format!("r{r}")))
                .collect();
            converge(&members, &mut holders, count);
            prop_assert!(holders.iter().all(Option::is_some), "every shard held: {:?}", holders);
            let per: Vec<usize> = members.iter().map(|m| holders.iter().filter(|h| h.as_ref() == Some(m)).count()).collect();
            let (lo, hi) = (*per.iter().min().unwrap(), *per.iter().max().unwrap());
            prop_assert!(hi <= (count as usize).div_ceil(replicas), "{:?}", per);
            prop_assert!(hi - lo <= 1, "even: {:?}", per);
        }
    }

    #[test]
    fn four_shards_on_three_replicas_spread_two_one_one() {
        let members: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        let mut holders = vec![None; 4];
        converge(&members, &mut holders, 4);
        let mut per: Vec<usize> =
            members.iter().map(|m| holders.iter().filter(|h| h.as_ref() == Some(m)).count()).collect();
        per.sort();
        assert_eq!(per, [1, 1, 2]);
    }
}
