//! `type = "file"`: structured-mode CloudEvent JSON lines appended to `sink.path`.
//!
//! An event is accepted once its line is on disk: written, then `fsync`ed (`sync_data`). The
//! fsync is shared: sends that wait while one runs are covered by the next one, which
//! covers every line written before it started (group commit), so a burst of events costs a
//! few fsyncs, not one each. Before it starts, an fsync lets the other tasks ready at that
//! moment run once (a yield, no timer): the sends of one batch then write their lines first
//! and one fsync covers them all, where the first of them would otherwise start one alone and
//! the rest need a second. A checkpoint therefore never passes a line a power loss could
//! take back.
//!
//! No torn line: a write that fails part-way is cut back to the end of the last whole line
//! before the event is retried (and, should that fail too, before the next write); a file that
//! ends in a partial line when kubecast starts (a crash in the middle of a write) is cut back
//! the same way. That partial line was never acknowledged, so it is sent again.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Mutex;

use super::outbound::{SendError, SinkError, io_send_error};

pub struct FileSink {
    path: PathBuf,
    file: Arc<File>,
    writer: Mutex<Writer>,
    /// Lines written so far (the generation of the last one).
    written: AtomicU64,
    /// Lines known to be on disk, and the last line an fsync failed for.
    synced: Mutex<Synced>,
    /// fsyncs started.
    fsyncs: AtomicU64,
    /// A regular file (fsync, cut back); not for a pipe or a device such as `/dev/stdout`.
    regular: bool,
}

#[derive(Default)]
struct Synced {
    through: u64,
    /// Lines up to here were covered by a failed fsync: their sends fail (retried), even when
    /// a later fsync of the same file succeeds (the kernel may have dropped their pages).
    failed_through: u64,
}

struct Writer {
    /// End of the last whole line.
    len: u64,
    /// A failed write may have left part of a line after `len`.
    torn: bool,
    /// Only a regular file can be cut back.
    regular: bool,
}

impl FileSink {
    /// `key`: the setting that names the file, for errors (`sink.path`).
    pub async fn open(path: PathBuf, key: &'static str) -> Result<Self, SinkError> {
        let at = path.clone();
        let open = move || -> std::io::Result<(File, u64, bool)> {
            let path = at;
            let file = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
            let regular = file.metadata()?.file_type().is_file();
            if !regular {
                return Ok((file, 0, false));
            }
            // Read access for the tail check (a write-only file stays usable without it).
            if let Ok(mut readable) = std::fs::OpenOptions::new().read(true).open(&path) {
                let len = whole_lines_len(&mut readable)?;
                if len < file.metadata()?.len() {
                    tracing::warn!(path = %path.display(), "the file ended in a partial line (a write cut short); cut back to the last whole line");
                    file.set_len(len)?;
                }
            }
            let len = file.metadata()?.len();
            Ok((file, len, true))
        };
        // On the blocking pool: opening a FIFO for writing waits for its reader.
        let (file, len, regular) = tokio::task::spawn_blocking(open)
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r)
            .map_err(|cause| SinkError::Open { key, path: path.clone(), cause })?;
        Ok(Self {
            path,
            file: Arc::new(file),
            writer: Mutex::new(Writer { len, torn: false, regular }),
            written: AtomicU64::new(0),
            synced: Mutex::new(Synced::default()),
            fsyncs: AtomicU64::new(0),
            regular,
        })
    }

    /// The process's one writer of `path` for `key`, opened by the first caller: a sharded
    /// process runs a sink per shard, all with the same file, and two writers of one file would
    /// each cut it back to their own idea of its end after a failed write, cutting off lines
    /// the other wrote (events acknowledged, never sent again). Kept while a sink uses it.
    pub async fn shared(path: PathBuf, key: &'static str) -> Result<Arc<Self>, SinkError> {
        use std::collections::BTreeMap;
        use std::sync::Weak;
        static OPEN: Mutex<BTreeMap<PathBuf, Weak<FileSink>>> = Mutex::const_new(BTreeMap::new());
        let mut open = OPEN.lock().await;
        open.retain(|_, sink| sink.strong_count() > 0);
        if let Some(sink) = open.get(&path).and_then(Weak::upgrade) {
            return Ok(sink);
        }
        let sink = Arc::new(Self::open(path.clone(), key).await?);
        open.insert(path, Arc::downgrade(&sink));
        Ok(sink)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `line` (ending in `\n`); `Ok` once it is on disk.
    pub async fn write_line(&self, line: &[u8]) -> Result<(), SendError> {
        let target = || self.path.display().to_string();
        let generation = {
            let mut w = self.writer.lock().await;
            if self.regular {
                // Small writes into the page cache: done in place, not worth a blocking task.
                w.append(&self.file, line).map_err(|e| io_send_error(&target(), e))?;
            } else {
                // A pipe, FIFO or device blocks for as long as its reader does not read: on the
                // blocking pool, so that the runtime (the admin server's probes too) goes on.
                let (file, line) = (self.file.clone(), line.to_vec());
                tokio::task::spawn_blocking(move || (&*file).write_all(&line))
                    .await
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .and_then(|r| r)
                    .map_err(|e| io_send_error(&target(), e))?;
            }
            self.written.fetch_add(1, Ordering::AcqRel) + 1
        };
        if !self.regular {
            return Ok(());
        }
        let mut synced = self.synced.lock().await;
        if generation <= synced.failed_through {
            return Err(SendError::Retriable(format!("{}: fsync failed for this line", target())));
        }
        if synced.through >= generation {
            return Ok(()); // another send's fsync covered this line
        }
        // The sends ready now write their lines before this fsync starts, and it covers them.
        tokio::task::yield_now().await;
        let covers = self.written.load(Ordering::Acquire);
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
        let file = self.file.clone();
        let result = tokio::task::spawn_blocking(move || file.sync_data())
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        match result {
            Ok(()) => {
                synced.through = covers;
                Ok(())
            }
            Err(e) => {
                synced.failed_through = covers;
                Err(io_send_error(&format!("{}: fsync", target()), e))
            }
        }
    }
}

impl Writer {
    fn append(&mut self, mut file: &File, line: &[u8]) -> std::io::Result<()> {
        if self.torn && self.regular {
            file.set_len(self.len)?;
            self.torn = false;
        }
        match file.write_all(line) {
            Ok(()) => {
                self.len += line.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.torn = self.regular;
                if self.regular && file.set_len(self.len).is_ok() {
                    self.torn = false;
                }
                Err(e)
            }
        }
    }
}

/// The length of `file` up to and including its last `\n` (0 when it has none).
fn whole_lines_len(file: &mut File) -> std::io::Result<u64> {
    let end = file.metadata()?.len();
    let mut at = end;
    let mut block = vec![0u8; 64 * 1024];
    while at > 0 {
        let start = at.saturating_sub(block.len() as u64);
        let n = (at - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut block[..n])?;
        if let Some(i) = memchr::memrchr(b'\n', &block[..n]) {
            return Ok(start + i as u64 + 1);
        }
        at = start;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_partial_last_line_is_cut_back_at_open_and_lines_append() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        std::fs::write(&path, b"{\"a\":1}\n{\"b\":").unwrap();
        let sink = FileSink::open(path.clone(), "sink.path").await.unwrap();
        sink.write_line(b"{\"c\":3}\n").await.unwrap();
        sink.write_line(b"{\"d\":4}\n").await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"a\":1}\n{\"c\":3}\n{\"d\":4}\n");
        std::fs::write(&path, b"no newline at all").unwrap();
        drop(sink);
        let sink = FileSink::open(path.clone(), "sink.path").await.unwrap();
        sink.write_line(b"x\n").await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "x\n");
    }

    /// A FIFO whose reader does not read: the writes wait on the blocking pool, and the
    /// runtime's one worker goes on with other tasks (the admin server's probes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_fifo_whose_reader_waits_does_not_stop_the_runtime() {
        use std::io::Read;
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.fifo");
        assert!(std::process::Command::new("mkfifo").arg(&path).status().unwrap().success());
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let reader = {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut f = std::fs::File::open(&path).unwrap();
                wait.recv().unwrap();
                let mut all = Vec::new();
                f.read_to_end(&mut all).unwrap();
                all.len()
            })
        };
        let sink = Arc::new(FileSink::open(path.clone(), "sink.path").await.unwrap());
        // 2000 KiB: more than a pipe can hold, so the writes wait for the reader.
        let writer = tokio::spawn({
            let sink = sink.clone();
            async move {
                let line = [vec![b'x'; 1023], vec![b'\n']].concat();
                for _ in 0..2000 {
                    sink.write_line(&line).await.unwrap();
                }
            }
        });
        // (Waits of this test thread are std's: it is not a worker, and with the worker stuck no
        // timer would fire.)
        std::thread::sleep(Duration::from_millis(300));
        let (ran, probe) = std::sync::mpsc::channel::<()>();
        tokio::spawn(async move { ran.send(()).unwrap() });
        let ran = probe.recv_timeout(Duration::from_secs(5)).is_ok();
        let waiting = !writer.is_finished();
        // The reader reads now, whatever happened: the writes end either way.
        go.send(()).unwrap();
        writer.await.unwrap();
        drop(sink);
        assert!(ran, "no other task ran while the FIFO was full");
        assert!(waiting, "the writes waited for the reader");
        assert_eq!(reader.join().unwrap(), 2000 * 1024);
    }

    #[tokio::test]
    async fn a_device_or_pipe_is_written_without_fsync_or_cutting_back() {
        let sink = FileSink::open("/dev/null".into(), "sink.path").await.unwrap();
        assert!(!sink.regular);
        sink.write_line(b"{}\n").await.unwrap();
    }

    #[tokio::test]
    async fn the_sinks_of_one_path_share_one_writer_while_one_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let (a, b) = (
            FileSink::shared(path.clone(), "sink.path").await.unwrap(),
            FileSink::shared(path.clone(), "sink.path").await.unwrap(),
        );
        assert!(Arc::ptr_eq(&a, &b), "two shards' sinks of one file: one writer");
        let other = FileSink::shared(dir.path().join("other.jsonl"), "sink.path").await.unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
        a.write_line(b"a1\n").await.unwrap();
        b.write_line(b"b1\n").await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a1\nb1\n");
        let weak = Arc::downgrade(&a);
        drop((a, b));
        assert!(weak.upgrade().is_none(), "closed once no sink uses it");
        let again = FileSink::shared(path.clone(), "sink.path").await.unwrap();
        again.write_line(b"c1\n").await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a1\nb1\nc1\n");
    }

    #[tokio::test]
    async fn concurrent_sends_all_land_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = Arc::new(FileSink::open(path.clone(), "sink.path").await.unwrap());
        let sends: Vec<_> = (0..200)
            .map(|i| {
                let sink = sink.clone();
                tokio::spawn(async move { sink.write_line(format!("{{\"n\":{i}}}\n").as_bytes()).await })
            })
            .collect();
        for s in sends {
            s.await.unwrap().unwrap();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut seen: Vec<u64> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["n"].as_u64().unwrap())
            .collect();
        seen.sort();
        assert_eq!(seen, (0..200).collect::<Vec<_>>());
        assert!(sink.synced.lock().await.through >= 200, "every line covered by an fsync");
    }

    #[tokio::test]
    async fn sends_made_together_share_one_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let sink = FileSink::open(path.clone(), "sink.path").await.unwrap();
        let lines: Vec<String> = (0..50).map(|i| format!("{{\"n\":{i}}}\n")).collect();
        // One task polls them all, as the delivery stage polls the sends of a batch.
        let sends = futures::future::join_all(lines.iter().map(|l| sink.write_line(l.as_bytes()))).await;
        assert!(sends.iter().all(Result::is_ok));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), lines.concat());
        assert_eq!(sink.fsyncs.load(Ordering::Relaxed), 1, "one fsync for the 50 lines written together");
        sink.write_line(b"{\"n\":50}\n").await.unwrap();
        assert_eq!(sink.fsyncs.load(Ordering::Relaxed), 2, "a line written later has an fsync of its own");
    }
}
