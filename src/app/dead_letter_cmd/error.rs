//! Why `kubecast dead-letter` stopped.

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "[delivery.dead_letter] type = \"stop\": there is no dead letter to read (fix: nothing to replay; or pass --file)"
    )]
    NoDeadLetter,
    #[error("the sink: {0}")]
    Sink(#[from] crate::sink::SinkError),
    #[error("the dead-letter file {0}")]
    File(String),
    #[error("Kafka: {0}")]
    Kafka(String),
    #[error("NATS: {0}")]
    Nats(String),
    #[error(
        "event {id} could not be sent to {destination}: {error}; stopped after {replayed} replayed (run it again to go on from this event)"
    )]
    Send { id: String, destination: String, error: String, replayed: u64 },
    #[error("{0} dead letter(s) could not be replayed, each named above; the rest was replayed")]
    Skipped(u64),
}
