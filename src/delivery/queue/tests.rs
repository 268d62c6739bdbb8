//! The queue with a stub sink: no server, no network, tokio's paused time (backoffs cost no
//! wall time).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::delivery::DeadLetterType;
use tokio::sync::mpsc;

use crate::delivery::queue::{DeliveryError, Job, Limiter, Queue};
use crate::delivery::testkit::{Harness, bookmark, config, id, job, settle};
use crate::model::gate::Gate;
use crate::model::{Budget, IndexEntry};
use crate::sink::SendError;
use crate::sink::stub::{Record, Reply, Step};

fn retriable() -> Result<(), SendError> {
    Err(SendError::Retriable("broker down".into()))
}

/// The log's records of event `id`.
fn of<'a>(log: &'a [Record], id: &str) -> Vec<&'a Record> {
    log.iter().filter(|r| r.id == id).collect()
}

/// Where in the log event `id`'s attempt `attempt` took `step`.
fn at(log: &[Record], id: &str, attempt: u32, step: &Step) -> usize {
    log.iter()
        .position(|r| r.id == id && r.attempt == attempt && r.step == *step)
        .unwrap_or_else(|| panic!("{id} attempt {attempt} {step:?} is not in the log: {log:#?}"))
}

fn entry(uid: &str, rv: u64) -> IndexEntry {
    IndexEntry { namespace: Some("n".into()), name: uid.into(), resource_version: rv.to_string() }
}

/// Several objects with several events each: one object's events are sent strictly one after
/// another (the next starts only after the previous was accepted), in the order they came;
/// different objects are in flight at once, up to `max_in_flight`.
#[tokio::test(start_paused = true)]
async fn one_object_at_a_time_different_objects_at_once() {
    let h = Harness::new(&config(100, 3), "QueueOrder");
    let (objects, rounds) = (5u64, 4u64);
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    let (tx, run) = h.start(64);
    for round in 0..rounds {
        for o in 0..objects {
            let (uid, seq) = (format!("obj-{o}"), round * objects + o);
            let rv = 100 + seq;
            // Different durations, so that sends of different objects finish out of order, and
            // obj-0 slow: its next event would overtake one in flight if the queue let it.
            let took = Duration::from_millis(if o == 0 { 50 } else { (o * 7 + round * 3) % 11 + 1 });
            h.stub.reply(&id(&uid, rv), Reply::After(took, Ok(())));
            expected.entry(uid.clone()).or_default().push(id(&uid, rv));
            tx.send(job(seq, &uid, rv)).await.unwrap();
        }
    }
    drop(tx);
    run.await.unwrap().expect("delivered");

    let log = h.stub.log();
    for (uid, ids) in &expected {
        let steps: Vec<(String, Step)> =
            log.iter().filter(|r| &r.key == uid).map(|r| (r.id.clone(), r.step.clone())).collect();
        let alternating: Vec<(String, Step)> =
            ids.iter().flat_map(|i| [(i.clone(), Step::Started), (i.clone(), Step::Finished(Ok(())))]).collect();
        assert_eq!(steps, alternating, "{uid}: each event starts after the one before it was accepted, in order");
    }
    assert_eq!(h.stub.max_in_flight(), 3, "different objects go out at once, up to max_in_flight");
    assert_eq!(h.stub.accepted().len(), 20);
    assert_eq!(h.checkpoint.acked_items(), 20);
    assert_eq!(h.acked_events(), 20, "every job acknowledged once");
    assert_eq!(h.committed().resource_version.as_deref(), Some("119"));
}

/// Acknowledgements arriving out of order (an early event held in flight, later ones of
/// other objects accepted): each job is acknowledged exactly once, and the checkpoint does not
/// pass the held event until it is accepted; the later acknowledgements are kept as
/// `acked_ahead` meanwhile.
#[tokio::test(start_paused = true)]
async fn out_of_order_acks_never_move_the_checkpoint_past_a_job_in_flight() {
    let h = Harness::new(&config(100, 10), "QueueAcks");
    let a10 = h.stub.hold(&id("a", 10));
    let b11 = h.stub.hold(&id("b", 11));
    let (tx, run) = h.start(16);
    for (seq, (uid, rv)) in [("a", 10), ("b", 11), ("c", 12), ("b", 13), ("a", 14), ("c", 15)].into_iter().enumerate() {
        tx.send(job(seq as u64, uid, rv)).await.unwrap();
    }
    h.stub.wait_until(|log| log.iter().filter(|r| r.step == Step::Finished(Ok(()))).count() == 2).await;
    settle().await;
    assert_eq!(h.stub.accepted(), [id("c", 12), id("c", 15)]);
    assert!(!h.stub.started().contains(&id("a", 14)), "a's second event waits behind its first");
    assert!(!h.stub.started().contains(&id("b", 13)));

    // b's first event accepted while a's (seq 0) is still in flight.
    b11.send(Ok(())).unwrap();
    h.stub.wait_until(|log| log.iter().any(|r| r.id == id("b", 13) && r.step == Step::Finished(Ok(())))).await;
    settle().await;
    assert_eq!(h.acked_events(), 4, "b 11, c 12, b 13, c 15");
    assert_eq!(h.checkpoint.acked_items(), 0, "seq 0 is not acknowledged");
    assert_eq!(h.committed(), Default::default(), "the checkpoint has not moved");
    assert!(h.persist());
    let stored = h.store.load(&h.key).unwrap().expect("written");
    assert_eq!(stored.resource_version, None);
    assert!(stored.objects.is_empty());
    let mut ahead = stored.acked_ahead.clone();
    ahead.sort();
    let pairs = [("b", "11"), ("b", "13"), ("c", "12"), ("c", "15")];
    assert_eq!(ahead, pairs.map(|(u, v)| (u.to_string(), v.to_string())));

    a10.send(Ok(())).unwrap();
    drop(tx);
    run.await.unwrap().expect("delivered");
    assert_eq!(h.acked_events(), 6, "every job acknowledged exactly once");
    assert_eq!(h.checkpoint.acked_items(), 6);
    let committed = h.committed();
    assert_eq!(committed.resource_version.as_deref(), Some("15"));
    assert_eq!(committed.objects.len(), 3);
    assert_eq!(committed.objects.to_index()["a"], entry("a", 14));
    assert_eq!(committed.objects.to_index()["b"], entry("b", 13));
    assert_eq!(committed.objects.to_index()["c"], entry("c", 15));
    assert!(h.persist());
    let stored = h.store.load(&h.key).unwrap().expect("written");
    assert!(stored.acked_ahead.is_empty(), "all in the prefix now");
    assert_eq!(stored.resource_version.as_deref(), Some("15"));
}

/// A retriable failure is retried with backoff; the object's later event waits behind it,
/// while other objects go on.
#[tokio::test(start_paused = true)]
async fn retries_back_off_and_keep_the_objects_order() {
    let h = Harness::new(&config(100, 10), "QueueRetries");
    let (a1, a2, b1) = (id("a", 1), id("a", 2), id("b", 3));
    h.stub.answer(&a1, retriable());
    h.stub.answer(&a1, retriable());
    let (tx, run) = h.start(16);
    for (seq, (uid, rv)) in [("a", 1), ("b", 3), ("a", 2)].into_iter().enumerate() {
        tx.send(job(seq as u64, uid, rv)).await.unwrap();
    }
    drop(tx);
    run.await.unwrap().expect("delivered");

    let log = h.stub.log();
    let a1s = of(&log, &a1);
    assert_eq!(a1s.len(), 6, "three attempts: {a1s:#?}");
    let ok = Step::Finished(Ok(()));
    assert!(at(&log, &b1, 1, &ok) < at(&log, &a1, 2, &Step::Started), "b does not wait for a's retries");
    assert!(at(&log, &a1, 3, &ok) < at(&log, &a2, 1, &Step::Started), "a's second event waits for its first");
    assert_eq!(of(&log, &a2).len(), 2);
    // Jittered exponential backoff from 100 ms: the first wait in [100, 200) ms, the second in
    // [200, 400) ms.
    let waited = |n: usize| a1s[2 * n].at - a1s[2 * n - 1].at;
    assert!(waited(1) >= Duration::from_millis(100) && waited(1) <= Duration::from_millis(200), "{:?}", waited(1));
    assert!(waited(2) >= Duration::from_millis(200) && waited(2) <= Duration::from_millis(400), "{:?}", waited(2));
    assert_eq!(h.metrics.retries.get(), 2);
    assert_eq!(h.stub.accepted(), [b1.clone(), a1, a2]);
    assert_eq!(h.committed().resource_version.as_deref(), Some("2"));
    assert!(h.dead_letters().is_empty());
}

/// `max_attempts` retriable failures: the event goes to the dead letter, is acknowledged, and
/// its object's next event follows.
#[tokio::test(start_paused = true)]
async fn attempts_exhausted_go_to_the_dead_letter() {
    let cfg = crate::delivery::DeliveryConfig { max_attempts: 3, ..config(100, 10) };
    let h = Harness::new(&cfg, "QueueExhausted");
    let (a1, a2) = (id("a", 1), id("a", 2));
    for _ in 0..5 {
        h.stub.answer(&a1, retriable());
    }
    let (tx, run) = h.start(16);
    tx.send(job(0, "a", 1)).await.unwrap();
    tx.send(job(1, "a", 2)).await.unwrap();
    drop(tx);
    run.await.unwrap().expect("delivered");

    let log = h.stub.log();
    assert_eq!(of(&log, &a1).len(), 6, "exactly max_attempts = 3 attempts");
    assert_eq!(h.stub.accepted(), [a2]);
    let dead = h.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["event"]["id"], a1.as_str());
    assert_eq!(dead[0]["reason"], "gave up after 3 attempts: broker down");
    assert_eq!(h.metrics.dead_lettered[crate::model::Verb::Modified.index()].get(), 1);
    assert_eq!(h.acked_events(), 2, "the dead-lettered event is acknowledged too");
    assert_eq!(h.committed().resource_version.as_deref(), Some("2"));
}

/// A destination that refuses every event (a set-up mistake: a missing topic): the event is
/// held in order, whatever `max_attempts` and `max_event_age_seconds` say, reported while it
/// is, never dead-lettered; the checkpoint does not pass it; once the operator fixes it, it
/// and the object's next event are delivered, in order.
#[tokio::test(start_paused = true)]
async fn a_refused_destination_holds_the_event_without_a_dead_letter_until_fixed() {
    let cfg = crate::delivery::DeliveryConfig { max_attempts: 2, max_event_age_seconds: 1, ..config(100, 10) };
    let h = Harness::new(&cfg, "QueueRefused");
    let (a1, a2) = (id("a", 1), id("a", 2));
    let refused = || {
        Err(SendError::Refused {
            refusal: crate::model::Refusal::MissingTopic,
            reason: "Kafka topic t: Broker: Unknown topic or partition".into(),
        })
    };
    for _ in 0..6 {
        h.stub.answer(&a1, refused());
    }
    let (tx, run) = h.start(16);
    tx.send(job(0, "a", 1)).await.unwrap();
    tx.send(job(1, "a", 2)).await.unwrap();
    drop(tx);
    settle().await;
    assert!(h.refusals.any(), "reported while held");
    let said = h.refusals.describe();
    assert!(said[0].starts_with("sink: stub refuses every event: the topic does not exist"), "{said:?}");
    assert!(said[0].contains("fix: create the topic"), "{said:?}");
    assert_eq!(h.committed().resource_version, None, "the checkpoint does not pass the held event");
    assert!(h.stub.accepted().is_empty(), "the object's next event waits behind it");
    run.await.unwrap().expect("delivered");

    assert_eq!(of(&h.stub.log(), &a1).len(), 14, "7 attempts: past max_attempts, never given up");
    assert_eq!(h.stub.accepted(), [a1, a2]);
    assert!(h.dead_letters().is_empty(), "a set-up mistake is not dead-lettered");
    assert!(!h.refusals.any(), "no longer reported once delivered");
    assert_eq!(h.acked_events(), 2);
    assert_eq!(h.committed().resource_version.as_deref(), Some("2"));
}

/// A permanent failure goes to the dead letter at once (no retry); the object's next event
/// is sent after it was written.
#[tokio::test(start_paused = true)]
async fn a_permanent_failure_is_dead_lettered_and_the_object_goes_on() {
    let h = Harness::new(&config(100, 10), "QueuePermanent");
    let (a1, a2, b1) = (id("a", 1), id("a", 2), id("b", 3));
    h.stub.answer(&a1, Err(SendError::Permanent("message too large".into())));
    let (tx, run) = h.start(16);
    for (seq, (uid, rv)) in [("a", 1), ("a", 2), ("b", 3)].into_iter().enumerate() {
        tx.send(job(seq as u64, uid, rv)).await.unwrap();
    }
    drop(tx);
    run.await.unwrap().expect("delivered");

    let log = h.stub.log();
    assert_eq!(of(&log, &a1).len(), 2, "one attempt");
    let failed = Step::Finished(Err(SendError::Permanent("message too large".into())));
    assert!(at(&log, &a1, 1, &failed) < at(&log, &a2, 1, &Step::Started));
    assert_eq!(h.metrics.retries.get(), 0);
    let dead = h.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["event"]["id"], a1.as_str());
    assert_eq!(dead[0]["reason"], "message too large");
    assert_eq!(dead[0]["destination"], "stub");
    let mut accepted = h.stub.accepted();
    accepted.sort();
    assert_eq!(accepted, [a2, b1]);
    assert_eq!(h.acked_events(), 3);
    assert_eq!(h.committed().resource_version.as_deref(), Some("3"));
    assert_eq!(h.committed().objects.to_index()["a"], entry("a", 2));
}

/// `[delivery.dead_letter] type = "stop"`: a permanent failure ends the queue with
/// `Undeliverable`; the checkpoint stays before the event.
#[tokio::test(start_paused = true)]
async fn a_permanent_failure_stops_the_queue_without_a_dead_letter() {
    let mut cfg = config(100, 10);
    cfg.dead_letter.kind = DeadLetterType::Stop;
    let h = Harness::new(&cfg, "QueueStop");
    h.stub.answer(&id("b", 2), Err(SendError::Permanent("not authorized".into())));
    let (tx, run) = h.start(16);
    tx.send(job(0, "a", 1)).await.unwrap();
    h.stub.wait_until(|log| log.len() == 2).await;
    tx.send(job(1, "b", 2)).await.unwrap();
    let Err(DeliveryError::Undeliverable(e)) = run.await.unwrap() else { panic!("the queue must stop") };
    assert_eq!(
        (e.id.as_str(), e.destination.as_str(), e.reason.as_str()),
        (id("b", 2).as_str(), "stub", "not authorized")
    );
    assert_eq!(h.checkpoint.acked_items(), 1);
    assert_eq!(h.committed().resource_version.as_deref(), Some("1"));
    assert!(!h.dead_letter.exists());
}

/// With `queue_capacity` N the queue holds at most N events; full, it takes no job from its
/// channel (whose senders then wait), and takes them again only once `refill_batch(N)` fit,
/// then that many at once.
#[tokio::test(start_paused = true)]
async fn a_full_queue_stops_taking_jobs_and_takes_them_again_in_batches() {
    // Capacity 32: refill batches of 4. Every event of an object of its own, and max_in_flight
    // above the capacity: what the queue holds is what is in flight at the stub.
    let h = Harness::new(&config(32, 64), "QueueCapacity");
    assert_eq!(super::refill_batch(32), 4);
    let total = 60u64;
    let mut held: Vec<_> = (0..36).map(|n| Some(h.stub.hold(&id(&format!("o{n}"), n + 1)))).collect();
    let (tx, run) = h.start(8);
    let sent = Arc::new(AtomicUsize::new(0));
    let producer = tokio::spawn({
        let sent = sent.clone();
        async move {
            for n in 0..total {
                tx.send(job(n, &format!("o{n}"), n + 1)).await.unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    h.stub.wait_until(|log| log.len() == 32).await;
    settle().await;
    assert_eq!(h.stub.in_flight(), 32, "the queue holds its capacity");
    assert_eq!(h.stub.started().len(), 32, "and takes no more");
    assert_eq!(sent.load(Ordering::SeqCst), 32 + 8, "the channel is full: its sender waits");

    let mut release = |n: usize| held[n].take().unwrap().send(Ok(())).unwrap();
    for n in 0..3 {
        release(n);
    }
    settle().await;
    assert_eq!(h.stub.in_flight(), 29);
    assert_eq!(h.stub.started().len(), 32, "three free places: less than a batch, nothing taken");
    assert_eq!(sent.load(Ordering::SeqCst), 40);

    release(3);
    settle().await;
    assert_eq!(h.stub.started().len(), 36, "a batch fits: four taken at once");
    assert_eq!(h.stub.in_flight(), 32);
    assert_eq!(sent.load(Ordering::SeqCst), 44);

    for n in 4..36 {
        release(n);
    }
    producer.await.unwrap();
    run.await.unwrap().expect("delivered");
    assert_eq!(h.stub.max_in_flight(), 32, "never more than the capacity");
    assert_eq!(h.acked_events(), total);
    assert_eq!(h.checkpoint.acked_items(), total);
}

/// Events waiting behind their object's event in flight count against the capacity too.
#[tokio::test(start_paused = true)]
async fn waiting_events_count_against_the_capacity() {
    let h = Harness::new(&config(8, 4), "QueueCapacityWaiting");
    let first = h.stub.hold(&id("a", 1));
    let (tx, run) = h.start(4);
    let sent = Arc::new(AtomicUsize::new(0));
    let producer = tokio::spawn({
        let sent = sent.clone();
        async move {
            for n in 0..20 {
                tx.send(job(n, "a", n + 1)).await.unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    h.stub.wait_until(|log| !log.is_empty()).await;
    settle().await;
    assert_eq!(h.stub.started(), [id("a", 1)], "one event of an object at a time");
    assert_eq!(sent.load(Ordering::SeqCst), 8 + 4, "8 held (1 in flight, 7 waiting), 4 in the channel");
    first.send(Ok(())).unwrap();
    producer.await.unwrap();
    run.await.unwrap().expect("delivered");
    let expected: Vec<String> = (0..20).map(|n| id("a", n + 1)).collect();
    assert_eq!(h.stub.accepted(), expected);
    assert_eq!(h.committed().resource_version.as_deref(), Some("20"));
}

/// Jobs without an event (a bookmark, a filtered change) are acknowledged at once, and the
/// checkpoint takes them in their place among the others.
#[tokio::test(start_paused = true)]
async fn jobs_without_an_event_are_acknowledged_at_once_in_order() {
    let h = Harness::new(&config(100, 10), "QueueNoEvent");
    let a10 = h.stub.hold(&id("a", 10));
    let (tx, run) = h.start(16);
    for j in [bookmark(0, 5), job(1, "a", 10), bookmark(2, 11), job(3, "b", 12), bookmark(4, 13)] {
        tx.send(j).await.unwrap();
    }
    h.stub.wait_until(|log| log.iter().any(|r| r.id == id("b", 12) && r.step == Step::Finished(Ok(())))).await;
    settle().await;
    assert_eq!(h.checkpoint.acked_items(), 1, "seq 0 acknowledged at once; seq 1 in flight");
    assert_eq!(h.committed().resource_version.as_deref(), Some("5"));
    assert!(h.committed().objects.is_empty());

    a10.send(Ok(())).unwrap();
    drop(tx);
    run.await.unwrap().expect("delivered");
    assert_eq!(h.checkpoint.acked_items(), 5);
    assert_eq!(h.acked_events(), 2, "bookmarks are not events");
    assert_eq!(h.committed().resource_version.as_deref(), Some("13"));
    assert_eq!(h.committed().objects.len(), 2);
}

/// A fatal send error ends the queue with `DeliveryError::Fatal`, its input still open; the
/// checkpoint stays before the event.
#[tokio::test(start_paused = true)]
async fn a_fatal_send_error_ends_the_queue() {
    let h = Harness::new(&config(100, 10), "QueueFatal");
    let (tx, run) = h.start(16);
    tx.send(job(0, "a", 1)).await.unwrap();
    h.stub.wait_until(|log| log.len() == 2).await;
    h.stub.answer(&id("b", 2), Err(SendError::Fatal("producer fenced".into())));
    let _c = h.stub.hold(&id("c", 3));
    tx.send(job(1, "b", 2)).await.unwrap();
    tx.send(job(2, "c", 3)).await.unwrap();
    let result = run.await.unwrap();
    assert!(matches!(&result, Err(DeliveryError::Fatal(r)) if r == "producer fenced"), "{result:?}");
    assert_eq!(h.checkpoint.acked_items(), 1);
    assert_eq!(h.committed().resource_version.as_deref(), Some("1"));
    assert_eq!(h.acked_events(), 1);
    assert!(h.dead_letters().is_empty());
    drop(tx);
}

/// One event held in flight while the stream's later events are all accepted: their
/// acknowledgements wait in the watermark behind it. Past `capacity` of those, the queue takes
/// no more jobs (backpressure), instead of letting the watermark grow without bound; once the
/// held event is accepted, everything goes on.
#[tokio::test(start_paused = true)]
async fn acknowledgements_held_behind_a_stuck_event_are_bounded() {
    let h = Harness::new(&config(8, 64), "WatermarkBound");
    let stuck = h.stub.hold(&id("stuck", 1));
    let (tx, run) = h.start(4);
    let sent = Arc::new(AtomicUsize::new(0));
    let producer = tokio::spawn({
        let sent = sent.clone();
        async move {
            tx.send(job(0, "stuck", 1)).await.unwrap();
            sent.fetch_add(1, Ordering::SeqCst);
            for n in 1..100u64 {
                tx.send(job(n, &format!("o{n}"), n + 1)).await.unwrap();
                sent.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    h.stub.wait_until(|log| log.iter().filter(|r| r.step == Step::Finished(Ok(()))).count() >= 8).await;
    settle().await;
    let accepted = h.stub.accepted().len();
    assert!((8..=16).contains(&accepted), "it stops soon after 8 held acknowledgements: {accepted} accepted");
    assert!(sent.load(Ordering::SeqCst) < 40, "and takes no more jobs: {} sent", sent.load(Ordering::SeqCst));
    assert_eq!(h.committed().resource_version, None, "nothing passes the stuck event");
    stuck.send(Ok(())).unwrap();
    producer.await.unwrap();
    run.await.unwrap().expect("delivered");
    assert_eq!(h.acked_events(), 100);
    assert_eq!(h.committed().resource_version.as_deref(), Some("100"));
}

/// Two shards' queues sharing the process's capacity of 32 (their sinks stuck, as in a broker
/// outage): the first holds all of it; the second, arriving then, takes one event (a queue
/// holding nothing always may) and more only as the first gives room back, while the first
/// takes no more than its new share (16). Together they never hold more than 32 + 1; once the
/// second is gone, the first has the whole capacity again.
#[tokio::test(start_paused = true)]
async fn the_queues_of_a_processs_shards_share_its_capacity() {
    let (capacity, in_flight) = (Budget::new(32), Budget::new(64));
    let a = Harness::sharing(&config(32, 64), "ShareA", &capacity, &in_flight);
    let mut held_a: Vec<_> = (0..60).map(|n| Some(a.stub.hold(&id(&format!("a{n}"), n + 1)))).collect();
    let (tx_a, run_a) = a.start(8);
    let feed = |tx: mpsc::Sender<Job>, prefix: &'static str| {
        tokio::spawn(async move {
            for n in 0..60u64 {
                tx.send(job(n, &format!("{prefix}{n}"), n + 1)).await.unwrap();
            }
        })
    };
    let feed_a = feed(tx_a, "a");
    a.stub.wait_until(|log| log.len() == 32).await;
    settle().await;
    assert_eq!((a.stub.in_flight(), capacity.used()), (32, 32), "alone, the first holds the whole capacity");

    let b = Harness::sharing(&config(32, 64), "ShareB", &capacity, &in_flight);
    let mut held_b: Vec<_> = (0..60).map(|n| Some(b.stub.hold(&id(&format!("b{n}"), n + 1)))).collect();
    let (tx_b, run_b) = b.start(8);
    let feed_b = feed(tx_b, "b");
    b.stub.wait_until(|log| !log.is_empty()).await;
    settle().await;
    assert_eq!(b.stub.started().len(), 1, "the whole capacity is held: the newcomer takes one");
    assert_eq!(capacity.used(), 33);

    // The first gives 20 back: it holds 12 and takes up to its share of 16; the second gets
    // the rest, up to its own share.
    for h in held_a.iter_mut().take(20) {
        h.take().unwrap().send(Ok(())).unwrap();
    }
    settle().await;
    // Each takes jobs in batches of 2 (an eighth of its share): up to its share, or one less.
    let (in_a, in_b) = (a.stub.in_flight(), b.stub.in_flight());
    assert!((15..=16).contains(&in_a), "the first, up to its new share: {in_a}");
    assert!((15..=16).contains(&in_b), "the second, woken by the room given back: {in_b}");
    assert_eq!(capacity.used(), in_a + in_b);
    assert!(a.stub.max_in_flight() <= 32 && a.stub.in_flight() + b.stub.in_flight() <= 33);

    // The second delivers everything and leaves: the first has the whole capacity again.
    for h in held_b.iter_mut() {
        h.take().unwrap().send(Ok(())).unwrap();
    }
    feed_b.await.unwrap();
    run_b.await.unwrap().expect("delivered");
    drop(b);
    settle().await;
    assert_eq!(a.stub.in_flight(), 32, "the first takes the whole capacity again");
    for h in held_a.iter_mut().filter_map(Option::take) {
        h.send(Ok(())).unwrap();
    }
    feed_a.await.unwrap();
    run_a.await.unwrap().expect("delivered");
    assert_eq!(a.acked_events(), 60);
    assert_eq!(capacity.used(), 0);
}

/// The harness's queue with exactly-once's gate and `limiter`; run as a task fed by `rx`.
fn gated(h: &Harness, limiter: Option<Limiter>) -> (Arc<Gate>, mpsc::Sender<Job>, Run) {
    let q = &h.queue;
    let gate = Arc::new(Gate::default());
    let queue = Queue {
        sink: q.sink.clone(),
        limiter,
        retry: q.retry,
        dead_letter: q.dead_letter.clone(),
        in_flight: Budget::new(q.in_flight.budget().total()).part(),
        capacity: Budget::new(q.capacity.budget().total()).part(),
        checkpoints: q.checkpoints.clone(),
        metrics: q.metrics.clone(),
        gate: Some(gate.clone()),
        refusals: q.refusals.clone(),
    };
    let (tx, rx) = mpsc::channel(16);
    (gate, tx, tokio::spawn(async move { queue.run(rx).await }))
}

type Run = tokio::task::JoinHandle<Result<(), DeliveryError>>;

/// Exactly-once: events waiting for the rate limit hold no gate pass, so a commit (a seal)
/// never waits for them; and delivery cut short while they wait leaves the gate whole.
#[tokio::test(start_paused = true)]
async fn a_commit_never_waits_for_the_rate_limit() {
    let h = Harness::new(&config(100, 100), "GateRate");
    // One event now, the next in an hour (of wall time: the limiter's clock is not tokio's).
    let limiter = Arc::new(governor::RateLimiter::direct(governor::Quota::per_hour(std::num::NonZeroU32::MIN)));
    let (gate, tx, run) = gated(&h, Some(limiter));
    for n in 0..5u64 {
        tx.send(job(n, &format!("o{n}"), n + 1)).await.unwrap();
    }
    h.stub.wait_until(|log| log.iter().any(|r| r.step == Step::Finished(Ok(())))).await;
    settle().await;
    assert_eq!(h.stub.started().len(), 1, "one event within the rate, four waiting for it");
    assert_eq!(gate.passes(), 0, "the four waiting hold no pass");
    let sealed = tokio::time::timeout(Duration::from_secs(3600), gate.seal()).await.expect("sealed at once");
    assert!(!sealed.broken());
    drop(sealed);
    run.abort();
    assert!(run.await.unwrap_err().is_cancelled());
    assert!(!gate.broken(), "no pass was out when delivery stopped");
    assert_eq!(h.committed().resource_version.as_deref(), Some("1"));
    drop(tx);
}

/// Exactly-once: a retriable failure gives the pass back (nothing of the event is in the
/// transaction), so a commit goes ahead during the backoff; the retry takes a pass again, only
/// after the commit, and the gate stays whole.
#[tokio::test(start_paused = true)]
async fn a_retriable_failure_lets_a_commit_go_ahead_while_backing_off() {
    let h = Harness::new(&config(100, 10), "GateRetry");
    let a1 = id("a", 1);
    let first = h.stub.hold(&a1);
    let second = h.stub.hold(&a1);
    let (gate, tx, run) = gated(&h, None);
    tx.send(job(0, "a", 1)).await.unwrap();
    h.stub.wait_until(|log| log.len() == 1).await;
    assert_eq!(gate.passes(), 1, "the send holds a pass");
    let seal = tokio::spawn({
        let gate = gate.clone();
        async move { gate.seal().await }
    });
    first.send(retriable()).unwrap();
    let sealed = tokio::time::timeout(Duration::from_secs(60), seal).await.expect("sealed during the backoff").unwrap();
    settle().await;
    assert_eq!(of(&h.stub.log(), &a1).len(), 2, "the retry waits for the commit: {:#?}", h.stub.log());
    drop(sealed);
    h.stub.wait_until(|log| log.len() == 3).await;
    second.send(Ok(())).unwrap();
    drop(tx);
    run.await.unwrap().expect("delivered");
    assert_eq!(h.stub.accepted(), [a1]);
    assert!(!gate.broken());
    assert_eq!(gate.passes(), 0);
}

/// Exactly-once: an event refused for good goes to the file dead letter, outside the
/// transaction: its pass is given back first, so a dead-letter file that cannot be written
/// (retried with backoff) holds up neither a commit nor the other objects' events.
#[tokio::test(start_paused = true)]
async fn a_file_dead_letter_being_retried_holds_no_gate_pass() {
    let h = Harness::new(&config(100, 10), "GateDeadLetter");
    // A directory where the file should be: every write fails until it is gone.
    std::fs::create_dir(&h.dead_letter).unwrap();
    let (a1, b2) = (id("a", 1), id("b", 2));
    h.stub.answer(&a1, Err(SendError::Permanent("message too large".into())));
    let (gate, tx, run) = gated(&h, None);
    tx.send(job(0, "a", 1)).await.unwrap();
    let failed = Step::Finished(Err(SendError::Permanent("message too large".into())));
    h.stub.wait_until(|log| log.iter().any(|r| r.step == failed)).await;
    settle().await;
    assert_eq!(gate.passes(), 0, "no pass while the dead letter is retried");
    let sealed = tokio::time::timeout(Duration::from_secs(60), gate.seal()).await.expect("a commit goes ahead");
    assert!(!sealed.broken());
    drop(sealed);
    tx.send(job(1, "b", 2)).await.unwrap();
    h.stub.wait_until(|log| log.iter().any(|r| r.id == b2 && r.step == Step::Finished(Ok(())))).await;
    std::fs::remove_dir(&h.dead_letter).unwrap();
    drop(tx);
    run.await.unwrap().expect("delivered");
    assert_eq!(h.dead_letters().len(), 1, "written once the file could be");
    assert_eq!(h.acked_events(), 2);
    assert!(!gate.broken());
}
