//! The async runtimes kubecast runs on (`kubecast run`, `kubecast state`, and the benchmarks).
//!
//! One worker thread by default. kubecast's stages are a few long-lived tasks handing each
//! other batches (the reflectors, shaping, the queue, the delivery reports, the persister);
//! with a worker per core, every hand-over from one task to the next woke the other worker to
//! look for work to steal, a context switch each time for a few microseconds of work. The heavy
//! work of the delivery path runs on librdkafka's or async-nats' own threads and on the
//! blocking pool (state writes, the final flush), not on the workers.
//!
//! The standard `TOKIO_WORKER_THREADS` variable overrides the number of workers.
//!
//! Threads of the blocking pool end after 2 s without work (tokio's default: 10 s). What a
//! thread frees stays in its allocator heap until the thread allocates again or ends; the
//! blocking pool's threads free large buffers (a checkpoint's full rewrite copies the index,
//! 70 MB at a million objects; the file sink's batches) and then sit idle. 2 s is past the
//! checkpoint's default flush interval (1 s), so steady writes keep reusing one thread.
//!
//! The Lease keepers run apart, on a thread of their own with a kube client of their own
//! ([`lease_thread`]): a worker kept busy (a large relist-diff, a burst of events) or held up
//! by a call that blocks never delays a renewal, so a busy process does not lose its Lease.

use std::sync::Mutex;
use std::time::Duration;

use tokio::runtime::{Builder, Handle, Runtime};

/// Worker threads unless `TOKIO_WORKER_THREADS` says otherwise.
pub const WORKERS: usize = 1;

/// How long a thread of the blocking pool waits for work before it ends.
pub const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(2);

/// Builds the runtime: `WORKERS` workers (or `TOKIO_WORKER_THREADS`), timers and I/O.
pub fn build() -> std::io::Result<Runtime> {
    let mut builder = Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(WORKERS);
    }
    builder
        .on_thread_park(super::allocator::collect_when_idle)
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .enable_all()
        .build()
}

/// The runtime of the Lease keepers: one thread (`kubecast-lease`), started the first time it
/// is asked for, running for the rest of the process. Tasks spawned on it (and the HTTP
/// connections their requests open) are driven by that thread alone.
pub fn lease_thread() -> std::io::Result<Handle> {
    static HANDLE: Mutex<Option<Handle>> = Mutex::new(None);
    let mut handle = HANDLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(h) = handle.as_ref() {
        return Ok(h.clone());
    }
    let rt = Builder::new_current_thread().enable_all().build()?;
    let h = rt.handle().clone();
    std::thread::Builder::new()
        .name("kubecast-lease".into())
        .spawn(move || rt.block_on(std::future::pending::<()>()))?;
    *handle = Some(h.clone());
    Ok(h)
}
