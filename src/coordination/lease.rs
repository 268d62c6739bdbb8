//! Leader election over a `coordination.k8s.io/v1` Lease: only the holder runs the streams.
//!
//! The loop is client-go's: the holder renews every `retry_period_seconds`; a candidate takes
//! the Lease over once it has seen the same record (holder and renew time) unchanged for
//! `lease_duration_seconds` (local observation time, so clocks need not agree); a holder that
//! could not renew for `renew_deadline_seconds` has lost it and must stop at once. Writes are
//! conditional on the resourceVersion read (optimistic concurrency): of two candidates, one
//! wins. Each takeover increments `leaseTransitions`: the *epoch* the holder works under.
//!
//! Not a crate for it: kube-lease-manager and kube-leader-election are built for other kube
//! majors (a second kube in the build); this loop is small and tested against the apiserver.

use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::{ObjectMeta, PostParams, WatchEvent, WatchParams};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

pub use super::lease_error::LeaseError;
use crate::model::Problem;
use crate::model::shard::{MAX_SHARDS, Shard};
use crate::observe::kube_error::in_words;

/// `[coordination]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinationConfig {
    /// Elect one active process through a Lease (off: every process runs its streams).
    #[serde(default)]
    pub enabled: bool,
    /// The Lease's name.
    #[serde(default = "d_name")]
    pub lease_name: String,
    /// Its namespace; default: `POD_NAMESPACE`, else `default`.
    #[serde(default)]
    pub lease_namespace: Option<String>,
    /// This process's identity in the Lease; default: `POD_NAME`, else the host name, plus
    /// what tells this process from others of that name (the pod's uid, the pid or a random
    /// number).
    #[serde(default)]
    pub identity: Option<String>,
    #[serde(default = "d_duration")]
    pub lease_duration_seconds: u32,
    #[serde(default = "d_deadline")]
    pub renew_deadline_seconds: u32,
    #[serde(default = "d_retry")]
    pub retry_period_seconds: u32,
    /// Shards of every stream (1: one active process runs them all). With N > 1, each shard
    /// is a Lease (`<lease_name>-<i>-of-<N>`), its own stream positions and, with exactly-once,
    /// its own `transactional.id`; the replicas spread the shards among themselves.
    #[serde(default = "d_shards")]
    pub shards: u32,
}

impl Default for CoordinationConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            lease_name: d_name(),
            lease_namespace: None,
            identity: None,
            lease_duration_seconds: d_duration(),
            renew_deadline_seconds: d_deadline(),
            retry_period_seconds: d_retry(),
            shards: d_shards(),
        }
    }
}

fn d_name() -> String {
    "kubecast".into()
}
fn d_duration() -> u32 {
    15
}
fn d_deadline() -> u32 {
    10
}
fn d_retry() -> u32 {
    2
}
fn d_shards() -> u32 {
    1
}

/// A Kubernetes object name of the DNS subdomain kind (RFC 1123): what a Lease's name must be.
fn is_dns_subdomain(name: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    edge(name.chars().next())
        && edge(name.chars().last())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// The longest `lease_duration_seconds` accepted: an hour.
const MAX_LEASE_SECONDS: u32 = 3600;

impl CoordinationConfig {
    /// Problems with `[coordination]`.
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let (d, r, p) = (self.lease_duration_seconds, self.renew_deadline_seconds, self.retry_period_seconds);
        // In u64: `r + p` of u32s could wrap, and a wrapped sum would pass the check.
        if p == 0 || r <= p || u64::from(d) < u64::from(r) + u64::from(p) {
            out.push(Problem::new(
                "coordination.lease_duration_seconds",
                format!(
                    "needs lease_duration_seconds ({d}) >= renew_deadline_seconds ({r}) + retry_period_seconds ({p}), and renew_deadline_seconds > retry_period_seconds >= 1 (a holder must notice a missed renewal before a standby may take over)"
                ),
                "e.g. 15, 10 and 2 (the defaults)",
            ));
        }
        if d > MAX_LEASE_SECONDS {
            out.push(Problem::new(
                "coordination.lease_duration_seconds",
                format!("is {d}; at most {MAX_LEASE_SECONDS} (a standby would wait that long to take over a holder that died)"),
                "e.g. 15 (the default)",
            ));
        }
        if let Some(ns) = &self.lease_namespace
            && !(is_dns_subdomain(ns) && ns.len() <= 63 && !ns.contains('.'))
        {
            // The apiserver would answer every attempt with 404 or 422: a standby forever.
            out.push(Problem::new(
                "coordination.lease_namespace",
                format!("{ns:?} is not a namespace name: lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63 characters"),
                "the namespace the Lease lives in, e.g. \"kubecast\"; remove it for the pod's own namespace",
            ));
        }
        if self.identity.as_deref().is_some_and(|i| i.trim().is_empty()) {
            out.push(Problem::new("coordination.identity", "must not be empty", "remove it for the pod name"));
        }
        if self.shards == 0 || self.shards > MAX_SHARDS {
            out.push(Problem::new(
                "coordination.shards",
                format!("is {}; it must be between 1 and {MAX_SHARDS}", self.shards),
                "1 (one active replica) or the number of slices the replicas share, e.g. 4",
            ));
        } else if self.shards > 1 && !self.enabled {
            out.push(Problem::new(
                "coordination.shards",
                format!(
                    "is {} but coordination.enabled is false: the replicas spread the shards through Leases",
                    self.shards
                ),
                "set coordination.enabled = true, or shards = 1",
            ));
        }
        if self.lease_name.is_empty() {
            out.push(Problem::new("coordination.lease_name", "must not be empty", "e.g. \"kubecast\""));
        } else if !is_dns_subdomain(&self.lease_name) || self.lease_name.len() > 253 - "-256-of-256".len() {
            // The apiserver refuses other names (422), at every attempt to take the Lease.
            out.push(Problem::new(
                "coordination.lease_name",
                format!(
                    "{:?} is not a Lease name: lowercase letters, digits, '-' and '.', starting and ending with a letter or digit, at most 242 characters",
                    self.lease_name
                ),
                "e.g. \"kubecast\" or \"kubecast-prod\"",
            ));
        } else if self.shards > 1 && self.lease_name.len() > 63 {
            // With shards it also labels the group's Leases, and lists select them by it: the
            // apiserver refuses a longer label value at every attempt, and no shard would run.
            out.push(Problem::new(
                "coordination.lease_name",
                format!(
                    "has {} characters; with shards it is also the value of a label on the group's Leases, which is at most 63",
                    self.lease_name.len()
                ),
                "a shorter name, e.g. \"kubecast-prod\"",
            ));
        }
        out
    }

    /// The shards this deployment runs; `None` with `shards = 1` (one Lease, as without
    /// sharding).
    pub fn sharded(&self) -> Option<Vec<Shard>> {
        (self.enabled && self.shards > 1).then(|| Shard::all(self.shards).collect())
    }

    pub fn namespace(&self) -> String {
        self.lease_namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok().filter(|n| !n.is_empty()))
            .unwrap_or_else(|| "default".into())
    }

    /// The configured identity (default: `POD_NAME`, else the host name), plus what tells this
    /// process from others sharing the name (see [`instance`]).
    pub fn identity(&self) -> String {
        let name = self.identity.clone().unwrap_or_else(|| {
            std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()).unwrap_or_else(crate::state::host_name)
        });
        format!("{name}-{}", this_instance())
    }
}

/// This process's [`instance`], the same for every Lease it holds.
fn this_instance() -> &'static str {
    static INSTANCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    INSTANCE.get_or_init(|| {
        let pod_uid = std::env::var("POD_UID").ok();
        instance(pod_uid.as_deref(), std::process::id(), || getrandom::u32().unwrap_or_else(|_| rand_fallback()))
    })
}

/// Something that differs between the processes that may share one identity's name (replicas
/// given one `identity` by a shared config, a pod replaced under the same name while the old
/// one still runs), and stays across restarts of a container in its pod (it then takes its own
/// Lease back at once): the pod's uid (`POD_UID`, set by the chart) when known, and the pid
/// when it is not 1. In a container without `POD_UID` the pid is 1 in every replica: a random
/// number then.
pub(crate) fn instance(pod_uid: Option<&str>, pid: u32, random: impl FnOnce() -> u32) -> String {
    let uid: String = pod_uid.unwrap_or("").chars().filter(char::is_ascii_alphanumeric).take(8).collect();
    match (uid.is_empty(), pid) {
        (false, 1) => uid,
        (false, pid) => format!("{uid}-{pid}"),
        (true, 1) => format!("{:08x}", random()),
        (true, pid) => pid.to_string(),
    }
}

/// When the system's random source cannot be read: the clock's nanoseconds.
fn rand_fallback() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
}

/// What one attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// This process holds the Lease, in this epoch (`leaseTransitions`).
    Held { epoch: i32 },
    /// Another process does.
    Other { holder: String },
    /// The Lease changed between this process's read and its write (409) while this process
    /// held it: not settled; try again (a renewal that failed, as client-go counts it).
    Conflict,
}

/// What identifies a Lease record: its holder and renew time.
type Record = (Option<String>, Option<MicroTime>);

/// One process's side of the election.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    namespace: String,
    identity: String,
    duration: Duration,
    /// The record last seen and when it was first seen so.
    observed: Option<(Record, Instant)>,
    /// Labels a Lease this process creates carries (a shard's: its group, see `members`).
    labels: std::collections::BTreeMap<String, String>,
    /// The shard whose Lease this is (`[coordination] shards` above 1).
    shard: Option<Shard>,
    /// The epoch a Lease this process creates starts at (see [`EpochFloor`]); `None`: 0.
    floor: Option<EpochFloor>,
    /// The Lease as this process last wrote it while holding it: the next renewal writes it
    /// again without reading it first (see [`Self::try_acquire_or_renew`]).
    written: Option<Lease>,
}

/// The epoch a Lease made anew starts at: one above every epoch in the state store. A Lease
/// is made anew when it was deleted with its namespace, when a release is renamed or moved,
/// when `lease_name` changes, while the state store stays: starting at 0, its holder would be
/// refused by the store ([`crate::state::store::CheckpointError::Superseded`]) and the
/// process would restart once per handover the old Lease saw. Creation is atomic, so the
/// creator alone holds that epoch, and it is above any older holder's, which the store still
/// fences. `Err`: the store could not be read; the Lease then starts at 0, as before.
pub type EpochFloor =
    std::sync::Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<i32, String>> + Send + Sync>;

impl Elector {
    pub fn new(client: kube::Client, cfg: &CoordinationConfig) -> Self {
        let namespace = cfg.namespace();
        Self {
            api: Api::namespaced(client, &namespace),
            name: cfg.lease_name.clone(),
            namespace,
            identity: cfg.identity(),
            duration: Duration::from_secs(cfg.lease_duration_seconds.into()),
            observed: None,
            labels: Default::default(),
            shard: None,
            floor: None,
            written: None,
        }
    }

    /// A Lease this elector creates starts at the epoch `floor` gives.
    pub fn with_epoch_floor(mut self, floor: Option<EpochFloor>) -> Self {
        self.floor = floor;
        self
    }

    /// The same Lease, created (or renewed) with `labels`.
    pub fn with_labels(mut self, labels: std::collections::BTreeMap<String, String>) -> Self {
        self.labels = labels;
        self
    }

    /// The elector of a shard's Lease (`<lease_name>-<i>-of-<N>`), created with `labels`.
    pub fn for_shard(
        client: kube::Client,
        cfg: &CoordinationConfig,
        shard: Shard,
        labels: std::collections::BTreeMap<String, String>,
    ) -> Self {
        Self { name: shard.lease_name(&cfg.lease_name), labels, shard: Some(shard), ..Self::new(client, cfg) }
    }

    /// The same elector, its requests sent through `client`.
    pub fn with_client(self, client: kube::Client) -> Self {
        Self { api: Api::namespaced(client, &self.namespace), ..self }
    }

    /// The shard whose Lease this is.
    pub fn shard(&self) -> Option<Shard> {
        self.shard
    }

    /// Takes in the Lease as a list showed it (`None`: it does not exist): its live holder,
    /// `None` when it has none or its holder did not renew it for the lease duration (seen
    /// locally, as [`Self::try_acquire_or_renew`] judges it, which it prepares).
    pub fn observe(&mut self, lease: Option<&Lease>) -> Option<String> {
        let spec = lease.and_then(|l| l.spec.as_ref())?;
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
        let record = (Some(holder.clone()), spec.renew_time.clone());
        let seen_since = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => Instant::now(),
        };
        self.observed = Some((record, seen_since));
        let recorded = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
        (holder == self.identity || seen_since.elapsed() < self.duration.max(recorded)).then_some(holder)
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// `namespace/name`.
    pub fn lease(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn error(&self, e: &kube::Error) -> LeaseError {
        LeaseError::from_kube(&self.namespace, &self.name, e)
    }

    /// Takes or renews the Lease if this process may. A lost race (409) is `Other`.
    ///
    /// A holder renews with one request: it writes the Lease as it last wrote it, with a new
    /// renew time, conditional on the resourceVersion of that write (as client-go's elector
    /// does since Kubernetes 1.28). Any other write since (another process took the Lease
    /// over, or deleted it) makes that write fail (409, 404), and the attempt goes on as
    /// without it: a read, then a write.
    pub async fn try_acquire_or_renew(&mut self) -> Result<Attempt, LeaseError> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        if let Some(mut lease) = self.written.take() {
            let spec = lease.spec.get_or_insert_with(Default::default);
            spec.renew_time = Some(now.clone());
            spec.lease_duration_seconds = Some(seconds);
            let epoch = spec.lease_transitions.unwrap_or(0);
            match self.api.replace(&self.name, &PostParams::default(), &lease).await {
                Ok(written) => {
                    self.written = Some(written);
                    return Ok(Attempt::Held { epoch });
                }
                Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {}
                Err(e) => return Err(self.error(&e)),
            }
        }
        let existing = self.api.get_opt(&self.name).await.map_err(|e| self.error(&e))?;
        let Some(mut lease) = existing else {
            // The read of the store runs on its own (it may take longer than an attempt may):
            // until it is done, no Lease is created and the attempt says so.
            let start = match &self.floor {
                None => 0,
                Some(floor) => match futures::FutureExt::now_or_never(floor()) {
                    None => {
                        return Ok(Attempt::Other {
                            holder: "(nobody yet: reading the state store's epochs to create the Lease above them)"
                                .into(),
                        });
                    }
                    Some(Ok(epoch)) => epoch,
                    Some(Err(e)) => {
                        warn!(lease = %self.lease(), error = %e, "the state store could not be read to start the new Lease above its epochs; it starts at 0 (a store written under a higher epoch refuses this holder once)");
                        0
                    }
                },
            };
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    labels: (!self.labels.is_empty()).then(|| self.labels.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(start),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(created) => {
                    self.written = Some(created);
                    if start > 0 {
                        tracing::info!(lease = %self.lease(), epoch = start, "created the Lease above the highest epoch in the state store (the Lease was made anew: deleted, renamed or moved)");
                    }
                    Ok(Attempt::Held { epoch: start })
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(Attempt::Other { holder: "(just created)".into() }),
                Err(e) => Err(self.error(&e)),
            };
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let record = (holder.clone(), spec.renew_time.clone());
        // When this record was first seen as it is (local time: no clock skew matters).
        let seen_since = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => Instant::now(),
        };
        self.observed = Some((record, seen_since));
        let mine = holder.as_deref() == Some(self.identity.as_str());
        let transitions = spec.lease_transitions.unwrap_or(0);
        // The holder's own duration counts too (a config change shortening it must not let a
        // standby take over between two renewals of the old holder).
        let recorded = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
        let epoch = if mine {
            transitions
        } else {
            let expired = holder.is_none() || seen_since.elapsed() >= self.duration.max(recorded);
            if !expired {
                return Ok(Attempt::Other { holder: holder.unwrap_or_default() });
            }
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(transitions.saturating_add(1));
            transitions.saturating_add(1)
        };
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(seconds);
        // A Lease created before it had its group's labels (by an older kubecast): given them,
        // so that replicas of another shard count see it.
        if !self.labels.is_empty() {
            let labels = lease.metadata.labels.get_or_insert_with(Default::default);
            for (k, v) in &self.labels {
                labels.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
        // Conditional on the resourceVersion read: a concurrent writer makes this fail (409).
        match self.api.replace(&self.name, &PostParams::default(), &lease).await {
            Ok(written) => {
                self.written = Some(written);
                Ok(Attempt::Held { epoch })
            }
            Err(kube::Error::Api(s)) if s.code == 409 && mine => Ok(Attempt::Conflict),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                Ok(Attempt::Other { holder: holder.unwrap_or_else(|| "(changed meanwhile)".into()) })
            }
            Err(e) => Err(self.error(&e)),
        }
    }

    /// Gives the Lease up (at a clean stop): a standby takes over at once instead of after
    /// the lease duration.
    pub async fn release(&mut self) {
        self.written = None;
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else { return };
        let Some(spec) = lease.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        let _ = self.api.replace(&self.name, &PostParams::default(), &lease).await;
    }

    /// A watch on the Lease, for a standby: it sees the holder give the Lease up as soon as
    /// the apiserver has it, instead of at its next retry period.
    pub fn watch(&self) -> LeaseWatch {
        LeaseWatch { api: self.api.clone(), name: self.name.clone(), events: None, forbidden: false }
    }
}

/// A watch on one Lease (`fieldSelector=metadata.name=<name>`: RBAC's `watch` verb on that one
/// Lease suffices). One long-lived request: it costs the apiserver less than polling faster.
pub struct LeaseWatch {
    api: Api<Lease>,
    name: String,
    events: Option<BoxStream<'static, kube::Result<WatchEvent<Lease>>>>,
    /// RBAC does not allow it: the standby polls only.
    forbidden: bool,
}

impl LeaseWatch {
    /// Completes when the watch shows the Lease without a holder (given up at a clean stop)
    /// or deleted. Each (re)opened watch first reports the Lease as it is. Never completes
    /// while the Lease cannot be watched (403: warned once); other failures reopen it after
    /// `backoff`. Cancel-safe: a pending call may be dropped and called again.
    pub async fn released(&mut self, backoff: Duration) {
        loop {
            if self.forbidden {
                return std::future::pending().await;
            }
            let events = match self.events.as_mut() {
                Some(events) => events,
                None => {
                    let params = WatchParams::default().fields(&format!("metadata.name={}", self.name)).timeout(290);
                    match self.api.watch(&params, "0").await {
                        Ok(events) => self.events.insert(events.boxed()),
                        Err(kube::Error::Api(s)) if s.code == 403 => {
                            warn!(lease = %self.name, error = %s, "cannot watch the lease: a standby sees it given up only at its next retry period (fix: grant watch on leases.coordination.k8s.io {} to kubecast's identity)", self.name);
                            self.forbidden = true;
                            continue;
                        }
                        Err(e) => {
                            debug!(lease = %self.name, error = %in_words(&e), "lease watch not opened; again after a retry period");
                            tokio::time::sleep(backoff).await;
                            continue;
                        }
                    }
                }
            };
            match events.next().await {
                Some(Ok(WatchEvent::Added(l) | WatchEvent::Modified(l))) => {
                    let holder = l.spec.and_then(|s| s.holder_identity).filter(|h| !h.is_empty());
                    if holder.is_none() {
                        return;
                    }
                }
                Some(Ok(WatchEvent::Deleted(_))) => return,
                Some(Ok(WatchEvent::Bookmark(_))) => {}
                Some(Ok(WatchEvent::Error(e))) => {
                    debug!(lease = %self.name, error = %e, "lease watch ended; reopening");
                    self.events = None;
                }
                Some(Err(e)) => {
                    debug!(lease = %self.name, error = %in_words(&e), "lease watch failed; reopening after a retry period");
                    self.events = None;
                    tokio::time::sleep(backoff).await;
                }
                None => self.events = None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::instance;

    #[test]
    fn the_instance_tells_apart_what_shares_a_name() {
        let uid = "6f1c1a9e-2b7d-4c1e-9f00-0123456789ab";
        // In a pod: its uid, the same after a restart of the container (pid 1 again).
        assert_eq!(instance(Some(uid), 1, || unreachable!()), "6f1c1a9e");
        // Two processes in one pod (a sidecar and `kubecast state`): the pid too.
        assert_eq!(instance(Some(uid), 4242, || unreachable!()), "6f1c1a9e-4242");
        // Not a pod: the pid.
        assert_eq!(instance(None, 4242, || unreachable!()), "4242");
        assert_eq!(instance(Some(""), 4242, || unreachable!()), "4242");
        // A container without POD_UID: every replica is pid 1, so a random number.
        assert_eq!(instance(None, 1, || 0xdead_beef), "deadbeef");
        assert_ne!(instance(None, 1, || 1), instance(None, 1, || 2));
        // Only letters and digits of the uid go into the name.
        assert_eq!(instance(Some("a-b_c.d/e"), 1, || 0), "abcde");
    }
}
