//! How kubecast's allocator (mimalloc, the binary's `#[global_allocator]`) gives memory back.
//!
//! mimalloc returns freed memory to the operating system in epochs: once some memory is freed,
//! everything free when `purge_delay` (default 1 s) has passed is decommitted, also what was
//! freed a moment before. At thousands of events per second the event buffers (~10 KB each
//! for Pods) are freed and allocated again all the time, so with a 1 s epoch about half of
//! them landed on decommitted pages and faulted them in again: ~1.4 page faults and ~10 µs of
//! CPU per event in the NATS benchmark (`docs/performance.md`). kubecast sets a 10 s epoch:
//! memory freed after a burst still goes back to the system, within 10 s.
//!
//! The standard `MIMALLOC_PURGE_DELAY` variable (milliseconds; -1 = never) overrides it.
//!
//! mimalloc purges what is due only when the process allocates or frees again: after loading a
//! checkpoint of a million objects, or a list of them, an idle kubecast kept every page the
//! load had used (265 MB resident at 1M objects, where 97 MB were in use). A thread of its own
//! asks mimalloc to collect every second, so what is due is given back while nothing else
//! happens: memory freed is back with the system within about 11 s.
//!
//! kubecast keeps its memory in 4 KiB pages: mimalloc asks the kernel for transparent huge
//! pages on its arenas (`MADV_HUGEPAGE`), and the kernel's `khugepaged` then fills every 2 MiB
//! region that has a page in use (by default even one of 512) with a huge page, so what the
//! purge gave back comes back as resident memory while the process does nothing: after a
//! list of a million objects an idle kubecast grew from 117 to 144 MiB in three minutes,
//! without allocating. `PR_SET_THP_DISABLE` turns huge pages off for the process; the
//! standard `MIMALLOC_ALLOW_THP=1` keeps them.

use std::time::Duration;

use libmimalloc_sys::{mi_collect, mi_option_set, mi_option_t};

/// `mi_option_purge_delay` of mimalloc v3 (`mimalloc.h`); the sys crate does not name it.
const PURGE_DELAY: mi_option_t = 15;

/// `mi_option_allow_thp` of mimalloc v3 (`mimalloc.h`).
const ALLOW_THP: mi_option_t = 43;

/// kubecast's purge epoch, in milliseconds.
pub const PURGE_DELAY_MS: i64 = 10_000;

/// How often the purge thread asks mimalloc to give back what is due: memory freed is given
/// back within the epoch and this (a collection with nothing due costs next to nothing).
const COLLECT_EVERY: Duration = Duration::from_secs(1);

/// Sets kubecast's allocator options, unless the environment sets them. Call first in `main`,
/// before any other thread starts (mimalloc's option setter is not thread-safe).
pub fn configure() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: a plain store into mimalloc's option table; no other thread runs yet.
        unsafe { mi_option_set(PURGE_DELAY, PURGE_DELAY_MS as _) };
    }
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: as above; then a prctl with integer arguments. Not fatal if refused (a
        // kernel without the flag): huge pages stay as the system sets them.
        unsafe {
            mi_option_set(ALLOW_THP, 0);
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
    // Not fatal if it cannot start: memory is then given back at the next allocation only.
    let _ = std::thread::Builder::new().name("kubecast-purge".into()).spawn(move || {
        loop {
            std::thread::sleep(COLLECT_EVERY);
            // SAFETY: mimalloc's collection is thread-safe; `false`: only what is due.
            unsafe { mi_collect(false) };
        }
    });
}

/// Called by a runtime worker when it parks (idle): gives back what the thread's own heap
/// holds free, at most once per [`COLLECT_EVERY`] per thread. mimalloc keeps a thread's freed
/// pages in that thread's heap, out of reach of the purge thread: after a list of a million
/// objects the worker held 50 MB of such pages for good.
pub fn collect_when_idle() {
    use std::cell::Cell;
    use std::time::Instant;
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    LAST.with(|last| {
        let now = Instant::now();
        if last.get().is_none_or(|t| now.duration_since(t) >= COLLECT_EVERY) {
            last.set(Some(now));
            // SAFETY: collects this thread's heap; `false`: only what is free and due.
            unsafe { mi_collect(false) };
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use libmimalloc_sys::mi_option_get;

    /// The purge epoch in effect, in milliseconds (-1: never).
    fn purge_delay_ms() -> i64 {
        // SAFETY: reads mimalloc's option table.
        unsafe { mi_option_get(PURGE_DELAY) }
    }

    /// One test: `configure` sets both options, and the tests of one binary share a process.
    #[test]
    fn the_option_indexes_are_the_purge_delay_and_huge_pages() {
        // mimalloc v3's default purge delay is 1000 ms; no option near it has that default, so
        // a wrong index (a mimalloc update renumbering its options) fails here. Huge pages are
        // allowed by default (1), and the options beside it default to other values.
        // SAFETY: reads mimalloc's option table.
        let allow_thp = || unsafe { mi_option_get(ALLOW_THP) };
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() && std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
            assert_eq!((purge_delay_ms(), allow_thp()), (1000, 1));
            // SAFETY: the options beside it, read only.
            let beside = unsafe { (mi_option_get(ALLOW_THP - 1), mi_option_get(ALLOW_THP + 1)) };
            assert_ne!(beside, (1, 1), "the index names an option among others of the same default");
            configure();
            assert_eq!((purge_delay_ms(), allow_thp()), (PURGE_DELAY_MS, 0));
            // SAFETY: a prctl query with integer arguments.
            assert_eq!(
                unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) },
                1,
                "huge pages off for the process"
            );
        }
    }
}
