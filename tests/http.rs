//! The HTTP sink against a real CloudEvents receiver: the example of `examples/receivers/http`,
//! built on the official CloudEvents Python SDK (`RECEIVER_HTTP` of the env file, built by
//! `tests/env/tools consumers`). What is judged is the receiver's own log of the requests it
//! accepted (a line written before its 2xx), never a file of kubecast's.
//!
//! - both modes parse, and each event's attributes and data equal those the Kafka sink sends;
//! - a receiver that fails a share of requests at random (503 and 429 with `Retry-After`, 500,
//!   hangs past the timeout, reset connections), is down for 60 s, and kubecast killed with
//!   SIGKILL in between: nothing lost, per-object order, a duplicate only ever with the same id
//!   and content, and the stored position never ahead of what the receiver accepted;
//! - 400 and 413 go to a dead-letter receiver with Knative's error extensions;
//! - 401 holds the events (named on `/readyz`) until the token file holds a token the receiver
//!   accepts, then they arrive without a restart;
//! - `K_SINK` and `K_CE_OVERRIDES`, ApiServerSource's event form, and neither `url` nor
//!   `K_SINK` a clear error at start;
//! - an HTTPS receiver whose certificate no trusted CA signed is named like the Kafka TLS
//!   errors, and delivery works with the right CA.

use kubecast_kit as common;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::receiver::Receiver;
use common::traffic::{Delivery, Source, Traffic};
use common::{Kubecast, TestNamespace, client, create_cm};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use rdkafka::message::{Headers, Message};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

fn http_sink(url: &str, extra: &str) -> String {
    format!("[sink]\ntype = \"http\"\n[sink.http]\nurl = \"{url}\"\n{extra}\n")
}

fn config(ns: &str) -> String {
    common::cm_config(ns, "")
}

/// The name of the object an event in the receiver's log is about.
fn name_of(e: &Value) -> &str {
    e["data"]["metadata"]["name"].as_str().unwrap_or_default()
}

/// id -> (attributes but `time`, data) of events whose attributes are `attributes`.
fn comparable(attributes: &Value, data: &Value) -> (String, (BTreeMap<String, String>, Value)) {
    let mut a: BTreeMap<String, String> = attributes
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().map(str::to_owned).unwrap_or_else(|| v.to_string())))
        .collect();
    // When kubecast saw the change: each process saw it at its own instant.
    a.remove("time");
    (a["id"].clone(), (a, data.clone()))
}

/// Both modes parse with the SDK, and what arrives is what the Kafka sink sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_events_in_both_modes_equal_the_kafka_sinks() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-same").await;
    for i in 0..6 {
        create_cm(&client, &ns.name, &format!("cm-{i}"), json!({}), json!({"i": i.to_string()})).await;
    }
    let binary = Receiver::start(&[]);
    let structured = Receiver::start(&[]);
    let topic = common::unique("http-same");
    let kafka_sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\nmode = \"binary\"\n",
        common::env_var("KAFKA_BROKERS")
    );
    let mut kk = Kubecast::start_with_sink(&config(&ns.name), &kafka_sink, "", &[]);
    let mut kb = Kubecast::start_with_sink(&config(&ns.name), &http_sink(&binary.url(), "mode = \"binary\""), "", &[]);
    let mut ks =
        Kubecast::start_with_sink(&config(&ns.name), &http_sink(&structured.url(), "mode = \"structured\""), "", &[]);
    binary.wait_accepted(6, &mut kb).await;
    structured.wait_accepted(6, &mut ks).await;
    // Watch events too: a modify with a value that needs escaping in a header, and a delete.
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let patch = json!({"data": {"note": "grüße \"quoted\" 100%"}});
    api.patch("cm-1", &PatchParams::default(), &Patch::Merge(&patch)).await.unwrap();
    api.delete("cm-2", &DeleteParams::default()).await.unwrap();
    let from_binary = binary.wait_accepted(8, &mut kb).await;
    let from_structured = structured.wait_accepted(8, &mut ks).await;
    assert!(from_binary.iter().all(|e| e["mode"] == "binary"), "binary mode requests");
    assert!(from_structured.iter().all(|e| e["mode"] == "structured"), "structured mode requests");
    // The Kafka sink's events, read from the topic.
    let deadline = Instant::now() + WAIT;
    let from_kafka = loop {
        let t = topic.clone();
        let msgs = tokio::task::spawn_blocking(move || common::topic::read_if_any(&t, false)).await.unwrap();
        if msgs.len() >= 8 {
            break msgs;
        }
        assert!(Instant::now() < deadline, "{} of 8 events on the topic\n{}", msgs.len(), kk.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let kafka: HashMap<_, _> = from_kafka
        .iter()
        .map(|m| {
            let mut attributes = serde_json::Map::new();
            for h in m.headers().unwrap().iter() {
                let v = String::from_utf8_lossy(h.value.unwrap_or_default()).to_string();
                match h.key.strip_prefix("ce_") {
                    Some(name) => attributes.insert(name.to_string(), Value::String(v)),
                    None if h.key == "content-type" => attributes.insert("datacontenttype".into(), Value::String(v)),
                    None => None,
                };
            }
            let data: Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
            comparable(&Value::Object(attributes), &data)
        })
        .collect();
    for (mode, got) in [("binary", &from_binary), ("structured", &from_structured)] {
        let http: HashMap<_, _> = got.iter().map(|e| comparable(&e["attributes"], &e["data"])).collect();
        assert_eq!(http.len(), 8, "{mode}: 8 distinct events: {got:?}");
        for (id, (attributes, data)) in &http {
            let (k_attributes, k_data) =
                kafka.get(id).unwrap_or_else(|| panic!("{mode}: event {id} is not on the Kafka topic"));
            assert_eq!(attributes, k_attributes, "{mode}: the attributes of {id}");
            assert_eq!(data, k_data, "{mode}: the data of {id}");
        }
        let noted = got.iter().find(|e| name_of(e) == "cm-1" && e["data"]["data"]["note"].is_string()).unwrap();
        assert_eq!(noted["data"]["data"]["note"], "grüße \"quoted\" 100%", "{mode}: data as it is");
    }
    for k in [&mut kk, &mut kb, &mut ks] {
        k.kill9();
    }
}

/// A receiver that fails requests at random, a 60 s outage and a SIGKILL of kubecast in
/// between: nothing lost, in order per object, duplicates only as the same event again, and the
/// stored position never ahead of what the receiver accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_faults_an_outage_and_a_kill_lose_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-faults").await;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let mut receiver = Receiver::start(&["--faults", "0.3", "--hang-seconds", "3", "--seed", "7"]);
    let sink = http_sink(&receiver.url(), "timeout_ms = 1000\nretry_after_max_seconds = 2");
    let checkpoint =
        "flush_interval_ms = 200\n[delivery]\nbackoff_min_ms = 100\nbackoff_max_ms = 2000\nmax_in_flight = 16\n";
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &sink, checkpoint, &[]);
    kc.wait_ready(200).await;
    let traffic = Traffic::start(&api, Source::HttpLog { path: receiver.log.clone() }, 12, 15);
    assert!(traffic.flowing(60, WAIT).await, "events flow through the faults\n{}", kc.log());
    // SIGKILL: the stored position covers only accepted events.
    kc.kill9();
    assert_position_not_ahead(&kc, &receiver, &traffic);
    kc.restart(&[]);
    assert!(traffic.flowing(30, WAIT).await, "events flow after the restart\n{}", kc.log());
    // The receiver is down for 60 s; kubecast is killed and restarted half-way through.
    receiver.stop();
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(30)).await;
    kc.kill9();
    assert_position_not_ahead(&kc, &receiver, &traffic);
    kc.restart(&[]);
    tokio::time::sleep(Duration::from_secs(60).saturating_sub(down.elapsed())).await;
    receiver.restart();
    assert!(traffic.flowing(30, WAIT).await, "events flow once the receiver is back\n{}", kc.log());
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    // A duplicate is the same event again: the same id, the same data.
    let mut by_id: HashMap<String, Value> = HashMap::new();
    for e in receiver.accepted() {
        let id = e["attributes"]["id"].as_str().unwrap().to_string();
        if let Some(before) = by_id.get(&id) {
            assert_eq!(before["data"], e["data"], "event {id} sent twice with different data");
            assert_eq!(
                before["attributes"]["type"], e["attributes"]["type"],
                "event {id} sent twice as different types"
            );
        }
        by_id.insert(id, e);
    }
    let faults = ["503", "429", "500", "timed out", "cannot connect"];
    let log = kc.log();
    let met: Vec<_> = faults.iter().filter(|f| log.contains(*f)).collect();
    assert!(met.len() >= 3, "kubecast met the receiver's faults (saw {met:?})");
    println!(
        "http faults: {} changes written, {} events accepted, {} duplicates",
        verdict.written.count(),
        verdict.seen,
        verdict.duplicates
    );
}

/// Every change of the namespace at or before the stored position is in the receiver's log.
fn assert_position_not_ahead(kc: &Kubecast, receiver: &Receiver, traffic: &Traffic) {
    let accepted: std::collections::HashSet<(String, u64)> = receiver
        .accepted()
        .iter()
        .map(|e| {
            let m = &e["data"]["metadata"];
            (m["uid"].as_str().unwrap().to_string(), m["resourceVersion"].as_str().unwrap().parse().unwrap())
        })
        .collect();
    let position: u64 = kc
        .checkpoints()
        .iter()
        .filter_map(|c| c["resource_version"].as_str().and_then(|rv| rv.parse().ok()))
        .max()
        .unwrap_or(0);
    let written = traffic.written();
    let missing: Vec<_> = written
        .changes
        .iter()
        .flat_map(|(uid, rvs)| rvs.iter().map(move |rv| (uid.clone(), *rv)))
        .filter(|(uid, rv)| *rv <= position && !accepted.contains(&(uid.clone(), *rv)))
        .take(10)
        .collect();
    assert!(
        missing.is_empty(),
        "the stored position {position} passed changes the receiver never accepted: {missing:?}"
    );
}

/// 400 and 413 are the event's own: the dead-letter receiver gets it with the status, and the
/// object's later events go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_400_and_413_go_to_the_dead_letter_receiver() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-dead").await;
    let receiver = Receiver::start(&["--reject", "bad=400", "--reject", "big=413"]);
    let dead = Receiver::start(&[]);
    let sink = format!(
        "{}[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{}\"\n",
        http_sink(&receiver.url(), ""),
        dead.url()
    );
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &sink, "", &[]);
    for name in ["ok-1", "bad-1", "big-1", "ok-2"] {
        create_cm(&client, &ns.name, name, json!({}), json!({})).await;
    }
    let got = receiver.wait_accepted(2, &mut kc).await;
    let dl = dead.wait_accepted(2, &mut kc).await;
    let names: Vec<_> = got.iter().map(name_of).collect();
    assert!(names.contains(&"ok-1") && names.contains(&"ok-2"), "{names:?}");
    for (name, code) in [("bad-1", "400"), ("big-1", "413")] {
        let e = dl.iter().find(|e| name_of(e) == name).unwrap_or_else(|| panic!("{name} not dead-lettered: {dl:?}"));
        let a = &e["attributes"];
        assert_eq!(a["knativeerrorcode"], code, "{name}");
        assert_eq!(a["knativeerrordest"], receiver.url(), "{name}");
        use base64::Engine;
        let data = base64::engine::general_purpose::STANDARD.decode(a["knativeerrordata"].as_str().unwrap()).unwrap();
        let data = String::from_utf8(data).unwrap();
        assert!(data.contains(&format!("rejected {name}: status {code}")), "the receiver's answer: {data}");
    }
    kc.kill9();
}

/// 401: held and named, never dead-lettered; a new token in the file is read and delivery goes
/// on without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_a_refused_token_holds_until_the_token_file_changes() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-auth").await;
    let dir = tempfile::tempdir().unwrap();
    let (accepted, ours) = (dir.path().join("accepted"), dir.path().join("ours"));
    std::fs::write(&accepted, "s3cr3t-right\n").unwrap();
    std::fs::write(&ours, "s3cr3t-wrong\n").unwrap();
    let receiver = Receiver::start(&["--bearer-token-file", accepted.to_str().unwrap()]);
    let sink = http_sink(&receiver.url(), &format!("bearer_token_file = \"{}\"", ours.display()));
    let checkpoint = "[delivery]\nmax_attempts = 2\nbackoff_min_ms = 100\nbackoff_max_ms = 500\n";
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &sink, checkpoint, &[]);
    create_cm(&client, &ns.name, "a", json!({}), json!({})).await;
    kc.wait_ready_reason("refuses kubecast's credentials").await;
    kc.wait_log("attempt=10 ", 1).await;
    assert!(receiver.accepted().is_empty(), "nothing accepted with the wrong token");
    assert!(!kc.log().contains("s3cr3t"), "the token is never logged");
    // The token is replaced the way the kubelet replaces a projected one: a new file moved in.
    let new = dir.path().join("ours.new");
    std::fs::write(&new, "s3cr3t-right\n").unwrap();
    std::fs::rename(&new, &ours).unwrap();
    let got = receiver.wait_accepted(1, &mut kc).await;
    assert_eq!(name_of(&got[0]), "a");
    kc.wait_ready(200).await;
    let dead = std::fs::read_to_string(kc.dir.path().join("state/dead-letter.jsonl")).unwrap_or_default();
    assert!(dead.is_empty(), "a refusal is never dead-lettered: {dead}");
    kc.kill9();
}

/// `K_SINK` and `K_CE_OVERRIDES` as Knative's SinkBinding sets them, with ApiServerSource's
/// event form; and neither `url` nor `K_SINK`: a clear error at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_k_sink_overrides_and_the_apiserversource_form() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-knative").await;
    let receiver = Receiver::start(&[]);
    let sink = "[sink]\ntype = \"http\"\n[sink.http]\nformat = \"apiserversource-resource\"\n";
    let url = receiver.url();
    let overrides = r#"{"extensions":{"team":"platform"}}"#;
    let mut kc = Kubecast::start_with_sink(
        &config(&ns.name),
        sink,
        "",
        &[("K_SINK", url.as_str()), ("K_CE_OVERRIDES", overrides)],
    );
    create_cm(&client, &ns.name, "a", json!({}), json!({})).await;
    let got = receiver.wait_accepted(1, &mut kc).await;
    let a = &got[0]["attributes"];
    assert_eq!(a["type"], "dev.knative.apiserver.resource.add");
    assert_eq!(a["subject"], format!("/apis/v1/namespaces/{}/configmaps/a", ns.name));
    assert_eq!(a["kind"], "ConfigMap");
    assert_eq!(a["name"], "a");
    assert_eq!(a["namespace"], ns.name.as_str());
    assert_eq!(a["team"], "platform", "K_CE_OVERRIDES");
    assert!(a["source"].as_str().unwrap().starts_with("https://"), "the apiserver's URL: {a}");
    assert_eq!(got[0]["data"]["metadata"]["name"], "a", "Resource mode: the object");
    kc.kill9();
    // Neither url nor K_SINK.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.toml");
    std::fs::write(&path, format!("{}\n{sink}", config(&ns.name))).unwrap();
    let out = Command::new(common::bin())
        .args(["run", "--config"])
        .arg(&path)
        .env_remove("K_SINK")
        .env("KUBECONFIG", common::kubeconfig())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "no URL is fatal");
    assert!(err.contains("sink.http.url") && err.contains("K_SINK"), "names the setting and the variable: {err}");
}

/// An HTTPS receiver: a CA that did not sign its certificate is named with the setting to
/// change; the right CA delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_tls_receiver_with_the_wrong_ca_is_named() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-tls").await;
    let pki = PathBuf::from(common::env_var("KAFKA_CA_FILE")).parent().unwrap().to_path_buf();
    let (cert, key) = (pki.join("broker.crt"), pki.join("broker.key"));
    let receiver = Receiver::start(&["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    create_cm(&client, &ns.name, "a", json!({}), json!({})).await;
    let wrong = http_sink(
        &receiver.url(),
        &format!("[sink.http.tls]\nca_file = \"{}\"", common::env_var("KAFKA_UNTRUSTED_CA_FILE")),
    );
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &wrong, "", &[]);
    kc.wait_ready_reason("sink.http.tls.ca_file").await;
    assert!(kc.log().contains("the receiver's certificate could not be verified"), "{}", kc.log());
    kc.kill9();
    assert!(receiver.accepted().is_empty());
    let right =
        http_sink(&receiver.url(), &format!("[sink.http.tls]\nca_file = \"{}\"", common::env_var("KAFKA_CA_FILE")));
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &right, "", &[]);
    let got = receiver.wait_accepted(1, &mut kc).await;
    assert_eq!(name_of(&got[0]), "a");
    kc.kill9();
}

/// The file dead letter (kubecast's default) with an HTTP sink: `kubecast dead-letter replay`
/// sends the entry to the receiver again, with its id, once the receiver takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_dead_letter_file_replays_to_the_receiver() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-replay").await;
    let mut receiver = Receiver::start(&["--reject", "bad=400"]);
    let sink = http_sink(&receiver.url(), "mode = \"structured\"");
    let mut kc = Kubecast::start_with_sink(&config(&ns.name), &sink, "", &[]);
    for name in ["bad-1", "ok-1"] {
        create_cm(&client, &ns.name, name, json!({}), json!({})).await;
    }
    receiver.wait_accepted(1, &mut kc).await;
    let dead_letter = kc.dir.path().join("state/dead-letter.jsonl");
    let deadline = Instant::now() + WAIT;
    while !std::fs::read_to_string(&dead_letter).unwrap_or_default().contains("HTTP 400 Bad Request from") {
        assert!(Instant::now() < deadline, "no dead letter with the status\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let id = serde_json::from_str::<Value>(std::fs::read_to_string(&dead_letter).unwrap().lines().next().unwrap())
        .unwrap()["event"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    kc.kill9();
    // The receiver fixed: it takes every event now.
    receiver.stop();
    receiver.args.clear();
    receiver.restart();
    let config_path = kc.dir.path().join("kubecast.toml");
    let out = common::dead_letter_ok(&config_path, &["replay"]);
    assert!(out.contains('1'), "one entry replayed: {out}");
    let got = receiver.accepted();
    let replayed = got
        .iter()
        .find(|e| e["attributes"]["id"] == id.as_str())
        .unwrap_or_else(|| panic!("{id} not replayed: {got:?}"));
    assert_eq!(name_of(replayed), "bad-1");
    assert_eq!(replayed["mode"], "structured", "in the sink's mode");
    // A second replay sends nothing more.
    common::dead_letter_ok(&config_path, &["replay"]);
    assert_eq!(receiver.accepted().iter().filter(|e| e["attributes"]["id"] == id.as_str()).count(), 1);
}

/// HTTP/2 against the Go SDK's receiver: over TLS, offered in the handshake (`http_version =
/// "auto"`), and over cleartext with prior knowledge (`"2"`); HTTP/1.1 when asked (`"1.1"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_over_tls_and_cleartext_to_the_go_sdk_receiver() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "http-h2").await;
    create_cm(&client, &ns.name, "a", json!({}), json!({})).await;
    let pki = PathBuf::from(common::env_var("KAFKA_CA_FILE")).parent().unwrap().to_path_buf();
    let (cert, key) = (pki.join("broker.crt"), pki.join("broker.key"));
    let tls = Receiver::start_go(&["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    let h2c = Receiver::start_go(&["--h2c"]);
    let ca = format!("[sink.http.tls]\nca_file = \"{}\"", common::env_var("KAFKA_CA_FILE"));
    for (receiver, extra, proto) in [
        (&tls, format!("http_version = \"auto\"\n{ca}"), "HTTP/2.0"),
        (&h2c, "http_version = \"2\"".to_string(), "HTTP/2.0"),
        (&h2c, "http_version = \"1.1\"".to_string(), "HTTP/1.1"),
    ] {
        let before = receiver.accepted().len();
        let mut kc = Kubecast::start_with_sink(&config(&ns.name), &http_sink(&receiver.url(), &extra), "", &[]);
        let got = receiver.wait_accepted(before + 1, &mut kc).await;
        let e = &got[before];
        assert_eq!(e["proto"], proto, "{extra}: {e}");
        assert_eq!(name_of(e), "a");
        assert_eq!(e["attributes"]["type"], "io.kubecast.core.ConfigMap.added");
        kc.kill9();
    }
}
