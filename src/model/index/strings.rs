//! Where the compact index keeps its text: namespaces interned (a few, each shared by many
//! objects: a `u32` per entry, counted so that a namespace no object is in any more is
//! dropped) and names in one arena (a `String`; an entry holds offset and length; a removed
//! name is garbage until the index compacts the arena).

use std::collections::HashMap;

/// The id of "no namespace" (a cluster-scoped object).
pub const NO_NAMESPACE: u32 = u32::MAX;

/// Interned namespaces with a count of the entries in each.
#[derive(Debug, Default, Clone)]
pub struct Namespaces {
    /// id -> (namespace, entries in it); `None` once freed.
    by_id: Vec<Option<(Box<str>, u32)>>,
    ids: HashMap<Box<str>, u32, foldhash::fast::RandomState>,
    free: Vec<u32>,
}

impl Namespaces {
    /// The id of `ns` for one more entry (`None`: [`NO_NAMESPACE`]); `None` when no id is left.
    pub fn acquire(&mut self, ns: Option<&str>) -> Option<u32> {
        let Some(ns) = ns else { return Some(NO_NAMESPACE) };
        if let Some(&id) = self.ids.get(ns) {
            let slot = self.by_id[id as usize].as_mut().expect("live id");
            slot.1 += 1;
            return Some(id);
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = u32::try_from(self.by_id.len()).ok().filter(|&id| id != NO_NAMESPACE)?;
                self.by_id.push(None);
                id
            }
        };
        self.by_id[id as usize] = Some((ns.into(), 1));
        self.ids.insert(ns.into(), id);
        Some(id)
    }

    /// One entry fewer in `id`.
    pub fn release(&mut self, id: u32) {
        if id == NO_NAMESPACE {
            return;
        }
        let slot = &mut self.by_id[id as usize];
        let (ns, count) = slot.as_mut().expect("live id");
        *count -= 1;
        if *count == 0 {
            self.ids.remove(&**ns);
            *slot = None;
            self.free.push(id);
        }
    }

    pub fn get(&self, id: u32) -> Option<&str> {
        if id == NO_NAMESPACE {
            return None;
        }
        Some(&self.by_id[id as usize].as_ref().expect("live id").0)
    }

    /// Namespaces in use.
    pub fn len(&self) -> usize {
        self.ids.len()
    }
}

/// Bytes per chunk of the name arena (a name never spans two).
const NAME_CHUNK: usize = 64 * 1024;

/// Names, one after the other in chunks of [`NAME_CHUNK`] bytes that are never moved (see
/// `chunked.rs`); a name's offset counts from the first chunk's start.
#[derive(Debug, Default, Clone)]
pub struct Arena {
    chunks: Vec<String>,
    /// Bytes of names pushed (the unused end of a full chunk not counted).
    used: usize,
    /// Bytes of removed names still in the chunks.
    garbage: usize,
}

impl Arena {
    /// Appends `name`: its offset, or `None` when the arena would outgrow `u32` offsets (or the
    /// name a chunk).
    pub fn push(&mut self, name: &str) -> Option<(u32, u32)> {
        let len = u32::try_from(name.len()).ok()?;
        if name.len() > NAME_CHUNK {
            return None;
        }
        let fits = self.chunks.last().is_some_and(|c| NAME_CHUNK - c.len() >= name.len());
        let chunk = if fits { self.chunks.len() - 1 } else { self.chunks.len() };
        let offset = if fits { self.chunks[chunk].len() } else { 0 };
        let at = u32::try_from(chunk * NAME_CHUNK + offset).ok()?;
        at.checked_add(len)?;
        if !fits {
            self.chunks.push(String::with_capacity(NAME_CHUNK));
        }
        self.chunks[chunk].push_str(name);
        self.used += name.len();
        Some((at, len))
    }

    pub fn get(&self, at: u32, len: u32) -> &str {
        let (at, len) = (at as usize, len as usize);
        let offset = at % NAME_CHUNK;
        &self.chunks[at / NAME_CHUNK][offset..offset + len]
    }

    /// A name at `len` bytes is no longer used.
    pub fn free(&mut self, len: u32) {
        self.garbage += len as usize;
    }

    /// Whether more than half of the arena is garbage (and it is worth a pass).
    pub fn wants_compaction(&self) -> bool {
        self.garbage > 4096 && self.garbage * 2 > self.used
    }

    /// Starts a compacted copy: push every live name into it, then [`Arena::replace`].
    pub fn fresh(&self) -> Arena {
        Arena::default()
    }

    pub fn replace(&mut self, compacted: Arena) {
        *self = compacted;
    }

    /// Bytes of live names.
    #[cfg(test)]
    pub fn live_bytes(&self) -> usize {
        self.used - self.garbage
    }

    pub fn clear(&mut self) {
        *self = Arena::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_dropped_with_its_last_entry_and_its_id_reused() {
        let mut ns = Namespaces::default();
        let shop = ns.acquire(Some("shop")).unwrap();
        assert_eq!(ns.acquire(Some("shop")), Some(shop));
        let web = ns.acquire(Some("web")).unwrap();
        assert_ne!(shop, web);
        assert_eq!(ns.acquire(None), Some(NO_NAMESPACE));
        assert_eq!(ns.get(NO_NAMESPACE), None);
        assert_eq!((ns.get(shop), ns.len()), (Some("shop"), 2));
        ns.release(shop);
        assert_eq!(ns.get(shop), Some("shop"), "one entry left in it");
        ns.release(shop);
        assert_eq!(ns.len(), 1);
        assert_eq!(ns.acquire(Some("db")), Some(shop), "the freed id");
        assert_eq!(ns.get(shop), Some("db"));
    }

    #[test]
    fn the_arena_gives_names_back_and_counts_its_garbage() {
        let mut a = Arena::default();
        let (x, y) = (a.push("alpha").unwrap(), a.push("").unwrap());
        let z = a.push("ça va").unwrap();
        assert_eq!((a.get(x.0, x.1), a.get(y.0, y.1), a.get(z.0, z.1)), ("alpha", "", "ça va"));
        a.free(x.1);
        assert_eq!(a.live_bytes(), "ça va".len());
        assert!(!a.wants_compaction(), "small");
        let mut big = Arena::default();
        let long = "n".repeat(5000);
        let (at, len) = big.push(&long).unwrap();
        big.push("kept").unwrap();
        big.free(len);
        assert!(big.wants_compaction());
        let mut fresh = big.fresh();
        let kept = fresh.push("kept").unwrap();
        big.replace(fresh);
        assert_eq!((big.get(kept.0, kept.1), big.live_bytes(), at), ("kept", 4, 0));
    }
}
