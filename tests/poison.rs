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

/// Sets the largest message `stream` takes (-1: no limit).
async fn set_max_message_size(js: &jetstream::Context, stream: &str, size: i32) {
    let mut cfg = js.get_stream(stream).await.unwrap().info().await.unwrap().config.clone();
    cfg.max_message_size = size;
    js.update_stream(&cfg).await.unwrap();
}

/// A stream of the test's own with `subjects` that takes no message larger than 64 bytes: every
/// event on them goes to the dead letter.
async fn small_stream(js: &jetstream::Context, name: &str, subjects: Vec<String>) {
    js.create_stream(stream::Config { name: name.into(), subjects, max_message_size: 64, ..Default::default() })
        .await
        .unwrap();
}

/// A dead-letter destination that cannot take dead letters (no stream covers the subject) is a
/// set-up mistake, not a reason to stop: named on `/readyz` from the start, and a dead letter
/// that comes meanwhile waits for it (held, named as the dead letter), the stream's position
/// before it, none lost. Once a stream covers the subject, the dead letter is written and the
/// stream goes on. Later, `kubecast dead-letter replay` sends it to the subject it was meant
/// for, once that takes it, under its original id; a second replay sends nothing.
#[tokio::test]
async fn a_dead_letter_destination_that_refuses_holds_the_dead_letter_and_replay_sends_it_back() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "poison-d").await;
    let js = jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("p").replace('-', "_");
    let events = prefix.to_uppercase();
    small_stream(&js, &events, vec![format!("{prefix}.ev.>")]).await;
    let sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{prefix}.ev.{{resource}}\"\n",
        common::env_var("NATS_URL")
    );
    // The events' subjects are covered, the dead letter's is not (yet).
    let dead = format!("{prefix}.dead");
    let extra =
        format!("flush_interval_ms = 100\n[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, &extra, &[]);
    kc.wait_ready_reason("destination: NATS dead-letter subject").await;
    let (status, body) = kc.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&dead) && body.contains("no JetStream stream covers") && body.contains("fix:"), "{body}");

    let cm = create_cm(&client, &ns.name, "a", json!({}), json!({"v": "1"})).await;
    let rv: u64 = cm.metadata.resource_version.clone().unwrap().parse().unwrap();
    let id = format!("{}:{rv}:added", cm.metadata.uid.unwrap());
    kc.wait_ready_reason("(the dead letter) refuses every event").await;
    let (_, body) = kc.admin_get("/readyz").await;
    assert!(body.contains(&dead), "{body}");
    assert!(kc.log().contains("the dead-letter destination refuses every event"), "{}", kc.log());
    // The position may be the (empty) list's end, never at or past the held event.
    let stored = |kc: &Kubecast| {
        kc.checkpoints().first().and_then(|c| c["resource_version"].as_str().map(|v| v.parse::<u64>().unwrap()))
    };
    assert!(
        stored(&kc).is_none_or(|at| at < rv),
        "the position moved past the held dead letter: {:?}",
        kc.checkpoints()
    );

    let dead_stream = format!("{events}_DEAD");
    js.create_stream(stream::Config { name: dead_stream.clone(), subjects: vec![dead.clone()], ..Default::default() })
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while stored(&kc).is_none_or(|at| at < rv) {
        assert!(Instant::now() < deadline, "the position never moved past the dead letter\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    kc.wait_ready(200).await;
    let mut s = js.get_stream(&dead_stream).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 1, "one dead letter");

    let config = kc.dir.path().join("kubecast.toml");
    let out = common::dead_letter_ok(&config, &["list"]);
    assert!(out.contains(&id) && out.contains(&format!("{prefix}.ev.configmaps")), "{out}");
    set_max_message_size(&js, &events, -1).await;
    let out = common::dead_letter_ok(&config, &["replay"]);
    assert!(out.contains(&format!("replayed: {id} to {prefix}.ev.configmaps")), "{out}");
    let m = js
        .get_stream(&events)
        .await
        .unwrap()
        .get_last_raw_message_by_subject(&format!("{prefix}.ev.configmaps"))
        .await
        .expect("the replayed event");
    // Structured mode, as the NATS sink sends by default; its own id.
    let event: Value = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(event["id"], id.as_str());
    assert_eq!(event["data"]["data"]["v"], "1");
    assert_eq!(
        m.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_string()),
        Some(format!("{id}@{prefix}.ev.configmaps")),
        "the sink's message id: a replay sent twice within the duplicate window is stored once"
    );
    assert_eq!(common::dead_letter_ok(&config, &["list"]), "", "nothing left to replay");
    assert!(!common::dead_letter_ok(&config, &["replay"]).contains("replayed:"));
    assert!(kc.stop().success(), "{}", kc.log());
    let _ = js.delete_stream(&events).await;
    let _ = js.delete_stream(&dead_stream).await;
}

/// The file dead letter (kubecast's default) is replayed the same way, and `<file>.replayed`
/// remembers how far it got: a second replay sends nothing, an event dead-lettered after it is
/// the only one the third sends.
#[tokio::test]
async fn the_file_dead_letter_is_replayed_once_in_order() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "poison-file").await;
    let js = jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("p").replace('-', "_");
    let events = prefix.to_uppercase();
    small_stream(&js, &events, vec![format!("{prefix}.>")]).await;
    let sink = format!(
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{prefix}.{{verb}}\"\n",
        common::env_var("NATS_URL")
    );
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, "", &[]);
    let a = create_cm(&client, &ns.name, "a", json!({}), json!({"v": "1"})).await;
    let b = create_cm(&client, &ns.name, "b", json!({}), json!({"v": "1"})).await;
    let dl = wait_dead_letters(&mut kc, 2).await;
    let id = |cm: &k8s_openapi::api::core::v1::ConfigMap| {
        format!("{}:{}:added", cm.metadata.uid.clone().unwrap(), cm.metadata.resource_version.clone().unwrap())
    };
    assert_eq!(dl[0]["event"]["id"], id(&a));
    let config = kc.dir.path().join("kubecast.toml");
    set_max_message_size(&js, &events, -1).await;
    let out = common::dead_letter_ok(&config, &["replay"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines,
        [format!("replayed: {} to {prefix}.added", id(&a)), format!("replayed: {} to {prefix}.added", id(&b))],
        "in the order they were dead-lettered"
    );
    assert_eq!(common::dead_letter_ok(&config, &["replay"]), "", "replayed once");
    set_max_message_size(&js, &events, 64).await;
    let c = create_cm(&client, &ns.name, "c", json!({}), json!({"v": "1"})).await;
    wait_dead_letters(&mut kc, 3).await;
    set_max_message_size(&js, &events, -1).await;
    assert_eq!(common::dead_letter_ok(&config, &["replay"]).trim(), format!("replayed: {} to {prefix}.added", id(&c)));
    let mut s = js.get_stream(&events).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.messages, 3, "each event once");
    assert!(kc.stop().success(), "{}", kc.log());
    let _ = js.delete_stream(&events).await;
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
