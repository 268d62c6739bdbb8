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
        // One line at a time in the process: a sharded process has a sink per shard, and
        // tokio may split a large write, so two handles' lines could interleave.
        static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());
        let _line = ONE_AT_A_TIME.lock().await;
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
