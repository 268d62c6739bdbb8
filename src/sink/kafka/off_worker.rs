//! librdkafka clients dropped off the runtime's worker. Dropping one blocks: a producer purges
//! its queues and flushes for up to 500 ms, then `rd_kafka_destroy` joins librdkafka's threads,
//! which takes seconds when a broker does not answer; an admin client joins its polling
//! thread. kubecast runs one worker ([`crate::app::runtime`]): a drop there would stall every
//! other shard, the coordinator and `/livez` meanwhile. [`OffWorker`] moves its client to the
//! blocking pool when dropped inside the runtime (and drops it in place outside one).

use std::ops::Deref;

/// `T`, dropped on the runtime's blocking pool.
pub struct OffWorker<T: Send + 'static>(Option<T>);

impl<T: Send + 'static> OffWorker<T> {
    pub fn new(client: T) -> Self {
        Self(Some(client))
    }
}

impl<T: Send + 'static> Deref for OffWorker<T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0.as_ref().expect("present until dropped")
    }
}

impl<T: Send + 'static> Drop for OffWorker<T> {
    fn drop(&mut self) {
        let Some(client) = self.0.take() else { return };
        match tokio::runtime::Handle::try_current() {
            // Not awaited: nothing waits for a client to be gone.
            Ok(runtime) => drop(runtime.spawn_blocking(move || drop(client))),
            Err(_) => drop(client),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the thread it is dropped on.
    struct Probe(std::sync::mpsc::Sender<String>);

    impl Drop for Probe {
        fn drop(&mut self) {
            let name = std::thread::current().name().unwrap_or("unnamed").to_string();
            let _ = self.0.send(name);
        }
    }

    #[test]
    fn inside_the_runtime_the_drop_runs_on_the_blocking_pool_and_outside_in_place() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).thread_name("rt").build().unwrap();
        let here = std::thread::current().name().unwrap_or("unnamed").to_string();
        assert_ne!(here, "rt");
        let (tx, rx) = std::sync::mpsc::channel();
        // `block_on` runs the future on this thread: an in-place drop would report `here`.
        runtime.block_on(async { drop(OffWorker::new(Probe(tx))) });
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap(), "rt", "the runtime's blocking pool");
        let (tx, rx) = std::sync::mpsc::channel();
        drop(OffWorker::new(Probe(tx)));
        assert_eq!(rx.recv().unwrap(), here, "outside a runtime: in place");
    }
}
