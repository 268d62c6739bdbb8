//! Kafka the way managed services run it, against the TLS listeners of the test broker
//! (`tests/env/up`: SSL, SASL_SSL with PLAIN and SCRAM-SHA-512, mutual TLS, one test CA):
//! the sink and the Kafka state store deliver and resume after a restart, exactly-once too;
//! setups the broker refuses are a clear error naming the cause and the fix, never a silent
//! retry loop, and no secret reaches the log. Events are read back through the PLAINTEXT
//! listener by an independent consumer.

use kubecast_kit as common;

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, create_cm};
use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::StreamConsumer;
use rdkafka::message::{Headers, Message};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

fn cluster_name() -> String {
    common::unique("tls").replace('_', "-")
}

fn watch_config(cluster: &str, ns: &str) -> String {
    format!(
        "[cluster]\nname = \"{cluster}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{ns}\"]\n"
    )
}

/// A `[sink]` section for Kafka at `brokers` with `properties` (`sink.kafka.properties`) and
/// `extra` lines for `[sink.kafka]`.
fn sink(brokers: &str, topic: &str, extra: &str, properties: &[(&str, String)]) -> String {
    let mut out = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\n{extra}\n[sink.kafka.properties]\n"
    );
    for (k, v) in properties {
        out.push_str(&format!("{k:?} = {v:?}\n"));
    }
    out.push_str("[delivery]\nshutdown_timeout_seconds = 2\n");
    out
}

/// The broker's TLS listeners answer (a Kafka started by an older `tests/env/up` has none).
fn tls_listeners_up() {
    for key in ["KAFKA_SSL_BROKERS", "KAFKA_SASL_SSL_BROKERS", "KAFKA_MTLS_BROKERS"] {
        let addr = common::env_var(key);
        let sock = addr.parse().unwrap_or_else(|e| panic!("{key}={addr}: {e}"));
        std::net::TcpStream::connect_timeout(&sock, Duration::from_secs(5)).unwrap_or_else(|e| {
            panic!("the test Kafka's listener {key}={addr} does not answer ({e}): start Kafka with this checkout's tests/env/up")
        });
    }
}

fn ca() -> (&'static str, String) {
    ("ssl.ca.location", common::env_var("KAFKA_CA_FILE"))
}

/// The `ce_subject` of every record of `topic`, read from the beginning through the PLAINTEXT
/// listener (committed transactions only when `read_committed`), until `done` holds.
async fn subjects(topic: &str, read_committed: bool, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    header_values(topic, "ce_subject", read_committed, done).await
}

/// The header `header` of every record of `topic` (empty when absent), like [`subjects`].
async fn header_values(
    topic: &str,
    header: &str,
    read_committed: bool,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::env_var("KAFKA_BROKERS"))
        .set("group.id", common::unique("tls-verify"))
        .set("enable.auto.commit", "false")
        .set("isolation.level", if read_committed { "read_committed" } else { "read_uncommitted" })
        .create()
        .expect("consumer");
    let never = AtomicBool::new(false);
    tokio::time::timeout(WAIT, common::traffic::assign_from_beginning(&consumer, topic, &never))
        .await
        .unwrap_or_else(|_| panic!("topic {topic} never appeared"));
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    let mut stream = consumer.stream();
    while !done(&out) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out reading {topic}; got {out:?}");
        if let Ok(Some(Ok(m))) = tokio::time::timeout(left.min(Duration::from_secs(2)), stream.next()).await {
            let subject = m.headers().and_then(|h| h.iter().find(|h| h.key == header).and_then(|h| h.value));
            out.push(subject.map(|v| String::from_utf8_lossy(v).into_owned()).unwrap_or_default());
        }
    }
    out
}

/// Secrets that must never appear in a log: the passwords, and every line of the client key.
fn assert_no_secret(log: &str) {
    let mut secrets = vec![
        common::env_var("KAFKA_SASL_PASSWORD"),
        common::env_var("KAFKA_SCRAM_PASSWORD"),
        common::env_var("KAFKA_CLIENT_KEY_PASSWORD"),
    ];
    for key in ["KAFKA_CLIENT_KEY", "KAFKA_UNTRUSTED_CLIENT_KEY"] {
        let pem = std::fs::read_to_string(common::env_var(key)).expect("the client key");
        secrets.extend(pem.lines().filter(|l| !l.starts_with("-----")).map(str::to_string));
    }
    for s in secrets {
        assert!(!log.contains(&s), "a secret leaked into the log ({} chars of it):\n{log}", s.len().min(8));
    }
}

/// A secured connection: what the sink needs, and the environment of kubecast's process.
struct Secured {
    brokers: String,
    properties: Vec<(&'static str, String)>,
    env: Vec<(&'static str, String)>,
}

impl Secured {
    fn env(&self) -> Vec<(&str, &str)> {
        self.env.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }
}

/// SASL_SSL with `mechanism` as `user`, the password from the environment, the CA explicit.
fn sasl_ssl(mechanism: &str, user: &str, password: String) -> Secured {
    Secured {
        brokers: common::env_var("KAFKA_SASL_SSL_BROKERS"),
        properties: vec![
            ("security.protocol", "SASL_SSL".into()),
            ("sasl.mechanism", mechanism.into()),
            ("sasl.username", user.into()),
            ("sasl.password", "${env:TLS_TEST_KAFKA_PASSWORD}".into()),
            ca(),
        ],
        env: vec![("TLS_TEST_KAFKA_PASSWORD", password)],
    }
}

fn scram() -> Secured {
    sasl_ssl("SCRAM-SHA-512", &common::env_var("KAFKA_SCRAM_USER"), common::env_var("KAFKA_SCRAM_PASSWORD"))
}

/// Mutual TLS: the client certificate and key from files, the key's password from the environment.
fn mutual_tls(cert: &str, key: &str) -> Secured {
    Secured {
        brokers: common::env_var("KAFKA_MTLS_BROKERS"),
        properties: vec![
            ("security.protocol", "SSL".into()),
            ca(),
            ("ssl.certificate.pem", format!("${{file:{}}}", common::env_var(cert))),
            ("ssl.key.pem", format!("${{file:{}}}", common::env_var(key))),
            ("ssl.key.password", "${env:TLS_TEST_KEY_PASSWORD}".into()),
        ],
        env: vec![("TLS_TEST_KEY_PASSWORD", common::env_var("KAFKA_CLIENT_KEY_PASSWORD"))],
    }
}

/// The sink and the Kafka state store over `conn`: an object made before the start arrives; one
/// made while kubecast is stopped arrives after the restart, which resumes from the state
/// topic (no new snapshot: the first object is not sent again).
async fn delivers_and_resumes(name: &str, conn: Secured, exactly_once: bool) {
    tls_listeners_up();
    let client = client().await;
    let ns = TestNamespace::new(&client, &format!("tls-{name}")).await;
    let cluster = cluster_name();
    let topic = format!("tls-{name}.{cluster}");
    let state = format!("tls-{name}-state.{cluster}");
    create_cm(&client, &ns.name, "before", json!({}), json!({"v": "1"})).await;
    let extra = if exactly_once { "exactly_once = true" } else { "" };
    let checkpoint = format!("store = \"kafka\"\nflush_interval_ms = 200\n[checkpoint.kafka]\ntopic = \"{state}\"\n");
    let mut kc = Kubecast::start_with_sink(
        &watch_config(&cluster, &ns.name),
        &sink(&conn.brokers, &topic, extra, &conn.properties),
        &checkpoint,
        &conn.env(),
    );
    kc.wait_ready(200).await;
    let before = format!("{}/before", ns.name);
    subjects(&topic, exactly_once, |s| s.contains(&before)).await;
    // The state that passes the first event is written before the stop returns.
    assert!(kc.stop().success(), "{}", kc.log());

    create_cm(&client, &ns.name, "while-down", json!({}), json!({"v": "1"})).await;
    kc.restart(&conn.env());
    kc.wait_ready(200).await;
    let later = format!("{}/while-down", ns.name);
    let seen = subjects(&topic, exactly_once, |s| s.contains(&later)).await;
    assert_eq!(
        seen.iter().filter(|s| **s == before).count(),
        1,
        "resumed from the state topic, nothing sent again: {seen:?}"
    );
    let run = kc.run_log();
    assert!(run.contains("Kafka state topic read") && !run.contains("list complete"), "resumed, no snapshot:\n{run}");
    assert!(kc.stop().success(), "{}", kc.log());
    assert_no_secret(&kc.log());
}

#[tokio::test]
async fn sasl_ssl_with_scram_sha_512_delivers_and_resumes() {
    delivers_and_resumes("scram", scram(), false).await;
}

#[tokio::test]
async fn sasl_ssl_with_plain_delivers_and_resumes() {
    let conn = sasl_ssl("PLAIN", &common::env_var("KAFKA_SASL_USER"), common::env_var("KAFKA_SASL_PASSWORD"));
    delivers_and_resumes("plain", conn, false).await;
}

#[tokio::test]
async fn mutual_tls_with_the_key_from_a_file_delivers_and_resumes() {
    delivers_and_resumes("mtls", mutual_tls("KAFKA_CLIENT_CERT", "KAFKA_CLIENT_KEY"), false).await;
}

#[tokio::test]
async fn exactly_once_over_sasl_ssl_delivers_and_resumes() {
    delivers_and_resumes("eos", scram(), true).await;
}

/// Starts kubecast on `conn` (the state in a local file) and waits until `/readyz` says the
/// broker is not reachable with a fix that contains `fix`, and a log line names `cause` with
/// that fix; nothing is acknowledged meanwhile, and the stop is clean.
async fn refused(name: &str, conn: Secured, cause: &str, fix: &str) -> Kubecast {
    tls_listeners_up();
    let client = client().await;
    let ns = TestNamespace::new(&client, &format!("tls-{name}")).await;
    let cluster = cluster_name();
    create_cm(&client, &ns.name, "waiting", json!({}), json!({"v": "1"})).await;
    let topic = format!("tls-{name}.{cluster}");
    let mut kc = Kubecast::start_with_sink(
        &watch_config(&cluster, &ns.name),
        &sink(&conn.brokers, &topic, "", &conn.properties),
        "flush_interval_ms = 100",
        &conn.env(),
    );
    // `/readyz` says why, with the fix.
    kc.wait_ready_reason("sink: broker not reachable").await;
    kc.wait_ready_reason(fix).await;
    let deadline = Instant::now() + WAIT;
    let explained = |log: &str| log.lines().any(|l| l.contains(cause) && l.contains(fix));
    while !explained(&kc.log()) {
        assert!(kc.exited().is_none(), "kubecast exited:\n{}", kc.log());
        assert!(Instant::now() < deadline, "no line with {cause:?} and the fix {fix:?}:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(kc.checkpoints().iter().all(|c| c["resource_version"].is_null()), "nothing acknowledged");
    assert!(kc.stop().success(), "no crash: a clean stop\n{}", kc.log());
    assert_no_secret(&kc.log());
    kc
}

#[tokio::test]
async fn a_broker_certificate_from_another_ca_is_a_clear_error() {
    let mut conn = scram();
    conn.properties.retain(|(k, _)| *k != "ssl.ca.location");
    conn.properties.push(("ssl.ca.location", common::env_var("KAFKA_UNTRUSTED_CA_FILE")));
    refused("other-ca", conn, "certificate verify failed", "set ssl.ca.location to your Kafka service's CA file").await;
}

#[tokio::test]
async fn a_wrong_scram_password_is_a_clear_error() {
    let conn = sasl_ssl("SCRAM-SHA-512", &common::env_var("KAFKA_SCRAM_USER"), "wrong-scram-password-42".into());
    let kc = refused("wrong-scram", conn, "Authentication failed", "check sasl.mechanism").await;
    assert!(!kc.log().contains("wrong-scram-password-42"), "the wrong password leaked:\n{}", kc.log());
}

#[tokio::test]
async fn a_client_certificate_the_broker_refuses_is_a_clear_error() {
    let mut conn = mutual_tls("KAFKA_UNTRUSTED_CLIENT_CERT", "KAFKA_UNTRUSTED_CLIENT_KEY");
    // That key is not encrypted: no password.
    conn.properties.retain(|(k, _)| *k != "ssl.key.password");
    refused("stranger", conn, "alert bad certificate", "a certificate signed by a CA the broker trusts").await;
}

/// A TCP forwarder on 127.0.0.2 (not in the broker certificate's names) to `target`.
async fn forwarder(target: String) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.expect("bind 127.0.0.2");
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn a_broker_address_the_certificate_does_not_name_is_a_clear_error() {
    let (addr, task) = forwarder(common::env_var("KAFKA_SSL_BROKERS")).await;
    let conn = Secured { brokers: addr, properties: vec![("security.protocol", "SSL".into()), ca()], env: vec![] };
    refused("hostname", conn, "certificate verify failed", "subject alternative names").await;
    task.abort();
}

/// With no `ssl.ca.location`, OpenSSL's `SSL_CERT_FILE` is honoured (here: the test CA as
/// the trust store), and without it kubecast trusts the system CA bundle, which does not hold
/// the test CA: a clear verification error.
#[tokio::test]
async fn without_a_ca_setting_the_system_trust_store_is_used() {
    tls_listeners_up();
    let plain_ssl = || Secured {
        brokers: common::env_var("KAFKA_SSL_BROKERS"),
        properties: vec![("security.protocol", "SSL".into())],
        env: vec![("SSL_CERT_FILE", common::env_var("KAFKA_CA_FILE"))],
    };
    let client = client().await;
    let ns = TestNamespace::new(&client, "tls-system-ca").await;
    let cluster = cluster_name();
    let topic = format!("tls-system-ca.{cluster}");
    create_cm(&client, &ns.name, "one", json!({}), json!({"v": "1"})).await;
    let conn = plain_ssl();
    let mut kc = Kubecast::start_with_sink(
        &watch_config(&cluster, &ns.name),
        &sink(&conn.brokers, &topic, "", &conn.properties),
        "",
        &conn.env(),
    );
    kc.wait_ready(200).await;
    let one = format!("{}/one", ns.name);
    subjects(&topic, false, |s| s.contains(&one)).await;
    assert!(kc.stop().success(), "{}", kc.log());
    assert!(kc.log().contains("OpenSSL reads the trusted CAs from SSL_CERT_FILE"), "{}", kc.log());

    // Empty: as if unset (the machine running the tests may set them).
    let mut conn = plain_ssl();
    conn.env = vec![("SSL_CERT_FILE", String::new()), ("SSL_CERT_DIR", String::new())];
    let kc = refused("system-ca", conn, "certificate verify failed", "without it kubecast trusts the system CA bundle")
        .await;
    assert!(kc.log().contains("trusting the system CA bundle"), "the bundle is named at DEBUG:\n{}", kc.log());
}

/// A client key that cannot be decrypted (a wrong `ssl.key.password`) stops kubecast at start
/// with the property and the fix, neither password in the log.
#[tokio::test]
async fn a_wrong_key_password_is_an_error_at_start() {
    let mut conn = mutual_tls("KAFKA_CLIENT_CERT", "KAFKA_CLIENT_KEY");
    conn.properties.retain(|(k, _)| !k.starts_with("ssl.certificate") && !k.starts_with("ssl.key"));
    conn.properties.push(("ssl.certificate.location", common::env_var("KAFKA_CLIENT_CERT")));
    conn.properties.push(("ssl.key.location", common::env_var("KAFKA_CLIENT_KEY")));
    conn.properties.push(("ssl.key.password", "${env:TLS_TEST_KEY_PASSWORD}".into()));
    conn.env = vec![("TLS_TEST_KEY_PASSWORD", "wrong-key-password-7".into())];
    let cluster = cluster_name();
    let mut kc = Kubecast::start_with_sink(
        &watch_config(&cluster, "tls-key-nothing"),
        &sink(&conn.brokers, &format!("tls-key.{cluster}"), "", &conn.properties),
        "",
        &conn.env(),
    );
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success(), "{}", kc.log());
    let log = kc.log();
    assert!(log.contains("ssl.key.location failed") && log.contains("set ssl.key.password"), "{log}");
    assert!(!log.contains("wrong-key-password-7"), "the password leaked:\n{log}");
    assert_no_secret(&log);
}

/// The dead letter over mutual TLS: a record over the topic's size limit goes to the
/// dead-letter topic through the same TLS connection, and the stream goes on.
#[tokio::test]
async fn the_dead_letter_goes_over_mutual_tls_too() {
    tls_listeners_up();
    let client = client().await;
    let ns = TestNamespace::new(&client, "tls-dead-letter").await;
    let cluster = cluster_name();
    let topic = format!("tls-small.{cluster}");
    let dead = format!("tls-dead.{cluster}");
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", common::env_var("KAFKA_BROKERS")).create().unwrap();
    let small_topic = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", "20000");
    let created = admin.create_topics(&[small_topic], &AdminOptions::new()).await.unwrap();
    created[0].as_ref().expect("topic created");
    let conn = mutual_tls("KAFKA_CLIENT_CERT", "KAFKA_CLIENT_KEY");
    let dead_letter = format!("[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"{dead}\"\n");
    let mut kc = Kubecast::start_with_sink(
        &watch_config(&cluster, &ns.name),
        &(sink(&conn.brokers, &topic, "", &conn.properties) + &dead_letter),
        "flush_interval_ms = 100",
        &conn.env(),
    );
    kc.wait_log("list complete", 1).await;
    create_cm(&client, &ns.name, "big", json!({}), json!({"blob": "x".repeat(50_000)})).await;
    create_cm(&client, &ns.name, "small", json!({}), json!({"v": "1"})).await;
    let small = format!("{}/small", ns.name);
    subjects(&topic, false, |s| s.contains(&small)).await;
    let dl = header_values(&dead, "kubecast_original_destination", false, |s| !s.is_empty()).await;
    assert_eq!(dl, [topic.as_str()], "the big event, dead-lettered");
    assert!(kc.log().contains("writing it to the dead letter"), "{}", kc.log());
    assert!(kc.stop().success(), "{}", kc.log());
    assert_no_secret(&kc.log());
}
