//! The replicas of a deployment with `[coordination] shards` above 1, as each sees them: every
//! replica renews a member Lease of its own (`<lease_name>-member-<hash of its identity>`),
//! and reads its group's Leases (label `kubecast.io/lease-group=<lease_name>`: the members'
//! and the shards' `<lease_name>-<i>-of-<N>`) in one list per retry period. A member Lease
//! not renewed for the lease duration (seen locally, as the election judges a holder) is a
//! replica gone; one gone for [`FORGET_AFTER`] lease durations is deleted.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::{DeleteParams, ListParams, ObjectMeta, PostParams};
use tracing::debug;

use super::lease::{CoordinationConfig, LeaseError};
use crate::state::store::short_hash;

/// The label that groups a deployment's Leases (its value: `lease_name`).
pub const GROUP_LABEL: &str = "kubecast.io/lease-group";
/// The label that says what a Lease of the group is: `member` or `shard`.
pub const ROLE_LABEL: &str = "kubecast.io/lease-role";
/// The label of a member Lease that says its replica's `[coordination] shards`.
pub const SHARDS_LABEL: &str = "kubecast.io/shards";
/// A member Lease not renewed for this many lease durations is deleted.
const FORGET_AFTER: u32 = 5;

/// What identifies a member Lease's record: its holder and renew time.
type Record = (Option<String>, Option<MicroTime>);

/// The labels of a shard's Lease.
pub fn shard_labels(cfg: &CoordinationConfig) -> BTreeMap<String, String> {
    [(GROUP_LABEL.to_string(), cfg.lease_name.clone()), (ROLE_LABEL.to_string(), "shard".to_string())].into()
}

/// What one list of the group showed.
#[derive(Debug, Default)]
pub struct Group {
    /// The live replicas' identities (this one's included once its Lease was written).
    pub members: BTreeSet<String>,
    /// The shards' Leases, by name.
    pub shards: HashMap<String, Lease>,
    /// The live replicas that run another `[coordination] shards` (a change of the count in
    /// progress), with when each joined.
    pub other_counts: Vec<OtherCount>,
    /// When this replica joined (its member Lease's creation), once its Lease was written.
    pub joined: Option<k8s_openapi::jiff::Timestamp>,
}

/// A live replica of the group that runs another shard count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtherCount {
    pub identity: String,
    pub shards: u32,
    /// Its member Lease's creation (the apiserver's clock: comparable between replicas).
    pub joined: Option<k8s_openapi::jiff::Timestamp>,
}

impl OtherCount {
    /// Whether it joined after a replica that joined at `joined` with `identity`: the count
    /// of the replica that joined last is the one the deployment changes to.
    pub fn joined_after(&self, joined: Option<k8s_openapi::jiff::Timestamp>, identity: &str) -> bool {
        (self.joined, self.identity.as_str()) > (joined, identity)
    }
}

/// This replica's member Lease and its view of the others'.
pub struct Members {
    api: Api<Lease>,
    group: String,
    namespace: String,
    identity: String,
    name: String,
    duration: Duration,
    /// This replica's `[coordination] shards`, in its member Lease's labels.
    shards: u32,
    /// Per member Lease: its last (holder, renew time) and when it was first seen so.
    seen: HashMap<String, (Record, Instant)>,
    /// This replica's member Lease as it last wrote it: renewed without a read first.
    written: Option<Lease>,
}

impl Members {
    pub fn new(client: kube::Client, cfg: &CoordinationConfig, identity: String) -> Self {
        let namespace = cfg.namespace();
        Self {
            api: Api::namespaced(client, &namespace),
            group: cfg.lease_name.clone(),
            name: format!("{}-member-{}", cfg.lease_name, short_hash(identity.as_bytes())),
            namespace,
            identity,
            duration: Duration::from_secs(cfg.lease_duration_seconds.into()),
            shards: cfg.shards,
            seen: HashMap::new(),
            written: None,
        }
    }

    fn error(&self, e: &kube::Error) -> LeaseError {
        LeaseError::from_kube(&self.namespace, &self.name, e)
    }

    /// Renews this replica's member Lease (creates it the first time). One request once it
    /// was written: the Lease as last written, with a new renew time, conditional on that
    /// write's resourceVersion; a read first only when that fails (409, 404: written or
    /// deleted by someone else) or nothing was written yet.
    pub async fn heartbeat(&mut self) -> Result<(), LeaseError> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        if let Some(mut lease) = self.written.take() {
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.renew_time = Some(now.clone());
            spec.lease_duration_seconds = Some(seconds);
            match self.api.replace(&self.name, &PostParams::default(), &lease).await {
                Ok(written) => {
                    self.written = Some(written);
                    return Ok(());
                }
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(self.error(&e)),
            }
        }
        let existing = self.api.get_opt(&self.name).await.map_err(|e| self.error(&e))?;
        let result = match existing {
            None => {
                let labels = [
                    (GROUP_LABEL.to_string(), self.group.clone()),
                    (ROLE_LABEL.to_string(), "member".to_string()),
                    (SHARDS_LABEL.to_string(), self.shards.to_string()),
                ];
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        labels: Some(labels.into()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(seconds),
                        renew_time: Some(now),
                        ..Default::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            Some(mut lease) => {
                // Written by an older kubecast, or before a change of the count.
                lease
                    .metadata
                    .labels
                    .get_or_insert_with(Default::default)
                    .insert(SHARDS_LABEL.to_string(), self.shards.to_string());
                let spec = lease.spec.get_or_insert_with(Default::default);
                spec.holder_identity = Some(self.identity.clone());
                spec.renew_time = Some(now);
                spec.lease_duration_seconds = Some(seconds);
                self.api.replace(&self.name, &PostParams::default(), &lease).await
            }
        };
        match result {
            Ok(written) => {
                self.written = Some(written);
                Ok(())
            }
            // Written meanwhile (another attempt of this replica): the next renewal settles it.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(self.error(&e)),
        }
    }

    /// Lists the group's Leases: the live members, and the shards' Leases. Member Leases gone
    /// for long are deleted on the way.
    pub async fn list(&mut self) -> Result<Group, LeaseError> {
        let params = ListParams::default().labels(&format!("{GROUP_LABEL}={}", self.group));
        let leases = self.api.list(&params).await.map_err(|e| self.error(&e))?;
        let mut group = Group::default();
        let mut present = BTreeSet::new();
        for lease in leases.items {
            let Some(name) = lease.metadata.name.clone() else { continue };
            let role = lease.metadata.labels.as_ref().and_then(|l| l.get(ROLE_LABEL)).map(String::as_str);
            if role != Some("member") {
                group.shards.insert(name, lease);
                continue;
            }
            present.insert(name.clone());
            // Without the label: an older kubecast's, of this count as far as it can tell.
            let shards = lease
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(SHARDS_LABEL))
                .and_then(|v| v.parse().ok())
                .unwrap_or(self.shards);
            let joined = lease.metadata.creation_timestamp.as_ref().map(|t| t.0);
            let spec = lease.spec.unwrap_or_default();
            let Some(holder) = spec.holder_identity.clone().filter(|h| !h.is_empty()) else { continue };
            let record = (Some(holder.clone()), spec.renew_time.clone());
            let since = match self.seen.get(&name) {
                Some((r, at)) if *r == record => *at,
                _ => Instant::now(),
            };
            self.seen.insert(name.clone(), (record, since));
            if holder == self.identity {
                group.joined = joined;
            }
            if holder == self.identity || since.elapsed() < self.duration {
                if shards != self.shards {
                    group.other_counts.push(OtherCount { identity: holder.clone(), shards, joined });
                }
                group.members.insert(holder);
            } else if since.elapsed() >= self.duration * FORGET_AFTER {
                debug!(lease = %name, holder = %holder, "deleting the member lease of a replica gone long ago");
                let _ = self.api.delete(&name, &DeleteParams::default()).await;
            }
        }
        self.seen.retain(|name, _| present.contains(name));
        Ok(group)
    }

    /// Deletes this replica's member Lease (at a clean stop): the others count one replica
    /// less at once.
    pub async fn leave(&self) {
        let _ = self.api.delete(&self.name, &DeleteParams::default()).await;
    }
}
