//! Sinks: where CloudEvents leave kubecast. A sink *accepts* an event when it is durably handed
//! over (stdout/file: written and flushed); only accepted events may advance a checkpoint.

mod file;
mod stdout;

use cloudevents::Event;

pub use file::FileSink;
pub use stdout::StdoutSink;

use crate::config::{SinkConfig, SinkType};

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error(
        "cannot open sink file {path}: {source} (fix: check sink.path and that its directory exists and is writable)"
    )]
    Open { path: std::path::PathBuf, source: std::io::Error },
    #[error("write to {target} failed: {source}")]
    Write { target: String, source: std::io::Error },
    #[error("event cannot be encoded: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("sink type {0} is not available in this version")]
    Unsupported(SinkType),
}

/// The configured sink (enum dispatch: one variant per sink type).
pub enum Sink {
    Stdout(StdoutSink),
    File(FileSink),
}

impl Sink {
    pub async fn open(cfg: &SinkConfig) -> Result<Sink, SinkError> {
        match cfg.kind {
            SinkType::Stdout => Ok(Sink::Stdout(StdoutSink::new())),
            SinkType::File => {
                let path = cfg.path.clone().unwrap_or_default();
                Ok(Sink::File(FileSink::open(path).await?))
            }
            other => Err(SinkError::Unsupported(other)),
        }
    }

    /// Sends one event; `Ok` means the sink accepted it.
    pub async fn send(&mut self, event: &Event) -> Result<(), SinkError> {
        let line = structured_line(event)?;
        match self {
            Sink::Stdout(s) => s.write_line(&line).await,
            Sink::File(s) => s.write_line(&line).await,
        }
    }
}

/// Structured-mode CloudEvent JSON followed by a newline (one event per line).
pub fn structured_line(event: &Event) -> Result<Vec<u8>, SinkError> {
    let mut line = serde_json::to_vec(event)?;
    line.push(b'\n');
    Ok(line)
}
