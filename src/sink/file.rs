//! `type = "file"`: structured-mode CloudEvent JSON lines appended to `sink.path`, flushed after
//! every event.

use std::path::{Path, PathBuf};

use tokio::fs::{File, OpenOptions};
use tokio::io::AsyncWriteExt;
use tokio::sync::Mutex;

use super::outbound::{SendError, SinkError, io_send_error};

pub struct FileSink {
    path: PathBuf,
    file: Mutex<File>,
}

impl FileSink {
    pub async fn open(path: PathBuf) -> Result<Self, SinkError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await
            .map_err(|cause| SinkError::Open { path: path.clone(), cause })?;
        Ok(Self { path, file: Mutex::new(file) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub async fn write_line(&self, line: &[u8]) -> Result<(), SendError> {
        let target = self.path.display().to_string();
        let mut f = self.file.lock().await;
        f.write_all(line).await.map_err(|e| io_send_error(&target, e))?;
        f.flush().await.map_err(|e| io_send_error(&target, e))
    }
}
