//! A replica without shards (`[coordination] shards = 1`) in the group of its Lease, so that a
//! change of the count from or to 1 never runs two counts at once either: it renews a member
//! Lease that says `shards = 1`, its one Lease carries the group's labels (replicas of other
//! counts wait while it is held), and before taking the Lease, and every retry period while
//! holding it, it asks [`count_change`] what the count change it takes part in asks of it.
//!
//! Lease names longer than a label value (63 characters) cannot label the group: such a replica
//! stays out of it (the configuration then allows no other count anyway, see
//! `CoordinationConfig::problems`).

use std::time::Duration;

use tracing::warn;

use super::count_change::CountChange;
use super::lease::CoordinationConfig;
use super::members::{Members, shard_labels};

/// The longest label value the apiserver takes.
const LABEL_MAX: usize = 63;

/// What one look at the group found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// No other count runs: take or keep the Lease.
    Alone,
    /// A change of the count asks this replica to give the Lease up, or not to take it yet.
    Change(CountChange),
    /// The group could not be read (the apiserver, or permissions): why, in words.
    Unknown(String),
}

/// This replica's member Lease and its view of the group.
pub struct CountGuard {
    members: Members,
    identity: String,
    lease_name: String,
    /// Each call gets a retry period.
    retry: Duration,
}

impl CountGuard {
    /// `None` without `[coordination]`, with shards (the coordinator of the shards does this),
    /// or with a Lease name too long to label the group.
    pub fn new(client: kube::Client, cfg: &CoordinationConfig) -> Option<Self> {
        if !cfg.enabled || cfg.shards > 1 || cfg.lease_name.len() > LABEL_MAX {
            return None;
        }
        let identity = cfg.identity();
        Some(Self {
            members: Members::new(client, cfg, identity.clone()),
            identity,
            lease_name: cfg.lease_name.clone(),
            retry: Duration::from_secs(cfg.retry_period_seconds.into()),
        })
    }

    /// The labels the one Lease carries: its group's, as a shard's Lease does.
    pub fn labels(cfg: &CoordinationConfig) -> std::collections::BTreeMap<String, String> {
        if cfg.lease_name.len() > LABEL_MAX { Default::default() } else { shard_labels(cfg) }
    }

    /// One round: renews this replica's member Lease, lists the group, and says what a change
    /// of the count asks of this replica.
    pub async fn look(&mut self) -> Seen {
        match tokio::time::timeout(self.retry, self.members.heartbeat()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Seen::Unknown(format!("this replica's member lease not renewed: {e}")),
            Err(_) => return Seen::Unknown(format!("no answer from the apiserver within {:?}", self.retry)),
        }
        let group = match tokio::time::timeout(self.retry, self.members.list()).await {
            Ok(Ok(group)) => group,
            Ok(Err(e)) => return Seen::Unknown(format!("the group's leases cannot be listed: {e}")),
            Err(_) => return Seen::Unknown(format!("no answer from the apiserver within {:?}", self.retry)),
        };
        let change = group.count_change(&self.identity, 1, &self.lease_name);
        change.map_or(Seen::Alone, Seen::Change)
    }

    /// Deletes this replica's member Lease (at a clean stop).
    pub async fn leave(&self) {
        if tokio::time::timeout(self.retry, self.members.leave()).await.is_err() {
            warn!("this replica's member lease not deleted: no answer from the apiserver (it expires)");
        }
    }
}
