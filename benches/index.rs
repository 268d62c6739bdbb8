//! Index benchmark: the bytes per object of a stream's object index, without a server.
//!
//! ```text
//! cargo bench --bench index                      # 1000000 objects
//! cargo bench --bench index -- --objects 100000  # another size
//! ```
//!
//! Builds the index of N synthetic objects (random UUID uids, 50 namespaces, names like a
//! Deployment's pods, 8-digit resourceVersions), once as the plain map the stores load and
//! write (`model::Index`, `HashMap<String, IndexEntry>`: what each stream held twice before
//! the compact index) and once as the compact `model::ObjectIndex`, and prints the heap bytes
//! each holds per object: the bytes asked of the allocator (a counting global allocator over
//! the system's), so without the allocator's own rounding and overhead. Also the uids a
//! relist collects, and the time to build, look up every uid and remove half. Figures are
//! printed, never asserted. See docs/performance.md.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use kubecast::model::{Index, IndexEntry, ObjectIndex, UidList};

/// Counts the bytes currently allocated.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// A small deterministic generator (xorshift), so every run indexes the same objects.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn uuid(&mut self) -> String {
        let (a, b) = (self.next(), self.next());
        let h = format!("{a:016x}{b:016x}");
        format!("{}-{}-4{}-a{}-{}", &h[0..8], &h[8..12], &h[13..16], &h[17..20], &h[20..32])
    }

    fn suffix(&mut self, len: usize) -> String {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        (0..len).map(|_| ALPHABET[(self.next() % ALPHABET.len() as u64) as usize] as char).collect()
    }
}

/// N objects: `(uid, entry)`.
fn objects(n: usize) -> Vec<(String, IndexEntry)> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .map(|i| {
            let deployment = format!("app-{}", i % 997);
            let entry = IndexEntry {
                namespace: Some(format!("team-{:02}", i % 50)),
                name: format!("{deployment}-{}-{}", rng.suffix(10), rng.suffix(5)),
                resource_version: (10_000_000 + rng.next() % 90_000_000).to_string(),
            };
            (rng.uuid(), entry)
        })
        .collect()
}

fn parse_args() -> usize {
    let mut args = std::env::args().skip(1);
    let mut n = 1_000_000;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--objects" => n = args.next().and_then(|v| v.parse().ok()).expect("--objects N"),
            "--bench" => {}
            other => eprintln!("ignored argument {other:?}"),
        }
    }
    n
}

fn per_object(bytes: usize, n: usize) -> f64 {
    bytes as f64 / n as f64
}

fn main() {
    let n = parse_args();
    let objects = objects(n);
    let text: usize = objects
        .iter()
        .map(|(u, e)| u.len() + e.name.len() + e.resource_version.len() + e.namespace.as_ref().map_or(0, String::len))
        .sum();
    println!(
        "index of {n} objects (text: {:.1} bytes per object: uid, namespace, name, resourceVersion)",
        per_object(text, n)
    );

    let before = live();
    let started = Instant::now();
    let plain: Index = objects.iter().cloned().collect();
    let plain_build = started.elapsed();
    let plain_bytes = live() - before;
    drop(plain);

    let before = live();
    let started = Instant::now();
    let mut compact = ObjectIndex::new();
    for (uid, e) in &objects {
        compact.insert(uid, e);
    }
    let compact_build = started.elapsed();
    let compact_bytes = live() - before;

    let started = Instant::now();
    let found = objects.iter().filter(|(uid, e)| compact.get(uid).is_some_and(|got| got.is(e))).count();
    let lookups = started.elapsed();
    assert_eq!(found, n, "every object found as inserted");

    let before = live();
    // As a relist collects them: room for the index's objects, then sorted for lookups.
    let mut seen = UidList::with_capacity(compact.len() + compact.len() / 16);
    for (uid, _) in &objects {
        seen.insert(uid);
    }
    let seen = seen.into_set();
    let seen_bytes = live() - before;
    assert!(objects.iter().all(|(uid, _)| seen.contains(uid)), "every listed uid found");
    drop(seen);

    let started = Instant::now();
    for (uid, _) in objects.iter().step_by(2) {
        compact.remove(uid);
    }
    let removals = started.elapsed();

    println!("| index | bytes per object | build |");
    println!("|---|---:|---:|");
    println!(
        "| plain map (`HashMap<String, IndexEntry>`) | {:.1} | {:.0} ms |",
        per_object(plain_bytes, n),
        plain_build.as_secs_f64() * 1e3
    );
    println!(
        "| compact (`ObjectIndex`) | {:.1} | {:.0} ms |",
        per_object(compact_bytes, n),
        compact_build.as_secs_f64() * 1e3
    );
    println!("| relist's seen uids (`UidList`, sorted) | {:.1} | |", per_object(seen_bytes, n));
    println!(
        "compact: {n} lookups in {:.0} ms ({:.0} ns each), {} removals in {:.0} ms; {} objects, {} namespaces left",
        lookups.as_secs_f64() * 1e3,
        lookups.as_secs_f64() * 1e9 / n as f64,
        n.div_ceil(2),
        removals.as_secs_f64() * 1e3,
        compact.len(),
        compact.namespaces()
    );
}
