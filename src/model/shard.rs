//! A shard: one of `count` equal slices of the 64-bit hash space of object uids
//! (`[coordination] shards`). Shard `index` of `count` owns the hashes in
//! `[index * 2^64 / count, (index + 1) * 2^64 / count)`; an object belongs to the shard whose
//! range holds the FNV-1a 64 hash of the bytes of its `metadata.uid`.
//!
//! The hash, the ranges and the selector are the apiserver's (Kubernetes' server-side sharded
//! list and watch, feature gate `ShardedListAndWatch`): `shardSelector=shardRange(
//! object.metadata.uid, '0x<start>', '0x<end>')`, bounds of exactly 16 lowercase hex digits, the
//! end of the last range written `'0x10000000000000000'` (2^64). Where the apiserver applies the
//! selector, a list echoes it in `metadata.shardInfo.selector`; where it does not, kubecast
//! applies [`Shard::owns`] itself, with the same result.
//!
//! Invariant: an object's uid never changes, so an object belongs to one shard for its whole
//! life: its changes are all seen by that shard, in order.

use std::fmt;
use std::hash::Hasher;

use serde::{Deserialize, Serialize};

/// The field the selector hashes.
pub const SHARD_FIELD: &str = "object.metadata.uid";
/// The most shards kubecast runs (a Lease, a set of positions and a producer each).
pub const MAX_SHARDS: u32 = 256;

/// Shard `index` of `count` (`index < count`, `1 <= count <= MAX_SHARDS`). Stored as its
/// label (`2-of-4`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Shard {
    index: u32,
    count: u32,
}

impl Shard {
    /// Shard `index` of `count`; `None` when `count` is 0 or above [`MAX_SHARDS`], or `index`
    /// is not below `count`.
    pub fn new(index: u32, count: u32) -> Option<Self> {
        ((1..=MAX_SHARDS).contains(&count) && index < count).then_some(Self { index, count })
    }

    /// Every shard of `count`, in order (none when `count` is out of range).
    pub fn all(count: u32) -> impl Iterator<Item = Shard> {
        (0..count).filter_map(move |i| Shard::new(i, count))
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// The first hash of the range (inclusive).
    pub fn start(&self) -> u64 {
        bound(self.index, self.count) as u64
    }

    /// The end of the range (exclusive): `2^64` for the last shard.
    pub fn end(&self) -> u128 {
        bound(self.index + 1, self.count)
    }

    /// Whether the range holds `hash`.
    pub fn holds(&self, hash: u64) -> bool {
        hash >= self.start() && u128::from(hash) < self.end()
    }

    /// Whether the object of this uid belongs to this shard.
    pub fn owns(&self, uid: &str) -> bool {
        self.holds(uid_hash(uid))
    }

    /// The shard of `count` that holds `hash`.
    pub fn of_hash(hash: u64, count: u32) -> Option<Shard> {
        if count == 0 || count > MAX_SHARDS {
            return None;
        }
        // floor(hash * count / 2^64) is the index whose range holds `hash` (the ranges' bounds
        // are floor(i * 2^64 / count)).
        let mut index = ((u128::from(hash) * u128::from(count)) >> 64) as u32;
        // The floor of the bounds can put a hash just below a bound into the next index.
        while index + 1 < count && u128::from(hash) >= bound(index + 1, count) {
            index += 1;
        }
        while index > 0 && u128::from(hash) < bound(index, count) {
            index -= 1;
        }
        Shard::new(index, count)
    }

    /// The apiserver's `shardSelector` for this range, exactly as it echoes it back in
    /// `metadata.shardInfo.selector`.
    pub fn selector(&self) -> String {
        format!("shardRange({SHARD_FIELD}, '{}', '{}')", hex_bound(self.start().into()), hex_bound(self.end()))
    }

    /// `3-of-4`: the shard in names (Lease, stream ids, metrics, `transactional.id`).
    pub fn label(&self) -> String {
        format!("{}-of-{}", self.index, self.count)
    }

    /// The name of this shard's Lease: `<lease_name>-<index>-of-<count>`.
    pub fn lease_name(&self, base: &str) -> String {
        format!("{base}-{}", self.label())
    }

    /// Parses [`Shard::label`] (`3-of-4`).
    pub fn parse_label(label: &str) -> Option<Shard> {
        let (index, count) = label.split_once("-of-")?;
        let (index, count) = (index.parse().ok()?, count.parse().ok()?);
        let shard = Shard::new(index, count)?;
        // Only the canonical spelling (no leading zeros or signs).
        (shard.label() == label).then_some(shard)
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shard {} of {}", self.index, self.count)
    }
}

impl TryFrom<String> for Shard {
    type Error = String;
    fn try_from(label: String) -> Result<Self, String> {
        Shard::parse_label(&label).ok_or_else(|| format!("{label:?} is not a shard (e.g. \"2-of-4\")"))
    }
}

impl From<Shard> for String {
    fn from(s: Shard) -> String {
        s.label()
    }
}

/// `floor(i * 2^64 / count)`, up to `2^64` for `i == count`.
fn bound(i: u32, count: u32) -> u128 {
    (u128::from(i) << 64) / u128::from(count)
}

/// A bound as the apiserver takes it: `0x` and 16 lowercase hex digits; 2^64 has 17.
fn hex_bound(b: u128) -> String {
    format!("0x{b:016x}")
}

/// The FNV-1a 64 hash of the uid's bytes: the apiserver's shard hash.
pub fn uid_hash(uid: &str) -> u64 {
    let mut h = fnv::FnvHasher::default();
    h.write(uid.as_bytes());
    h.finish()
}

/// Parses a selector the apiserver echoed (`metadata.shardInfo.selector`): the ranges it
/// applied, `(start, end)` each, over [`SHARD_FIELD`]; `None` when it is not a selector of
/// that form (kubecast then filters itself).
pub fn parse_selector(selector: &str) -> Option<Vec<(u64, u128)>> {
    let mut out = Vec::new();
    for part in selector.split("||") {
        let inner = part.trim().strip_prefix("shardRange(")?.strip_suffix(')')?;
        let mut args = inner.split(',').map(str::trim);
        let (field, start, end) = (args.next()?, args.next()?, args.next()?);
        if field != SHARD_FIELD || args.next().is_some() {
            return None;
        }
        let (start, end) = (parse_bound(start)?, parse_bound(end)?);
        if start >= end || start > u128::from(u64::MAX) {
            return None;
        }
        out.push((start as u64, end));
    }
    Some(out)
}

fn parse_bound(quoted: &str) -> Option<u128> {
    let hex = quoted.strip_prefix('\'')?.strip_suffix('\'')?.strip_prefix("0x")?;
    if hex.is_empty() || hex.len() > 17 {
        return None;
    }
    let v = u128::from_str_radix(hex, 16).ok()?;
    (v <= 1u128 << 64).then_some(v)
}

/// Whether the ranges a server applied select exactly what `shard` owns (the server then
/// filtered for it).
pub fn applies_exactly(ranges: &[(u64, u128)], shard: &Shard) -> bool {
    ranges == [(shard.start(), shard.end())]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_hash_is_fnv1a_64_of_the_uid_bytes() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(uid_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(uid_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(uid_hash("foobar"), 0x8594_4171_f739_67e8);
        // Computed by the apiserver's own code (k8s.io/apimachinery v0.36.3,
        // pkg/sharding.HashField), for uids as the apiserver makes them.
        for (uid, hex) in [
            ("6f1c1a9e-2b7d-4c1e-9f00-0123456789ab", "2198f536c97444d6"),
            ("00000000-0000-0000-0000-000000000000", "7c384c6218f299f1"),
            ("d2b3c1f0-8e4a-4b9e-a1c7-3f5e9d2a7b64", "6c9047a5687b963a"),
        ] {
            assert_eq!(format!("{:016x}", uid_hash(uid)), hex, "{uid}");
        }
    }

    #[test]
    fn four_shards_are_the_apiserver_s_documented_split() {
        let s: Vec<String> = Shard::all(4).map(|s| s.selector()).collect();
        assert_eq!(
            s,
            [
                "shardRange(object.metadata.uid, '0x0000000000000000', '0x4000000000000000')",
                "shardRange(object.metadata.uid, '0x4000000000000000', '0x8000000000000000')",
                "shardRange(object.metadata.uid, '0x8000000000000000', '0xc000000000000000')",
                "shardRange(object.metadata.uid, '0xc000000000000000', '0x10000000000000000')",
            ]
        );
        assert_eq!(
            Shard::new(0, 1).unwrap().selector(),
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x10000000000000000')"
        );
    }

    #[test]
    fn out_of_range_shards_do_not_exist() {
        assert!(Shard::new(0, 0).is_none());
        assert!(Shard::new(4, 4).is_none());
        assert!(Shard::new(0, MAX_SHARDS + 1).is_none());
        assert_eq!(Shard::all(0).count(), 0);
        assert_eq!(Shard::all(3).count(), 3);
    }

    #[test]
    fn labels_and_lease_names() {
        let s = Shard::new(2, 4).unwrap();
        assert_eq!(s.label(), "2-of-4");
        assert_eq!(s.lease_name("kubecast"), "kubecast-2-of-4");
        assert_eq!(Shard::parse_label("2-of-4"), Some(s));
        for bad in ["4-of-4", "02-of-4", "2-of-04", "-1-of-4", "2of4", "2-of-", ""] {
            assert_eq!(Shard::parse_label(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_echoed_selector_is_recognised_only_when_it_is_the_shard_s_range() {
        let s = Shard::new(1, 4).unwrap();
        let ranges = parse_selector(&s.selector()).expect("parses");
        assert!(applies_exactly(&ranges, &s));
        assert!(!applies_exactly(&ranges, &Shard::new(2, 4).unwrap()));
        let last = Shard::new(3, 4).unwrap();
        assert!(applies_exactly(&parse_selector(&last.selector()).unwrap(), &last));
        for bad in [
            "",
            "shardRange(object.metadata.namespace, '0x0000000000000000', '0x4000000000000000')",
            "shardRange(object.metadata.uid, '0x4000000000000000', '0x0000000000000000')",
            "shardRange(object.metadata.uid, '0x0000000000000000', '0x20000000000000000')",
            "labels(x)",
        ] {
            assert!(parse_selector(bad).is_none_or(|r| !applies_exactly(&r, &s)), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn the_ranges_of_a_count_cover_the_hash_space_once(count in 1u32..=MAX_SHARDS) {
            let shards: Vec<Shard> = Shard::all(count).collect();
            prop_assert_eq!(shards[0].start(), 0);
            prop_assert_eq!(shards.last().unwrap().end(), 1u128 << 64);
            for w in shards.windows(2) {
                prop_assert_eq!(w[0].end(), u128::from(w[1].start()));
                prop_assert!(u128::from(w[0].start()) < w[0].end());
            }
        }

        #[test]
        fn every_hash_belongs_to_exactly_one_shard(hash: u64, count in 1u32..=MAX_SHARDS) {
            let owner = Shard::of_hash(hash, count).unwrap();
            prop_assert!(owner.holds(hash));
            let holders = Shard::all(count).filter(|s| s.holds(hash)).count();
            prop_assert_eq!(holders, 1);
        }

        #[test]
        fn bounds_are_spelled_as_the_apiserver_requires(index in 0u32..MAX_SHARDS, count in 1u32..=MAX_SHARDS) {
            prop_assume!(index < count);
            let s = Shard::new(index, count).unwrap();
            let sel = s.selector();
            for b in sel.split('\'').skip(1).step_by(2) {
                let hex = b.strip_prefix("0x").unwrap();
                prop_assert!(hex.len() == 16 || b == "0x10000000000000000", "{}", b);
                prop_assert!(hex.chars().all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)), "{}", b);
            }
            prop_assert!(applies_exactly(&parse_selector(&sel).unwrap(), &s));
        }

        #[test]
        fn a_uid_belongs_to_one_shard_of_each_count(uid in "[0-9a-f-]{36}", count in 1u32..=64) {
            let owners: Vec<Shard> = Shard::all(count).filter(|s| s.owns(&uid)).collect();
            prop_assert_eq!(owners.len(), 1);
            prop_assert_eq!(Some(owners[0]), Shard::of_hash(uid_hash(&uid), count));
        }
    }
}
