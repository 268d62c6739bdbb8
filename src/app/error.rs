//! `RunError`: why `kubecast run` stopped (the first fatal error of any stage).

use crate::coordination::lease::LeaseError;
use crate::delivery::queue::DeliveryError;
use crate::observe::admin::AdminError;
use crate::sink::SinkError;
use crate::source::client::ClientError;
use crate::source::reflector::ReflectorError;
use crate::state::store::CheckpointError;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Reflector(#[from] ReflectorError),
    #[error(transparent)]
    Sink(#[from] SinkError),
    #[error(transparent)]
    Delivery(#[from] DeliveryError),
    #[error(transparent)]
    Admin(#[from] AdminError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error(
        "lost the lease {lease} ({why}): stopped publishing at once; another process is the active one now (records already handed to the producer may still reach the broker, with their usual ids)"
    )]
    LeaseLost { lease: String, why: String },
    #[error("cannot start the thread that keeps the Lease: {0} (the process may be out of threads or memory)")]
    LeaseThread(std::io::Error),
}
