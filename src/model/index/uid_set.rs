//! A set of uids, compact like the index: a canonical UUID as its 16 bytes, any other uid as
//! text. What a relist collects (the uids it saw) to find the objects it did not see.

use std::collections::HashSet;

use super::encoding::{UidRef, parse_uuid};

#[derive(Debug, Clone, Default)]
pub struct UidSet {
    uuids: HashSet<[u8; 16], foldhash::fast::RandomState>,
    others: HashSet<Box<str>, foldhash::fast::RandomState>,
}

impl UidSet {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `uid`; `false` when it was there already.
    pub fn insert(&mut self, uid: &str) -> bool {
        match parse_uuid(uid) {
            Some(key) => self.uuids.insert(key),
            None => self.others.insert(uid.into()),
        }
    }

    pub fn contains(&self, uid: &str) -> bool {
        match parse_uuid(uid) {
            Some(key) => self.uuids.contains(&key),
            None => self.others.contains(uid),
        }
    }

    /// [`UidSet::contains`] for a uid read from an index (no parsing).
    pub fn contains_ref(&self, uid: UidRef<'_>) -> bool {
        match uid {
            UidRef::Uuid(key) => self.uuids.contains(key),
            UidRef::Text(t) => self.contains(t),
        }
    }

    pub fn len(&self) -> usize {
        self.uuids.len() + self.others.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Empties the set and gives its memory back.
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_and_other_uids_are_members_alike() {
        let uuid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let upper = "0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0";
        let mut set = UidSet::new();
        assert!(set.insert(uuid) && set.insert("u1"));
        assert!(!set.insert(uuid) && !set.insert("u1"));
        assert!(set.contains(uuid) && set.contains("u1"));
        assert!(!set.contains(upper), "another uid (not canonical: kept as text)");
        assert!(set.insert(upper));
        assert_eq!(set.len(), 3);
        let key = parse_uuid(uuid).unwrap();
        assert!(set.contains_ref(UidRef::Uuid(&key)) && set.contains_ref(UidRef::Text("u1")));
        assert!(set.contains_ref(UidRef::Text(uuid)), "a UUID given as text is found");
        set.clear();
        assert!(set.is_empty() && !set.contains(uuid));
    }
}
