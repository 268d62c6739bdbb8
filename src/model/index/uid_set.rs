//! The uids a list contained, to find the objects of the index it did not contain (deleted
//! while the stream was not watching). Compact like the index: a canonical UUID as its 16
//! bytes, any other uid as text.
//!
//! Collected as a plain sequence ([`UidList`]: 16 bytes per object, appended as the list
//! goes), then sorted once for lookups ([`UidSet`]). A hash set of the same keys takes 36
//! bytes per object (its table at most 7/8 full, doubling as it grows), the largest part of a
//! relist's peak at a million objects.

use std::collections::HashSet;

use super::encoding::{UidRef, parse_uuid};

/// Uids being collected (appended, not yet searchable): see [`UidList::into_set`].
#[derive(Debug, Clone, Default)]
pub struct UidList {
    uuids: Vec<[u8; 16]>,
    others: Vec<Box<str>>,
}

impl UidList {
    pub fn new() -> Self {
        Self::default()
    }

    /// Room for `n` UUIDs from the start (the size of the index a relist compares with): no
    /// growth, and no old buffer beside the new one while it grows.
    pub fn with_capacity(n: usize) -> Self {
        Self { uuids: Vec::with_capacity(n), others: Vec::new() }
    }

    pub fn insert(&mut self, uid: &str) {
        match parse_uuid(uid) {
            Some(key) => self.uuids.push(key),
            None => self.others.push(uid.into()),
        }
    }

    /// Uids collected (a uid inserted twice counts twice).
    pub fn len(&self) -> usize {
        self.uuids.len() + self.others.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The collected uids, sorted for lookups (in place: no second copy).
    pub fn into_set(self) -> UidSet {
        let mut uuids = self.uuids;
        uuids.sort_unstable();
        uuids.dedup();
        UidSet { uuids, others: self.others.into_iter().collect() }
    }
}

/// A set of uids to look up: see [`UidList`].
#[derive(Debug, Clone, Default)]
pub struct UidSet {
    /// Sorted, without duplicates.
    uuids: Vec<[u8; 16]>,
    others: HashSet<Box<str>, foldhash::fast::RandomState>,
}

impl UidSet {
    pub fn contains(&self, uid: &str) -> bool {
        match parse_uuid(uid) {
            Some(key) => self.uuids.binary_search(&key).is_ok(),
            None => self.others.contains(uid),
        }
    }

    /// [`UidSet::contains`] for a uid read from an index (no parsing).
    pub fn contains_ref(&self, uid: UidRef<'_>) -> bool {
        match uid {
            UidRef::Uuid(key) => self.uuids.binary_search(key).is_ok(),
            UidRef::Text(t) => self.contains(t),
        }
    }

    pub fn len(&self) -> usize {
        self.uuids.len() + self.others.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn uuids_and_other_uids_are_members_alike() {
        let uuid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let upper = "0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0";
        let mut list = UidList::with_capacity(4);
        for uid in [uuid, "u1", uuid, "u1"] {
            list.insert(uid);
        }
        assert_eq!(list.len(), 4);
        let set = list.into_set();
        assert_eq!(set.len(), 2, "a uid listed twice is one member");
        assert!(set.contains(uuid) && set.contains("u1"));
        assert!(!set.contains(upper), "another uid (not canonical: kept as text)");
        let key = parse_uuid(uuid).unwrap();
        assert!(set.contains_ref(UidRef::Uuid(&key)) && set.contains_ref(UidRef::Text("u1")));
        assert!(set.contains_ref(UidRef::Text(uuid)), "a UUID given as text is found");
        assert!(UidList::new().into_set().is_empty());
    }

    proptest! {
        /// Membership is exactly that of a `HashSet` of the same uids, UUIDs or not.
        #[test]
        fn members_are_exactly_the_inserted_uids(
            inserted in proptest::collection::vec(0u16..400, 0..300),
            probes in proptest::collection::vec(0u16..400, 0..100),
        ) {
            // Half of the numbers as UUIDs, the other half as other text.
            let uid = |n: u16| if n.is_multiple_of(2) { format!("00000000-0000-0000-0000-{n:012x}") } else { format!("uid-{n}") };
            let mut list = UidList::new();
            let mut model = std::collections::HashSet::new();
            for &n in &inserted {
                list.insert(&uid(n));
                model.insert(uid(n));
            }
            let set = list.into_set();
            prop_assert_eq!(set.len(), model.len());
            for n in inserted.iter().chain(&probes) {
                prop_assert_eq!(set.contains(&uid(*n)), model.contains(&uid(*n)));
            }
        }
    }
}
