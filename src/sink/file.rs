//! `type = "file"`: structured-mode CloudEvent JSON lines appended to `sink.path`, flushed after
//! every event.

use std::path::PathBuf;

use tokio::fs::{File, OpenOptions};
use tokio::io::AsyncWriteExt;

use super::SinkError;

pub struct FileSink {
    path: PathBuf,
    file: File,
}

impl FileSink {
    pub async fn open(path: PathBuf) -> Result<Self, SinkError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .await
            .map_err(|source| SinkError::Open { path: path.clone(), source })?;
        Ok(Self { path, file })
    }

    pub async fn write_line(&mut self, line: &[u8]) -> Result<(), SinkError> {
        let err = |source| SinkError::Write { target: self.path.display().to_string(), source };
        self.file.write_all(line).await.map_err(err)?;
        self.file.flush().await.map_err(err)
    }
}
