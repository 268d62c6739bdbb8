//! The index of a stream's delivered objects, compact: uid -> namespace, name and
//! resourceVersion, at a few dozen bytes per object instead of a few hundred.
//!
//! Representation (no caller sees it; they speak `&str` and [`IndexEntry`]):
//!
//! * Entries whose uid is a canonical UUID and whose resourceVersion a canonical decimal (all
//!   of them on the apiservers we test) are one 36-byte [`Slot`] in a dense sequence of
//!   fixed chunks that are never moved (`chunked.rs`, for the peak of a load): the uid's 16
//!   bytes, the resourceVersion as a `u64` (comparable by contract since Kubernetes 1.35,
//!   KEP-5504; here only compared for equality), the namespace as the `u32` id of an interned
//!   namespace, the name as offset and length in one name arena. A hash table of `u32` slot
//!   numbers (hashed by uid) finds them. A removed slot is filled with the last one
//!   (`swap_remove`), so the sequence stays dense.
//! * Any other entry (a uid that is not a lowercase UUID, a resourceVersion that is not a
//!   decimal number, a name past the arena's `u32` offsets) is kept as text in `loose`, a
//!   plain map. Each encoding gives back exactly the text it was made from, so what is read
//!   is what was inserted, whichever way it was kept.
//!
//! Invariant: a uid is in at most one of the two.

mod chunked;
mod encoding;
mod entry;
mod strings;
mod uid_set;

use std::collections::HashMap;
use std::fmt;
use std::hash::BuildHasher;

use hashbrown::HashTable;

use self::chunked::Chunked;
pub use self::encoding::UidRef;
use self::encoding::{parse_rv, parse_uuid};
pub use self::entry::{Index, IndexEntry};
use self::strings::{Arena, Namespaces};
pub use self::uid_set::{UidList, UidSet};

/// One compact entry: 36 bytes, no pointer.
#[derive(Debug, Clone, Copy)]
struct Slot {
    uid: [u8; 16],
    /// The resourceVersion, `u64::to_le_bytes` (bytes: the slot stays 4-aligned, 36 bytes).
    rv: [u8; 8],
    namespace: u32,
    name_at: u32,
    name_len: u32,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 36);

/// The index of a stream's objects: see the module documentation.
#[derive(Clone, Default)]
pub struct ObjectIndex {
    /// Slot numbers, hashed by their slot's uid.
    table: HashTable<u32>,
    slots: Chunked<Slot>,
    names: Arena,
    namespaces: Namespaces,
    loose: HashMap<Box<str>, IndexEntry, foldhash::fast::RandomState>,
    hasher: foldhash::fast::RandomState,
}

/// A resourceVersion read from the index; equal to another when their texts are.
#[derive(Debug, Clone, Copy)]
pub enum Rv<'a> {
    Number(u64),
    Text(&'a str),
}

impl Rv<'_> {
    /// Whether this is the resourceVersion `rv`.
    pub fn is(&self, rv: &str) -> bool {
        match self {
            Rv::Number(n) => parse_rv(rv) == Some(*n),
            Rv::Text(t) => *t == rv,
        }
    }
}

impl PartialEq for Rv<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Rv::Number(a), Rv::Number(b)) => a == b,
            (Rv::Text(a), Rv::Text(b)) => a == b,
            (Rv::Number(_), Rv::Text(t)) | (Rv::Text(t), Rv::Number(_)) => self.is(t) && other.is(t),
        }
    }
}

impl fmt::Display for Rv<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rv::Number(n) => n.fmt(f),
            Rv::Text(t) => f.write_str(t),
        }
    }
}

/// An entry read from the index (borrowed; [`EntryRef::to_entry`] for an owned one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EntryRef<'a> {
    pub namespace: Option<&'a str>,
    pub name: &'a str,
    pub resource_version: Rv<'a>,
}

impl EntryRef<'_> {
    pub fn to_entry(&self) -> IndexEntry {
        IndexEntry {
            namespace: self.namespace.map(str::to_owned),
            name: self.name.to_owned(),
            resource_version: self.resource_version.to_string(),
        }
    }

    /// Whether this is `e`.
    pub fn is(&self, e: &IndexEntry) -> bool {
        self.namespace == e.namespace.as_deref() && self.name == e.name && self.resource_version.is(&e.resource_version)
    }
}

impl<'a> From<&'a IndexEntry> for EntryRef<'a> {
    fn from(e: &'a IndexEntry) -> Self {
        EntryRef { namespace: e.namespace.as_deref(), name: &e.name, resource_version: Rv::Text(&e.resource_version) }
    }
}

impl ObjectIndex {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.slots.len() + self.loose.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Namespaces the objects are in.
    pub fn namespaces(&self) -> usize {
        self.namespaces.len()
    }

    pub fn get(&self, uid: &str) -> Option<EntryRef<'_>> {
        if let Some(key) = parse_uuid(uid)
            && let Some(slot) = self.find(&key)
        {
            return Some(self.view(&self.slots[slot]));
        }
        self.loose.get(uid).map(EntryRef::from)
    }

    pub fn contains(&self, uid: &str) -> bool {
        self.get(uid).is_some()
    }

    /// Holds `entry` for `uid` (replacing what it held).
    pub fn insert(&mut self, uid: &str, entry: &IndexEntry) {
        self.insert_ref(uid, EntryRef::from(entry));
    }

    /// Holds `entry` for `uid` (replacing what it held), copying only what it keeps: an entry
    /// read from another index costs no allocation when it fits a slot.
    pub fn insert_ref(&mut self, uid: &str, entry: EntryRef<'_>) {
        let key = parse_uuid(uid);
        let rv = match entry.resource_version {
            Rv::Number(n) => Some(n),
            Rv::Text(t) => parse_rv(t),
        };
        if let (Some(key), Some(rv)) = (key, rv) {
            if !self.loose.is_empty() {
                self.loose.remove(uid);
            }
            if let Some(slot) = self.find(&key) {
                let held = &self.slots[slot];
                if self.names.get(held.name_at, held.name_len) == entry.name
                    && self.namespaces.get(held.namespace) == entry.namespace
                {
                    self.slots[slot].rv = rv.to_le_bytes();
                    return;
                }
                // Another name or namespace for the uid (never from an apiserver): anew.
                self.remove_slot(&key);
            }
            if self.push_slot(key, rv, entry) {
                return;
            }
        } else if let Some(key) = key {
            self.remove_slot(&key);
        }
        self.loose.insert(uid.into(), entry.to_entry());
    }

    /// Removes `uid`; its entry, if it was held.
    pub fn remove(&mut self, uid: &str) -> Option<IndexEntry> {
        if let Some(key) = parse_uuid(uid)
            && let Some(e) = self.remove_slot(&key)
        {
            return Some(e);
        }
        if self.loose.is_empty() { None } else { self.loose.remove(uid) }
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (UidRef<'_>, EntryRef<'_>)> + '_ {
        let compact = self.slots.iter().map(|s| (UidRef::Uuid(&s.uid), self.view(s)));
        compact.chain(self.loose.iter().map(|(u, e)| (UidRef::Text(u), EntryRef::from(e))))
    }

    /// The index as a plain map (tests, and the position as the stores write it).
    pub fn to_index(&self) -> Index {
        self.iter().map(|(u, e)| (u.to_string(), e.to_entry())).collect()
    }

    pub fn clear(&mut self) {
        *self = Self { hasher: self.hasher.clone(), ..Self::default() };
    }

    fn hash(&self, key: &[u8; 16]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn find(&self, key: &[u8; 16]) -> Option<usize> {
        let slots = &self.slots;
        self.table.find(self.hash(key), |&s| slots[s as usize].uid == *key).map(|&s| s as usize)
    }

    fn view(&self, s: &Slot) -> EntryRef<'_> {
        EntryRef {
            namespace: self.namespaces.get(s.namespace),
            name: self.names.get(s.name_at, s.name_len),
            resource_version: Rv::Number(u64::from_le_bytes(s.rv)),
        }
    }

    /// A new slot for `key`; `false` (nothing changed) when the entry does not fit one.
    fn push_slot(&mut self, key: [u8; 16], rv: u64, entry: EntryRef<'_>) -> bool {
        let Ok(number) = u32::try_from(self.slots.len()) else { return false };
        let Some(namespace) = self.namespaces.acquire(entry.namespace) else { return false };
        let name = match self.names.push(entry.name) {
            Some(at) => Some(at),
            None => {
                self.compact_names();
                self.names.push(entry.name)
            }
        };
        let Some((name_at, name_len)) = name else {
            self.namespaces.release(namespace);
            return false;
        };
        self.slots.push(Slot { uid: key, rv: rv.to_le_bytes(), namespace, name_at, name_len });
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table.insert_unique(hasher.hash_one(key), number, |&s| hasher.hash_one(slots[s as usize].uid));
        true
    }

    fn remove_slot(&mut self, key: &[u8; 16]) -> Option<IndexEntry> {
        let hash = self.hash(key);
        let slots = &self.slots;
        let found = self.table.find_entry(hash, |&s| slots[s as usize].uid == *key).ok()?;
        let (slot, _) = found.remove();
        let slot = slot as usize;
        let last = self.slots.len() - 1;
        if slot != last {
            // The last slot moves into the hole: its number in the table changes.
            let moved = self.hash(&self.slots[last].uid);
            *self.table.find_mut(moved, |&s| s as usize == last).expect("every slot is in the table") = slot as u32;
        }
        let gone = self.slots.swap_remove(slot);
        let entry = self.view(&gone).to_entry();
        self.namespaces.release(gone.namespace);
        self.names.free(gone.name_len);
        if self.names.wants_compaction() {
            self.compact_names();
        }
        self.shrink_if_sparse();
        Some(entry)
    }

    /// Rewrites the name arena without its garbage.
    fn compact_names(&mut self) {
        let mut fresh = self.names.fresh();
        for s in self.slots.iter_mut() {
            let (at, _) = fresh.push(self.names.get(s.name_at, s.name_len)).expect("smaller than the arena it leaves");
            s.name_at = at;
        }
        self.names.replace(fresh);
    }

    /// After many removals, gives memory back (the slots' chunks go as they empty; the table
    /// keeps twice the entries).
    fn shrink_if_sparse(&mut self) {
        let len = self.slots.len();
        if self.table.capacity() > 1024 && len * 4 < self.table.capacity() {
            let (slots, hasher) = (&self.slots, &self.hasher);
            self.table.shrink_to(len * 2, |&s| hasher.hash_one(slots[s as usize].uid));
        }
        if self.slots.is_empty() {
            self.names.clear();
        }
    }
}

impl FromIterator<(String, IndexEntry)> for ObjectIndex {
    fn from_iter<I: IntoIterator<Item = (String, IndexEntry)>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut index = ObjectIndex::new();
        for (uid, entry) in iter {
            index.insert(&uid, &entry);
        }
        index
    }
}

impl From<Index> for ObjectIndex {
    fn from(index: Index) -> Self {
        index.into_iter().collect()
    }
}

impl PartialEq for ObjectIndex {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().all(|(uid, e)| other.get(&uid.to_string()) == Some(e))
    }
}

impl fmt::Debug for ObjectIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter().map(|(u, e)| (u.to_string(), e))).finish()
    }
}

#[cfg(test)]
mod tests;
