//! Operations against the real apiserver: `/metrics` read with a Prometheus text parser, and a
//! graceful shutdown under load.

use kubecast_kit as common;

use std::collections::HashSet;
use std::time::Duration;

use common::{Kubecast, TestNamespace, client, create_cm};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn parse(text: &str) -> prometheus_parse::Scrape {
    // prometheus-parse reads the classic text format; the OpenMetrics end marker is not part
    // of it.
    let lines = text.lines().filter(|l| *l != "# EOF").map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).expect("a Prometheus text exposition")
}

/// The value of `name` with all of `labels`; 0 when there is no such sample.
fn value(s: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = s
        .samples
        .iter()
        .filter(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(*v)))
        .map(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => f64::NAN,
        })
        .collect();
    assert!(found.len() <= 1, "{name} {labels:?}: several samples {found:?}");
    found.first().copied().unwrap_or(0.0)
}

/// Counters match the events delivered, filtered and acknowledged; gauges settle.
#[tokio::test]
async fn metrics_count_what_happened() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "ops-metrics").await;
    let config = format!(
        "{}events = [\"added\", \"modified\"]\nfilter = \"!has(object.metadata.labels) || object.metadata.labels.skip != 'yes'\"\n",
        common::cm_config(&ns.name, "")
    );
    let mut k = Kubecast::start(&config);
    k.wait_ready(200).await;
    for i in 0..3 {
        create_cm(&client, &ns.name, &format!("m{i}"), json!({}), json!({"v": "0"})).await;
    }
    create_cm(&client, &ns.name, "skipped", json!({"skip": "yes"}), json!({})).await;
    let api = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    api.patch("m0", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "1"}}))).await.unwrap();
    api.delete("m1", &DeleteParams::default()).await.unwrap();
    k.wait_for("3 added + 1 modified", WAIT, |e| e.len() >= 4).await;

    let cm = [("group", "core"), ("kind", "ConfigMap")];
    let with = |verb: &'static str| -> Vec<(&'static str, &'static str)> {
        let mut l = cm.to_vec();
        l.push(("verb", verb));
        l
    };
    // Gauges, the filtered delete and the acknowledgements settle within a checkpoint interval
    // or two.
    let deadline = std::time::Instant::now() + WAIT;
    let s = loop {
        let (status, body) = k.admin_get("/metrics").await;
        assert_eq!(status, 200);
        let s = parse(&body);
        // The delete is filtered out (not in `events`): only the metrics show when it was read.
        let settled = value(&s, "kubecast_events_acked_total", &with("modified")) == 1.0
            && value(&s, "kubecast_events_observed_total", &with("deleted")) == 1.0
            && value(&s, "kubecast_checkpoint_lag", &[]) == 0.0
            && value(&s, "kubecast_queue_depth", &[]) == 0.0;
        if settled {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "metrics never settled:\n{body}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(value(&s, "kubecast_events_observed_total", &with("added")), 4.0);
    assert_eq!(value(&s, "kubecast_events_observed_total", &with("modified")), 1.0);
    assert_eq!(value(&s, "kubecast_events_observed_total", &with("deleted")), 1.0);
    let filtered = |verb, reason| {
        let mut l = with(verb);
        l.push(("reason", reason));
        value(&s, "kubecast_events_filtered_total", &l)
    };
    assert_eq!(filtered("deleted", "verb"), 1.0);
    assert_eq!(filtered("added", "filter"), 1.0, "the labelled one");
    assert_eq!(value(&s, "kubecast_events_published_total", &with("added")), 3.0);
    assert_eq!(value(&s, "kubecast_events_published_total", &with("modified")), 1.0);
    assert_eq!(value(&s, "kubecast_events_acked_total", &with("added")), 3.0);
    assert_eq!(value(&s, "kubecast_events_dead_lettered_total", &with("added")), 0.0);
    assert_eq!(value(&s, "kubecast_in_flight", &[]), 0.0);
    assert_eq!(value(&s, "kubecast_sink_connected", &[]), 1.0);
    assert_eq!(value(&s, "kubecast_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), 1.0);
    assert_eq!(value(&s, "kubecast_gone_total", &[]), 0.0);
    // The real apiserver's watch lines all take the fast decoding path.
    assert!(s.samples.iter().any(|x| x.metric == "kubecast_watch_objects_slow_decoded_total"));
    assert_eq!(value(&s, "kubecast_watch_objects_slow_decoded_total", &[]), 0.0);
    assert!(value(&s, "kubecast_publish_latency_seconds_count", &[]) >= 4.0);
    assert!(value(&s, "kubecast_checkpoint_age_seconds", &[]) < 30.0);
    assert_eq!(k.events().len(), 4);
}

/// A burst of changes is gathered on the watch connection (`cluster.watch_gather_ms`), and
/// every change of it arrives, the last ones too although nothing follows them.
#[tokio::test]
async fn a_burst_of_changes_is_gathered_on_the_connection_and_every_change_arrives() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "ops-gather").await;
    // The longest window allowed: any burst the test can make comes within it.
    let mut k = Kubecast::start(&common::cm_config(&ns.name, "watch_gather_ms = 50"));
    k.wait_ready(200).await;
    let names = common::names("burst", 0..400);
    common::create_cms(&client, &ns.name, &names).await;
    k.wait_for("all 400", WAIT, |e| e.len() >= 400).await;
    let (status, body) = k.admin_get("/metrics").await;
    assert_eq!(status, 200);
    let s = parse(&body);
    assert!(value(&s, "kubecast_watch_gathered_total", &[]) >= 1.0, "the burst was gathered:\n{body}");
    // What the apiserver sent is counted: at least the 400 objects' JSON (each well over 200
    // bytes: its name, namespace, uid, resourceVersion, timestamp and managed fields).
    let received = value(&s, "kubecast_apiserver_received_bytes_total", &[]);
    assert!(received >= 400.0 * 200.0, "{received} bytes counted:\n{body}");
    let ids: HashSet<String> = k.events().iter().map(|e| e["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids.len(), 400, "every change arrived once");
    // One more change after the burst, alone: read when the window ends, not when more come.
    create_cm(&client, &ns.name, "alone", json!({}), json!({})).await;
    k.wait_for("the change after the burst", WAIT, |e| e.len() >= 401).await;
}

/// SIGTERM while 300 changes wait in the queue: exit 0 within the shutdown timeout (1 s, too
/// short to drain them all); the restart sends the rest and nothing that was acknowledged
/// (also not what was acknowledged out of order); together every change arrives once.
#[tokio::test]
async fn sigterm_under_load_exits_cleanly_and_the_restart_repeats_nothing_acked() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "ops-sigterm").await;
    // A slow sink (rate limit) so that the stop lands in the middle of the load.
    let mut k = Kubecast::start(&format!(
        "{}\n[delivery]\nrate_per_second = 50\nshutdown_timeout_seconds = 1\n",
        common::cm_config(&ns.name, "")
    ));
    k.wait_ready(200).await;
    let names = common::names("load", 0..300);
    common::create_cms(&client, &ns.name, &names).await;
    k.wait_for("some events", WAIT, |e| e.len() >= 20).await;
    let t0 = std::time::Instant::now();
    let status = k.stop();
    assert_eq!(status.code(), Some(0), "{}", k.log());
    assert!(t0.elapsed() < Duration::from_secs(6), "stopped within the shutdown timeout: {:?}", t0.elapsed());
    let first: Vec<Value> = k.events();
    assert!(first.len() < 300, "the stop happened under load ({} delivered)", first.len());
    let covered: HashSet<(String, String)> = k.checkpoints()[0]["objects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| (o[0].as_str().unwrap().to_string(), o[3].as_str().unwrap().to_string()))
        .collect();
    let key = |e: &Value| {
        (e["partitionkey"].as_str().unwrap().to_string(), e["resourceversion"].as_str().unwrap().to_string())
    };
    // Delivered but not in the index: acknowledged after a gap (an earlier event of the stream
    // was still waiting when the timeout cut the queue off). The checkpoint lists them as
    // acknowledged ahead, so the restart does not send them again.
    let ahead: HashSet<(String, String)> = k.checkpoints()[0]["acked_ahead"]
        .as_array()
        .map(|a| a.iter().map(|x| (x[0].as_str().unwrap().to_string(), x[1].as_str().unwrap().to_string())).collect())
        .unwrap_or_default();
    let not_recorded: Vec<&Value> =
        first.iter().filter(|e| !covered.contains(&key(e)) && !ahead.contains(&key(e))).collect();
    // Only a send cut off between the file write and its acknowledgement can be in neither.
    assert!(not_recorded.len() <= 2, "{} delivered events not recorded as acknowledged", not_recorded.len());

    k.restart(&[]);
    k.wait_for("all 300", WAIT, |e| e.iter().map(|x| x["id"].as_str().unwrap()).collect::<HashSet<_>>().len() >= 300)
        .await;
    let barrier = common::settle(&mut k, &client, &ns.name, json!({})).await;
    let all = common::without(&k.events(), &barrier);
    let second = &all[first.len()..];
    for e in second {
        assert!(
            !covered.contains(&key(e)) && !ahead.contains(&key(e)),
            "the restart sent an acknowledged change again: {}",
            e["id"]
        );
    }
    let ids: HashSet<&str> = all.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 300, "every change arrived");
    assert_eq!(all.len(), 300 + not_recorded.len(), "nothing acknowledged was sent again");
}
