//! State in the broker (`[checkpoint] store = "kafka" | "nats"`), against the real servers: a
//! replaced pod with no disk resumes from the broker, also after 410 Gone; a corrupt record, a
//! second cluster with the same `[cluster] name` and a second writer are refused; with
//! `[coordination]`, a killed leader's standby continues where it ended, a paused leader
//! that wakes up never moves the state again, and a leader that loses the Lease while it opens
//! the store stops without touching it.

use kubecast_kit as common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, about, cm_config, create_cms, hundred_changes, names, verb, wait_until_expired};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use rdkafka::ClientConfig;
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Kafka,
    Nats,
}

/// A store of its own (topic or bucket named `name`).
struct Store {
    kind: Kind,
    name: String,
}

impl Store {
    fn new(kind: Kind, prefix: &str) -> Self {
        Self { kind, name: common::unique(prefix).replace('.', "-") }
    }

    /// The `[checkpoint]` lines.
    fn lines(&self) -> String {
        match self.kind {
            Kind::Kafka => format!(
                "store = \"kafka\"\nflush_interval_ms = 100\n[checkpoint.kafka]\nbrokers = \"{}\"\ntopic = \"{}\"\n",
                common::env_var("KAFKA_BROKERS"),
                self.name
            ),
            Kind::Nats => format!(
                "store = \"nats\"\nflush_interval_ms = 100\n[checkpoint.nats]\nurl = \"{}\"\nbucket = \"{}\"\n",
                common::env_var("NATS_URL"),
                self.name
            ),
        }
    }

    /// The latest value of every key (`None`: deleted).
    async fn records(&self) -> HashMap<String, Option<Vec<u8>>> {
        match self.kind {
            Kind::Kafka => self.kafka_history().into_iter().collect(),
            Kind::Nats => {
                let client = async_nats::connect(common::env_var("NATS_URL")).await.unwrap();
                let kv = async_nats::jetstream::new(client).get_key_value(&self.name).await.unwrap();
                let mut out = HashMap::new();
                let mut keys = kv.keys().await.unwrap();
                while let Some(k) = keys.next().await {
                    let k = k.unwrap();
                    let v = kv.get(&k).await.unwrap().map(|b| b.to_vec());
                    out.insert(k, v);
                }
                out
            }
        }
    }

    /// Every record of the Kafka state topic, in order (committed ones: the store writes in
    /// transactions).
    fn kafka_history(&self) -> Vec<(String, Option<Vec<u8>>)> {
        common::topic::read_to_end(&self.name, true)
            .into_iter()
            .map(|m| (String::from_utf8(m.key().unwrap().to_vec()).unwrap(), m.payload().map(<[u8]>::to_vec)))
            .collect()
    }

    /// The position records, parsed.
    async fn positions(&self) -> Vec<Value> {
        self.records()
            .await
            .into_iter()
            .filter(|(k, _)| k.ends_with(".p"))
            .map(|(_, v)| serde_json::from_slice(&v.expect("a position")).unwrap())
            .collect()
    }

    async fn put(&self, key: &str, value: &[u8]) {
        match self.kind {
            Kind::Kafka => {
                let p: FutureProducer =
                    ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
                p.send(FutureRecord::to(&self.name).key(key).payload(value), Duration::from_secs(10)).await.unwrap();
            }
            Kind::Nats => {
                let client = async_nats::connect(common::env_var("NATS_URL")).await.unwrap();
                let kv = async_nats::jetstream::new(client).get_key_value(&self.name).await.unwrap();
                kv.put(key, value.to_vec().into()).await.unwrap();
            }
        }
    }

    /// Waits until the stored resume point is set (the first list was written).
    async fn wait_position(&self) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let ps = if self.exists().await { self.positions().await } else { vec![] };
            if let Some(rv) = ps.first().and_then(|p| p["resource_version"].as_str()) {
                return rv.to_string();
            }
            assert!(Instant::now() < deadline, "no position written to {}", self.name);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn exists(&self) -> bool {
        match self.kind {
            Kind::Kafka => true,
            Kind::Nats => {
                let client = async_nats::connect(common::env_var("NATS_URL")).await.unwrap();
                async_nats::jetstream::new(client).get_key_value(&self.name).await.is_ok()
            }
        }
    }
}

/// A pod replaced by one with no disk: the new process resumes from the broker. Its resume
/// point expired meanwhile (compacting apiserver): the relist-diff against the stored index
/// delivers exactly the 100 changes, deletes included; a third process then emits nothing.
async fn replaced_pod_resumes_from_the_broker_after_410(kind: Kind) {
    let kubeconfig = common::compacting_kubeconfig();
    let env = [("KUBECONFIG", kubeconfig.as_str())];
    let client = common::client_for(&kubeconfig).await;
    let ns = TestNamespace::new(&client, "state").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let existing = create_cms(&client, &ns.name, &names("c", 0..60)).await;
    let store = Store::new(kind, "kubecast-state");
    let config = cm_config(&ns.name, "");

    let mut first = Kubecast::start_with_checkpoint(&config, &store.lines(), &env);
    first.wait_for("snapshot", WAIT, |e| e.len() == 60).await;
    let rv = store.wait_position().await;
    assert!(first.stop().success(), "{}", first.log());
    assert!(first.checkpoint_files().is_empty(), "nothing on the local disk");

    let (expected, deleted) = hundred_changes(&client, &ns.name, &existing).await;
    wait_until_expired(&api, &rv).await;

    // A new pod: a fresh directory, the same config.
    let mut second = Kubecast::start_with_checkpoint(&config, &store.lines(), &env);
    second.wait_for("the 100 changes", WAIT, |e| e.len() >= 100).await;
    let barrier = common::settle(&mut second, &client, &ns.name, json!({})).await;
    let after = common::without(&second.events(), &barrier);
    assert_eq!(after.len(), 100, "exactly the 100 changes, no snapshot:\n{}", common::pretty(&after));
    let got: BTreeSet<String> =
        after.iter().filter(|e| verb(e) != "deleted").map(|e| e["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(got, expected);
    let got_deleted: BTreeSet<String> = after
        .iter()
        .filter(|e| verb(e) == "deleted")
        .map(|e| e["partitionkey"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(got_deleted, deleted, "the deletes made while down");
    assert!(second.log().contains("410 Gone"), "{}", second.log());
    assert!(second.stop().success(), "{}", second.log());

    let mut third = Kubecast::start_with_checkpoint(&config, &store.lines(), &env);
    third.wait_ready(200).await;
    let barrier = common::settle(&mut third, &client, &ns.name, json!({})).await;
    let again = common::without(&third.events(), &barrier);
    assert!(again.is_empty(), "nothing again:\n{}", common::pretty(&again));
    assert!(third.stop().success(), "{}", third.log());
}

#[tokio::test]
async fn kafka_a_replaced_pod_resumes_from_the_state_topic_after_410() {
    replaced_pod_resumes_from_the_broker_after_410(Kind::Kafka).await;
}

#[tokio::test]
async fn nats_a_replaced_pod_resumes_from_the_state_bucket_after_410() {
    replaced_pod_resumes_from_the_broker_after_410(Kind::Nats).await;
}

/// A corrupt position record and state of another cluster that used the same `[cluster]
/// name` are errors naming them (non-zero exit), never a silent replay; a second process on
/// the same store takes it over and the first stops.
async fn refusals(kind: Kind) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "state-refuse").await;
    create_cms(&client, &ns.name, &names("c", 0..3)).await;
    let store = Store::new(kind, "kubecast-state");
    let config = cm_config(&ns.name, "");

    let mut a = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    a.wait_for("snapshot", WAIT, |e| e.len() == 3).await;
    store.wait_position().await;
    // A second writer: it takes the store over; the first stops at its next write.
    let mut b = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    b.wait_ready(200).await;
    create_cms(&client, &ns.name, &names("d", 0..1)).await;
    let status = a.wait_exit(Duration::from_secs(30)).await;
    assert!(!status.success(), "the first writer stops");
    assert!(a.log().contains("another kubecast process owns the state now"), "{}", a.log());
    b.wait_for("d00 from the new owner", WAIT, |e| !about(e, &format!("{}/d00", ns.name)).is_empty()).await;
    assert!(b.stop().success(), "{}", b.log());

    // The same [cluster] name on another cluster (the compacting apiserver), same namespace.
    let kubeconfig = common::compacting_kubeconfig();
    let other = common::client_for(&kubeconfig).await;
    common::create_namespace(&other, &ns.name, &[]).await.unwrap();
    let mut c = Kubecast::start_with_checkpoint(&config, &store.lines(), &[("KUBECONFIG", kubeconfig.as_str())]);
    let status = c.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = c.log();
    assert!(log.contains("belongs to another cluster") && log.contains("[cluster] name"), "{log}");
    assert!(c.events().is_empty(), "nothing published");
    Api::<k8s_openapi::api::core::v1::Namespace>::all(other).delete(&ns.name, &DeleteParams::default()).await.ok();

    // A corrupt position record.
    let key = store.records().await.into_keys().find(|k| k.ends_with(".p")).unwrap();
    store.put(&key, b"{not json").await;
    let mut d = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    let status = d.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = d.log();
    assert!(log.contains("corrupt") && log.contains(&key), "names the record {key}:\n{log}");
    assert!(d.events().is_empty(), "no silent replay");
}

#[tokio::test]
async fn kafka_corrupt_foreign_and_second_writers_are_refused() {
    refusals(Kind::Kafka).await;
}

#[tokio::test]
async fn nats_corrupt_foreign_and_second_writers_are_refused() {
    refusals(Kind::Nats).await;
}

/// Two processes, one Lease, state in the broker. Under a steady 50 changes/s on 20 objects
/// the leader is SIGKILLed: the standby continues from the stored state, and a consumer of
/// both outputs that drops duplicates by id sees every change, deletes included, per object
/// in apiserver order.
async fn failover_loses_nothing(kind: Kind) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "state-failover").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let store = Store::new(kind, "kubecast-state");
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let mut a = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    a.wait_log("holding the lease", 1).await;
    a.wait_ready(200).await;
    let mut b = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    b.wait_log("standby: another process holds the lease", 1).await;

    // What the apiserver did, in its order: (name, uid, rv, verb).
    let writer = {
        let (api, client, ns) = (api.clone(), client.clone(), ns.name.clone());
        tokio::spawn(async move {
            let mut done: Vec<(String, String, String, &'static str)> = Vec::new();
            let mut uids: HashMap<String, String> = HashMap::new();
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            for i in 0..400usize {
                tick.tick().await;
                let name = format!("o{:02}", i % 20);
                let round = i / 20;
                if round % 4 == 3 {
                    api.delete(&name, &DeleteParams::default()).await.unwrap();
                    let uid = uids[&name].clone();
                    done.push((name, uid, String::new(), "deleted"));
                } else if round % 4 == 0 {
                    let c = common::create_cm(&client, &ns, &name, json!({}), json!({"r": round.to_string()})).await;
                    uids.insert(name.clone(), c.metadata.uid.clone().unwrap());
                    done.push((name, c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap(), "added"));
                } else {
                    let c = api
                        .patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"r": round.to_string()}})))
                        .await
                        .unwrap();
                    done.push((name, c.metadata.uid.unwrap(), c.metadata.resource_version.unwrap(), "modified"));
                }
            }
            done
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    a.kill9();
    b.wait_log("holding the lease", 1).await;
    let done = writer.await.unwrap();
    let want_ids: Vec<String> = done
        .iter()
        .map(|(_, uid, rv, v)| if *v == "deleted" { format!("{uid}:deleted") } else { format!("{uid}:{rv}:{v}") })
        .collect();
    let last = want_ids.last().unwrap().clone();
    b.wait_for("the last change", WAIT, |e| e.iter().any(|e| e["id"] == last.as_str())).await;
    common::settle(&mut b, &client, &ns.name, json!({})).await;

    // Both outputs, duplicates dropped by id, in the order each process published.
    let mut seen = std::collections::HashSet::new();
    let mut got: Vec<Value> = Vec::new();
    for e in a.events().into_iter().chain(b.events()) {
        if seen.insert(e["id"].as_str().unwrap().to_string()) {
            got.push(e);
        }
    }
    for id in &want_ids {
        assert!(seen.contains(id), "change {id} lost across the failover");
    }
    // Per object (uid: a name deleted and created again is another object), in apiserver order.
    let uids: BTreeSet<&str> = done.iter().map(|(_, uid, ..)| uid.as_str()).collect();
    for uid in uids {
        let want: Vec<&str> =
            done.iter().zip(&want_ids).filter(|((_, u, ..), _)| u == uid).map(|(_, id)| id.as_str()).collect();
        let order: Vec<&str> = got
            .iter()
            .filter(|e| e["partitionkey"] == uid)
            .map(|e| e["id"].as_str().unwrap())
            .filter(|id| want.contains(id))
            .collect();
        assert_eq!(order, want, "object {uid}: its changes in order");
    }
    let dup = a.events().len() + b.events().len() - got.len();
    println!("failover ({kind:?}): {} changes, {dup} published twice (same ids)", want_ids.len());
    assert!(b.stop().success(), "{}", b.log());
}

#[tokio::test]
async fn kafka_a_killed_leaders_standby_continues_from_the_state_topic() {
    failover_loses_nothing(Kind::Kafka).await;
}

#[tokio::test]
async fn nats_a_killed_leaders_standby_continues_from_the_state_bucket() {
    failover_loses_nothing(Kind::Nats).await;
}

/// A leader paused past its lease: the standby takes over (and the store with it); when the
/// old one wakes up it never moves the state again (every position record is the new
/// leader's) and stops.
async fn paused_leader_never_moves_the_state(kind: Kind) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "state-pause").await;
    let store = Store::new(kind, "kubecast-state");
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let mut a = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    a.wait_log("holding the lease", 1).await;
    a.wait_ready(200).await;
    store.wait_position().await;
    let mut b = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    b.wait_log("standby: another process holds the lease", 1).await;

    a.signal("STOP");
    b.wait_log("holding the lease", 1).await;
    create_cms(&client, &ns.name, &names("z", 0..5)).await;
    b.wait_for("z from the new leader", WAIT, |e| e.len() >= 5).await;
    a.signal("CONT");
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "{}", a.log());
    // Whatever the old one tried after waking up, the stored state is the new leader's: until
    // the new leader's position (epoch 1) covers y.
    create_cms(&client, &ns.name, &names("y", 0..1)).await;
    b.wait_for("y from the new leader", WAIT, |e| e.len() >= 6).await;
    let y_rv: u64 = b.events().last().unwrap()["resourceversion"].as_str().unwrap().parse().unwrap();
    let deadline = Instant::now() + WAIT;
    let positions = loop {
        let positions = store.positions().await;
        let covered =
            positions.first().and_then(|p| p["resource_version"].as_str()).and_then(|rv| rv.parse::<u64>().ok());
        if positions.len() == 1 && positions[0]["epoch"] == 1 && covered.is_some_and(|rv| rv >= y_rv) {
            break positions;
        }
        assert!(Instant::now() < deadline, "the new leader's position never covered y: {positions:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let log = b.log();
    assert!(log.contains(positions[0]["writer"].as_str().unwrap()), "the new leader wrote it:\n{positions:?}");
    if kind == Kind::Kafka {
        // The whole history: no position of the old epoch after the first of the new one.
        let epochs: Vec<i64> = store
            .kafka_history()
            .iter()
            .filter(|(k, _)| k.ends_with(".p"))
            .filter_map(|(_, v)| v.as_ref())
            .map(|v| serde_json::from_slice::<Value>(v).unwrap()["epoch"].as_i64().unwrap())
            .collect();
        let first_new = epochs.iter().position(|e| *e == 1).expect("a position of epoch 1");
        assert!(epochs[first_new..].iter().all(|e| *e == 1), "an old-epoch position after the takeover: {epochs:?}");
    }
    assert!(b.stop().success(), "{}", b.log());
}

#[tokio::test]
async fn kafka_a_paused_leader_never_moves_the_state_again() {
    paused_leader_never_moves_the_state(Kind::Kafka).await;
}

#[tokio::test]
async fn nats_a_paused_leader_never_moves_the_state_again() {
    paused_leader_never_moves_the_state(Kind::Nats).await;
}

/// The leader's broker does not answer (paused) while it opens the store; meanwhile the leader
/// itself is paused past its Lease and a standby takes over, then the old leader wakes up: it
/// abandons the opening at once, while the broker is still paused (it never reaches the
/// store: no claim of the NATS position records, no Kafka `init_transactions` fencing the new
/// holder). When the broker is back, the new leader opens the store and goes on: it is never
/// fenced, it publishes every object, and every position record is its own, at the new epoch.
async fn lease_lost_while_opening_the_store(kind: Kind) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "state-open-lost").await;
    let mut uids: Vec<String> =
        create_cms(&client, &ns.name, &names("c", 0..3)).await.into_values().map(|(u, _)| u).collect();
    let store = Store::new(kind, "kubecast-state");
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let service = if kind == Kind::Kafka { "kafka" } else { "nats" };
    let paused = common::Paused::now(service, Duration::from_secs(90));
    let mut a = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    a.wait_log("holding the lease", 1).await;
    a.wait_log("opening the state store", 1).await;
    a.signal("STOP");
    let mut b = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    b.wait_log("holding the lease", 1).await;
    b.wait_log("opening the state store", 1).await;

    // The old leader wakes up while the broker is still paused: it notices the lost Lease
    // within a retry period and stops, without waiting for the broker.
    a.signal("CONT");
    let status = a.wait_exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "{}", a.log());
    let log = a.log();
    assert!(log.contains("lost the lease while opening the state store"), "{log}");
    assert!(!log.contains("stream positions loaded"), "it never read the state:\n{log}");
    drop(paused);

    b.wait_for("the objects from the new leader", WAIT, |e| e.len() >= 3).await;
    uids.extend(create_cms(&client, &ns.name, &names("d", 0..1)).await.into_values().map(|(u, _)| u));
    let d = format!("{}/d00", ns.name);
    b.wait_for("d00 from the new leader", WAIT, |e| !about(e, &d).is_empty()).await;
    let want: BTreeSet<String> = ["c00", "c01", "c02", "d00"].iter().map(|n| format!("{}/{n}", ns.name)).collect();
    let got: BTreeSet<String> = b.events().iter().map(|e| e["subject"].as_str().unwrap().to_string()).collect();
    assert!(got.is_superset(&want), "every object from the new leader: {got:?}");
    assert!(a.events().is_empty(), "the old leader published nothing");
    // The state covers every object (an index record each), under the new leader's position.
    let deadline = Instant::now() + WAIT;
    let position = loop {
        let records = store.records().await;
        let indexed = uids.iter().all(|u| records.keys().any(|k| k.ends_with(&format!(".o.{u}"))));
        let ps: Vec<&Vec<u8>> =
            records.iter().filter(|(k, _)| k.ends_with(".p")).filter_map(|(_, v)| v.as_ref()).collect();
        if indexed && ps.len() == 1 {
            break serde_json::from_slice::<Value>(ps[0]).unwrap();
        }
        assert!(Instant::now() < deadline, "the new leader's state never stored: {:?}", records.keys());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(position["epoch"], 1, "written under the new lease epoch: {position}");
    let writer = position["writer"].as_str().unwrap();
    assert!(b.log().contains(writer) && !a.log().contains(writer), "the new leader wrote it: {position}");
    assert!(b.exited().is_none(), "the new leader was never fenced:\n{}", b.log());
    assert!(!b.log().contains("another kubecast process owns the state now"), "{}", b.log());
    assert!(b.stop().success(), "{}", b.log());
}

#[tokio::test]
async fn kafka_a_lease_lost_while_opening_the_state_topic_leaves_it_to_the_new_leader() {
    lease_lost_while_opening_the_store(Kind::Kafka).await;
}

#[tokio::test]
async fn nats_a_lease_lost_while_opening_the_state_bucket_leaves_it_to_the_new_leader() {
    lease_lost_while_opening_the_store(Kind::Nats).await;
}

/// Another writer of the state topic (another shard, another deployment sharing it) keeps a
/// transaction open: a reader of committed records gets no further than its start, where
/// librdkafka reports the end of the partition. A position committed after it must still be
/// loaded (the load waits for that transaction to end), not the one before: else a new
/// process resumes from the older position and sends the changes after it again.
#[tokio::test]
async fn kafka_a_transaction_another_writer_keeps_open_does_not_hide_a_later_position() {
    use rdkafka::producer::Producer;
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "state-open-txn").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let store = Store::new(Kind::Kafka, "kubecast-state-open-txn");
    let config = cm_config(&ns.name, "");
    common::create_cm(&client, &ns.name, "a", json!({}), json!({"v": "0"})).await;
    let mut first = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    first.wait_for("a", WAIT, |e| e.len() == 1).await;
    assert!(first.stop().success(), "{}", first.log());

    // Another writer's transaction on the state topic, left open (the broker aborts it after
    // 30 s).
    let topic = store.name.clone();
    let foreign = tokio::task::spawn_blocking(move || {
        let p: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
            .set("transactional.id", common::unique("another-writer"))
            .set("transaction.timeout.ms", "30000")
            .create()
            .unwrap();
        p.init_transactions(Duration::from_secs(30)).unwrap();
        p.begin_transaction().unwrap();
        let record = FutureRecord::to(&topic).key("another-deployment.x").payload("{}");
        p.send_result(record).map_err(|(e, _)| e).unwrap();
        p.flush(Duration::from_secs(30)).unwrap();
        p
    })
    .await
    .unwrap();

    // A second run delivers a change; its stop commits a position after the open transaction.
    let mut second = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    second.wait_ready(200).await;
    api.patch("a", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "1"}}))).await.unwrap();
    second.wait_for("a modified", WAIT, |e| e.iter().any(|e| verb(e) == "modified")).await;
    assert!(second.stop().success(), "{}", second.log());

    // A third run, while the transaction is still open, resumes after the change.
    let mut third = Kubecast::start_with_checkpoint(&config, &store.lines(), &[]);
    third.wait_ready(200).await;
    let barrier = common::settle(&mut third, &client, &ns.name, json!({})).await;
    let again = common::without(&third.events(), &barrier);
    assert!(again.is_empty(), "sent again:\n{}\n{}", common::pretty(&again), third.log());
    assert!(third.stop().success(), "{}", third.log());
    drop(foreign);
}
