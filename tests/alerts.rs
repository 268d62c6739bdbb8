//! Dashboards and alerts of the chart (`charts/kubecast`: `metrics.prometheusRule`,
//! `metrics.dashboard`).
//!
//! The PrometheusRule is rendered with helm (`HELM`), validated by the test apiserver against
//! prometheus-operator's own CRD (`PROMETHEUS_OPERATOR_CRDS`, fetched by `tests/env/tools`
//! from its Go module), and its group goes through `promtool check rules` and `promtool test
//! rules` (`PROMTOOL`, built by `tests/env/tools`) with `tests/alerts/rules.test.yaml`: every
//! alert fires when it should and stays silent when it should not. Every metric and label the
//! rules and the dashboard's queries use is checked against the `/metrics` of a running
//! kubecast (Kafka sink, `[coordination]` on).

use kubecast_kit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, create_cm};
use serde_json::{Value, json};

const ALERTS: [&str; 8] = [
    "KubecastStreamStalled",
    "KubecastCheckpointTooOld",
    "KubecastExactlyOnceCommitsFailing",
    "KubecastDeadLetters",
    "KubecastSinkDisconnected",
    "KubecastSinkRefused",
    "KubecastNoActiveReplica",
    "KubecastRelistsRepeating",
];

/// Labels Prometheus adds to every scraped series (target labels), not kubecast's own.
const TARGET_LABELS: [&str; 4] = ["namespace", "job", "pod", "instance"];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A tool's path from the env file (written by `tests/env/tools`).
fn tool(key: &str) -> String {
    common::env()
        .get(key)
        .cloned()
        .unwrap_or_else(|| panic!("{key} is not in the test environment file: run tests/env/tools (tests/run does)"))
}

fn helm(args: &[&str]) -> Output {
    static HOME: OnceLock<tempfile::TempDir> = OnceLock::new();
    let home = HOME.get_or_init(|| tempfile::tempdir().unwrap()).path();
    Command::new(tool("HELM"))
        .args(args)
        .env("KUBECONFIG", common::kubeconfig())
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .stdin(Stdio::null())
        .output()
        .expect("run helm")
}

fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(common::env_var("KUBECTL"))
        .args(args)
        .env("KUBECONFIG", common::kubeconfig())
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl");
    if let Some(input) = stdin {
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn promtool(args: &[&str], dir: &Path) -> Output {
    Command::new(tool("PROMTOOL")).args(args).current_dir(dir).stdin(Stdio::null()).output().expect("run promtool")
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed ({}):\n{}\n{}", out.status, text(&out.stderr), text(&out.stdout));
    text(&out.stdout)
}

/// Once per test process: the release namespace `kc` and prometheus-operator's PrometheusRule
/// CRD (the real one, from its Go module) on the test apiserver.
fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kc"}}).to_string();
        ok(kubectl(&["apply", "--server-side", "-f", "-"], Some(&ns)), "create namespace kc");
        let crd = PathBuf::from(tool("PROMETHEUS_OPERATOR_CRDS")).join("monitoring.coreos.com_prometheusrules.yaml");
        ok(
            kubectl(&["apply", "--server-side", "--force-conflicts", "-f", crd.to_str().unwrap()], None),
            "install the PrometheusRule CRD",
        );
        ok(
            kubectl(
                &["wait", "--for=condition=established", "--timeout=60s", "crd/prometheusrules.monitoring.coreos.com"],
                None,
            ),
            "wait for the PrometheusRule CRD",
        );
    });
}

/// `helm template k --namespace kc charts/kubecast --set ...`
fn template(sets: &[&str]) -> Output {
    let chart = repo().join("charts/kubecast").display().to_string();
    let mut args = vec!["template", "k", "--namespace", "kc"];
    for s in sets {
        args.extend(["--set", s]);
    }
    args.push(&chart);
    helm(&args)
}

/// The rendered objects, validated by the apiserver (server-side apply, dry run: schemas of
/// the CRD included, strict fields).
fn render(sets: &[&str]) -> Vec<Value> {
    setup();
    let manifests = ok(template(sets), &format!("helm template {sets:?}"));
    let out = ok(
        kubectl(&["apply", "--server-side", "--dry-run=server", "-o", "json", "-f", "-"], Some(&manifests)),
        "server-side dry run of the rendered manifests",
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    match v["kind"].as_str() {
        Some("List") => v["items"].as_array().unwrap().clone(),
        _ => vec![v],
    }
}

fn find<'a>(objs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objs.iter().filter(|o| o["kind"] == kind).collect()
}

fn the_rule(sets: &[&str]) -> Value {
    let mut all = vec!["metrics.prometheusRule.enabled=true"];
    all.extend_from_slice(sets);
    let objs = render(&all);
    let rules = find(&objs, "PrometheusRule");
    assert_eq!(rules.len(), 1, "{objs:?}");
    rules[0].clone()
}

/// The alerting rules of the PrometheusRule: name -> rule.
fn alerts(rule: &Value) -> BTreeMap<String, Value> {
    let groups = rule["spec"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 1);
    groups[0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["alert"].as_str().unwrap().to_string(), r.clone()))
        .collect()
}

/// Writes the PrometheusRule's groups as `rules.yaml` (JSON is YAML) into `dir`, without the
/// `runbook` / `runbook_url` annotations (long prose, checked separately), and the unit tests
/// next to it.
fn write_rule_files(rule: &Value, dir: &Path) {
    let mut groups = rule["spec"]["groups"].clone();
    for r in groups[0]["rules"].as_array_mut().unwrap() {
        let a = r["annotations"].as_object_mut().unwrap();
        a.remove("runbook");
        a.remove("runbook_url");
    }
    std::fs::write(dir.join("rules.yaml"), json!({"groups": groups}).to_string()).unwrap();
    std::fs::copy(repo().join("tests/alerts/rules.test.yaml"), dir.join("rules.test.yaml")).unwrap();
}

fn promtool_test(dir: &Path) -> Output {
    promtool(&["test", "rules", "rules.test.yaml"], dir)
}

/// `alertname: X` cases of the unit test file: (cases where X fires, cases where it is silent).
fn cases_per_alert() -> BTreeMap<String, (usize, usize)> {
    let tests = std::fs::read_to_string(repo().join("tests/alerts/rules.test.yaml")).unwrap();
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (i, l) in lines.iter().enumerate() {
        if let Some(name) = l.strip_prefix("alertname: ") {
            let e = out.entry(name.to_string()).or_default();
            match lines[i + 1] {
                "exp_alerts: []" => e.1 += 1,
                "exp_alerts:" => e.0 += 1,
                other => panic!("alertname {name}: exp_alerts expected next, got {other:?}"),
            }
        }
    }
    out
}

/// The chart's alerts pass `promtool check rules`, and the unit tests of every alert pass
/// (it fires when it should, stays silent when it should not). The unit tests can fail: an
/// alert that never fires, or one that fires without its threshold, fails them.
#[test]
fn the_alerts_pass_promtool_check_and_the_unit_tests_of_every_alert() {
    let rule = the_rule(&[]);
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(rule["metadata"]["namespace"], "kc");
    let alerts = alerts(&rule);
    assert_eq!(alerts.keys().map(String::as_str).collect::<BTreeSet<_>>(), ALERTS.into_iter().collect());
    for (name, r) in &alerts {
        for key in ["summary", "description", "runbook"] {
            let v = r["annotations"][key].as_str().unwrap_or_default();
            assert!(v.len() > 20, "{name}: annotation {key} is missing or empty: {r}");
        }
        assert!(["warning", "critical"].contains(&r["labels"]["severity"].as_str().unwrap_or_default()), "{name}");
        assert!(r["expr"].as_str().unwrap().contains(r#"job="k-kubecast",namespace="kc""#), "{name}: {r}");
        assert!(r["annotations"].get("runbook_url").is_none(), "no runbookUrl, no runbook_url: {r}");
    }
    let dir = tempfile::tempdir().unwrap();
    write_rule_files(&rule, dir.path());
    let out = ok(promtool(&["check", "rules", "rules.yaml"], dir.path()), "promtool check rules");
    assert!(out.contains(&format!("SUCCESS: {} rules found", ALERTS.len())), "{out}");
    // Every alert has cases where it fires and cases where it stays silent.
    let cases = cases_per_alert();
    for a in ALERTS {
        let (fires, silent) = cases.get(a).copied().unwrap_or_default();
        assert!(fires >= 1 && silent >= 1, "{a}: {fires} firing and {silent} silent cases in rules.test.yaml");
    }
    let out = promtool_test(dir.path());
    assert!(out.status.success(), "promtool test rules failed:\n{}\n{}", text(&out.stdout), text(&out.stderr));
    assert!(text(&out.stdout).contains("SUCCESS"), "{}", text(&out.stdout));

    // The unit tests catch broken alerts: each alert made to never fire, then made to fire
    // without its threshold, fails them, naming that alert.
    let comparison = |e: &str| {
        // Drops every `<op> <number>` comparison: the expression then returns its series always.
        let mut out = String::new();
        let mut rest = e;
        while let Some(i) = rest.find([' ', ')']) {
            out.push_str(&rest[..=i]);
            rest = &rest[i + 1..];
            let t = rest.trim_start();
            for op in ["==", "!=", ">=", "<=", ">", "<"] {
                if let Some(after) = t.strip_prefix(op) {
                    let after = after.trim_start();
                    let n = after.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(after.len());
                    if n > 0 {
                        rest = &after[n..];
                    }
                    break;
                }
            }
        }
        out.push_str(rest);
        out
    };
    for a in ALERTS {
        let original = alerts[a]["expr"].as_str().unwrap().to_string();
        let no_threshold = comparison(&original);
        assert_ne!(no_threshold, original, "{a}: no threshold found in {original}");
        for broken in ["vector(1) < 0".to_string(), no_threshold] {
            let mut bad = rule.clone();
            for r in bad["spec"]["groups"][0]["rules"].as_array_mut().unwrap() {
                if r["alert"] == a {
                    r["expr"] = json!(broken);
                }
            }
            write_rule_files(&bad, dir.path());
            ok(promtool(&["check", "rules", "rules.yaml"], dir.path()), &format!("promtool check rules ({broken})"));
            let out = promtool_test(dir.path());
            let all = text(&out.stdout) + &text(&out.stderr);
            assert!(!out.status.success(), "{a} with expr {broken:?} passed the unit tests:\n{all}");
            assert!(all.contains(&format!("alertname: {a}")), "{a} with expr {broken:?}:\n{all}");
        }
    }
}

/// Off by default; the values reach the rules (threshold, window, selector, labels, runbook
/// URL); sidecar mode needs a selector.
#[test]
fn the_prometheus_rule_is_off_by_default_and_follows_its_values() {
    let objs = render(&[]);
    assert!(find(&objs, "PrometheusRule").is_empty(), "a PrometheusRule by default");
    assert!(
        find(&objs, "ConfigMap").iter().all(|c| !c["metadata"]["name"].as_str().unwrap().ends_with("-dashboard")),
        "a dashboard by default"
    );
    let rule = the_rule(&[
        "metrics.prometheusRule.checkpointAgeSeconds=900",
        "metrics.prometheusRule.relistThreshold=10",
        "metrics.prometheusRule.relistWindow=3h",
        r#"metrics.prometheusRule.selector=namespace="shop"\,app_kubernetes_io_instance="k""#,
        "metrics.prometheusRule.labels.release=prometheus",
        "metrics.prometheusRule.additionalRuleLabels.team=platform",
        "metrics.prometheusRule.runbookUrl=https://docs.example/kubecast/docs/operations.md",
    ]);
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let alerts = alerts(&rule);
    let expr = |a: &str| alerts[a]["expr"].as_str().unwrap().to_string();
    assert!(expr("KubecastCheckpointTooOld").ends_with("> 900"), "{}", expr("KubecastCheckpointTooOld"));
    assert!(expr("KubecastRelistsRepeating").ends_with("[3h])) > 10"), "{}", expr("KubecastRelistsRepeating"));
    for (name, r) in &alerts {
        let e = r["expr"].as_str().unwrap();
        assert!(e.contains(r#"{namespace="shop",app_kubernetes_io_instance="k"}"#), "{name}: {e}");
        assert!(!e.contains("job="), "{name}: {e}");
        assert_eq!(r["labels"]["team"], "platform", "{name}");
        assert_eq!(
            r["annotations"]["runbook_url"],
            format!("https://docs.example/kubecast/docs/operations.md#{}", name.to_lowercase())
        );
    }
    // The selector must be label matchers: the schema refuses anything else.
    let out = template(&["metrics.prometheusRule.enabled=true", "metrics.prometheusRule.selector=up == 1"]);
    assert!(!out.status.success(), "a selector that is not label matchers was accepted");
    assert!(text(&out.stderr).contains("/metrics/prometheusRule/selector"), "{}", text(&out.stderr));
    // Sidecar mode has no Service for the default selector: a clear error.
    let out = template(&["mode=sidecar", "metrics.prometheusRule.enabled=true"]);
    assert!(!out.status.success(), "sidecar mode without a selector was accepted");
    assert!(text(&out.stderr).contains("needs metrics.prometheusRule.selector"), "{}", text(&out.stderr));
}

/// Every alert has a row in the chart README and a runbook in docs/operations.md (where its
/// runbook_url points), with what it means and what to do: one place for each.
#[test]
fn every_alert_has_its_row_and_its_runbook() {
    let readme = std::fs::read_to_string(repo().join("charts/kubecast/README.md")).unwrap();
    let ops = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    for a in ALERTS {
        assert!(
            readme.contains(&format!("| `{a}` |")) && readme.contains(&format!("operations.md#{}", a.to_lowercase())),
            "no row for {a} linking its runbook in charts/kubecast/README.md"
        );
        assert!(!readme.contains(&format!("### {a}\n")), "{a}'s runbook is in docs/operations.md only");
        let heading = format!("### {a}\n");
        let at = ops.find(&heading).unwrap_or_else(|| panic!("no {heading:?} in docs/operations.md"));
        let section = &ops[at + heading.len()..];
        let section = &section[..section.find("\n#").unwrap_or(section.len())];
        assert!(section.lines().filter(|l| !l.trim().is_empty()).count() >= 3, "{a}: a runbook, not a line: {section}");
    }
}

/// The dashboard's ConfigMap: off by default (see above), the sidecar's label, the JSON of
/// `files/grafana-dashboard.json`; every panel queries; every query is valid PromQL.
#[test]
fn the_dashboard_is_a_configmap_for_the_grafana_sidecar_with_valid_queries() {
    let objs = render(&["metrics.dashboard.enabled=true"]);
    let cms: Vec<_> =
        find(&objs, "ConfigMap").into_iter().filter(|c| c["metadata"]["name"] == "k-kubecast-dashboard").collect();
    assert_eq!(cms.len(), 1, "{objs:?}");
    let cm = cms[0];
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["namespace"], "kc");
    let shipped: Value =
        serde_json::from_slice(&std::fs::read(repo().join("charts/kubecast/files/grafana-dashboard.json")).unwrap())
            .expect("files/grafana-dashboard.json is JSON");
    let in_cm: Value =
        serde_json::from_str(cm["data"]["kubecast.json"].as_str().unwrap()).expect("the ConfigMap's JSON");
    assert_eq!(in_cm, shipped);
    assert_eq!(shipped["uid"], "kubecast");

    // Label, annotations and namespace are values.
    let objs = render(&[
        "metrics.dashboard.enabled=true",
        "metrics.dashboard.labels.grafana_dashboard=null",
        "metrics.dashboard.labels.dashboards=kubecast",
        "metrics.dashboard.annotations.grafana_folder=Streaming",
        "metrics.dashboard.namespace=kc",
    ]);
    let cm = find(&objs, "ConfigMap").into_iter().find(|c| c["metadata"]["name"] == "k-kubecast-dashboard").unwrap();
    assert_eq!(cm["metadata"]["labels"]["dashboards"], "kubecast");
    assert!(cm["metadata"]["labels"].get("grafana_dashboard").is_none(), "{cm}");
    assert_eq!(cm["metadata"]["annotations"]["grafana_folder"], "Streaming");

    // Every non-row panel has queries; all of them (and the variables') are valid PromQL:
    // promtool checks them as recording rules, with Grafana's variables filled in.
    let queries = dashboard_queries(&shipped);
    let panels = panels(&shipped);
    assert!(panels.len() >= 15, "{}", panels.len());
    for p in &panels {
        let targets = p["targets"].as_array().map(Vec::len).unwrap_or(0);
        assert!(targets > 0, "panel {:?} has no query", p["title"]);
    }
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, q)| json!({"record": format!("dashboard:query_{i}"), "expr": grafana_to_promql(&q.expr)}))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("queries.yaml"),
        json!({"groups": [{"name": "dashboard", "rules": rules}]}).to_string(),
    )
    .unwrap();
    let out = ok(promtool(&["check", "rules", "queries.yaml"], dir.path()), "promtool check rules (dashboard queries)");
    assert!(out.contains(&format!("SUCCESS: {} rules found", queries.len())), "{out}");
    // The check can fail: a broken query is refused.
    let bad = json!({"groups": [{"name": "dashboard", "rules": [{"record": "x", "expr": "sum by (stream (kubecast_leader)"}]}]});
    std::fs::write(dir.path().join("bad.yaml"), bad.to_string()).unwrap();
    assert!(!promtool(&["check", "rules", "bad.yaml"], dir.path()).status.success());
}

/// Every panel of the dashboard (rows' nested panels included), rows excluded.
fn panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten().cloned());
        } else {
            out.push(p.clone());
        }
    }
    out
}

struct Query {
    expr: String,
    /// Labels the query's legend shows (`{{label}}`).
    legend_labels: Vec<String>,
}

/// The queries of the panels and of the query variables.
fn dashboard_queries(d: &Value) -> Vec<Query> {
    let mut out = Vec::new();
    for p in panels(d) {
        for t in p["targets"].as_array().into_iter().flatten() {
            let legend = t["legendFormat"].as_str().unwrap_or_default();
            out.push(Query {
                expr: t["expr"].as_str().unwrap().to_string(),
                legend_labels: template_labels(legend, "{{", "}}"),
            });
        }
    }
    for v in d["templating"]["list"].as_array().unwrap() {
        if v["type"] == "query" {
            // label_values(METRIC{...}, LABEL): the series part is PromQL; LABEL is a label of it.
            let q = v["query"]["query"].as_str().unwrap();
            let inner = q.strip_prefix("label_values(").and_then(|s| s.strip_suffix(')')).expect(q);
            let (series, label) = inner.rsplit_once(',').expect(q);
            out.push(Query { expr: series.trim().to_string(), legend_labels: vec![label.trim().to_string()] });
        }
    }
    assert!(out.len() > 20, "{}", out.len());
    out
}

/// `start`label`end` placeholders of a template, e.g. `{{stream}}` or `$labels.stream`.
fn template_labels(s: &str, start: &str, end: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(i) = rest.find(start) {
        rest = &rest[i + start.len()..];
        let n = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let label = rest[..n].trim();
        if !label.is_empty() && (end.is_empty() || rest[n..].starts_with(end)) {
            out.push(label.to_string());
        }
        rest = &rest[n..];
    }
    out
}

/// Grafana's variables replaced by values, for promtool.
fn grafana_to_promql(q: &str) -> String {
    q.replace("$__rate_interval", "5m").replace("$namespace", "kc").replace("$job", "k-kubecast").replace("$pod", ".+")
}

/// `kubecast_*` metric names in a PromQL expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("kubecast_") {
        let start = i + at;
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'_') {
            end += 1;
        }
        if start == 0 || !(b[start - 1].is_ascii_alphanumeric() || b[start - 1] == b'_') {
            out.insert(expr[start..end].to_string());
        }
        i = end;
    }
    out
}

/// The labels of `by (...)` / `without (...)` / `on (...)` clauses in a PromQL expression.
fn grouping_labels(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by (", "without (", "on (", "group_left ("] {
        let mut rest = expr;
        while let Some(i) = rest.find(kw) {
            rest = &rest[i + kw.len()..];
            let close = rest.find(')').unwrap();
            out.extend(rest[..close].split(',').map(|l| l.trim().to_string()).filter(|l| !l.is_empty()));
        }
    }
    out
}

/// Series name -> the label names it carries, from a text exposition.
fn exposition(body: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = out.entry(line[..name_end].to_string()).or_default();
        if line[name_end..].starts_with('{') {
            // key="value",... with escapes inside the values.
            let mut chars = line[name_end + 1..].chars();
            let mut key = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '}' => break,
                    '=' => {
                        assert_eq!(chars.next(), Some('"'), "{line}");
                        while let Some(c) = chars.next() {
                            match c {
                                '\\' => {
                                    chars.next();
                                }
                                '"' => break,
                                _ => {}
                            }
                        }
                        labels.insert(std::mem::take(&mut key));
                    }
                    ',' => {}
                    c => key.push(c),
                }
            }
        }
    }
    out
}

/// What the rules and the dashboard use: (where, metric names, labels of those metrics).
fn uses() -> Vec<(String, BTreeSet<String>, Vec<String>)> {
    let mut out = Vec::new();
    let rule = the_rule(&[]);
    for (name, r) in alerts(&rule) {
        let expr = r["expr"].as_str().unwrap();
        let mut labels = grouping_labels(expr);
        for a in r["annotations"].as_object().unwrap().values() {
            labels.extend(template_labels(a.as_str().unwrap(), "$labels.", ""));
        }
        out.push((format!("alert {name}: {expr}"), metric_names(expr), labels));
    }
    let dashboard: Value =
        serde_json::from_slice(&std::fs::read(repo().join("charts/kubecast/files/grafana-dashboard.json")).unwrap())
            .unwrap();
    for q in dashboard_queries(&dashboard) {
        let mut labels = grouping_labels(&q.expr);
        labels.extend(q.legend_labels);
        out.push((format!("dashboard query {}", q.expr), metric_names(&q.expr), labels));
    }
    out
}

/// Every metric name the alerts and the dashboard's queries use is in the `/metrics` of a
/// running kubecast (Kafka sink with exactly-once, `[coordination]` on, a stream that has listed and published),
/// with every label they group by or show; none is made up.
#[tokio::test(flavor = "multi_thread")]
async fn every_metric_and_label_the_alerts_and_the_dashboard_use_is_exposed_by_kubecast() {
    let uses = uses();
    let used: BTreeSet<String> = uses.iter().flat_map(|(_, names, _)| names.iter().cloned()).collect();
    // The extraction found them (a sample of each kind: gauges, counters, the histogram).
    for m in [
        "kubecast_leader",
        "kubecast_lease_epoch",
        "kubecast_stream_stalled",
        "kubecast_checkpoint_age_seconds",
        "kubecast_events_dead_lettered_total",
        "kubecast_relists_total",
        "kubecast_sink_connected",
        "kubecast_sink_refused",
        "kubecast_publish_latency_seconds_bucket",
    ] {
        assert!(used.contains(m), "{m} not found in the rules and the dashboard: {used:?}");
    }

    let client = client().await;
    let ns = TestNamespace::new(&client, "alerts").await;
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    // Exactly-once (the Kafka store): its commit gauge too.
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{}\"\nexactly_once = true\n",
        common::env_var("KAFKA_BROKERS"),
        common::unique("alerts")
    );
    let state = format!("store = \"kafka\"\n[checkpoint.kafka]\ntopic = \"{}\"\n", common::unique("alerts-state"));
    let mut kc = Kubecast::start_with_sink(&config, &sink, &state, &[]);
    kc.wait_log("holding the lease", 1).await;
    kc.wait_log("list complete", 1).await;
    create_cm(&client, &ns.name, "x", json!({}), json!({"v": "1"})).await;

    // Families appear as their first sample is recorded (checkpoint age after the first
    // checkpoint write, the stall gauge after the first stall check): poll, bounded.
    let deadline = Instant::now() + Duration::from_secs(60);
    let exposed = loop {
        let (status, body) = kc.admin_get("/metrics").await;
        assert_eq!(status, 200, "{body}");
        let exposed = exposition(&body);
        let published = body.lines().any(|l| {
            l.starts_with("kubecast_events_published_total{") && l.contains("kind=\"ConfigMap\"") && !l.ends_with(" 0")
        });
        if (published && used.iter().all(|m| exposed.contains_key(m))) || Instant::now() > deadline {
            break exposed;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let missing: Vec<_> = used.iter().filter(|m| !exposed.contains_key(*m)).collect();
    assert!(
        missing.is_empty(),
        "metrics used by the alerts or the dashboard that kubecast does not expose: {missing:?}\nexposed: {:?}",
        exposed.keys().collect::<Vec<_>>()
    );
    for (what, names, labels) in &uses {
        assert!(!names.is_empty(), "{what}: no kubecast metric");
        for l in labels.iter().filter(|l| !TARGET_LABELS.contains(&l.as_str())) {
            for m in names {
                assert!(exposed[m].contains(l), "{what}: {m} has no label {l:?} (it has {:?})", exposed[m]);
            }
        }
    }
    // The check can fail: a made-up name is not exposed.
    assert!(!exposed.contains_key("kubecast_events_lost_total"));
    assert!(kc.stop().success(), "{}", kc.log());
}
