//! Start-up refusals that name what is wrong: a second process on one checkpoint directory,
//! a broken kubeconfig named by `KUBECONFIG`; the admin server up before the sink.

use kubecast_kit as common;

use std::process::Command;
use std::time::Duration;

use common::{Kubecast, TestNamespace, client, cm_config};

const WAIT: Duration = Duration::from_secs(60);

fn run_once(config: &std::path::Path, env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(common::bin());
    cmd.args(["run", "--config"]).arg(config).env("KUBECAST_ADMIN__LISTEN", "127.0.0.1:0");
    cmd.env("KUBECONFIG", common::kubeconfig());
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Bounded: a process that is not refused would run until killed.
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            return (status.success(), err);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kubecast was not refused within {WAIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn a_second_process_on_one_checkpoint_directory_is_refused_naming_the_first() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "lock").await;
    let mut first = Kubecast::start(&cm_config(&ns.name, ""));
    first.wait_log("list complete", 1).await;
    let (ok, err) = run_once(&first.dir.path().join("kubecast.toml"), &[]);
    assert!(!ok, "a second process was accepted:\n{err}");
    assert!(err.contains("is in use by another kubecast process (pid "), "{err}");
    assert!(err.contains(&first.dir.path().join("state").display().to_string()), "names the directory: {err}");
    assert!(err.contains("fix:"), "{err}");
    // The first one is undisturbed and stops cleanly; then the directory is free again.
    assert!(first.stop().success(), "{}", first.log());
    first.restart(&[]);
    first.wait_log("resuming from checkpoint", 1).await;
    assert!(first.stop().success(), "{}", first.log());
}

#[test]
fn a_broken_kubeconfig_named_by_the_environment_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("kubecast.toml");
    std::fs::write(
        &config,
        format!(
            "[checkpoint]\ndir = \"{}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n",
            dir.path().join("state").display()
        ),
    )
    .unwrap();
    let unparsable = dir.path().join("unparsable-kubeconfig");
    std::fs::write(&unparsable, "clusters: [ this is : not yaml").unwrap();
    let (ok, err) = run_once(&config, &[("KUBECONFIG", unparsable.to_str().unwrap())]);
    assert!(!ok);
    assert!(err.contains(unparsable.to_str().unwrap()), "the file is named: {err}");

    let no_context = dir.path().join("no-context-kubeconfig");
    std::fs::write(&no_context, "apiVersion: v1\nkind: Config\nclusters: []\nusers: []\ncontexts: []\n").unwrap();
    let (ok, err) = run_once(&config, &[("KUBECONFIG", no_context.to_str().unwrap())]);
    assert!(!ok);
    assert!(err.contains(no_context.to_str().unwrap()), "the file is named: {err}");
    assert!(err.contains("fix:"), "{err}");
}

#[tokio::test]
async fn an_unreachable_apiserver_is_named_in_the_log_and_in_readyz() {
    // The test apiserver's kubeconfig, pointed at a port nobody listens on.
    let mut kc: serde_json::Value = serde_yaml_from(&std::fs::read_to_string(common::kubeconfig()).unwrap());
    for c in kc["clusters"].as_array_mut().unwrap() {
        c["cluster"]["server"] = "https://127.0.0.1:9".into();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, kc.to_string()).unwrap();
    let mut k = Kubecast::start_with(&cm_config("default", ""), &[("KUBECONFIG", path.to_str().unwrap())]);
    k.wait_ready_reason("apiserver https://127.0.0.1:9/ not reachable").await;
    k.wait_log("the apiserver cannot be reached", 1).await;
    assert!(k.log().contains("apiserver=https://127.0.0.1:9/"), "{}", k.log());
    assert!(k.stop().success(), "stops cleanly while unreachable\n{}", k.log());
}

/// The admin server answers before the sink is open: a NATS server that cannot be reached
/// holds the opening for up to 10 s, and meanwhile `/livez` is 200 and `/readyz` 503 naming
/// the sink (a liveness probe must not restart a process that waits for its broker).
#[tokio::test]
async fn the_admin_server_answers_while_the_sink_is_opened() {
    let sink = "[sink]\ntype = \"nats\"\n[sink.nats]\nurl = \"nats://127.0.0.1:9\"\nsubject = \"kubecast.x\"\n";
    let mut k = Kubecast::start_with_sink(&cm_config("default", ""), sink, "", &[]);
    k.wait_ready_reason("sink: not open yet").await;
    let (live, _) = k.admin_get("/livez").await;
    assert_eq!(live, 200, "{}", k.log());
    // Stopped while it waits for NATS: how it ends is not what this is about.
    k.stop();
}

/// The kubeconfig as JSON (kube reads JSON as YAML; the test env writes YAML).
fn serde_yaml_from(text: &str) -> serde_json::Value {
    let kc = kube::config::Kubeconfig::from_yaml(text).unwrap();
    serde_json::to_value(kc).unwrap()
}
