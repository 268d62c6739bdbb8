//! A transaction the broker aborted because it stayed open past `transaction.timeout.ms` (the
//! broker was paused or unreachable that long), against the real Kafka broker of `tests/env`,
//! through the library with a short timeout.
//!
//! The broker's abort bumps the producer's epoch, and librdkafka reports the next commit as the
//! same fatal "fenced" a successor's `init_transactions` gives. While this process still owns
//! the state, the commit takes the `transactional.id` over again with a new producer and sends
//! the kept events again, so the next commit carries them: a `read_committed` consumer sees each
//! once. Once the Lease is lost, the fence stays fatal.
//!
//! Nothing here pauses the shared broker.

use kubecast_kit as common;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kubecast::sink::kafka::transaction::{OwnerCheck, Record, Transaction, TxnError};
use rdkafka::ClientConfig;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::Message;

/// The transactions' `transaction.timeout.ms` here (the broker looks for timed-out ones every
/// 10 s, `transaction.abort.timed.out.transaction.cleanup.interval.ms`).
const TXN_TIMEOUT: Duration = Duration::from_secs(5);
const WAIT: Duration = Duration::from_secs(90);

fn client() -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", common::env_var("KAFKA_BROKERS"));
    c
}

async fn init(id: &str, owner: OwnerCheck) -> Arc<Transaction> {
    let id = id.to_string();
    let txn = tokio::task::spawn_blocking(move || {
        Transaction::init_with_timeout(&client(), &id, true, Arc::default(), TXN_TIMEOUT)
    })
    .await
    .unwrap()
    .expect("init_transactions");
    txn.may_take_over(owner);
    Arc::new(txn)
}

fn record(topic: &str, key: &str) -> Record {
    Record {
        topic: topic.into(),
        key: key.into(),
        payload: Some(format!("value of {key}").into_bytes()),
        headers: None,
    }
}

/// Sends each key as one event, holding a gate pass as the delivery queue does.
async fn send(txn: &Transaction, topic: &str, keys: &[&str]) {
    for k in keys {
        let _pass = txn.gate().pass().await;
        txn.send(vec![record(topic, k)]).await.expect("sent into the open transaction");
    }
}

async fn commit(txn: &Arc<Transaction>) -> Result<(), TxnError> {
    let sealed = tokio::time::timeout(Duration::from_secs(10), txn.gate().seal()).await.expect("the gate sealed");
    let t = txn.clone();
    let done = tokio::task::spawn_blocking(move || t.commit(&[])).await.unwrap();
    drop(sealed);
    done
}

/// The transaction state the broker's coordinator reports for `id` (Kafka's own tool).
fn coordinator_state(id: &str) -> String {
    let tool = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/env/kafka-run-class");
    let out = Command::new(tool)
        .args(["org.apache.kafka.tools.TransactionsCommand", "--bootstrap-server"])
        .arg(common::env_var("KAFKA_BROKERS"))
        .args(["describe", "--transactional-id", id])
        .output()
        .expect("Kafka's TransactionsCommand runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let (Some(head), Some(row)) = (lines.next(), lines.next()) else {
        return format!("no answer: {}", String::from_utf8_lossy(&out.stderr).trim());
    };
    let column = head.split_whitespace().position(|c| c == "TransactionState");
    column.and_then(|c| row.split_whitespace().nth(c)).unwrap_or("unparsed").to_string()
}

/// Waits until the broker aborted the open transaction of `id` for its age.
async fn wait_for_the_brokers_abort(id: &str) {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < WAIT {
        let id = id.to_string();
        last = tokio::task::spawn_blocking(move || coordinator_state(&id)).await.unwrap();
        if last == "CompleteAbort" {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("the broker did not abort the transaction of {id} within {WAIT:?} (last state: {last})");
}

/// Every committed record of `topic`, key -> how many times.
async fn committed(topic: &str, expected: usize) -> BTreeMap<String, usize> {
    let consumer: StreamConsumer = client()
        .set("group.id", common::unique("txn-timeout-verify"))
        .set("isolation.level", "read_committed")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let stop = AtomicBool::new(false);
    assert!(common::traffic::assign_from_beginning(&consumer, topic, &stop).await);
    let mut seen = BTreeMap::new();
    let started = Instant::now();
    // All expected records, then a quiet second for any extra copy.
    let mut quiet_since = None::<Instant>;
    while started.elapsed() < WAIT {
        match tokio::time::timeout(Duration::from_millis(250), consumer.recv()).await {
            Ok(Ok(m)) => {
                let key = String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned();
                *seen.entry(key).or_insert(0) += 1;
            }
            Ok(Err(e)) => panic!("consumer: {e}"),
            Err(_) => {}
        }
        if seen.values().sum::<usize>() >= expected {
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(1) {
                break;
            }
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_the_broker_aborted_for_its_age_is_taken_over_again_and_committed_once() {
    let id = common::unique("txn-timeout");
    let topic = common::unique("txn-timeout");
    let txn = init(&id, Arc::new(|| true)).await;
    send(&txn, &topic, &["a", "b", "c"]).await;
    wait_for_the_brokers_abort(&id).await;

    let e = commit(&txn).await.expect_err("the broker aborted the transaction: not committed");
    assert!(matches!(e, TxnError::Retriable(_)), "taken over again, not fatal: {e}");
    assert!(e.to_string().contains("taken over again"), "{e}");
    // The kept events are in the new transaction; one more event after them.
    send(&txn, &topic, &["d"]).await;
    commit(&txn).await.expect("the new producer commits");
    assert_eq!(txn.committed_events(), 4);

    let seen = committed(&topic, 4).await;
    let expected: BTreeMap<String, usize> = ["a", "b", "c", "d"].iter().map(|k| (k.to_string(), 1)).collect();
    assert_eq!(seen, expected, "each event committed once, none lost");
}

#[tokio::test(flavor = "multi_thread")]
async fn once_the_lease_is_lost_a_transaction_the_broker_aborted_stays_fatal() {
    let id = common::unique("txn-timeout-lost");
    let topic = common::unique("txn-timeout-lost");
    let held = Arc::new(AtomicBool::new(true));
    let owner = {
        let held = held.clone();
        Arc::new(move || held.load(Ordering::SeqCst))
    };
    let txn = init(&id, owner).await;
    send(&txn, &topic, &["a"]).await;
    commit(&txn).await.expect("committed while the transaction is young");
    send(&txn, &topic, &["b"]).await;
    held.store(false, Ordering::SeqCst);
    wait_for_the_brokers_abort(&id).await;

    let e = commit(&txn).await.expect_err("fenced");
    assert!(matches!(e, TxnError::Fenced(_)), "not taken over without the Lease: {e}");
    assert!(e.to_string().contains("no longer holds the Lease"), "{e}");
    let seen = committed(&topic, 1).await;
    assert_eq!(seen, BTreeMap::from([("a".to_string(), 1)]), "only the committed event");
}

/// A transaction begun long ago but empty (nothing sent since the last commit) is unknown to
/// the broker, which cannot have aborted it for its age: a fence then comes from another
/// producer of the `transactional.id` (a successor, `kubecast state reset --force`) and stays
/// fatal, although this process still holds the Lease and the local transaction is old.
#[tokio::test(flavor = "multi_thread")]
async fn a_fence_of_a_transaction_idle_since_its_begin_is_not_taken_for_the_brokers_timeout() {
    let id = common::unique("txn-idle-fenced");
    let topic = common::unique("txn-idle-fenced");
    let txn = init(&id, Arc::new(|| true)).await;
    send(&txn, &topic, &["a"]).await;
    commit(&txn).await.expect("committed");
    // Idle for longer than the transaction timeout: the next transaction is begun, empty.
    tokio::time::sleep(TXN_TIMEOUT + Duration::from_secs(1)).await;
    let successor = init(&id, Arc::new(|| true)).await;
    send(&txn, &topic, &["b"]).await;
    let e = commit(&txn).await.expect_err("fenced by the successor");
    assert!(matches!(e, TxnError::Fenced(_)), "a successor's fence is not taken over: {e}");
    send(&successor, &topic, &["c"]).await;
    commit(&successor).await.expect("the successor commits");
    let seen = committed(&topic, 2).await;
    assert_eq!(seen, BTreeMap::from([("a".to_string(), 1), ("c".to_string(), 1)]));
}
