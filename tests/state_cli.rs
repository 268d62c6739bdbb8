//! `kubecast state` (list, show, reset, export, import), against the real servers: the state a
//! run left is shown as it is; a file store's export imported into Kafka and NATS lets a run on
//! those stores resume without a snapshot (the changes made meanwhile, deletes included, and
//! nothing else); `reset --to now` makes a run emit nothing for the existing objects, `reset
//! --to snapshot` everything again; a write while another kubecast holds the Lease is refused
//! naming it, `--force` goes through (and the running kubecast is fenced); another cluster's
//! export is refused.

use kubecast_kit as common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Kubecast, TestNamespace, cm_config, create_cm, verb};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// `kubecast state ARGS --config CONFIG`: (success, stdout, stderr).
fn state(config: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::bin())
        .arg("state")
        .args(args)
        .arg("--config")
        .arg(config)
        .env("KUBECONFIG", common::kubeconfig())
        .env("RUST_LOG", "warn")
        .output()
        .expect("run kubecast state");
    let (o, e) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    (out.status.success(), o, e)
}

/// Like [`state`], which must succeed; its stdout.
fn state_ok(config: &Path, args: &[&str]) -> String {
    let (ok, out, err) = state(config, args);
    assert!(ok, "kubecast state {args:?} failed:\n{err}\n{out}");
    out
}

/// A broker store of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    File,
    Kafka,
    Nats,
}

impl Store {
    /// The `[checkpoint]` lines (the file store: the harness's directory).
    fn lines(self, name: &str) -> String {
        match self {
            Store::File => "flush_interval_ms = 100\n".into(),
            Store::Kafka => format!(
                "store = \"kafka\"\nflush_interval_ms = 100\n[checkpoint.kafka]\nbrokers = \"{}\"\ntopic = \"{name}\"\n",
                common::env_var("KAFKA_BROKERS")
            ),
            Store::Nats => format!(
                "store = \"nats\"\nflush_interval_ms = 100\n[checkpoint.nats]\nurl = \"{}\"\nbucket = \"{name}\"\n",
                common::env_var("NATS_URL")
            ),
        }
    }
}

/// The config file a [`Kubecast`] instance runs with.
fn config_of(k: &Kubecast) -> std::path::PathBuf {
    k.dir.path().join("kubecast.toml")
}

/// Writes a config for `kubecast state` alone (no run): `config` with a file sink and
/// `checkpoint` lines, in `dir`.
fn write_config(dir: &Path, file: &str, config: &str, checkpoint: &str) -> std::path::PathBuf {
    let path = dir.join(file);
    let full = format!(
        "{config}\n[sink]\ntype = \"file\"\npath = \"{}\"\n\n[checkpoint]\ndir = \"{}\"\n{checkpoint}\n",
        dir.join("cli-events.jsonl").display(),
        dir.join("cli-state").display()
    );
    std::fs::write(&path, full).unwrap();
    path
}

/// Seconds since the RFC 3339 time `t`.
fn chrono_age(t: &str) -> i64 {
    let then = chrono::DateTime::parse_from_rfc3339(t).unwrap_or_else(|e| panic!("not a time ({e}): {t}"));
    (chrono::Utc::now() - then.with_timezone(&chrono::Utc)).num_seconds()
}

/// `evs` without the events of `common::settle`'s barriers.
fn real(evs: &[Value]) -> Vec<Value> {
    evs.iter().filter(|e| !e["subject"].as_str().unwrap_or("").contains("/barrier-")).cloned().collect()
}

fn subjects(evs: &[Value]) -> BTreeSet<String> {
    evs.iter().map(|e| format!("{} {}", verb(e), e["subject"].as_str().unwrap())).collect()
}

/// A run (file store) leaves 3 objects; `list` (table and JSON) and `show` show them as stored;
/// the export, imported into Kafka and into NATS, lets a run on each resume without a snapshot:
/// exactly the 3 changes made meanwhile (an update, a delete, a create). Another cluster's
/// export and streams the config does not watch are refused.
#[tokio::test]
async fn file_state_exported_and_imported_into_kafka_and_nats_resumes_without_snapshot() {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "statecli").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    for n in ["c1", "c2", "c3"] {
        create_cm(&client, &ns.name, n, json!({}), json!({"a": "1"})).await;
    }
    let config = cm_config(&ns.name, "");
    let mut first = Kubecast::start_with_checkpoint(&config, &Store::File.lines(""), &[]);
    first.wait_for("snapshot", WAIT, |e| e.len() == 3).await;
    assert!(first.stop().success(), "{}", first.log());
    let stored_rv = first.checkpoints()[0]["resource_version"].as_str().unwrap().to_string();
    let cfg = config_of(&first);

    let listed: Value = serde_json::from_str(&state_ok(&cfg, &["list", "--output", "json"])).unwrap();
    let streams = listed.as_array().unwrap();
    assert_eq!(streams.len(), 1, "{listed:#}");
    let s = &streams[0];
    let id = s["stream"].as_str().unwrap().to_string();
    assert!(id.starts_with(&format!("configmap.core.v1.ns-{}.", ns.name)), "{id}");
    assert_eq!(s["objects"], 3, "{s:#}");
    assert_eq!(s["resource_version"], stored_rv.as_str(), "{s:#}");
    assert_eq!(s["query"]["namespace"], ns.name.as_str());
    assert!(s["written_at"].as_str().is_some_and(|t| t.starts_with("20")), "{s:#}");
    let table = state_ok(&cfg, &["list"]);
    let row = table.lines().find(|l| l.starts_with(&id)).unwrap_or_else(|| panic!("no row for {id}:\n{table}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert!(cols.contains(&stored_rv.as_str()) && cols.contains(&"3"), "{row}");
    // A unique prefix names the stream.
    let shown = state_ok(&cfg, &["show", &id[..id.len() - 10]]);
    for n in ["c1", "c2", "c3"] {
        assert!(shown.lines().any(|l| l.split_whitespace().any(|w| w == n)), "{n} in:\n{shown}");
    }
    let shown: Value = serde_json::from_str(&state_ok(&cfg, &["show", &id, "-o", "json", "--entries", "2"])).unwrap();
    assert_eq!(shown["entries"].as_array().unwrap().len(), 2, "{shown:#}");
    let (ok, _, err) = state(&cfg, &["show", "nosuchstream"]);
    assert!(!ok && err.contains("no stream \"nosuchstream\"") && err.contains(&id), "{err}");

    let export = state_ok(&cfg, &["export"]);
    let doc: Value = serde_json::from_str(&export).unwrap();
    assert_eq!(doc["streams"][0]["objects"].as_array().unwrap().len(), 3);
    let exported = first.dir.path().join("export.json");
    std::fs::write(&exported, &export).unwrap();
    // With standard output closed (or /dev/null) the export goes nowhere: an error, not a
    // success.
    for redirect in [">&-", ">/dev/null"] {
        let nowhere = Command::new("sh")
            .args(["-c", &format!("exec \"$0\" state export --config \"$1\" {redirect}")])
            .arg(common::bin())
            .arg(&cfg)
            .env("KUBECONFIG", common::kubeconfig())
            .output()
            .expect("run kubecast state export");
        let err = String::from_utf8_lossy(&nowhere.stderr);
        assert!(
            !nowhere.status.success() && err.contains("standard output is closed or /dev/null"),
            "{redirect}: {:?}: {err}",
            nowhere.status
        );
    }

    // Meanwhile: an update, a delete, a create.
    api.patch("c1", &PatchParams::default(), &Patch::Merge(json!({"data": {"a": "2"}}))).await.unwrap();
    api.delete("c2", &DeleteParams::default()).await.unwrap();
    create_cm(&client, &ns.name, "c4", json!({}), json!({})).await;
    let want: BTreeSet<String> =
        [format!("modified {}/c1", ns.name), format!("deleted {}/c2", ns.name), format!("added {}/c4", ns.name)]
            .into_iter()
            .collect();

    for store in [Store::Kafka, Store::Nats] {
        let name = common::unique("statecli").replace('.', "-");
        let tmp = tempfile::tempdir().unwrap();
        let target = write_config(tmp.path(), "target.toml", &config, &store.lines(&name));
        // Another cluster's export: refused, naming both uids.
        let mut other: Value = doc.clone();
        other["cluster_uid"] = "0000-other-cluster".into();
        let other_file = tmp.path().join("other.json");
        std::fs::write(&other_file, other.to_string()).unwrap();
        let (ok, _, err) = state(&target, &["import", other_file.to_str().unwrap()]);
        assert!(!ok && err.contains("0000-other-cluster") && err.contains("another cluster"), "{store:?}: {err}");
        // A stream the config does not watch: refused without --all.
        let elsewhere =
            write_config(tmp.path(), "elsewhere.toml", &cm_config("some-other-ns", ""), &store.lines(&name));
        let (ok, _, err) = state(&elsewhere, &["import", exported.to_str().unwrap()]);
        assert!(!ok && err.contains("does not watch") && err.contains(&id), "{store:?}: {err}");

        state_ok(&target, &["import", exported.to_str().unwrap()]);
        let listed: Value = serde_json::from_str(&state_ok(&target, &["list", "-o", "json"])).unwrap();
        assert_eq!(listed[0]["stream"], id.as_str(), "{store:?}: {listed:#}");
        assert_eq!(listed[0]["objects"], 3, "{store:?}: {listed:#}");
        assert_eq!(listed[0]["resource_version"], stored_rv.as_str(), "{store:?}: {listed:#}");
        assert_eq!(listed[0]["epoch"], 0, "{store:?}: {listed:#}");
        assert!(listed[0]["writer"].as_str().unwrap().starts_with("kubecast state import"), "{listed:#}");
        let written = listed[0]["written_at"].as_str().unwrap_or_else(|| panic!("{store:?}: {listed:#}"));
        let age = chrono_age(written);
        assert!(age < 120, "{store:?}: written {age} s ago? {listed:#}");

        let mut k = Kubecast::start_with_checkpoint(&config, &store.lines(&name), &[]);
        k.wait_for("the 3 changes", WAIT, |e| e.len() >= 3).await;
        common::settle(&mut k, &client, &ns.name, json!({})).await;
        let evs = real(&k.events());
        assert_eq!(subjects(&evs), want, "{store:?}: only the changes, no snapshot:\n{}", common::pretty(&evs));
        assert_eq!(evs.len(), 3, "{store:?}:\n{}", common::pretty(&evs));
        assert!(k.stop().success(), "{}", k.log());
        // Imported again: the document replaces the stream's state (c4, indexed by the run,
        // is removed from the index; c2 is back).
        state_ok(&target, &["import", exported.to_str().unwrap()]);
        let shown: Value =
            serde_json::from_str(&state_ok(&target, &["show", &id, "-o", "json", "--entries", "10"])).unwrap();
        let names: BTreeSet<&str> =
            shown["entries"].as_array().unwrap().iter().map(|r| r[2].as_str().unwrap()).collect();
        assert_eq!(names, ["c1", "c2", "c3"].into_iter().collect(), "{store:?}: {shown:#}");
        assert_eq!(shown["resource_version"], stored_rv.as_str(), "{store:?}: {shown:#}");
    }
}

/// `reset --to now`: a run emits nothing for the objects existing then (one created while
/// kubecast was stopped included), and a later change; `reset --to snapshot`: every object
/// again. On the file store and the Kafka and NATS stores (index records deleted there).
async fn reset_now_then_snapshot(store: Store) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "statecli-reset").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    for n in ["c1", "c2", "c3"] {
        create_cm(&client, &ns.name, n, json!({}), json!({})).await;
    }
    let name = common::unique("statecli-reset").replace('.', "-");
    let config = cm_config(&ns.name, "");
    let mut k = Kubecast::start_with_checkpoint(&config, &store.lines(&name), &[]);
    k.wait_for("snapshot", WAIT, |e| e.len() == 3).await;
    assert!(k.stop().success(), "{}", k.log());
    let cfg = config_of(&k);
    let id = serde_json::from_str::<Value>(&state_ok(&cfg, &["list", "-o", "json"])).unwrap()[0]["stream"]
        .as_str()
        .unwrap()
        .to_string();

    // While stopped: c4 created, c3 deleted. Without the reset the next run would emit both.
    create_cm(&client, &ns.name, "c4", json!({}), json!({})).await;
    api.delete("c3", &DeleteParams::default()).await.unwrap();
    let out = state(&cfg, &["reset", &id, "--to", "now"]);
    assert!(out.0, "{}", out.2);
    let shown: Value = serde_json::from_str(&state_ok(&cfg, &["show", &id, "-o", "json", "--entries", "10"])).unwrap();
    let names: BTreeSet<&str> = shown["entries"].as_array().unwrap().iter().map(|r| r[2].as_str().unwrap()).collect();
    assert_eq!(names, ["c1", "c2", "c4"].into_iter().collect(), "the current objects indexed: {shown:#}");
    assert!(shown["resource_version"].as_str().is_some(), "a resume point: {shown:#}");

    let before = k.events().len();
    k.restart(&[]);
    k.wait_ready(200).await;
    common::settle(&mut k, &client, &ns.name, json!({})).await;
    let after = real(&k.events()[before..]);
    assert!(after.is_empty(), "nothing for existing objects:\n{}", common::pretty(&after));
    api.patch("c2", &PatchParams::default(), &Patch::Merge(json!({"data": {"a": "2"}}))).await.unwrap();
    let evs = k.wait_for("the change after the reset", WAIT, |e| !real(&e[before..]).is_empty()).await;
    common::settle(&mut k, &client, &ns.name, json!({})).await;
    let after = &real(&k.events()[before..]);
    assert_eq!(subjects(after), [format!("modified {}/c2", ns.name)].into_iter().collect(), "{}", common::pretty(&evs));
    assert!(k.stop().success(), "{}", k.log());

    let out = state(&cfg, &["reset", &id[..20], "--to", "snapshot"]);
    assert!(out.0, "{}", out.2);
    let listed: Value = serde_json::from_str(&state_ok(&cfg, &["list", "-o", "json"])).unwrap();
    assert_eq!(listed[0]["objects"], 0, "{listed:#}");
    assert_eq!(listed[0]["resource_version"], Value::Null, "{listed:#}");
    let before = k.events().len();
    k.restart(&[]);
    k.wait_for("everything again", WAIT, |e| real(&e[before..]).len() >= 3).await;
    common::settle(&mut k, &client, &ns.name, json!({})).await;
    let again = &real(&k.events()[before..]);
    let want: BTreeSet<String> = ["c1", "c2", "c4"].iter().map(|n| format!("added {}/{n}", ns.name)).collect();
    assert_eq!(subjects(again), want, "{}", common::pretty(again));
    assert_eq!(again.len(), 3, "{}", common::pretty(again));
    assert!(again.iter().all(|e| e["origin"] == "snapshot"), "{}", common::pretty(again));
    assert!(k.stop().success(), "{}", k.log());

    // With initial = "now" too: the reset marks the stream, so the next run emits every object
    // once (a stream without state would emit nothing there); once that list is acknowledged
    // the mark is gone, and a restart emits nothing.
    let path = config_of(&k);
    let text = std::fs::read_to_string(&path).unwrap();
    let ns_line = format!("namespaces = [\"{}\"]\n", ns.name);
    assert!(text.contains(&ns_line), "{text}");
    std::fs::write(&path, text.replacen(&ns_line, &format!("{ns_line}initial = \"now\"\n"), 1)).unwrap();
    let out = state(&path, &["reset", &id, "--to", "snapshot"]);
    assert!(out.0, "{}", out.2);
    let before = k.events().len();
    k.restart(&[]);
    k.wait_for("everything again with initial = now", WAIT, |e| real(&e[before..]).len() >= 3).await;
    common::settle(&mut k, &client, &ns.name, json!({})).await;
    let again = &real(&k.events()[before..]);
    assert_eq!(subjects(again), want, "{}", common::pretty(again));
    assert_eq!(again.len(), 3, "{}", common::pretty(again));
    assert!(again.iter().all(|e| e["origin"] == "snapshot"), "{}", common::pretty(again));
    assert!(k.stop().success(), "{}", k.log());
    let before = k.events().len();
    k.restart(&[]);
    k.wait_ready(200).await;
    common::settle(&mut k, &client, &ns.name, json!({})).await;
    let again = real(&k.events()[before..]);
    assert!(again.is_empty(), "the mark was cleared:\n{}", common::pretty(&again));
    assert!(k.stop().success(), "{}", k.log());
}

#[tokio::test]
async fn file_reset_to_now_then_to_snapshot() {
    reset_now_then_snapshot(Store::File).await;
}

#[tokio::test]
async fn kafka_reset_to_now_then_to_snapshot() {
    reset_now_then_snapshot(Store::Kafka).await;
}

#[tokio::test]
async fn nats_reset_to_now_then_to_snapshot() {
    reset_now_then_snapshot(Store::Nats).await;
}

/// With `[coordination]`: a reset while a kubecast holds the Lease is refused, naming the
/// holder; with `--force` it goes through, and the running kubecast (whose transactional.id
/// the reset took over, or whose position record it claimed) stops at its next state write
/// instead of overwriting it. The file store: `--force` still meets the directory's lock.
async fn write_refused_while_the_lease_is_held_unless_forced(store: Store) {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "statecli-lease").await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    create_cm(&client, &ns.name, "c1", json!({}), json!({})).await;
    let name = common::unique("statecli-lease").replace('.', "-");
    let config = common::lease_cm_config(&ns.name, "statecli");
    let mut k = Kubecast::start_with_checkpoint(&config, &store.lines(&name), &[]);
    k.wait_for("snapshot", WAIT, |e| e.len() == 1).await;
    let pid = k.pid().unwrap();
    let cfg = config_of(&k);
    // Reading works while it runs (once its first checkpoint write happened: the event in the
    // sink comes first).
    let deadline = std::time::Instant::now() + WAIT;
    let id = loop {
        let listed: Value = serde_json::from_str(&state_ok(&cfg, &["list", "-o", "json"])).unwrap();
        if let Some(id) = listed[0]["stream"].as_str() {
            break id.to_string();
        }
        assert!(std::time::Instant::now() < deadline, "the stream never listed: {listed:#}\n{}", k.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let (ok, _, err) = state(&cfg, &["reset", &id, "--to", "now"]);
    assert!(!ok, "refused while held");
    assert!(
        err.contains(&format!("lease {}/statecli is held by", ns.name)) && err.contains(&format!("-{pid} ")),
        "names the holder (pid {pid}): {err}"
    );
    let doc = k.dir.path().join("export.json");
    std::fs::write(&doc, state_ok(&cfg, &["export"])).unwrap();
    let (ok, _, err) = state(&cfg, &["import", doc.to_str().unwrap()]);
    assert!(!ok && err.contains("is held by"), "{err}");

    let (ok, _, err) = state(&cfg, &["reset", &id, "--to", "now", "--force"]);
    if store == Store::File {
        assert!(
            !ok && err.contains("in use by another kubecast process") && err.contains(&format!("pid {pid} ")),
            "{err}"
        );
        assert!(k.exited().is_none(), "still running:\n{}", k.log());
        assert!(k.stop().success(), "{}", k.log());
        return;
    }
    assert!(ok, "--force goes through: {err}");
    assert!(err.contains("--force"), "{err}");
    let shown: Value = serde_json::from_str(&state_ok(&cfg, &["show", &id, "-o", "json"])).unwrap();
    assert!(shown["writer"].as_str().unwrap().starts_with("kubecast state reset"), "{shown:#}");
    // The running kubecast was fenced: its next state write fails and it stops.
    api.patch("c1", &PatchParams::default(), &Patch::Merge(json!({"data": {"a": "2"}}))).await.unwrap();
    let status = k.wait_exit(WAIT).await;
    assert!(!status.success(), "{}", k.log());
    assert!(k.log().contains("another kubecast process owns the state"), "{}", k.log());
    let shown: Value = serde_json::from_str(&state_ok(&cfg, &["show", &id, "-o", "json"])).unwrap();
    assert!(shown["writer"].as_str().unwrap().starts_with("kubecast state reset"), "not overwritten: {shown:#}");
}

#[tokio::test]
async fn file_write_refused_while_the_lease_is_held_and_force_meets_the_lock() {
    write_refused_while_the_lease_is_held_unless_forced(Store::File).await;
}

#[tokio::test]
async fn kafka_write_refused_while_the_lease_is_held_unless_forced() {
    write_refused_while_the_lease_is_held_unless_forced(Store::Kafka).await;
}

#[tokio::test]
async fn nats_write_refused_while_the_lease_is_held_unless_forced() {
    write_refused_while_the_lease_is_held_unless_forced(Store::Nats).await;
}
