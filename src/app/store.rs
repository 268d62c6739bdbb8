//! Opening the configured state store (`[checkpoint] store`) for this process: its owner
//! (the cluster's identity, the lease epoch, the writer), its connection (the sink's, or the
//! store's own) and, for Kafka, the `transactional.id` that names the deployment.

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use rdkafka::ClientConfig;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::bounds::Bounds;
use crate::config::Config;
use crate::observe::health::Health;
use crate::observe::kube_error::in_words;
use crate::sink::{Sink, secret};
use crate::state::StoreKind;
use crate::state::store::file::FileStore;
use crate::state::store::kafka::{KafkaStore, KafkaStoreConfig};
use crate::state::store::nats::{NatsStore, NatsStoreConfig};
use crate::state::store::{CheckpointError, Owner, Store, StreamKey, short_hash};

/// The epoch a Lease made anew starts at: one above the highest epoch of the configured broker
/// store's records (0 when it holds none). Read only when a Lease is created (rare: the first
/// start, or a Lease deleted, renamed or moved), with a connection of its own. `None` for the
/// file store (its records carry no epoch: one process locks the directory).
pub fn epoch_floor(config: &Config) -> Option<crate::coordination::lease::EpochFloor> {
    if config.checkpoint.store == StoreKind::File {
        return None;
    }
    let config = std::sync::Arc::new(config.clone());
    // Read once per process (a sharded replica creates several Leases at once), in a task of
    // its own: a Lease attempt is bounded by the retry period, and a read cut short by it
    // would start over at every attempt (a large state topic takes longer to read than that).
    // The attempts wait for the one read; an error is not kept: the next creation reads again.
    type Read = tokio::sync::watch::Receiver<Option<Result<i32, String>>>;
    let reading: std::sync::Arc<std::sync::Mutex<Option<Read>>> = std::sync::Arc::default();
    Some(std::sync::Arc::new(move || {
        let mut rx = {
            let mut reading = reading.lock().expect("epoch floor lock");
            match &*reading {
                Some(rx) => rx.clone(),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    let config = config.clone();
                    tokio::spawn(async move {
                        let _ = tx.send(Some(read_epoch_floor(&config).await));
                    });
                    *reading = Some(rx.clone());
                    rx
                }
            }
        };
        let reading = reading.clone();
        Box::pin(async move {
            let read = match rx.wait_for(Option::is_some).await {
                Ok(read) => read.clone().expect("a value"),
                Err(_) => Err("the read of the state store's epochs stopped".to_string()),
            };
            if read.is_err() {
                // Read again at the next creation.
                *reading.lock().expect("epoch floor lock") = None;
            }
            read
        })
    }))
}

/// One above the highest epoch of the broker store's records; 0 when there is no state.
async fn read_epoch_floor(config: &Config) -> Result<i32, String> {
    let c = &config.checkpoint;
    let sink = Sink::open(&config.sink, 1).await.map_err(|e| e.to_string())?;
    let scanned = if c.store == StoreKind::Kafka {
        let client = kafka_client(config, &sink).map_err(|e| e.to_string())?;
        let (cc, topic) = (client.clone(), c.kafka.topic.clone());
        let looked = tokio::task::spawn_blocking(move || {
            crate::sink::kafka::lookup::lookup_topics(&cc, &[topic], Duration::from_secs(10))
        })
        .await
        .expect("lookup task")?;
        if matches!(looked.0.first(), Some((_, crate::sink::kafka::lookup::TopicState::Missing))) {
            // No state topic yet: nothing was written, nothing to be above.
            return Ok(0);
        }
        crate::state::store::kafka::scan(&client, &c.kafka.topic).await
    } else {
        let client = nats_client(config, &sink).await.map_err(|e| e.to_string())?;
        let js = async_nats::jetstream::new(client.clone());
        match js.get_key_value(&c.nats.bucket).await {
            Err(e) if e.kind() == async_nats::jetstream::context::KeyValueErrorKind::GetBucket => return Ok(0),
            _ => crate::state::store::nats::scan(&client, &c.nats.bucket).await,
        }
    };
    let epochs = scanned.map_err(|e| e.to_string())?.iter().map(|s| s.record.epoch).max();
    Ok(epochs.map_or(0, |e| i32::try_from(e.saturating_add(1)).unwrap_or(i32::MAX)))
}

/// The uid of the `kube-system` namespace: what tells two clusters with one `[cluster] name`
/// apart. `None` (with a warning) when it cannot be read.
pub async fn cluster_uid(client: &kube::Client) -> Option<String> {
    let api: Api<Namespace> = Api::all(client.clone());
    match tokio::time::timeout(Duration::from_secs(10), api.get("kube-system")).await {
        Ok(Ok(ns)) => ns.metadata.uid,
        Ok(Err(e)) => {
            warn!(error = %in_words(&e), "cannot read the kube-system namespace: state from another cluster with the same [cluster] name would not be detected (fix: grant get on namespaces/kube-system)");
            None
        }
        Err(_) => {
            warn!(
                "no answer reading the kube-system namespace: the cluster's identity is not checked against the stored state"
            );
            None
        }
    }
}

/// The `transactional.id` of the Kafka store: configured, else named after the Lease (one per
/// deployment with `[coordination]`), else after the cluster and the set of streams. A shard's
/// (its streams' keys name it) adds `.shard-<i>-of-<N>`: the producer fencing holds per shard.
pub fn transactional_id(config: &Config, keys: &[StreamKey]) -> String {
    let shard = keys.first().and_then(|k| k.shard).map(|s| format!(".shard-{}", s.label())).unwrap_or_default();
    if let Some(id) = &config.checkpoint.kafka.transactional_id {
        return format!("{id}{shard}");
    }
    let c = &config.coordination;
    if c.enabled {
        return format!("kubecast-state.{}.{}.{}{shard}", config.cluster.name, c.namespace(), c.lease_name);
    }
    let mut ids: Vec<String> = keys.iter().map(StreamKey::id).collect();
    ids.sort();
    let hex = short_hash(ids.join(",").as_bytes());
    format!("kubecast-state.{}.{hex}", config.cluster.name)
}

/// Opens the store. A broker that cannot be reached is retried (every 2 s, with a warning),
/// and so is a broker that refuses the store for a set-up reason (a missing ACL on the
/// `transactional.id`, a transaction timeout above its maximum: every 5 s, `health` not ready
/// naming it and the fix), until `cancel` fires; anything else is an error. With exactly-once,
/// the sink's events go into the store's transaction, within its part of `bounds`.
pub async fn open(
    config: &Config,
    sink: &Sink,
    keys: &[StreamKey],
    owner: Owner,
    health: &Health,
    bounds: &Bounds,
    cancel: &CancellationToken,
) -> Result<Option<Store>, CheckpointError> {
    let c = &config.checkpoint;
    info!(store = ?c.store, "opening the state store");
    loop {
        let opened = match c.store {
            StoreKind::File => {
                // Directory creation, lock and reads: on the blocking pool.
                let (dir, owner) = (c.dir.clone(), owner.clone());
                tokio::task::spawn_blocking(move || FileStore::open(&dir, owner))
                    .await
                    .expect("file store open task")
                    .map(Store::File)
            }
            StoreKind::Kafka => {
                let client = kafka_client(config, sink)?;
                let cfg = KafkaStoreConfig {
                    client,
                    topic: c.kafka.topic.clone(),
                    create_topic: c.kafka.create_topic,
                    transactional_id: transactional_id(config, keys),
                    exactly_once: sink.kafka().is_some_and(|k| k.exactly_once()),
                    replication_factor: c.kafka.replication_factor,
                    min_insync_replicas: c.kafka.min_insync_replicas,
                };
                KafkaStore::open(cfg, owner.clone()).await.map(|s| {
                    if let Some(k) = sink.kafka().filter(|k| k.exactly_once()) {
                        k.attach(s.transaction().clone(), bounds.uncommitted());
                        health.set_transaction_connection(s.transaction().connected());
                    }
                    Store::Kafka(s.into())
                })
            }
            // A server that cannot be reached (`[checkpoint.nats] url`) is retried too.
            StoreKind::Nats => match nats_client(config, sink).await {
                Ok(client) => {
                    let cfg = NatsStoreConfig {
                        client,
                        bucket: c.nats.bucket.clone(),
                        create_bucket: c.nats.create_bucket,
                        replicas: c.nats.replicas,
                    };
                    NatsStore::open(cfg, owner.clone()).await.map(|s| Store::Nats(s.into()))
                }
                Err(e) => Err(e),
            },
        };
        let wait = match opened {
            Ok(store) => {
                health.set_state_problem(None);
                return Ok(Some(store));
            }
            Err(e @ CheckpointError::Broker { .. }) => {
                warn!(error = %e, "state store cannot be opened yet; retrying in 2 s");
                Duration::from_secs(2)
            }
            // A set-up mistake, not another owner: said until the operator fixes it.
            Err(e @ CheckpointError::Refused { .. }) => {
                warn!(error = %e, "state store refused (a set-up mistake); retrying in 5 s until it is fixed");
                health.set_state_problem(Some(format!("state: {e}")));
                Duration::from_secs(5)
            }
            Err(e) => return Err(e),
        };
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// The sink's connection, or `[checkpoint.kafka] brokers` and its properties. With
/// `exactly_once` always the sink's: its producer sends the events (the config refuses other
/// brokers or properties for the store then).
pub(super) fn kafka_client(config: &Config, sink: &Sink) -> Result<ClientConfig, CheckpointError> {
    let k = &config.checkpoint.kafka;
    match (&k.brokers, sink.kafka()) {
        (_, Some(s)) if s.exactly_once() => Ok(s.client_config().clone()),
        (None, Some(s)) => Ok(s.client_config().clone()),
        (Some(brokers), _) => {
            let mut cc = ClientConfig::new();
            cc.set("bootstrap.servers", brokers);
            for (name, v) in &k.properties {
                let v = secret::resolve(v).map_err(|e| CheckpointError::Broker {
                    what: format!("checkpoint.kafka.properties.\"{name}\""),
                    cause: e.to_string(),
                })?;
                cc.set(name, v);
            }
            crate::sink::kafka::security::set_system_ca(&mut cc);
            cc.set_log_level(crate::sink::kafka::log_level(&cc));
            Ok(cc)
        }
        (None, None) => unreachable!("checked by the config"),
    }
}

/// The sink's connection, or `[checkpoint.nats] url`.
pub(super) async fn nats_client(config: &Config, sink: &Sink) -> Result<async_nats::Client, CheckpointError> {
    match (&config.checkpoint.nats.url, sink.nats()) {
        (None, Some(n)) => Ok(n.client().clone()),
        (Some(url), _) => {
            // Credentials written in the URL: async-nats would not send them.
            let opts = match crate::sink::nats::url_credentials(url) {
                Some(crate::sink::nats::UrlCredentials::UserPassword(u, p)) => {
                    async_nats::ConnectOptions::with_user_and_password(u, p)
                }
                Some(crate::sink::nats::UrlCredentials::Token(t)) => async_nats::ConnectOptions::with_token(t),
                None => async_nats::ConnectOptions::new(),
            };
            opts.connect(url.as_str()).await.map_err(|e| CheckpointError::Broker {
                what: format!("checkpoint.nats.url {:?}", crate::sink::secret::url_for_display(url)),
                cause: e.to_string(),
            })
        }
        (None, None) => unreachable!("checked by the config"),
    }
}
