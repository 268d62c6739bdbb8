//! `type = "stdout"`: one structured-mode CloudEvent JSON per line on standard output
//! (logs go to standard error).

use tokio::io::{AsyncWriteExt, Stdout};
use tokio::sync::Mutex;

use super::outbound::{SendError, io_send_error};

pub struct StdoutSink {
    out: Mutex<Stdout>,
}

impl StdoutSink {
    pub fn new() -> Self {
        Self { out: Mutex::new(tokio::io::stdout()) }
    }

    pub async fn write_line(&self, line: &[u8]) -> Result<(), SendError> {
        let mut out = self.out.lock().await;
        out.write_all(line).await.map_err(|e| io_send_error("stdout", e))?;
        out.flush().await.map_err(|e| io_send_error("stdout", e))
    }
}

impl Default for StdoutSink {
    fn default() -> Self {
        Self::new()
    }
}
