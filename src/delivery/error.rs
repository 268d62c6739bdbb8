//! Why delivery stops kubecast (`DeliveryError`); the checkpoint stays at the last
//! acknowledged event in every case, so nothing is lost.

/// A permanent failure with `[delivery.dead_letter] type = "stop"`.
#[derive(Debug, thiserror::Error)]
#[error(
    "event {id} cannot be delivered to {destination}: {reason}; stopping because [delivery.dead_letter] type = \"stop\" (fix: correct the cause, or configure a dead letter)"
)]
pub struct Undeliverable {
    pub id: String,
    pub destination: String,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    #[error("sink failed: {0} (kubecast stops; the checkpoint stays at the last acknowledged event)")]
    Fatal(String),
    #[error(transparent)]
    Undeliverable(#[from] Undeliverable),
    #[error(
        "event {id} could not be written to the dead letter {dead_letter} ({attempts} attempts, [delivery] max_attempts): {error}; stopping, the checkpoint stays before this event, so nothing is lost (fix: make the dead letter writable, or set max_attempts = 0 to retry it for as long as it takes)"
    )]
    DeadLetterUnwritable { id: String, dead_letter: String, attempts: u32, error: String },
    #[error("{0}")]
    DeadLetterCheck(String),
}
