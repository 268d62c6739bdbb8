//! `type = "stdout"`: one structured-mode CloudEvent JSON per line on standard output
//! (logs go to standard error).

use tokio::io::{AsyncWriteExt, Stdout};

use super::SinkError;

pub struct StdoutSink {
    out: Stdout,
}

impl StdoutSink {
    pub fn new() -> Self {
        Self { out: tokio::io::stdout() }
    }

    pub async fn write_line(&mut self, line: &[u8]) -> Result<(), SinkError> {
        let err = |source| SinkError::Write { target: "stdout".into(), source };
        self.out.write_all(line).await.map_err(err)?;
        self.out.flush().await.map_err(err)
    }
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::new()
    }
}
