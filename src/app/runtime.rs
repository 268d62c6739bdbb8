//! The async runtime kubecast runs on (`kubecast run`, `kubecast state`, and the benchmarks).
//!
//! One worker thread by default. kubecast's stages are a few long-lived tasks handing each
//! other batches (the reflectors, shaping, the queue, the delivery reports, the persister);
//! with a worker per core, every hand-over from one task to the next woke the other worker to
//! look for work to steal, a context switch each time for a few microseconds of work. The heavy
//! work of the delivery path runs on librdkafka's or async-nats' own threads and on the
//! blocking pool (state writes, the final flush), not on the workers.
//!
//! The standard `TOKIO_WORKER_THREADS` variable overrides the number of workers.

use tokio::runtime::{Builder, Runtime};

/// Worker threads unless `TOKIO_WORKER_THREADS` says otherwise.
pub const WORKERS: usize = 1;

/// Builds the runtime: `WORKERS` workers (or `TOKIO_WORKER_THREADS`), timers and I/O.
pub fn build() -> std::io::Result<Runtime> {
    let mut builder = Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        builder.worker_threads(WORKERS);
    }
    builder.enable_all().build()
}
