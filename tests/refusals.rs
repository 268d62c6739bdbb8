//! A mistake in the set-up is a clear signal, never a quiet loss: a Kafka topic that does not
//! exist, a Write permission not granted, a NATS subject no JetStream stream covers. Under a
//! steady load of changes, kubecast holds the stream (the events wait in order, the position
//! does not move), `/readyz` is 503 naming the destination, the cause and the fix,
//! `kubecast_sink_refused{reason}` counts the events held, and nothing goes to the dead letter,
//! whatever `max_attempts` and `max_event_age_seconds` say. Once the operator creates the
//! topic, grants the permission or adds the stream, every change arrives, in order per object,
//! without a restart.

use kubecast_kit as common;

use std::process::Command;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use common::traffic::{Delivery, Source, Traffic};
use common::{Kubecast, TestNamespace, client, create_cm};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

const WAIT: Duration = Duration::from_secs(120);
/// Changes per second of the load, on this many ConfigMaps.
const RATE: u64 = 10;
const NAMES: usize = 8;
/// Delivery settings that would dead-letter a failing event within seconds if the refusal were
/// treated as the event's fault.
const DELIVERY: &str = "flush_interval_ms = 200\n[delivery]\nmax_attempts = 2\nmax_event_age_seconds = 3\nbackoff_min_ms = 100\nbackoff_max_ms = 500\n";

fn dead_letters(kc: &Kubecast) -> String {
    std::fs::read_to_string(kc.dir.path().join("state/dead-letter.jsonl")).unwrap_or_default()
}

/// `kubecast_sink_refused{reason="<reason>"}`'s value.
async fn refused_metric(kc: &mut Kubecast, reason: &str) -> i64 {
    let (_, metrics) = kc.admin_get("/metrics").await;
    let prefix = format!("kubecast_sink_refused{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no {prefix} in the metrics:\n{metrics}"))
        .trim()
        .parse()
        .unwrap()
}

/// Waits until an event has been refused at least `attempts` times (the warning repeats at
/// every tenth attempt): past `max_attempts` and `max_event_age_seconds`.
async fn wait_refused_attempts(kc: &mut Kubecast, attempts: u32) {
    kc.wait_log(&format!("attempt={attempts} "), 1).await;
}

/// While refused: not ready with `says` in `/readyz`, the metric counts held events, no dead
/// letter, and the stream's position has not moved past the first held event.
async fn assert_held(kc: &mut Kubecast, says: &[&str], reason: &str) {
    kc.wait_ready_reason("refuses every event").await;
    wait_refused_attempts(kc, 10).await;
    let (status, body) = kc.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    for s in says {
        assert!(body.contains(s), "/readyz does not say {s:?}: {body}");
    }
    assert!(body.contains("fix: "), "{body}");
    eprintln!("/readyz while held: {body}");
    assert!(refused_metric(kc, reason).await > 0, "kubecast_sink_refused{{reason={reason:?}}} counts held events");
    assert_eq!(dead_letters(kc), "", "a set-up mistake is not dead-lettered\n{}", kc.log());
    assert!(!kc.log().contains("writing it to the dead letter"), "{}", kc.log());
    // The position may be the initial list's end (an empty namespace), but no held event is
    // in the stored index: none counts as delivered.
    assert!(
        kc.checkpoints().first().is_none_or(|c| c["objects"].as_array().is_some_and(Vec::is_empty)),
        "the position moved past held events: {:?}",
        kc.checkpoints()
    );
}

/// After the fix: ready again, every change delivered in order, still no dead letter.
async fn assert_resumed(mut kc: Kubecast, traffic: Traffic, reason: &str) {
    kc.wait_ready(200).await;
    let verdict = traffic.finish(Delivery::AtLeastOnce, WAIT).await;
    assert!(verdict.seen > NAMES, "{verdict:?}");
    assert_eq!(refused_metric(&mut kc, reason).await, 0);
    assert_eq!(dead_letters(&kc), "", "{}", kc.log());
    assert!(kc.log().contains("the destination refuses every event"), "{}", kc.log());
    assert!(kc.stop().success(), "{}", kc.log());
}

async fn create_topic(name: &str) {
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let r =
        admin.create_topics(&[NewTopic::new(name, 2, TopicReplication::Fixed(1))], &AdminOptions::new()).await.unwrap();
    r[0].as_ref().expect("topic created");
}

fn kafka_source(topic: &str) -> Source {
    Source::Kafka { brokers: common::env_var("KAFKA_BROKERS"), topic: topic.into(), read_committed: false }
}

/// A Kafka sink on `topic` whose producer never lets the broker create a missing topic (as with
/// a broker whose auto.create.topics.enable is false), `extra` lines added to its properties.
fn no_auto_create_sink(topic: &str, extra: &str) -> String {
    format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n[sink.kafka.properties]\n\"allow.auto.create.topics\" = \"false\"\n{extra}",
        common::env_var("KAFKA_BROKERS")
    )
}

#[tokio::test]
async fn a_missing_kafka_topic_holds_the_stream_until_it_is_created_and_loses_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-topic").await;
    let topic = common::unique("missing");
    // The test broker creates topics on first use; this producer asks it not to, as a broker
    // with auto.create.topics.enable=false does.
    let sink = no_auto_create_sink(&topic, "\"topic.metadata.propagation.max.ms\" = \"1000\"\n");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, DELIVERY, &[]);
    // The load starts after kubecast's initial list (of an empty namespace): a change made
    // before it could be invisible to everyone (the list shows states, not history).
    kc.wait_log("list complete", 1).await;
    let traffic =
        Traffic::start(&Api::<ConfigMap>::namespaced(client.clone(), &ns.name), kafka_source(&topic), NAMES, RATE);
    assert_held(&mut kc, &[&topic, "the topic does not exist", "fix: create the topic"], "missing_topic").await;
    // Said at start too, before the first event was refused: the look-up of every destination.
    kc.wait_log("a destination is not ready; its events will be held until it is fixed", 1).await;
    assert!(kc.log().contains(&format!("Kafka event topic \"{topic}\" does not exist")), "{}", kc.log());
    create_topic(&topic).await;
    assert_resumed(kc, traffic, "missing_topic").await;
}

/// Before any event: a missing topic that every event of the stream would go to is looked up
/// at start, logged and named on `/readyz`; once created, the next look-up finds it and the
/// process is ready.
#[tokio::test]
async fn a_missing_topic_is_named_on_readyz_before_the_first_event() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-start").await;
    let topic = common::unique("missing-start");
    let sink = no_auto_create_sink(&topic, "");
    // A selector nothing matches: no event at all.
    let config = common::cm_config(&ns.name, "") + "label_selector = \"kubecast-test=nothing\"\n";
    let mut kc = Kubecast::start_with_sink(&config, &sink, "", &[]);
    kc.wait_ready_reason("destination: Kafka event topic").await;
    let (status, body) = kc.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains(&topic) && body.contains("does not exist") && body.contains("fix: create the topic"),
        "{body}"
    );
    assert!(!body.contains("refuses every event"), "no event was sent: {body}");
    create_topic(&topic).await;
    kc.wait_ready(200).await;
    assert!(kc.stop().success(), "{}", kc.log());
}

/// `tests/env/kafka-acls` with `args` against the test broker (as its super user).
fn kafka_acls(args: &[&str]) {
    let tool = common::env::repo_root().join("tests/env/kafka-acls");
    let out = Command::new(&tool)
        .args(["--bootstrap-server", &common::env_var("KAFKA_BROKERS")])
        .args(args)
        .output()
        .expect("run tests/env/kafka-acls");
    assert!(
        out.status.success(),
        "kafka-acls {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Denies the limited user `operation` on `resource` (e.g. `["--topic", t]`) when `add`, or
/// takes that denial back (which grants it: the broker allows what no ACL names).
fn deny_limited(add: bool, operation: &str, resource: &[&str]) {
    let principal = format!("User:{}", common::env_var("KAFKA_LIMITED_USER"));
    let action = if add { "--add" } else { "--remove" };
    let mut args = vec![action, "--deny-principal", &principal, "--operation", operation];
    args.extend_from_slice(resource);
    if !add {
        args.push("--force");
    }
    kafka_acls(&args);
}

/// A Kafka sink on `topic` as the limited user over SASL (SCRAM-SHA-512), `extra` lines added
/// to `[sink.kafka]`; the password from the environment variable `REFUSALS_TEST_KAFKA_PASSWORD`.
fn limited_sink(topic: &str, extra: &str) -> String {
    format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\n{extra}[sink.kafka.properties]\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"{}\"\n\"sasl.password\" = \"${{env:REFUSALS_TEST_KAFKA_PASSWORD}}\"\n",
        common::env_var("KAFKA_SASL_BROKERS"),
        common::env_var("KAFKA_LIMITED_USER"),
    )
}

#[tokio::test]
async fn a_kafka_topic_write_not_authorized_holds_the_stream_until_granted_and_loses_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-acl").await;
    let topic = common::unique("acl");
    create_topic(&topic).await;
    deny_limited(true, "Write", &["--topic", &topic]);
    // The limited user over SASL (SCRAM-SHA-512): allowed what no ACL names, denied Write on
    // this topic.
    let sink = limited_sink(&topic, "");
    let password = common::env_var("KAFKA_LIMITED_PASSWORD");
    let mut kc = Kubecast::start_with_sink(
        &common::cm_config(&ns.name, ""),
        &sink,
        DELIVERY,
        &[("REFUSALS_TEST_KAFKA_PASSWORD", password.as_str())],
    );
    // The load starts after kubecast's initial list (of an empty namespace): a change made
    // before it could be invisible to everyone (the list shows states, not history).
    kc.wait_log("list complete", 1).await;
    let traffic =
        Traffic::start(&Api::<ConfigMap>::namespaced(client.clone(), &ns.name), kafka_source(&topic), NAMES, RATE);
    let principal = format!("as User:{}", common::env_var("KAFKA_LIMITED_USER"));
    assert_held(&mut kc, &[&topic, &principal, "may not write to the topic", "kafka-acls"], "topic_not_authorized")
        .await;
    deny_limited(false, "Write", &["--topic", &topic]);
    assert!(!kc.log().contains(&password), "the password leaked into the log");
    assert_resumed(kc, traffic, "topic_not_authorized").await;
}

#[tokio::test]
async fn a_nats_subject_no_stream_covers_holds_the_stream_until_a_stream_does_and_loses_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-nats").await;
    let js = jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("r").replace('-', "_");
    let name = prefix.to_uppercase();
    // Covers the `default` namespace only (what kubecast's start-up check samples for a
    // cluster-wide stream, which this one is, with a field selector on the test's namespace);
    // the test's namespace is not covered until the fix.
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.default.>")],
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    let config = format!(
        "[cluster]\nname = \"e2e\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nfield_selector = \"metadata.namespace={}\"\nsubject = \"{prefix}.{{namespace}}.{{verb}}\"\n",
        ns.name
    );
    let sink = format!("[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\n", common::env_var("NATS_URL"));
    let mut kc = Kubecast::start_with_sink(&config, &sink, DELIVERY, &[]);
    let source = Source::Nats { url: common::env_var("NATS_URL"), stream: name.clone() };
    // The load starts after kubecast's initial list (of an empty namespace): a change made
    // before it could be invisible to everyone (the list shows states, not history).
    kc.wait_log("list complete", 1).await;
    let traffic = Traffic::start(&Api::<ConfigMap>::namespaced(client.clone(), &ns.name), source, NAMES, RATE);
    let subject = format!("{prefix}.{}.", ns.name);
    assert_held(
        &mut kc,
        &[&subject, "no JetStream stream covers the subject", "fix: add the subject"],
        "missing_stream",
    )
    .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let mut s = js.get_stream(&name).await.unwrap();
        let mut cfg = s.info().await.unwrap().config.clone();
        cfg.subjects.push(format!("{prefix}.{}.>", ns.name));
        if js.update_stream(&cfg).await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "the stream could not be updated");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_resumed(kc, traffic, "missing_stream").await;
    let _ = js.delete_stream(&name).await;
}

/// A NATS user whose permissions deny the subject: the server refuses each publish on the
/// connection (no PubAck ever comes). Held and named, not read as a slow server and never
/// dead-lettered; routed to a subject the user may publish on, every change arrives.
#[tokio::test]
async fn a_nats_subject_the_user_may_not_publish_on_holds_the_stream_and_loses_nothing() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-perm").await;
    let js = jetstream::new(async_nats::connect(common::env_var("NATS_URL")).await.unwrap());
    let prefix = common::unique("p").replace('-', "_");
    let name = prefix.to_uppercase();
    // The user "restricted" of the test server may not publish on denied.>.
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("denied.{prefix}.>"), format!("{prefix}.>")],
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    let sink = |subject: &str| {
        format!(
            "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{subject}\"\nack_timeout_ms = 1000\n",
            // The credentials in the URL: they must be sent (the server would let an
            // anonymous client publish anywhere).
            common::env_var("NATS_URL").replace(
                "nats://",
                &format!(
                    "nats://{}:{}@",
                    common::env_var("NATS_RESTRICTED_USER"),
                    common::env_var("NATS_RESTRICTED_PASSWORD")
                )
            )
        )
    };
    let denied = format!("denied.{prefix}.{{namespace}}");
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink(&denied), DELIVERY, &[]);
    let source = Source::Nats { url: common::env_var("NATS_URL"), stream: name.clone() };
    kc.wait_log("list complete", 1).await;
    let traffic = Traffic::start(&Api::<ConfigMap>::namespaced(client.clone(), &ns.name), source, NAMES, RATE);
    assert_held(
        &mut kc,
        &[
            &format!("denied.{prefix}.{}", ns.name),
            "the NATS user may not publish on the subject",
            "Permissions Violation",
        ],
        "subject_not_permitted",
    )
    .await;
    // The fix an operator without a say over the server's permissions makes: another subject.
    kc.kill9();
    kc.set_sink(&sink(&format!("{prefix}.{{namespace}}")));
    kc.restart(&[]);
    assert_resumed(kc, traffic, "subject_not_permitted").await;
    let _ = js.delete_stream(&name).await;
}

/// Exactly-once, the state store's `transactional.id` not granted: a set-up mistake, not
/// another owner. The process stays up, not ready, naming the transactional.id and the fix,
/// writes nothing and publishes nothing (its streams start once the store is open); once
/// granted it opens the store, sends the objects that exist, and every change after is
/// committed exactly once.
#[tokio::test]
async fn a_transactional_id_not_authorized_is_not_read_as_fencing_and_resumes_once_granted() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-txn").await;
    let (topic, state, id) = (common::unique("eos-acl"), common::unique("eos-acl-state"), common::unique("txn"));
    create_topic(&topic).await;
    deny_limited(true, "Write", &["--transactional-id", &id]);
    let existing = common::names("before", 0..3);
    common::create_cms(&client, &ns.name, &existing).await;
    let sink = limited_sink(&topic, "exactly_once = true\n");
    let checkpoint = format!(
        "store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\ntransactional_id = \"{id}\"\n"
    );
    let password = common::env_var("KAFKA_LIMITED_PASSWORD");
    let mut kc = Kubecast::start_with_sink(
        &common::cm_config(&ns.name, ""),
        &sink,
        &checkpoint,
        &[("REFUSALS_TEST_KAFKA_PASSWORD", password.as_str())],
    );
    kc.wait_ready_reason("the principal may not use the transactional.id").await;
    // Retried, still saying so, and still running: not taken for another owner.
    kc.wait_log("state store refused (a set-up mistake)", 2).await;
    let (status, body) = kc.admin_get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains(&id) && body.contains("--transactional-id") && body.contains("no other kubecast owns the state"),
        "{body}"
    );
    assert!(kc.exited().is_none(), "kubecast stays up:\n{}", kc.log());
    assert!(!kc.log().contains("another kubecast process owns the state"), "{}", kc.log());
    assert!(common::topic::read_if_any(&topic, true).is_empty(), "nothing committed while the store cannot be opened");
    deny_limited(false, "Write", &["--transactional-id", &id]);
    kc.wait_ready(200).await;
    let source =
        Source::Kafka { brokers: common::env_var("KAFKA_BROKERS"), topic: topic.clone(), read_committed: true };
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let traffic = Traffic::start_after(&api, source, NAMES, RATE, existing.len(), WAIT).await;
    assert!(traffic.flowing(2 * NAMES, WAIT).await, "changes are committed:\n{}", kc.log());
    let verdict = traffic.finish(Delivery::ExactlyOnce, WAIT).await;
    assert!(verdict.seen > NAMES, "{verdict:?}");
    assert!(!kc.log().contains(&password), "the password leaked into the log");
    assert!(kc.stop().success(), "{}", kc.log());
}

/// `kubecast check-config --connect` with `config` (a whole TOML file): (exit code, stdout,
/// stderr).
fn check_connect(config: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubecast.toml");
    std::fs::write(&path, config).unwrap();
    let out = Command::new(common::bin())
        .args(["check-config", "--connect", "--config"])
        .arg(&path)
        .env("KUBECONFIG", common::kubeconfig())
        .env("REFUSALS_TEST_KAFKA_PASSWORD", common::env_var("KAFKA_LIMITED_PASSWORD"))
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

/// The finding lines (`ok:` / `problem:`) of `check-config --connect`'s output that name `what`.
fn finding<'a>(out: &'a str, what: &str) -> &'a str {
    out.lines()
        .find(|l| (l.starts_with("ok:") || l.starts_with("problem:")) && l.contains(what))
        .unwrap_or_else(|| panic!("{what} not named:\n{out}"))
}

/// The command an installer runs before the install: every destination the config names,
/// looked up without creating it; exit 2 naming each problem, 0 once they are fixed.
#[tokio::test]
async fn check_config_connect_names_every_missing_or_refused_destination() {
    let cluster = common::unique("connect");
    let (events, dead) = (common::unique("connect-events"), common::unique("connect-dead"));
    let resources = "[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"default\"]\n";
    // A producer that never creates topics (as with a broker whose auto.create.topics.enable is
    // false), the limited user, a dead letter on the broker.
    let kafka = format!(
        "[cluster]\nname = \"{cluster}\"\n[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{events}\"\n[sink.kafka.properties]\n\"allow.auto.create.topics\" = \"false\"\n\"security.protocol\" = \"SASL_PLAINTEXT\"\n\"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"{}\"\n\"sasl.password\" = \"${{env:REFUSALS_TEST_KAFKA_PASSWORD}}\"\n[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\ntopic = \"{cluster}-state\"\n{resources}",
        common::env_var("KAFKA_SASL_BROKERS"),
        common::env_var("KAFKA_LIMITED_USER"),
    );
    let (code, out, err) = check_connect(&kafka);
    assert_eq!(code, 2, "exit {code}\n{out}\n{err}");
    for topic in [&events, &dead] {
        let line = finding(&out, topic);
        assert!(
            line.starts_with("problem:") && line.contains("does not exist") && line.contains("fix: create"),
            "{line}"
        );
    }
    let state = finding(&out, "-state");
    assert!(state.starts_with("ok:") && state.contains("kubecast creates it"), "{state}");
    assert!(err.contains("2 problem(s)"), "{err}");
    // Nothing was created by looking.
    assert!(common::topic::read_if_any(&events, false).is_empty());

    // Both created; the limited user denied Describe on the event topic: named as refused.
    create_topic(&events).await;
    create_topic(&dead).await;
    let principal = format!("User:{}", common::env_var("KAFKA_LIMITED_USER"));
    deny_limited(true, "Describe", &["--topic", &events]);
    let (code, out, err) = check_connect(&kafka);
    assert_eq!(code, 2, "exit {code}\n{out}\n{err}");
    let line = finding(&out, &events);
    assert!(line.starts_with("problem:") && line.contains(&principal) && line.contains("kafka-acls"), "{line}");
    deny_limited(false, "Describe", &["--topic", &events]);
    let (code, out, err) = check_connect(&kafka);
    assert_eq!(code, 0, "exit {code}\n{out}\n{err}");
    assert!(out.lines().any(|l| l.starts_with("ok:") && l.contains(events.as_str()) && l.contains("exists")), "{out}");

    // NATS: a subject no stream covers.
    let nats = format!(
        "[cluster]\nname = \"{cluster}\"\n[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"{}\"\nsubject = \"{}.{{namespace}}\"\n{resources}",
        common::env_var("NATS_URL"),
        common::unique("uncovered").replace('-', "_")
    );
    let (code, out, err) = check_connect(&nats);
    assert_eq!(code, 2, "exit {code}\n{out}\n{err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("problem:") && l.contains(".default") && l.contains("no JetStream stream covers")),
        "{out}"
    );
}

/// Two shards on one replica, exactly once, their `transactional.id`s not granted: each shard
/// is held (no shard given up and taken again), the replica not ready naming it, nothing
/// written; once granted both shards open their stores and the replica is ready.
#[tokio::test]
async fn sharded_with_the_transactional_ids_refused_holds_its_shards_not_ready_until_granted() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-shards").await;
    let (topic, state, id) = (common::unique("eos-shards"), common::unique("eos-shards-state"), common::unique("txns"));
    create_topic(&topic).await;
    deny_limited(true, "Write", &["--resource-pattern-type", "prefixed", "--transactional-id", &id]);
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"))
        .replace("enabled = true\n", "enabled = true\nshards = 2\n");
    let sink = limited_sink(&topic, "exactly_once = true\n");
    let checkpoint = format!(
        "store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\ntransactional_id = \"{id}\"\n"
    );
    let password = common::env_var("KAFKA_LIMITED_PASSWORD");
    let mut kc =
        Kubecast::start_with_sink(&config, &sink, &checkpoint, &[("REFUSALS_TEST_KAFKA_PASSWORD", password.as_str())]);
    // Both shards taken and refused, each said on /readyz.
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, body) = kc.admin_get("/readyz").await;
        let said = body.matches("the principal may not use the transactional.id").count();
        if said == 2 {
            assert_eq!(status, 503, "{body}");
            assert!(body.contains("shard 0-of-2") && body.contains("shard 1-of-2"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "/readyz: {status} {body}\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Refused again and again, held all along: no shard given up or failed.
    kc.wait_log("state store refused (a set-up mistake)", 6).await;
    let (_, metrics) = kc.admin_get("/metrics").await;
    let held = metrics.lines().filter(|l| l.starts_with("kubecast_shard_held{") && l.ends_with(" 1")).count();
    assert_eq!(held, 2, "{metrics}");
    for churn in ["shard lost", "shard failed", "shard stopped"] {
        assert!(!kc.log().contains(churn), "{churn}:\n{}", kc.log());
    }
    assert!(!kc.log().contains("another kubecast process owns the state"), "{}", kc.log());
    deny_limited(false, "Write", &["--resource-pattern-type", "prefixed", "--transactional-id", &id]);
    kc.wait_ready(200).await;
    create_cm(&client, &ns.name, "after", serde_json::json!({}), serde_json::json!({"v": "1"})).await;
    let deadline = Instant::now() + WAIT;
    while !common::topic::read_if_any(&topic, true).iter().any(|m| {
        rdkafka::message::Message::payload(m).is_some_and(|p| String::from_utf8_lossy(p).contains("\"after\""))
            || common::topic::header(m, "ce_subject").is_some_and(|s| s.ends_with("/after"))
    }) {
        assert!(Instant::now() < deadline, "the change after the grant never committed:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(kc.stop().success(), "{}", kc.log());
}

/// `kubecast dead-letter replay --progress <group>` with the sink's credentials: (success,
/// stdout, stderr).
fn replay_as_limited(kc: &Kubecast, group: &str) -> (bool, String, String) {
    let out = Command::new(common::bin())
        .args(["dead-letter", "replay", "--progress", group, "--config"])
        .arg(kc.dir.path().join("kubecast.toml"))
        .env("REFUSALS_TEST_KAFKA_PASSWORD", common::env_var("KAFKA_LIMITED_PASSWORD"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run kubecast dead-letter replay");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// kubecast reads its state topic by partition, never as a member of a consumer group: a
/// principal with every group refused runs, loads its state and resumes after a restart.
/// `kubecast dead-letter replay` keeps how far it got in a group: refused, it names the group
/// and the permission to grant, and replays once granted.
#[tokio::test]
async fn running_needs_no_group_permission_and_replay_names_a_refused_group() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "refused-group").await;
    let (topic, dead) = (common::unique("dl-small"), common::unique("dl-dead"));
    let (state, group) = (common::unique("group-state"), common::unique("replay"));
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let small = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", "4000");
    let dl = NewTopic::new(&dead, 1, TopicReplication::Fixed(1));
    for r in admin.create_topics(&[small, dl], &AdminOptions::new()).await.unwrap() {
        r.expect("topic created");
    }
    let state_groups = ["kubecast-state-loader", "kubecast-state-check", "kubecast-state-cli"];
    for g in state_groups.iter().chain([&group.as_str()]) {
        deny_limited(true, "Read", &["--group", g]);
    }
    let sink =
        limited_sink(&topic, "") + &format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n");
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let password = common::env_var("KAFKA_LIMITED_PASSWORD");
    let env = [("REFUSALS_TEST_KAFKA_PASSWORD", password.as_str())];
    let mut kc = Kubecast::start_with_sink(&common::cm_config(&ns.name, ""), &sink, &checkpoint, &env);
    kc.wait_ready(200).await;
    let big =
        create_cm(&client, &ns.name, "big", serde_json::json!({}), serde_json::json!({"blob": "x".repeat(8000)})).await;
    create_cm(&client, &ns.name, "small", serde_json::json!({}), serde_json::json!({"v": "1"})).await;
    let deadline = Instant::now() + WAIT;
    while common::topic::read_if_any(&dead, false).is_empty() || common::topic::read_if_any(&topic, false).is_empty() {
        assert!(Instant::now() < deadline, "the big event dead-lettered, the small one sent:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A restart loads the state (positions and index) back, with every group still refused.
    assert!(kc.stop().success(), "{}", kc.log());
    kc.restart(&env);
    kc.wait_ready(200).await;
    assert!(kc.log().contains("resuming from checkpoint"), "resumed from the stored state:\n{}", kc.log());
    create_cm(&client, &ns.name, "after", serde_json::json!({}), serde_json::json!({"v": "1"})).await;
    while !common::topic::read_if_any(&topic, false)
        .iter()
        .any(|m| common::topic::header(m, "ce_subject").is_some_and(|s| s.ends_with("/after")))
    {
        assert!(Instant::now() < deadline, "a change after the restart:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let said = |l: &&str| (l.contains(" ERROR ") || l.contains(" WARN ")) && l.contains("Group authorization");
    assert!(!kc.log().lines().any(|l| said(&l)), "no group needed, none complained of:\n{}", kc.log());

    let (ok, out, err) = replay_as_limited(&kc, &group);
    assert!(!ok, "replay cannot keep its progress in a refused group: {out}\n{err}");
    assert!(err.contains(&format!("--group {group}")) && err.contains("Read on the consumer group"), "{err}");
    deny_limited(false, "Read", &["--group", &group]);
    let alter = rdkafka::admin::AlterConfig::new(rdkafka::admin::ResourceSpecifier::Topic(&topic))
        .set("max.message.bytes", "1000000");
    admin.alter_configs(&[alter], &AdminOptions::new()).await.unwrap()[0].as_ref().expect("topic config altered");
    let (ok, out, err) = replay_as_limited(&kc, &group);
    let uid = big.metadata.uid.unwrap();
    assert!(ok && out.contains(&format!("replayed: {uid}:")), "replayed once granted: {out}\n{err}");
    for g in state_groups {
        deny_limited(false, "Read", &["--group", g]);
    }
    assert!(!kc.log().contains(&password), "the password leaked into the log");
    assert!(kc.stop().success(), "{}", kc.log());
}
