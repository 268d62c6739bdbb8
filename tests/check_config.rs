//! `kubecast check-config`: valid configs pass with a summary, bad ones fail with a message
//! that names the key and the fix. No server is needed.

use std::process::Command;

fn check(toml: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubecast.toml");
    std::fs::write(&path, toml).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kubecast"));
    cmd.args(["check-config", "--config"]).arg(&path);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

const GOOD: &str = r#"
[cluster]
name = "demo"
[sink]
type = "stdout"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
"#;

#[test]
fn an_empty_config_variable_is_named() {
    let out =
        Command::new(env!("CARGO_BIN_EXE_kubecast")).arg("check-config").env("KUBECAST_CONFIG", "").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("KUBECAST_CONFIG is set but empty") && err.contains("fix:"), "{err}");
}

/// The variables Kubernetes puts in pods for a Service named `kubecast-admin` in their
/// namespace (service links) look like overrides with one underscore: they are not refused.
#[test]
fn a_service_s_link_variables_are_not_taken_for_overrides() {
    let links = [
        ("KUBECAST_ADMIN_SERVICE_HOST", "10.0.0.1"),
        ("KUBECAST_ADMIN_SERVICE_PORT", "9090"),
        ("KUBECAST_ADMIN_PORT", "tcp://10.0.0.1:9090"),
        ("KUBECAST_ADMIN_PORT_9090_TCP", "tcp://10.0.0.1:9090"),
        ("KUBECAST_ADMIN_PORT_9090_TCP_PROTO", "tcp"),
        ("KUBECAST_ADMIN_PORT_9090_TCP_PORT", "9090"),
        ("KUBECAST_ADMIN_PORT_9090_TCP_ADDR", "10.0.0.1"),
    ];
    let (ok, _, err) = check(GOOD, &links);
    assert!(ok, "{err}");
}

#[test]
fn a_valid_config_passes_with_a_one_line_summary() {
    let (ok, out, err) = check(GOOD, &[]);
    assert!(ok, "{err}");
    assert_eq!(out.lines().count(), 1);
    assert!(
        out.starts_with("config OK: cluster \"demo\", sink stdout, 1 resource(s): v1 ConfigMap (all namespaces)"),
        "{out}"
    );
}

#[test]
fn environment_overrides_use_double_underscores() {
    let (ok, out, err) = check(
        GOOD,
        &[("KUBECAST_SINK__TYPE", "file"), ("KUBECAST_SINK__PATH", "/tmp/x.jsonl"), ("KUBECAST_CLUSTER__NAME", "prod")],
    );
    assert!(ok, "{err}");
    assert!(out.contains("cluster \"prod\", sink file /tmp/x.jsonl"), "{out}");
    // The CLI's own variables are not config keys.
    let (ok, _, err) = check(GOOD, &[("KUBECAST_LOG_FORMAT", "json")]);
    assert!(ok, "{err}");
}

#[test]
fn the_embedded_defaults_are_valid() {
    let out = Command::new(env!("CARGO_BIN_EXE_kubecast"))
        .arg("check-config")
        .env_remove("KUBECAST_CONFIG")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("config OK"));
}

#[test]
fn two_entries_watching_one_stream_are_refused_naming_both() {
    let twice = format!("{GOOD}\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n");
    let (ok, _, err) = check(&twice, &[]);
    assert!(!ok, "accepted: {err}");
    assert!(err.contains("`resources[1]`") && err.contains("same stream as resources[0]"), "{err}");
    assert!(err.contains("emitted twice") && err.contains("fix: merge resources[1] into resources[0]"), "{err}");
    // Selectors spelt two ways that select the same objects.
    let spelt = r#"
[[resources]]
api_version = "v1"
kind = "Pod"
label_selector = "app=web,tier=db"
[[resources]]
api_version = "v1"
kind = "Pod"
label_selector = "tier==db, app==web"
"#;
    let (ok, _, err) = check(spelt, &[]);
    assert!(!ok && err.contains("same stream as resources[0]"), "accepted or not named: {err}");
    // One namespace in common is one stream in common.
    let overlap = r#"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
namespaces = ["a", "b"]
[[resources]]
api_version = "v1"
kind = "ConfigMap"
namespaces = ["c", "b"]
"#;
    let (ok, _, err) = check(overlap, &[]);
    assert!(!ok && err.contains("v1 ConfigMap in namespace b"), "{err}");
    // Other selectors: other streams, both allowed.
    let other =
        format!("{GOOD}\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nlabel_selector = \"app=x\"\n");
    let (ok, _, err) = check(&other, &[]);
    assert!(ok, "{err}");
}

#[test]
fn a_missing_config_file_is_an_error_not_an_empty_config() {
    let out = Command::new(env!("CARGO_BIN_EXE_kubecast"))
        .args(["check-config", "--config", "/nonexistent/kubecast.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/kubecast.toml") && err.contains("cannot be read"), "{err}");
}

/// (what is wrong, config, env, fragments the message must contain)
type BadCase = (&'static str, &'static str, &'static [(&'static str, &'static str)], &'static [&'static str]);

const BAD: &[BadCase] = &[
    ("TOML syntax error", "[cluster\nname = 1", &[], &["line 1", "fix:"]),
    (
        "a Kafka producer that reports only failed deliveries (no event would ever count as delivered)",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[sink.kafka.properties]\n\"delivery.report.only.error\" = \"true\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &[
            "sink.kafka.properties.\"delivery.report.only.error\"",
            "requires delivery.report.only.error = false",
            "fix: remove it",
        ],
    ),
    (
        "a lease renewed less often than it expires",
        "[coordination]\nenabled = true\nlease_duration_seconds = 5\nrenew_deadline_seconds = 10\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_duration_seconds", "lease_duration_seconds (5) >= renew_deadline_seconds (10)", "fix:"],
    ),
    (
        "a renew deadline so large that deadline + retry period would wrap around",
        "[coordination]\nenabled = true\nlease_duration_seconds = 15\nrenew_deadline_seconds = 4294967295\nretry_period_seconds = 1\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_duration_seconds", "renew_deadline_seconds (4294967295)"],
    ),
    (
        "a lease duration of days",
        "[coordination]\nenabled = true\nlease_duration_seconds = 86400\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_duration_seconds", "is 86400; at most 3600"],
    ),
    (
        "a lease namespace that cannot exist",
        "[coordination]\nenabled = true\nlease_namespace = \"kube_system\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_namespace", "\"kube_system\" is not a namespace name"],
    ),
    (
        "a shutdown timeout of years",
        "[delivery]\nshutdown_timeout_seconds = 9223372036854775807\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["delivery.shutdown_timeout_seconds", "at most 3600"],
    ),
    (
        "a JetStream duplicate window of zero (the server's 2 minutes)",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\ncreate_stream = true\n[sink.nats.stream]\nduplicate_window_seconds = 0\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.nats.stream.duplicate_window_seconds", "it must be 1 to"],
    ),
    (
        "a JetStream duplicate window longer than the stream keeps messages",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\ncreate_stream = true\n[sink.nats.stream]\nmax_age_seconds = 60\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.nats.stream.duplicate_window_seconds", "longer than stream.max_age_seconds (60)"],
    ),
    (
        "a delivery timeout the Kafka store's transactional producer refuses",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[sink.kafka.properties]\n\"message.timeout.ms\" = \"120000\"\n[checkpoint]\nstore = \"kafka\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.kafka.properties.\"message.timeout.ms\"", "is 120000", "at most 60000"],
    ),
    (
        "exactly-once with state-store properties of its own (the events would not go out with the sink's SASL)",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\nexactly_once = true\n[sink.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"u\"\n\"sasl.password\" = \"${env:HOME}\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"k:9092\"\n[checkpoint.kafka.properties]\n\"compression.type\" = \"zstd\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &[
            "checkpoint.kafka.properties",
            "\"compression.type\"",
            "one producer",
            "move them to [sink.kafka.properties]",
        ],
    ),
    (
        "state-store properties without the state store's own brokers",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka.properties]\n\"security.protocol\" = \"SSL\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["checkpoint.kafka.properties", "only used with checkpoint.kafka.brokers"],
    ),
    (
        "the Kafka store's brokers while the positions go to files",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[checkpoint.kafka]\nbrokers = \"other:9092\"\ntopic = \"my-state\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &[
            "checkpoint.kafka.brokers",
            "only used with checkpoint.store = \"kafka\", and the store is \"file\"",
            "set checkpoint.store = \"kafka\"",
        ],
    ),
    (
        "the NATS store's server while the positions go to Kafka",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.nats]\nurl = \"nats://n:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["checkpoint.nats.url", "only used with checkpoint.store = \"nats\", and the store is \"kafka\""],
    ),
    (
        "a state-store secret from a variable that is not set",
        "[sink]\ntype = \"stdout\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"k:9092\"\n[checkpoint.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"u\"\n\"sasl.password\" = \"${env:KUBECAST_TEST_SURELY_UNSET}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["checkpoint.kafka.properties.\"sasl.password\"", "KUBECAST_TEST_SURELY_UNSET is not set"],
    ),
    (
        "a Kafka topic template that makes no topic name",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\ntopic = \"kubecast events.{kind}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.kafka.topic", "does not make a Kafka topic name", "only ASCII letters, digits"],
    ),
    (
        "a resource's Kafka topic with a slash",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\ntopic = \"kubecast/{resource}\"",
        &[],
        &["resources[0].topic", "does not make a Kafka topic name"],
    ),
    (
        "a NATS dead-letter subject with a wildcard",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\n[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"dl.*\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["delivery.dead_letter.destination", "\"dl.*\" is not a NATS subject"],
    ),
    (
        "a Kafka dead-letter topic with a space",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[delivery.dead_letter]\ntype = \"broker\"\ndestination = \"dead letters\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["delivery.dead_letter.destination", "\"dead letters\" is not a Kafka topic name"],
    ),
    (
        "a sampling ratio from the environment that is not one",
        "[telemetry]\ntraces = true\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[("OTEL_TRACES_SAMPLER_ARG", "10%")],
        &["telemetry.sampling_ratio", "OTEL_TRACES_SAMPLER_ARG=\"10%\"", "not a number between 0 and 1"],
    ),
    (
        "a dead-letter destination for the file type",
        "[delivery.dead_letter]\ndestination = \"kubecast.dead-letter\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["delivery.dead_letter.destination", "only used with type = \"broker\""],
    ),
    (
        "an nkey seed that is not one",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\nnkey_seed = \"SUAnotAseedSecretXYZ\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.nats.nkey_seed", "is not a valid nkey seed (its value not shown)"],
    ),
    (
        "a CA file that is not PEM",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"tls://n:4222\"\n[sink.nats.tls]\nca_file = \"/etc/passwd\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["sink.nats.tls.ca_file", "/etc/passwd holds no PEM block"],
    ),
    (
        "shards without coordination",
        "[coordination]\nshards = 4\n[checkpoint]\nstore = \"nats\"\n[checkpoint.nats]\nurl = \"nats://x:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.shards", "coordination.enabled is false", "fix: set coordination.enabled = true"],
    ),
    (
        "no shards",
        "[coordination]\nenabled = true\nshards = 0\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.shards", "is 0; it must be between 1 and 256"],
    ),
    (
        "a shards' lease name longer than a label value",
        "[coordination]\nenabled = true\nshards = 2\nlease_name = \"kubecast-production-eu-west-1-payments-and-orders-platform-events\"\n[checkpoint]\nstore = \"nats\"\n[checkpoint.nats]\nurl = \"nats://x:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_name", "65 characters", "at most 63"],
    ),
    (
        "shards with the state in one replica's directory",
        "[coordination]\nenabled = true\nshards = 2\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.shards", "checkpoint.store is \"file\"", "set checkpoint.store = \"kafka\" or \"nats\""],
    ),
    (
        "the dead letter in the sink's own file",
        "[sink]\ntype = \"file\"\npath = \"/tmp/e.jsonl\"\n[delivery.dead_letter]\npath = \"/tmp/e.jsonl\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["delivery.dead_letter.path", "sink.path", "a file of its own"],
    ),
    (
        "unknown top-level key",
        "[clusterr]\nname = \"x\"",
        &[],
        &["unknown key `clusterr`", "cluster, checkpoint, sink, delivery, admin, telemetry, resources"],
    ),
    (
        "unknown nested key",
        "[sink]\ntype = \"stdout\"\npaht = \"x\"",
        &[],
        &["sink.paht", "unknown key `paht`", "type, path"],
    ),
    ("wrong type", "[cluster]\nname = 5", &[], &["cluster.name", "wrong type", "string"]),
    (
        "a lease name the apiserver refuses",
        "[coordination]\nenabled = true\nlease_name = \"Bad_Name!\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["coordination.lease_name", "\"Bad_Name!\" is not a Lease name", "kubecast-prod"],
    ),
    (
        "an admin address without a port",
        "[admin]\nlisten = \"notanaddr\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"",
        &[],
        &["admin.listen", "\"notanaddr\" is not an address to listen on", "0.0.0.0:9090"],
    ),
    (
        "a negative number where a count goes",
        "[delivery]\nmax_in_flight = -5",
        &[],
        &["delivery.max_in_flight", "found signed int `-5`", "fix: write a whole number, 0 or more"],
    ),
    (
        "a text where a list goes",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nnamespaces = \"default\"",
        &[],
        &["resources[0].namespaces", "expected a list", "fix: write a list (e.g. [\"a\", \"b\"])"],
    ),
    (
        "too small a bound on the uncommitted events",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\nmax_uncommitted_events = 0\nmax_uncommitted_bytes = 1000",
        &[],
        &[
            "sink.kafka.max_uncommitted_events",
            "is 0",
            "sink.kafka.max_uncommitted_bytes",
            "below the minimum of 65536",
        ],
    ),
    ("unknown sink type", "[sink]\ntype = \"kafak\"", &[], &["sink.type", "\"kafak\"", "stdout, file, kafka, nats"]),
    ("file sink without path", "[sink]\ntype = \"file\"", &[], &["sink.path", "is required", "KUBECAST_SINK__PATH"]),
    (
        "path on a stdout sink",
        "[sink]\ntype = \"stdout\"\npath = \"x\"",
        &[],
        &["sink.path", "only used by sink.type = \"file\""],
    ),
    ("missing kind", "[[resources]]\napi_version = \"v1\"", &[], &["resources[0]", "`kind`", "missing"]),
    (
        "empty kind",
        "[[resources]]\napi_version = \"v1\"\nkind = \"\"",
        &[],
        &["resources[0].kind", "must not be empty"],
    ),
    (
        "plural instead of kind",
        "[[resources]]\napi_version = \"v1\"\nkind = \"configmaps\"",
        &[],
        &["resources[0].kind", "CamelCase"],
    ),
    (
        "bad api_version",
        "[[resources]]\napi_version = \"apps\"\nkind = \"Deployment\"",
        &[],
        &["resources[0].api_version", "\"apps/v1\""],
    ),
    (
        "bad label selector",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nlabel_selector = \"app in web\"",
        &[],
        &["resources[0].label_selector", "parentheses"],
    ),
    (
        "bad field selector",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nfield_selector = \"status.phase\"",
        &[],
        &["resources[0].field_selector", "no operator"],
    ),
    (
        "unknown event verb",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nevents = [\"created\"]",
        &[],
        &["resources[0].events[0]", "\"created\"", "added, modified, deleted"],
    ),
    (
        "empty events",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nevents = []",
        &[],
        &["resources[0].events", "is empty"],
    ),
    (
        "bad namespace",
        "[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\nnamespaces = [\"Prod_1\"]",
        &[],
        &["resources[0].namespaces[0]", "not a valid namespace"],
    ),
    ("nats sink without its table", "[sink]\ntype = \"nats\"", &[], &["sink.nats", "is required", "url = "]),
    (
        "unknown nats key",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurls = \"nats://x:4222\"",
        &[],
        &["sink.nats.urls", "unknown key", "url"],
    ),
    (
        "wildcard in a nats subject",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\nsubject = \"kubecast.*.{kind}\"",
        &[],
        &["sink.nats.subject", "not make a valid NATS subject", "kubecast.{cluster}"],
    ),
    (
        "nats user without password",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\nuser = \"kubecast\"",
        &[],
        &["sink.nats.password", "go together"],
    ),
    (
        "two nats auth methods",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\ntoken = \"t\"\nnkey_seed = \"SU\"",
        &[],
        &["sink.nats.user", "more than one of"],
    ),
    (
        "nats secret from an unset variable",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\ntoken = \"${env:KUBECAST_TEST_UNSET_TOKEN}\"",
        &[],
        &["sink.nats.token", "KUBECAST_TEST_UNSET_TOKEN is not set"],
    ),
    (
        "missing nats credentials file",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\ncredentials_file = \"/nonexistent/k.creds\"",
        &[],
        &["sink.nats.credentials_file", "/nonexistent/k.creds"],
    ),
    (
        "nats stream subjects cannot be derived",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\nsubject = \"{cluster}.x\"\ncreate_stream = true",
        &[],
        &["sink.nats.stream.subjects", "cannot be derived"],
    ),
    (
        "kafka topic on a nats resource",
        "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"\ntopic = \"x\"",
        &[],
        &["resources[0].topic", "only used by the kafka sink", "use `subject`"],
    ),
    (
        "bad telemetry sampling ratio",
        "[telemetry]\ntraces = true\nsampling_ratio = 2.0",
        &[],
        &["telemetry.sampling_ratio", "not between 0 and 1"],
    ),
    (
        "bad telemetry endpoint",
        "[telemetry]\nendpoint = \"otel-collector:4318\"",
        &[],
        &["telemetry.endpoint", "not an http(s) URL"],
    ),
    (
        "a SASL mechanism without its password",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9093\"\n[sink.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"SCRAM-SHA-512\"\n\"sasl.username\" = \"u\"",
        &[],
        &["sink.kafka.properties.\"sasl.password\"", "SCRAM-SHA-512 needs a user name and a password"],
    ),
    (
        "SASL over TLS without a mechanism (GSSAPI)",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9093\"\n[sink.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.username\" = \"u\"\n\"sasl.password\" = \"p\"",
        &[],
        &["sink.kafka.properties.\"sasl.mechanism\"", "GSSAPI", "SCRAM-SHA-512"],
    ),
    (
        "SASL settings without a SASL protocol",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9093\"\n[sink.kafka.properties]\n\"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"u\"\n\"sasl.password\" = \"p\"",
        &[],
        &["sink.kafka.properties.\"sasl.mechanism\"", "no SASL login", "SASL_SSL"],
    ),
    (
        "a missing ssl.ca.location file",
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9093\"\n[sink.kafka.properties]\n\"security.protocol\" = \"SSL\"\n\"ssl.ca.location\" = \"/nonexistent/kafka-ca.crt\"",
        &[],
        &["sink.kafka.properties.\"ssl.ca.location\"", "/nonexistent/kafka-ca.crt", "does not exist"],
    ),
    (
        "a missing client key file of the state store's own connection",
        "[sink]\ntype = \"stdout\"\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"k:9093\"\n[checkpoint.kafka.properties]\n\"security.protocol\" = \"SSL\"\n\"ssl.certificate.location\" = \"/nonexistent/client.crt\"\n\"ssl.key.location\" = \"/nonexistent/client.key\"",
        &[],
        &[
            "checkpoint.kafka.properties.\"ssl.key.location\"",
            "/nonexistent/client.key",
            "checkpoint.kafka.properties.\"ssl.certificate.location\"",
        ],
    ),
    ("no resources", "[cluster]\nname = \"x\"", &[], &["`resources`", "nothing would be watched"]),
    ("bad cluster name", "[cluster]\nname = \"Prod EU\"", &[], &["cluster.name", "lower-case"]),
    (
        "a gathering window too long",
        "[cluster]\nwatch_gather_ms = 500",
        &[],
        &["cluster.watch_gather_ms", "500 ms", "0 (off) to 50"],
    ),
    (
        "an env override of a section that does not exist",
        "",
        &[("KUBECAST_CHECKPOINT_KAFKA__TOPIC", "positions")],
        &["checkpoint_kafka", "KUBECAST_CHECKPOINT_KAFKA__TOPIC", "checkpoint"],
    ),
    (
        "an env override of a resource entry",
        "",
        &[("KUBECAST_RESOURCES__0__KIND", "Secret")],
        &["resources", "KUBECAST_RESOURCES__0__KIND", "cannot be set from the environment"],
    ),
    (
        "an env override with one underscore after the section",
        "",
        &[("KUBECAST_SINK_TYPE", "kafka")],
        &["sink.type", "KUBECAST_SINK_TYPE is not read", "KUBECAST_SINK__TYPE"],
    ),
    (
        "bad env override",
        "",
        &[("KUBECAST_SINK__TYPE", "nope")],
        &["sink.type", "KUBECAST_SINK__TYPE", "stdout, file, kafka, nats"],
    ),
];

#[test]
fn bad_configs_are_rejected_naming_the_key_and_the_fix() {
    let resource = "\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n";
    for (what, toml, env, fragments) in BAD {
        // Add a valid resource where the case is not about resources, so only one thing is wrong.
        let toml = if toml.contains("[[resources]]") || what.contains("no resources") || what.contains("syntax") {
            toml.to_string()
        } else {
            format!("{toml}\n{resource}")
        };
        let (ok, out, err) = check(&toml, env);
        assert!(!ok, "{what}: accepted, printed {out}");
        assert!(err.contains("fix"), "{what}: no fix given: {err}");
        for f in *fragments {
            assert!(err.contains(f), "{what}: message lacks {f:?}:\n{err}");
        }
    }
}

#[test]
fn the_example_configs_in_config_dir_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let out = Command::new(env!("CARGO_BIN_EXE_kubecast"))
                .arg("check-config")
                .arg("--config")
                .arg(&path)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}: {}", path.display(), String::from_utf8_lossy(&out.stderr));
            n += 1;
        }
    }
    assert!(n >= 2, "config/ has the embedded defaults and the documented example");
}

/// A broker state store needs a connection: the sink's (of its kind) or its own.
#[test]
fn a_broker_store_without_a_connection_is_refused_naming_the_fix() {
    let (ok, _, err) = check(&format!("{GOOD}\n[checkpoint]\nstore = \"kafka\"\n"), &[]);
    assert!(!ok);
    assert!(err.contains("checkpoint.store") && err.contains("checkpoint.kafka.brokers"), "{err}");
    let (ok, _, err) = check(&format!("{GOOD}\n[checkpoint]\nstore = \"nats\"\n"), &[]);
    assert!(!ok);
    assert!(err.contains("checkpoint.store") && err.contains("checkpoint.nats.url"), "{err}");
    let (ok, _, err) = check(&format!("{GOOD}\n[checkpoint]\nstore = \"redis\"\n"), &[]);
    assert!(!ok, "an unknown store");
    assert!(err.contains("redis"), "{err}");
    let (ok, _, err) = check(
        &format!(
            "{GOOD}\n[checkpoint]\nstore = \"nats\"\n[checkpoint.nats]\nbucket = \"a.b\"\nurl = \"nats://x:4222\"\n"
        ),
        &[],
    );
    assert!(!ok);
    assert!(err.contains("checkpoint.nats.bucket"), "{err}");
    let (ok, _, err) =
        check(&format!("{GOOD}\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"k:9092\"\n"), &[]);
    assert!(ok, "its own brokers: {err}");
}

/// Exactly-once needs the state in the sink's Kafka cluster and a commit interval well under
/// the transaction timeout.
#[test]
fn exactly_once_without_the_kafka_store_of_the_sinks_cluster_is_refused_naming_the_fix() {
    let eos = r#"
[cluster]
name = "demo"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
[sink]
type = "kafka"
[sink.kafka]
brokers = "k:9092"
exactly_once = true
"#;
    let (ok, _, err) = check(&format!("{eos}\n[checkpoint]\nstore = \"file\"\n"), &[]);
    assert!(!ok, "a file store");
    assert!(err.contains("sink.kafka.exactly_once") && err.contains("store = \"kafka\""), "{err}");
    let (ok, _, err) =
        check(&format!("{eos}\n[checkpoint]\nstore = \"kafka\"\n[checkpoint.kafka]\nbrokers = \"other:9092\"\n"), &[]);
    assert!(!ok, "another cluster");
    assert!(err.contains("checkpoint.kafka.brokers") && err.contains("remove"), "{err}");
    let (ok, _, err) = check(&format!("{eos}\n[checkpoint]\nstore = \"kafka\"\nflush_interval_ms = 60000\n"), &[]);
    assert!(!ok, "a commit interval past the transaction timeout");
    assert!(err.contains("checkpoint.flush_interval_ms") && err.contains("30000"), "{err}");
    let (ok, _, err) = check(&format!("{eos}\n[checkpoint]\nstore = \"kafka\"\n"), &[]);
    assert!(ok, "the Kafka store on the sink's cluster: {err}");
    // A commit waits for no rate limit: any rate and number in flight work with exactly-once.
    let (ok, _, err) = check(
        &format!("{eos}\n[checkpoint]\nstore = \"kafka\"\n[delivery]\nrate_per_second = 1\nmax_in_flight = 100000\n"),
        &[],
    );
    assert!(ok, "a low rate limit and many events in flight: {err}");
    // The transactional producer's properties are kubecast's.
    for (property, says) in
        [("transactional.id", "names its transactional producer itself"), ("transaction.timeout.ms", "60000")]
    {
        let (ok, _, err) = check(
            &format!("{eos}[sink.kafka.properties]\n\"{property}\" = \"90000\"\n[checkpoint]\nstore = \"kafka\"\n"),
            &[],
        );
        assert!(!ok, "{property}");
        assert!(
            err.contains(&format!("sink.kafka.properties.\"{property}\""))
                && err.contains(says)
                && err.contains("remove it"),
            "{err}"
        );
    }
}

#[test]
fn shards_with_coordination_and_a_broker_store_pass() {
    let toml = "[coordination]\nenabled = true\nshards = 4\n[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://x:4222\"\n[checkpoint]\nstore = \"nats\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, out, err) = check(toml, &[]);
    assert!(ok, "{err}");
    assert!(out.starts_with("config OK"), "{out}");
}

#[test]
fn secrets_in_urls_and_misspelled_kafka_properties_are_never_printed() {
    // A NATS URL with a password: the summary shows the user, not the password.
    let nats = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://kubecast:UrlPw-S3cr3t@nats:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, out, err) = check(nats, &[]);
    assert!(ok, "{err}");
    assert!(out.contains("nats://kubecast:***@nats:4222") && !out.contains("S3cr3t"), "{out}");
    // A misspelled property with a secret from the environment: refused by name, without it.
    let kafka = "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[sink.kafka.properties]\n\"security.protocol\" = \"SASL_SSL\"\n\"sasl.mechanism\" = \"PLAIN\"\n\"sasl.username\" = \"u\"\n\"sasl.pasword\" = \"${env:KUBECAST_TEST_TYPO_SECRET}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, out, err) = check(kafka, &[("KUBECAST_TEST_TYPO_SECRET", "TypoPw-S3cr3t")]);
    assert!(!ok, "accepted: {out}");
    assert!(
        err.contains("sink.kafka.properties.\"sasl.pasword\"") && err.contains("no property of that name"),
        "{err}"
    );
    assert!(err.contains("CONFIGURATION.md"), "{err}");
    assert!(!err.contains("S3cr3t") && !out.contains("S3cr3t"), "{err}");
    // A malformed address with a password: named, without the password.
    let bad = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://u:BadUrlPw-S3cr3t@nats//x 4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, _, err) = check(bad, &[]);
    assert!(!ok);
    assert!(err.contains("sink.nats.url") && err.contains("not a NATS server address"), "{err}");
    assert!(!err.contains("S3cr3t"), "{err}");
    let store = "[checkpoint]\nstore = \"nats\"\n[checkpoint.nats]\nurl = \"nats//127.0.0.1 14222\"\n[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, _, err) = check(store, &[]);
    assert!(!ok);
    assert!(err.contains("checkpoint.nats.url") && err.contains("scheme://host:port"), "{err}");
    // A password with a `/` (unencoded base64) in the URL: refused, shown masked.
    let slash = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://u:Sl/ashPw-S3cr3t==@nats:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, _, err) = check(slash, &[]);
    assert!(!ok);
    assert!(err.contains("nats://u:***@nats:4222") && err.contains("%2F"), "{err}");
    assert!(!err.contains("S3cr3t"), "{err}");
    // A token of digits from the environment is read as a number: refused, without the value.
    let token = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, out, err) = check(token, &[("KUBECAST_SINK__NATS__TOKEN", "8731209945")]);
    assert!(!ok, "accepted: {out}");
    assert!(err.contains("sink.nats.token") && err.contains("a whole number (not shown"), "{err}");
    assert!(err.contains("KUBECAST_SINK__NATS__TOKEN") && err.contains("quoted"), "{err}");
    assert!(!err.contains("8731209945"), "{err}");
    // An nkey seed that is not one: refused at check time, without its value.
    let seed = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://n:4222\"\nnkey_seed = \"SUAnotAseedS3cr3t\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Pod\"";
    let (ok, _, err) = check(seed, &[]);
    assert!(!ok && err.contains("sink.nats.nkey_seed"), "{err}");
    assert!(!err.contains("S3cr3t"), "{err}");
}

/// A dead-letter file or a file state store on a tmpfs (here `/dev/shm`; in a pod, an emptyDir
/// or a memory medium) goes with the pod or the machine: a warning naming the file, the mount
/// and the fix, found from the process's own mounts. Not for a directory on a disk.
#[test]
fn files_on_storage_that_goes_with_the_pod_are_warned_about() {
    let shm = std::path::Path::new("/dev/shm");
    let on_tmpfs = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some("/dev/shm"))
        .is_some_and(|l| l.contains(" - tmpfs "));
    assert!(on_tmpfs && shm.is_dir(), "this test needs /dev/shm on a tmpfs (as on Linux by default)");
    let config = format!("{GOOD}[checkpoint]\ndir = \"/dev/shm/kubecast-check-config-test/state\"\n");
    let (ok, _, err) = check(&config, &[]);
    assert!(ok, "a warning, not an error: {err}");
    assert!(
        err.contains("kubecast: warning: [delivery.dead_letter] the file /dev/shm/kubecast-check-config-test/state/dead-letter.jsonl is on /dev/shm (a tmpfs")
            && err.contains("fix: with a Kafka or NATS sink, type = \"broker\""),
        "{err}"
    );
    assert!(
        err.contains("kubecast: warning: [checkpoint] dir /dev/shm/kubecast-check-config-test/state is on /dev/shm"),
        "{err}"
    );
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = format!("{GOOD}[checkpoint]\ndir = \"{}\"\n", disk.path().display());
    let (ok, _, err) = check(&config, &[]);
    assert!(ok && !err.contains("warning"), "{err}");
}
