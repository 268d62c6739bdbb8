//! An event its destination will never take must not freeze its stream: the event goes to the
//! dead letter with the reason, and the stream's checkpoint moves on. (A destination that
//! refuses every event, a set-up mistake, holds the stream instead: `tests/refusals.rs`.)

use kubecast_kit as common;

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use common::{Kubecast, TestNamespace, client, create_cm};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

fn dead_letters(kc: &Kubecast) -> Vec<Value> {
    std::fs::read_to_string(kc.dir.path().join("state/dead-letter.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn wait_dead_letters(kc: &mut Kubecast, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + WAIT;
    loop {
        let d = dead_letters(kc);
        if d.len() >= n {
            return d;
        }
        assert!(Instant::now() < deadline, "{} of {n} dead letters\n{}", d.len(), kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The checkpoint moved past the dead-lettered events: the list's end was acknowledged.
async fn wait_checkpoint_moved(kc: &Kubecast) {
    let deadline = Instant::now() + WAIT;
    while !kc.checkpoints().first().is_some_and(|c| c["resource_version"].is_string()) {
        assert!(Instant::now() < deadline, "the checkpoint never moved\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A JetStream stream of the test's own: named after a unique prefix (upper case), with the
/// subjects `subjects(prefix)` and a 10-minute duplicate window.
async fn test_stream(subjects: impl FnOnce(&str) -> Vec<String>) -> (jetstream::Context, String) {
    let js = jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("p").replace('-', "_");
    js.create_stream(stream::Config {
        name: prefix.to_uppercase(),
        subjects: subjects(&prefix),
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    (js, prefix)
}

#[tokio::test]
async fn a_dead_letter_destination_that_cannot_take_dead_letters_is_refused_at_start() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "poison-d").await;
    let (js, prefix) = test_stream(|p| vec![format!("{p}.>")]).await;
    let sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{prefix}.{{resource}}\"\n",
        common::env_var("NATS_URL")
    );
    // The events' subjects are covered, the dead letter's is not.
    let subject = format!("{}.dead", common::unique("uncovered").replace('-', "_"));
    let checkpoint = format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{subject}\"\n");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, &checkpoint, &[]);
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = kc.log();
    assert!(log.contains("[delivery.dead_letter] destination") && log.contains(&subject), "{log}");
    assert!(log.contains("fix:"), "{log}");
    let _ = js.delete_stream(prefix.to_uppercase()).await;
}

/// A dead letter on NATS has a message id of its own: the event's id may already be in the
/// stream's duplicate window (an event stored whose PubAck was lost, then given up on), and a
/// dead letter under that id would be dropped as a duplicate yet counted as dead-lettered.
#[tokio::test]
async fn a_nats_dead_letter_is_not_dropped_as_a_duplicate_of_its_event() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "poison-dup").await;
    // The dead-letter subject in one stream; the events in another that takes no message
    // larger than 64 bytes, so each event is one no retry delivers (the dead letter).
    let (js, prefix) = test_stream(|p| vec![format!("{p}.dead")]).await;
    let name = prefix.to_uppercase();
    let small = format!("{name}_EV");
    js.create_stream(stream::Config {
        name: small.clone(),
        subjects: vec![format!("{prefix}.ev.>")],
        max_message_size: 64,
        ..Default::default()
    })
    .await
    .unwrap();
    let label = common::unique("l");
    let cm = create_cm(&client, &ns.name, "a", json!({"poison": label}), json!({"v": "1"})).await;
    let id = format!("{}:{}:added", cm.metadata.uid.unwrap(), cm.metadata.resource_version.unwrap());
    // What a stored event whose PubAck was lost leaves in the window: its id on its subject.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("{id}@{prefix}.ev.{}.added", ns.name));
    js.publish_with_headers(format!("{prefix}.dead"), headers, "stored before".into()).await.unwrap().await.unwrap();

    let config = format!(
        "[cluster]\nname = \"e2e\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nlabel_selector = \"poison={label}\"\nsubject = \"{prefix}.ev.{{namespace}}.{{verb}}\"\n"
    );
    let sink = format!("[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\n", common::env_var("NATS_URL"));
    let dead = format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{prefix}.dead\"\n");
    let mut kc = Kubecast::start_with_sink(&config, &sink, &dead, &[]);
    kc.wait_log("writing it to the dead letter", 1).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let mut s = js.get_stream(&name).await.unwrap();
        let n = s.info().await.unwrap().state.messages;
        if n == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "{n} messages: the dead letter was dropped as a duplicate\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(kc.stop().success(), "{}", kc.log());
    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(&small).await;
}

/// The sink cannot take events (no broker): the stream's checkpoint stops moving with events
/// pending. kubecast reports the stall (`/readyz`, `kubecast_stream_stalled`, a log line naming
/// the event and the reason); with `max_event_age_seconds`, the events go to the dead letter
/// once they are older, and the stream moves again.
#[tokio::test]
async fn a_stalled_stream_is_reported_and_max_event_age_dead_letters_what_waited_too_long() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "poison-age").await;
    let cm = create_cm(&client, &ns.name, "a", json!({}), json!({"v": "1"})).await;
    let id = format!("{}:{}:added", cm.metadata.uid.unwrap(), cm.metadata.resource_version.unwrap());
    // Nothing listens on port 9.
    let sink = "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"127.0.0.1:9\"\n[sink.kafka.properties]\n\"message.timeout.ms\" = \"1000\"\n";
    let stalled = "[delivery]\nstall_after_seconds = 2\nbackoff_max_ms = 500\nshutdown_timeout_seconds = 2\n";
    let mut kc = Kubecast::start_with_sink(
        &common::cm_config(&ns.name, ""),
        sink,
        &format!("flush_interval_ms = 200\n{stalled}"),
        &[],
    );
    kc.wait_ready_reason("checkpoint stalled").await;
    let (_, body) = kc.admin_get("/readyz").await;
    assert!(body.contains(&format!("last failed event {id}")), "{body}");
    let (_, metrics) = kc.admin_get("/metrics").await;
    assert!(metrics.lines().any(|l| l.starts_with("kubecast_stream_stalled{") && l.ends_with(" 1")), "{metrics}");
    kc.wait_log("stream stalled: its checkpoint has not moved", 1).await;
    assert!(kc.log().contains(&format!("event_id={id}")), "{}", kc.log());
    assert!(dead_letters(&kc).is_empty(), "no max_event_age_seconds: retried as long as it takes");
    assert!(kc.stop().success(), "{}", kc.log());

    // The same, with a deadline per event.
    let aged = format!("flush_interval_ms = 200\n{stalled}max_event_age_seconds = 3\n");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), sink, &aged, &[]);
    let dead = wait_dead_letters(&mut kc, 1).await;
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.starts_with("not delivered within 3 s (max_event_age_seconds)"), "{reason}");
    assert_eq!(dead[0]["event"]["id"], id.as_str());
    wait_checkpoint_moved(&kc).await;
    assert!(kc.stop().success(), "{}", kc.log());
}
