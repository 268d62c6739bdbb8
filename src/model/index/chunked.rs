//! Storage that grows by fixed chunks, never by moving what it holds: the index's slots and
//! names. A `Vec` growing to a million slots copies them at every growth and frees the old
//! buffer; an allocator that gives memory back only after a delay (mimalloc's purge epoch)
//! keeps every old buffer resident until then, several times the final size at the moment a
//! checkpoint or a list of a million objects has just been read (222 MB resident for a 55 MB
//! index). Chunks are never moved: the peak is the index itself, and at most one chunk is
//! unused.

use std::ops::{Index, IndexMut};

/// Slots per chunk of [`Chunked`].
pub const CHUNK: usize = 4096;

/// A dense sequence of `T` in chunks of [`CHUNK`]: `push`, `swap_remove`, indexing.
#[derive(Debug, Clone)]
pub struct Chunked<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Self { chunks: Vec::new(), len: 0 }
    }
}

impl<T> Chunked<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the chunks can hold without a new one.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.chunks.len() * CHUNK
    }

    pub fn push(&mut self, value: T) {
        match self.chunks.last_mut() {
            Some(last) if last.len() < CHUNK => last.push(value),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(value);
                self.chunks.push(chunk);
            }
        }
        self.len += 1;
    }

    /// Removes element `i`, the last one taking its place; a chunk left empty is freed.
    pub fn swap_remove(&mut self, i: usize) -> T {
        assert!(i < self.len, "swap_remove index {i} out of {}", self.len);
        let last_chunk = self.chunks.last_mut().expect("not empty");
        let mut value = last_chunk.pop().expect("no empty chunk is kept");
        if last_chunk.is_empty() {
            self.chunks.pop();
        }
        self.len -= 1;
        if i < self.len {
            std::mem::swap(&mut self[i], &mut value);
        }
        value
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flatten()
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> + '_ {
        self.chunks.iter_mut().flatten()
    }
}

impl<T> Index<usize> for Chunked<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl<T> IndexMut<usize> for Chunked<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Behaves as a `Vec` under any sequence of pushes and swap_removes, and holds at
        /// most one chunk more than it needs.
        #[test]
        fn behaves_as_a_vec(ops in proptest::collection::vec(proptest::option::of(0usize..20_000), 0..3000)) {
            let (mut c, mut v) = (Chunked::default(), Vec::new());
            let mut next = 0u32;
            for op in ops {
                match op {
                    Some(i) if !v.is_empty() => prop_assert_eq!(c.swap_remove(i % v.len()), v.swap_remove(i % v.len())),
                    _ => {
                        for _ in 0..37 {
                            c.push(next);
                            v.push(next);
                            next += 1;
                        }
                    }
                }
                prop_assert_eq!(c.len(), v.len());
                prop_assert!(c.capacity() < v.len() + CHUNK + 1 && c.capacity() >= v.len());
            }
            prop_assert_eq!(c.iter().copied().collect::<Vec<_>>(), v.clone());
            for (i, x) in v.iter().enumerate() {
                prop_assert_eq!(c[i], *x);
            }
        }
    }
}
