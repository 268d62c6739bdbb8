//! The documentation cannot drift from the code:
//!
//! - `docs/configuration.md` has a section per table of the config and in it exactly the keys
//!   kubecast accepts (asked of the config structs themselves: the unknown-key error of a probe
//!   lists the keys serde expects), and every key of `config/kubecast.toml`, set or commented
//!   out;
//! - `docs/operations.md` lists exactly the metrics a running kubecast serves (Kafka sink,
//!   `[coordination]` on, then with `shards = 2`, against the test apiserver and Kafka), and a
//!   runbook per alert of the
//!   chart's PrometheusRule;
//! - every error message quoted in `docs/troubleshooting.md` occurs in `src/`;
//! - every relative link of the README, `docs/`, the chart README and the other READMEs users
//!   read resolves, anchors included;
//! - every value of `charts/kubecast/values.yaml` is in the chart README's table, with the
//!   default `values.yaml` gives it;
//! - the defaults `docs/configuration.md` states are those of the config structs, and so are
//!   the defaults the docs state in passing (`` `key` (default N) ``);
//! - every `kubectl` / `helm` command of the docs names the Deployment, Lease, PodTemplate,
//!   labels, templates and release the chart renders (`helm template`, `$HELM`);
//! - the exit statuses `docs/troubleshooting.md` states are the binary's (run in each case);
//! - none of them speaks of the development process.

use kubecast_kit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, create_cm};
use figment::Figment;
use figment::error::Kind;
use figment::providers::{Format, Toml};
use kubecast::config::Config;
use serde_json::json;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Files under `dir` (relative to the repository) whose name ends in `ext`, recursively.
fn files(dir: &str, ext: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![repo().join(dir)];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else if p.to_string_lossy().ends_with(ext) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The Markdown files users read.
fn user_docs() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> =
        ["README.md", "charts/kubecast/README.md", "benches/README.md"].iter().map(|f| repo().join(f)).collect();
    out.extend(files("docs", ".md"));
    out.extend(files("examples", ".md"));
    out
}

fn rel(p: &Path) -> String {
    p.strip_prefix(repo()).unwrap_or(p).display().to_string()
}

// ---------------------------------------------------------------------------------------------
// Configuration keys

/// `docs/configuration.md`: table -> keys, from `` ## `[a.b]` `` headings and `` | `key` | ``
/// rows (`[[resources]]` is the table `resources`).
/// The config table a `## ` heading of `docs/configuration.md` names (`` `[sink.kafka]` ``,
/// `` `[[resources]]` ``), if it names one.
fn config_table(heading: &str) -> Option<String> {
    heading
        .trim()
        .strip_prefix("`[")
        .and_then(|h| h.strip_suffix("]`"))
        .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
}

fn documented_keys(md: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut table: Option<String> = None;
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            table = config_table(h);
            if let Some(t) = &table {
                out.entry(t.clone()).or_default();
            }
        } else if let (Some(t), Some(row)) = (&table, line.strip_prefix("| `")) {
            let key = &row[..row.find('`').expect("a closed code span")];
            out.get_mut(t).unwrap().insert(key.to_string());
        }
    }
    out
}

/// The keys serde accepts in the config table at `path` ("" = the top level), read from the
/// unknown-key error of a probe key; `None` when that path is no table of named keys (a
/// scalar, an enum, a free-form map such as `properties`).
fn struct_keys(path: &str) -> Option<BTreeSet<String>> {
    let toml = match path {
        "" => "zz_probe = \"x\"\n".to_string(),
        "resources" => "[[resources]]\nzz_probe = \"x\"\n".to_string(),
        p => format!("[{p}]\nzz_probe = \"x\"\n"),
    };
    let err = Figment::from(Toml::string(&toml)).extract::<Config>().err()?;
    err.into_iter().find_map(|e| match e.kind {
        Kind::UnknownField(f, expected) if f == "zz_probe" => Some(expected.iter().map(|s| s.to_string()).collect()),
        _ => None,
    })
}

/// Every table of the config structs and its keys, found from the top level down.
fn config_tables() -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    let mut todo: Vec<String> = struct_keys("").expect("the top level is a table").into_iter().collect();
    while let Some(t) = todo.pop() {
        if let Some(keys) = struct_keys(&t) {
            todo.extend(keys.iter().map(|k| format!("{t}.{k}")));
            out.insert(t, keys);
        }
    }
    out
}

/// Both ways: a section per table with exactly the keys kubecast accepts.
fn config_problems(documented: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let tables = config_tables();
    let mut out = Vec::new();
    for (t, keys) in &tables {
        let Some(doc) = documented.get(t) else {
            out.push(format!("no section `[{t}]` in docs/configuration.md (its keys: {keys:?})"));
            continue;
        };
        out.extend(keys.difference(doc).map(|k| format!("[{t}] {k}: kubecast accepts it, the docs do not list it")));
        out.extend(doc.difference(keys).map(|k| format!("[{t}] {k}: documented, but kubecast does not accept it")));
    }
    out.extend(
        documented
            .keys()
            .filter(|t| !tables.contains_key(*t))
            .map(|t| format!("section `[{t}]` of docs/configuration.md is no table of kubecast's config")),
    );
    out
}

#[test]
fn configuration_md_documents_exactly_the_keys_kubecast_accepts() {
    // The probe reads the structs: it knows real keys and no made-up ones.
    let cluster = struct_keys("cluster").unwrap();
    assert!(cluster.contains("qps") && !cluster.contains("nme"), "{cluster:?}");
    assert!(struct_keys("sink.nats.stream").unwrap().contains("duplicate_window_seconds"));
    assert_eq!(struct_keys("sink.kafka.properties"), None, "a free-form map has no fixed keys");

    let documented = documented_keys(&read("docs/configuration.md"));
    let problems = config_problems(&documented);
    assert!(problems.is_empty(), "docs/configuration.md:\n{}", problems.join("\n"));

    // The comparison can fail: a key too many or too few is found.
    let mut broken = documented.clone();
    broken.get_mut("delivery").unwrap().insert("duplicate_window".into());
    broken.get_mut("cluster").unwrap().remove("qps");
    assert_eq!(config_problems(&broken).len(), 2, "{:?}", config_problems(&broken));
}

/// `config/kubecast.toml`: `(table, key)` of every key, set or commented out (`# key = ...`,
/// `# # key = ...` under `# [table]`), except in the free-form `properties` tables.
fn example_keys(text: &str) -> Vec<(String, String)> {
    let mut table = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.trim_start_matches(['#', ' ']);
        let code = code.split(" #").next().unwrap().trim_end();
        if let Some(inner) = code.strip_prefix('[').and_then(|c| c.strip_suffix(']')) {
            let name = inner.trim_start_matches('[').trim_end_matches(']');
            if !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == '.') {
                table = name.to_string();
                continue;
            }
        }
        if table.ends_with(".properties") {
            continue;
        }
        if let Some((key, _)) = code.split_once('=') {
            let key = key.trim();
            if !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                out.push((table.clone(), key.to_string()));
            }
        }
    }
    out
}

#[test]
fn every_key_of_the_example_config_is_documented() {
    let documented = documented_keys(&read("docs/configuration.md"));
    let keys = example_keys(&read("config/kubecast.toml"));
    // Commented-out keys are found too (the example has about 90).
    assert!(keys.len() > 80, "{keys:?}");
    assert!(keys.contains(&("sink.nats.stream".into(), "duplicate_window_seconds".into())), "{keys:?}");
    assert!(keys.contains(&("checkpoint.kafka".into(), "transactional_id".into())), "{keys:?}");
    let missing: Vec<_> = keys.iter().filter(|(t, k)| !documented.get(t).is_some_and(|d| d.contains(k))).collect();
    assert!(missing.is_empty(), "keys of config/kubecast.toml not in docs/configuration.md: {missing:?}");
}

// ---------------------------------------------------------------------------------------------
// Metrics and alerts

/// The metric names of `docs/operations.md`'s "Metrics" table (first column).
fn documented_metrics(md: &str) -> BTreeSet<String> {
    let start = md.find("\n## Metrics\n").expect("a Metrics section");
    let section = &md[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut out = BTreeSet::new();
    for row in section.lines().filter(|l| l.starts_with("| `kubecast_")) {
        let first = row[1..].split('|').next().unwrap();
        out.extend(first.split('`').skip(1).step_by(2).map(str::to_string));
    }
    out
}

/// The metric names a `/metrics` body serves, as users query them: counters with `_total`
/// (the OpenMetrics `# TYPE` line names the family without it), histograms by their base name.
fn served_metrics(body: &str) -> BTreeSet<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let (name, kind) = l.split_once(' ').expect("# TYPE name kind");
            if kind == "counter" && !name.ends_with("_total") { format!("{name}_total") } else { name.to_string() }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn operations_md_documents_exactly_the_metrics_kubecast_serves() {
    let documented = documented_metrics(&read("docs/operations.md"));
    assert!(documented.contains("kubecast_leader") && documented.contains("kubecast_publish_latency_seconds"));

    let client = client().await;
    let ns = TestNamespace::new(&client, "docs").await;
    let config = common::lease_cm_config(&ns.name, &common::unique("lease"));
    let sink = format!(
        "[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"{}\"\ntopic = \"{}\"\n",
        common::env_var("KAFKA_BROKERS"),
        common::unique("docs")
    );
    // The state in Kafka too: a family shows once it has a sample, and the transactions of the
    // Kafka store are the only path of `kubecast_kafka_transactions_total`.
    let checkpoint = format!("store = \"kafka\"\n[checkpoint.kafka]\ntopic = \"{}\"\n", common::unique("docs-state"));
    let mut kc = Kubecast::start_with_sink(&config, &sink, &checkpoint, &[]);
    kc.wait_log("holding the lease", 1).await;
    kc.wait_log("list complete", 1).await;
    create_cm(&client, &ns.name, "x", json!({}), json!({"v": "1"})).await;

    // Scrape once the event went through the whole path (published to Kafka, its position
    // committed to the state topic), bounded.
    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        let (status, body) = kc.admin_get("/metrics").await;
        assert_eq!(status, 200, "{body}");
        let published = body.lines().any(|l| {
            l.starts_with("kubecast_events_published_total{") && l.contains("kind=\"ConfigMap\"") && !l.ends_with(" 0")
        });
        let committed = body.lines().any(|l| l.starts_with("kubecast_kafka_transactions_total{outcome=\"committed\"}"));
        if published && committed {
            break body;
        }
        assert!(Instant::now() < deadline, "no event published and committed within 60 s:\n{body}\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(kc.stop().success(), "{}", kc.log());
    // With [coordination] shards, the shard families too (they have samples only then).
    let sharded = common::lease_cm_config(&ns.name, &common::unique("lease"))
        .replace("enabled = true\n", "enabled = true\nshards = 2\n");
    let checkpoint = format!("store = \"kafka\"\n[checkpoint.kafka]\ntopic = \"{}\"\n", common::unique("docs-state"));
    // Exactly-once here: its commit gauge (per transactional.id) too.
    let eos = format!("{sink}exactly_once = true\n");
    let mut kc = Kubecast::start_with_sink(&sharded, &eos, &checkpoint, &[]);
    kc.wait_log("list complete", 2).await;
    let (status, sharded_body) = kc.admin_get("/metrics").await;
    assert_eq!(status, 200, "{sharded_body}");
    assert!(kc.stop().success(), "{}", kc.log());

    let served: BTreeSet<String> = served_metrics(&body).into_iter().chain(served_metrics(&sharded_body)).collect();
    assert!(
        served.contains("kubecast_events_published_total") && served.contains("kubecast_publish_latency_seconds"),
        "the exposition was not read as expected: {served:?}\n{body}"
    );
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let made_up: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty() && made_up.is_empty(),
        "served by kubecast, not in docs/operations.md: {undocumented:?}\nin docs/operations.md, not served: {made_up:?}"
    );
}

#[test]
fn operations_md_has_a_runbook_per_alert() {
    let rule = read("charts/kubecast/templates/prometheusrule.yaml");
    let alerts: BTreeSet<String> =
        rule.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).map(|a| a.trim().to_string()).collect();
    assert!(alerts.len() >= 6 && alerts.contains("KubecastStreamStalled"), "{alerts:?}");
    let ops = read("docs/operations.md");
    let runbooks: BTreeSet<String> =
        ops.lines().filter_map(|l| l.strip_prefix("### Kubecast")).map(|a| format!("Kubecast{}", a.trim())).collect();
    let missing: Vec<_> = alerts.difference(&runbooks).collect();
    let stale: Vec<_> = runbooks.difference(&alerts).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "alerts without a runbook: {missing:?}; runbooks of no alert: {stale:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Error messages

/// The messages `docs/troubleshooting.md` quotes: the code span of each `###` heading, split
/// into its fixed parts at each `…`.
fn quoted_messages(md: &str) -> Vec<(String, Vec<String>)> {
    md.lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| {
            let quote = h.trim().trim_matches('`').trim().to_string();
            let parts = quote.split('…').map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect();
            (quote, parts)
        })
        .collect()
}

/// Messages none of whose source files holds all their fixed parts (string escapes undone).
fn messages_not_in(messages: &[(String, Vec<String>)], sources: &[String]) -> Vec<String> {
    messages
        .iter()
        .filter(|(_, parts)| !sources.iter().any(|s| parts.iter().all(|p| s.contains(p.as_str()))))
        .map(|(q, _)| q.clone())
        .collect()
}

#[test]
fn every_message_troubleshooting_quotes_occurs_in_src() {
    let messages = quoted_messages(&read("docs/troubleshooting.md"));
    assert!(messages.len() > 20, "{messages:?}");
    assert!(messages.iter().all(|(_, parts)| !parts.is_empty()), "{messages:?}");
    let sources: Vec<String> =
        files("src", ".rs").iter().map(|p| std::fs::read_to_string(p).unwrap().replace("\\\"", "\"")).collect();
    let missing = messages_not_in(&messages, &sources);
    assert!(missing.is_empty(), "quoted in docs/troubleshooting.md, not found in src/: {missing:#?}");
    // The search can fail: a message with a changed word is not found.
    let changed = vec![("checkpoint … turned purple".to_string(), vec!["checkpoint".into(), "turned purple".into()])];
    assert_eq!(messages_not_in(&changed, &sources).len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Links

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(md: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            let s = slug(line.trim_start_matches('#'));
            let mut candidate = s.clone();
            let mut n = 0;
            while out.contains(&candidate) {
                n += 1;
                candidate = format!("{s}-{n}");
            }
            out.insert(candidate);
        }
    }
    out
}

/// The relative links of `md` (a file at `path`) that do not resolve: a missing file, or an
/// anchor no heading of the target has. Links inside fenced code are not links.
fn broken_links(path: &Path, md: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            rest = &rest[end..];
            if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let resolved = if file.is_empty() { path.to_path_buf() } else { path.parent().unwrap().join(file) };
            if !resolved.exists() {
                out.push(format!("{}: {target}: no file {}", rel(path), rel(&resolved)));
            } else if !anchor.is_empty() {
                let text = std::fs::read_to_string(&resolved).unwrap_or_default();
                if !anchors(&text).contains(anchor) {
                    out.push(format!("{}: {target}: no heading #{anchor} in {}", rel(path), rel(&resolved)));
                }
            }
        }
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    assert_eq!(slug("`[delivery.dead_letter]`"), "deliverydead_letter");
    assert_eq!(slug("The stored state: `kubecast state`"), "the-stored-state-kubecast-state");
    let mut problems = Vec::new();
    let mut links = 0;
    for f in user_docs() {
        let md = std::fs::read_to_string(&f).unwrap();
        links += md.matches("](").count();
        problems.extend(broken_links(&f, &md));
    }
    assert!(links > 50, "{links} links: the link search found too few");
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
    // The check can fail: a missing file and a missing anchor are found.
    let readme = repo().join("README.md");
    let bad = "[a](docs/nothing.md) [b](docs/guarantees.md#nothing-here) [c](docs/guarantees.md#at-a-glance)";
    assert_eq!(broken_links(&readme, bad).len(), 2, "{:?}", broken_links(&readme, bad));
}

// ---------------------------------------------------------------------------------------------
// Chart values

/// The dotted paths of the leaves of a block-style YAML map: keys with a value on their line,
/// or with nothing nested under them but list items (a list is the value of its key).
fn yaml_leaves(yaml: &str) -> Vec<String> {
    let mut entries: Vec<(usize, String, bool)> = Vec::new(); // indent, path, value on the line
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut list_indent: Option<usize> = None;
    for line in yaml.lines() {
        let body = line.trim_start();
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        let indent = line.len() - body.len();
        if list_indent.is_some_and(|i| indent >= i) {
            continue;
        }
        list_indent = None;
        if body.starts_with("- ") || body == "-" {
            list_indent = Some(indent);
            continue;
        }
        let Some((key, value)) = body.split_once(':') else { continue };
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        stack.push((indent, key.trim().to_string()));
        let path = stack.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>().join(".");
        entries.push((indent, path, !value.split(" #").next().unwrap().trim().is_empty()));
    }
    entries
        .iter()
        .enumerate()
        .filter(|(n, (indent, _, inline))| *inline || entries.get(n + 1).is_none_or(|(next, _, _)| next <= indent))
        .map(|(_, (_, path, _))| path.clone())
        .collect()
}

#[test]
fn every_chart_value_is_in_the_chart_readme() {
    let leaves = yaml_leaves(&read("charts/kubecast/values.yaml"));
    for want in ["mode", "config.cluster.name", "config.resources", "persistence.accessModes", "sidecar.podTemplate"] {
        assert!(leaves.iter().any(|l| l == want), "{want} not found in values.yaml: {leaves:?}");
    }
    let readme = read("charts/kubecast/README.md");
    let rows: BTreeSet<String> =
        readme.lines().filter_map(|l| l.strip_prefix("| `")).map(|r| r[..r.find('`').unwrap()].to_string()).collect();
    let documented = |path: &str| {
        let mut p = path;
        loop {
            if rows.contains(p) {
                return true;
            }
            match p.rfind('.') {
                Some(i) => p = &p[..i],
                None => return false,
            }
        }
    };
    let missing: Vec<_> = leaves.iter().filter(|l| !documented(l)).collect();
    assert!(missing.is_empty(), "values of charts/kubecast/values.yaml without a row in the chart README: {missing:?}");
    assert!(!documented("metrics.made_up"), "the check can fail");
}

// ---------------------------------------------------------------------------------------------
// Words for users

/// Lines of `text` that speak of the development process: sessions and helpers (not a
/// producer's or TLS session), issue numbers (`#20`), branches.
fn process_words(text: &str) -> Vec<String> {
    let words = |l: &str| -> Vec<String> {
        l.split(|c: char| !c.is_alphanumeric() && c != '#').map(str::to_lowercase).filter(|w| !w.is_empty()).collect()
    };
    text.lines()
        .filter(|l| {
            let lower = l.to_lowercase().replace("producer session", "").replace("tls session", "");
            words(&lower).iter().any(|w| {
                matches!(w.as_str(), "session" | "sessions" | "helper" | "helpers" | "branch" | "branches")
                    || (w.len() > 1 && w.starts_with('#') && w[1..].chars().all(|c| c.is_ascii_digit()))
            })
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn user_docs_do_not_speak_of_the_development_process() {
    assert_eq!(process_words("figures of session 10 (#19)\nthe producer session\n").len(), 1);
    assert_eq!(process_words("see issue #20\nbranch h-memory\n").len(), 2);
    let mut found = Vec::new();
    for f in user_docs() {
        found.extend(
            process_words(&std::fs::read_to_string(&f).unwrap()).into_iter().map(|l| format!("{}: {l}", rel(&f))),
        );
    }
    assert!(found.is_empty(), "words of the development process in user docs:\n{}", found.join("\n"));
}

// ---------------------------------------------------------------------------------------------
// Chart defaults

/// A value of a block-style YAML document, as far as `values.yaml` uses YAML: maps, lists and
/// scalars (kept as written, quotes included).
#[derive(Debug, Clone, PartialEq)]
enum Yaml {
    Scalar(String),
    Map(Vec<(String, Yaml)>),
    List(Vec<Yaml>),
    Null,
}

impl Yaml {
    /// Flow style, as the chart README writes a default: `{}`, `[ReadWriteOnce]`,
    /// `{type: stdout}`, `""`.
    fn flow(&self) -> String {
        match self {
            Yaml::Scalar(s) => s.clone(),
            Yaml::Null => "null".into(),
            Yaml::List(items) => format!("[{}]", items.iter().map(Yaml::flow).collect::<Vec<_>>().join(", ")),
            Yaml::Map(entries) => {
                format!(
                    "{{{}}}",
                    entries.iter().map(|(k, v)| format!("{k}: {}", v.flow())).collect::<Vec<_>>().join(", ")
                )
            }
        }
    }

    fn get(&self, path: &str) -> Option<&Yaml> {
        path.split('.').try_fold(self, |y, k| match y {
            Yaml::Map(entries) => entries.iter().find(|(key, _)| key == k).map(|(_, v)| v),
            _ => None,
        })
    }

    /// Every scalar below this value.
    fn scalars(&self) -> Vec<String> {
        match self {
            Yaml::Scalar(s) => vec![s.trim_matches('"').to_string()],
            Yaml::Null => vec![],
            Yaml::List(items) => items.iter().flat_map(Yaml::scalars).collect(),
            Yaml::Map(entries) => entries.iter().flat_map(|(_, v)| v.scalars()).collect(),
        }
    }
}

/// Parses the block-style YAML of `values.yaml` (comments, maps, lists of scalars or maps,
/// `{}` / `[]` / `null`).
fn parse_yaml(text: &str) -> Yaml {
    let lines: Vec<(usize, String)> = text
        .lines()
        .filter_map(|l| {
            let body = l.trim_start();
            if body.is_empty() || body.starts_with('#') {
                return None;
            }
            let body = body.split(" #").next().unwrap().trim_end();
            Some((l.len() - l.trim_start().len(), body.to_string()))
        })
        .collect();
    fn scalar(v: &str) -> Yaml {
        if v == "null" || v == "~" { Yaml::Null } else { Yaml::Scalar(v.to_string()) }
    }
    fn block(lines: &mut Vec<(usize, String)>, i: &mut usize, indent: usize) -> Yaml {
        if lines[*i].1.starts_with("- ") || lines[*i].1 == "-" {
            let mut items = Vec::new();
            while *i < lines.len() && lines[*i].0 == indent && lines[*i].1.starts_with('-') {
                let rest = lines[*i].1[1..].trim_start().to_string();
                if rest.contains(": ") || rest.ends_with(':') {
                    // A map as a list item: its first key on the dash's line.
                    lines[*i] = (indent + 2, rest);
                    items.push(block(lines, i, indent + 2));
                } else {
                    items.push(scalar(&rest));
                    *i += 1;
                }
            }
            return Yaml::List(items);
        }
        let mut entries = Vec::new();
        while *i < lines.len() && lines[*i].0 == indent && !lines[*i].1.starts_with("- ") {
            let (key, value) = lines[*i].1.split_once(':').expect("key: value");
            let (key, value) = (key.trim().to_string(), value.trim().to_string());
            *i += 1;
            let nested =
                *i < lines.len() && (lines[*i].0 > indent || (lines[*i].0 == indent && lines[*i].1.starts_with("- ")));
            let v = if !value.is_empty() {
                scalar(&value)
            } else if nested {
                let inner = lines[*i].0;
                block(lines, i, inner)
            } else {
                Yaml::Null
            };
            entries.push((key, v));
        }
        Yaml::Map(entries)
    }
    let mut lines = lines;
    let mut i = 0;
    let out = block(&mut lines, &mut i, 0);
    assert_eq!(i, lines.len(), "values.yaml: not read past line {:?}", lines.get(i));
    out
}

/// The code spans of a Markdown cell.
fn code_spans(cell: &str) -> Vec<String> {
    cell.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Rows of the chart README's values table whose default disagrees with `values.yaml`:
/// - `unset` / `empty…`: the value is absent or null;
/// - one code span (maybe followed by a parenthesis): exactly the value, in flow style;
/// - words: every code span and every figure they hold is a value below that key.
fn chart_default_problems(readme: &str, values: &Yaml) -> Vec<String> {
    let mut out = Vec::new();
    for row in readme.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let key = cells[0].trim_start_matches("| ").trim_matches('`');
        let Some(default) = cells.get(1).map(|d| d.trim()) else { continue };
        let actual = values.get(key);
        if default.starts_with("unset") || default.starts_with("empty") {
            if actual.is_some_and(|a| *a != Yaml::Null) {
                out.push(format!("{key}: the README says {default:?}, values.yaml has {}", actual.unwrap().flow()));
            }
            continue;
        }
        let Some(actual) = actual else {
            out.push(format!("{key}: the README gives the default {default:?}, values.yaml has no such value"));
            continue;
        };
        let spans = code_spans(default);
        let single = default.starts_with('`')
            && !spans.is_empty()
            && default[spans[0].len() + 2..].trim().chars().next().is_none_or(|c| c == '(');
        if single {
            if spans[0] != actual.flow() {
                out.push(format!("{key}: the README says `{}`, values.yaml has `{}`", spans[0], actual.flow()));
            }
            continue;
        }
        let known = actual.scalars();
        let figures = default
            .split(|c: char| c.is_whitespace() || matches!(c, ',' | '/' | '(' | ')' | '`' | ';'))
            .filter(|w| w.chars().any(|c| c.is_ascii_digit()));
        for word in spans.iter().map(String::as_str).chain(figures) {
            if !known.iter().any(|k| k == word) {
                out.push(format!(
                    "{key}: the README's default {default:?} names {word:?}, not a value of values.yaml there"
                ));
            }
        }
    }
    out
}

#[test]
fn the_chart_readme_states_the_defaults_of_values_yaml() {
    let values = parse_yaml(&read("charts/kubecast/values.yaml"));
    // The parser reads what values.yaml holds.
    assert_eq!(values.get("mode").map(Yaml::flow).as_deref(), Some("standalone"));
    assert_eq!(values.get("persistence.accessModes").map(Yaml::flow).as_deref(), Some("[ReadWriteOnce]"));
    assert_eq!(values.get("config.sink").map(Yaml::flow).as_deref(), Some("{type: stdout}"));
    assert_eq!(values.get("terminationGracePeriodSeconds"), Some(&Yaml::Null));
    assert_eq!(
        values.get("config.resources").map(Yaml::flow).as_deref(),
        Some("[{api_version: apps/v1, kind: Deployment, resource: deployments}]")
    );
    let readme = read("charts/kubecast/README.md");
    let table = &readme[readme.find("\n## Values\n").expect("a Values section")..];
    let table = &table[..table[1..].find("\n## ").map_or(table.len(), |e| e + 1)];
    let problems = chart_default_problems(table, &values);
    assert!(
        problems.is_empty(),
        "defaults in the chart README's values table that values.yaml does not have:\n{}",
        problems.join("\n")
    );
    // The check can fail: a changed default, in a code span and in words, is found.
    let broken = "| `replicas` | `2` | |\n| `resources` | requests 50m / 64Mi, limit 1Gi memory | |\n";
    assert_eq!(chart_default_problems(broken, &values).len(), 2, "{:?}", chart_default_problems(broken, &values));
}

// ---------------------------------------------------------------------------------------------
// Names of the chart's objects in commands

/// What `helm template` renders for one release: object names by kind, the
/// `app.kubernetes.io/*` labels (`key=value`) and the Lease's name.
#[derive(Debug, Default)]
struct Rendered {
    release: String,
    names: BTreeMap<String, BTreeSet<String>>,
    labels: BTreeSet<String>,
}

fn parse_rendered(manifests: &str) -> Rendered {
    let mut out = Rendered::default();
    for doc in manifests.split("\n---") {
        let kind = doc.lines().find_map(|l| l.strip_prefix("kind: ")).map(|k| k.trim().to_lowercase());
        let name = doc
            .split("\nmetadata:\n")
            .nth(1)
            .and_then(|m| m.lines().take_while(|l| l.starts_with("  ")).find_map(|l| l.strip_prefix("  name: ")));
        if let (Some(kind), Some(name)) = (kind, name) {
            out.names.entry(kind).or_default().insert(name.trim().trim_matches('"').to_string());
        }
        for line in doc.lines() {
            let l = line.trim();
            if let Some((k, v)) = l.split_once(": ").filter(|(k, _)| k.starts_with("app.kubernetes.io/")) {
                out.labels.insert(format!("{k}={}", v.trim().trim_matches('"')));
            }
            if let Some(lease) = l.strip_prefix("lease_name = ") {
                out.names.entry("lease".into()).or_default().insert(lease.trim_matches('"').to_string());
            }
        }
    }
    out
}

/// Renders the chart for `release` in `namespace` with every optional object on (twice:
/// standalone and sidecar).
fn render(helm: &str, release: &str, namespace: &str) -> Rendered {
    let mut all = String::new();
    for mode in ["standalone", "sidecar"] {
        let out = std::process::Command::new(helm)
            .args(["template", release, "charts/kubecast", "-n", namespace, "--set"])
            .arg(format!(
                "mode={mode},coordination.enabled=true,metrics.dashboard.enabled=true,\
                 metrics.prometheusRule.enabled=true,metrics.prometheusRule.selector=job=\"x\",\
                 metrics.serviceMonitor.enabled=true,podDisruptionBudget.enabled=true"
            ))
            .current_dir(repo())
            .output()
            .expect("run helm");
        assert!(out.status.success(), "helm template: {}", String::from_utf8_lossy(&out.stderr));
        all.push_str(&String::from_utf8(out.stdout).unwrap());
        all.push_str("\n---");
    }
    Rendered { release: release.to_string(), ..parse_rendered(&all) }
}

/// The kubectl and helm commands of a Markdown text: code blocks (fenced or indented) and
/// code spans (also across a line break), continuation lines joined, split at `|`, `;`, `&&`.
fn commands(md: &str) -> Vec<String> {
    let mut code = Vec::new();
    let mut fenced = false;
    let mut prose = String::new();
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || (line.starts_with("    ") && !line.trim_start().starts_with("- ")) {
            code.push(line.trim().to_string());
        } else {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    let blocks = code.join("\n").replace("\\\n", " ");
    let spans = prose.split('`').skip(1).step_by(2).map(|s| s.replace('\n', " ")).collect::<Vec<_>>();
    let mut out = Vec::new();
    for text in std::iter::once(blocks.as_str()).chain(spans.iter().map(String::as_str)) {
        for line in text.lines() {
            for part in line.split(['|', ';']).flat_map(|p| p.split("&&")) {
                let part = part.split(" #").next().unwrap().trim();
                for tool in ["kubectl ", "helm "] {
                    if let Some(at) = part.find(tool).filter(|at| *at == 0 || part[..*at].ends_with(' ')) {
                        out.push(part[at..].to_string());
                    }
                }
            }
        }
    }
    out
}

/// Kinds as kubectl spells them, to the rendered kind.
fn kind_of(word: &str) -> Option<&'static str> {
    Some(match word {
        "deploy" | "deployment" | "deployments" | "deployment.apps" => "deployment",
        "svc" | "service" | "services" => "service",
        "cm" | "configmap" | "configmaps" => "configmap",
        "lease" | "leases" => "lease",
        "podtemplate" | "podtemplates" => "podtemplate",
        "sa" | "serviceaccount" | "serviceaccounts" => "serviceaccount",
        "pdb" | "poddisruptionbudget" | "poddisruptionbudgets" => "poddisruptionbudget",
        "prometheusrule" | "prometheusrules" => "prometheusrule",
        "servicemonitor" | "servicemonitors" => "servicemonitor",
        _ => return None,
    })
}

/// The names of the chart's objects a command uses that no render has: `kind/name`,
/// `get kind name`, `-l app.kubernetes.io/...=...`, `--show-only templates/...`, and the
/// release of `helm install|upgrade|template|rollback|uninstall`. The render
/// is chosen by the command's namespace (`renders`: namespace -> render); a name with a
/// placeholder (`<fullname>`) is not checked.
fn unrendered_names(command: &str, renders: &BTreeMap<String, Rendered>) -> Vec<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    let flag = |short: &str, long: &str| {
        words.iter().enumerate().find_map(|(i, w)| {
            if *w == short || *w == long {
                words.get(i + 1).map(|v| v.to_string())
            } else {
                w.strip_prefix(&format!("{long}=")).map(str::to_string)
            }
        })
    };
    let namespace = flag("-n", "--namespace");
    let Some(render) = namespace.as_ref().and_then(|n| renders.get(n)) else { return vec![] };
    let mut out = Vec::new();
    let check = |out: &mut Vec<String>, kind: &str, name: &str| {
        let name = name.trim_matches(['\'', '"', ',', '.', ')']);
        if name.contains('<') || name.is_empty() {
            return;
        }
        if !render.names.get(kind).is_some_and(|n| n.contains(name)) {
            out.push(format!(
                "`{command}`: {kind} {name:?}; the chart renders {:?} in namespace {}",
                render.names.get(kind).cloned().unwrap_or_default(),
                namespace.as_deref().unwrap_or("")
            ));
        }
    };
    for (i, w) in words.iter().enumerate() {
        if let Some((k, name)) = w.split_once('/').and_then(|(k, n)| kind_of(k).map(|k| (k, n))) {
            check(&mut out, k, name);
        } else if let Some(k) = kind_of(w).filter(|_| i > 1 && words[1] != "api-resources")
            && let Some(name) = words.get(i + 1).filter(|n| !n.starts_with('-'))
        {
            check(&mut out, k, name);
        }
    }
    if words[0] == "helm"
        && matches!(words.get(1), Some(&("install" | "upgrade" | "template" | "rollback" | "uninstall")))
        && let Some(release) = words.get(2).filter(|r| !r.starts_with(['-', '<']))
        && *release != render.release
    {
        out.push(format!(
            "`{command}`: release {release:?}; in namespace {} the docs' release is {:?}",
            namespace.as_deref().unwrap_or(""),
            render.release
        ));
    }
    if let Some(selector) = flag("-l", "--selector") {
        for term in selector.trim_matches(['\'', '"']).split(',') {
            if term.starts_with("app.kubernetes.io/") && !render.labels.contains(term) {
                out.push(format!("`{command}`: label {term}; the chart's labels are {:?}", render.labels));
            }
            if let Some(group) = term.strip_prefix("kubecast.io/lease-group=") {
                check(&mut out, "lease", group);
            }
        }
    }
    if let Some(template) = flag("--show-only", "--show-only")
        && !repo().join("charts/kubecast").join(&template).exists()
    {
        out.push(format!("`{command}`: the chart has no {template}"));
    }
    out
}

#[test]
fn commands_in_the_docs_name_what_the_chart_renders() {
    let Some(helm) = std::env::var("HELM").ok().filter(|h| !h.is_empty()) else {
        eprintln!("SKIPPED: HELM is unset (tests/env writes it to the env file): no chart render to compare with");
        return;
    };
    // The releases the docs use, by namespace: `events` in `kc`, `kubecast` in `kubecast`
    // (its objects then named `kubecast`), and in `shop` (the sidecar example).
    let mut renders = BTreeMap::new();
    renders.insert("kc".to_string(), render(&helm, "events", "kc"));
    renders.insert("kubecast".to_string(), render(&helm, "kubecast", "kubecast"));
    renders.insert("shop".to_string(), render(&helm, "kubecast", "shop"));
    let kc = &renders["kc"];
    assert!(kc.names["deployment"].contains("events-kubecast"), "{kc:?}");
    assert!(kc.names["lease"].contains("events-kubecast"), "{kc:?}");
    assert!(kc.names["podtemplate"].contains("events-kubecast-sidecar"), "{kc:?}");
    assert!(kc.labels.contains("app.kubernetes.io/instance=events"), "{kc:?}");

    let mut found = 0;
    let mut problems = Vec::new();
    for f in ["README.md", "charts/kubecast/README.md"].iter().map(|f| repo().join(f)).chain(files("docs", ".md")) {
        for c in commands(&std::fs::read_to_string(&f).unwrap()) {
            found += 1;
            problems.extend(unrendered_names(&c, &renders).into_iter().map(|p| format!("{}: {p}", rel(&f))));
        }
    }
    assert!(found > 20, "{found} commands: the search found too few");
    assert!(problems.is_empty(), "commands naming objects the chart does not render:\n{}", problems.join("\n"));
    // The check can fail: a wrong Deployment, Lease, label and template are found.
    let bad = "Run `kubectl -n kc rollout status deploy/events` and `kubectl -n kc get lease kubecast`.\n\n    \
               kubectl -n kc get pods -l app.kubernetes.io/name=events \\\n      -o name | head\n    \
               helm template events charts/kubecast -n kc --show-only templates/cm.yaml\n    \
               helm upgrade kubecast charts/kubecast -n kc\n";
    let found: Vec<String> = commands(bad).iter().flat_map(|c| unrendered_names(c, &renders)).collect();
    assert_eq!(found.len(), 5, "{found:#?}");
}

// ---------------------------------------------------------------------------------------------
// Configuration defaults

/// `docs/configuration.md`: `(table, key, default cell)` of every row of a table section.
fn documented_defaults(md: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    let mut table: Option<String> = None;
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            table = config_table(h);
        } else if let (Some(t), Some(row)) = (&table, line.strip_prefix("| `")) {
            let cells: Vec<&str> = row.split(" | ").collect();
            let key = &row[..row.find('`').unwrap()];
            if let Some(default) = cells.get(1) {
                out.push((t.clone(), key.to_string(), default.trim().trim_end_matches('|').trim().to_string()));
            }
        }
    }
    out
}

/// kubecast's own defaults: a config naming every table (and the few keys without a default),
/// read by the config structs and written out again.
fn code_defaults() -> serde_json::Value {
    let toml = r#"
[cluster]
[checkpoint]
[checkpoint.kafka]
[checkpoint.nats]
[sink]
[sink.kafka]
brokers = "kafka:9092"
[sink.nats]
url = "nats://nats:4222"
[sink.nats.stream]
[sink.nats.tls]
[sink.http]
[sink.http.tls]
[delivery]
[delivery.dead_letter]
[coordination]
[admin]
[telemetry]
[[resources]]
api_version = "v1"
kind = "ConfigMap"
"#;
    let config: Config = Figment::from(Toml::string(toml)).extract().unwrap_or_else(|e| panic!("{e}"));
    serde_json::to_value(&config).unwrap()
}

/// A default as the page writes it in a code span, read as a TOML value; `None` when the span
/// is no TOML value (a template, a word).
fn toml_value(span: &str) -> Option<serde_json::Value> {
    Figment::from(Toml::string(&format!("v = {span}"))).extract_inner::<serde_json::Value>("v").ok()
}

fn same_value(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// The value at `table.key` of the written-out config (`resources`: its first entry).
fn code_value<'a>(code: &'a serde_json::Value, table: &str, key: &str) -> &'a serde_json::Value {
    let mut at = code;
    for part in table.split('.').chain([key]) {
        at = match at {
            serde_json::Value::Array(items) => &items[0][part],
            v => &v[part],
        };
    }
    at
}

/// Rows whose default is a code span (maybe followed by a parenthesis) that is not kubecast's
/// default of that key, or `unset` where kubecast has a default.
fn default_problems(rows: &[(String, String, String)], code: &serde_json::Value) -> (usize, Vec<String>) {
    let mut compared = 0;
    let mut out = Vec::new();
    for (table, key, cell) in rows {
        if cell == "unset" {
            compared += 1;
            let at = code_value(code, table, key);
            if !at.is_null() {
                out.push(format!("[{table}] {key}: documented as unset, kubecast's default is {at}"));
            }
            continue;
        }
        let spans = code_spans(cell);
        let Some(span) = spans
            .first()
            .filter(|s| cell.starts_with('`') && cell[s.len() + 2..].trim().chars().next().is_none_or(|c| c == '('))
        else {
            continue;
        };
        let Some(documented) = toml_value(span) else { continue };
        let at = code_value(code, table, key);
        compared += 1;
        if at.is_null() {
            out.push(format!("[{table}] {key}: documented default `{span}`, kubecast has none"));
        } else if !same_value(at, &documented) {
            out.push(format!("[{table}] {key}: documented default `{span}`, kubecast's is {at}"));
        }
    }
    (compared, out)
}

#[test]
fn configuration_md_states_kubecasts_defaults() {
    let code = code_defaults();
    // The structs give their defaults: a few known ones.
    assert_eq!(code["cluster"]["qps"].as_f64(), Some(20.0), "{code:#}");
    assert_eq!(code["checkpoint"]["flush_interval_ms"], json!(1000), "{code:#}");
    let rows = documented_defaults(&read("docs/configuration.md"));
    let (compared, problems) = default_problems(&rows, &code);
    assert!(compared > 60, "only {compared} defaults compared: {rows:?}");
    assert!(problems.is_empty(), "defaults in docs/configuration.md that are not kubecast's:\n{}", problems.join("\n"));
    // The check can fail: a changed default is found.
    let row = |t: &str, k: &str, d: &str| (t.to_string(), k.to_string(), d.to_string());
    let broken = vec![row("cluster", "qps", "`25`"), row("delivery", "queue_capacity", "unset")];
    assert_eq!(default_problems(&broken, &code).1.len(), 2, "{:?}", default_problems(&broken, &code));
}

/// `` `key` (default N) `` and `` `key`, default N `` in a text: the code span and the figure
/// (`64 MiB` as bytes); figures in pairs (`20 / 40`) are left out.
fn stated_defaults(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for gap in ["` (default ", "`, default "] {
        let mut rest = text;
        while let Some(at) = rest.find(gap) {
            let before = &rest[..at];
            let after = &rest[at + gap.len()..];
            rest = after;
            let Some(open) = before.rfind('`') else { continue };
            let span = before[open + 1..].replace('\n', " ");
            let figure: String = after.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
            let tail = after[figure.len()..].trim_start_matches(' ');
            let Ok(mut n) = figure.parse::<f64>() else { continue };
            if tail.starts_with('/') {
                continue;
            }
            for (unit, factor) in [("KiB", 1024.0), ("MiB", 1048576.0), ("GiB", 1073741824.0)] {
                if tail.starts_with(unit) {
                    n *= factor;
                }
            }
            out.push((span, n));
        }
    }
    out
}

/// The default kubecast or the chart has for a code span: `[table] key`, a key name that only
/// one table has, or a dotted chart value.
fn default_of(span: &str, code: &serde_json::Value, chart: &Yaml) -> Option<f64> {
    if let Some((table, key)) = span.strip_prefix('[').and_then(|s| s.split_once("] ")) {
        return code_value(code, table.trim_matches(['[', ']']), key).as_f64();
    }
    if span.contains('.') {
        return chart.get(span).and_then(|v| match v {
            Yaml::Scalar(s) => s.trim_matches('"').parse().ok(),
            _ => None,
        });
    }
    fn find<'a>(v: &'a serde_json::Value, key: &str, out: &mut Vec<&'a serde_json::Value>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    if k == key && !v.is_object() {
                        out.push(v);
                    }
                    find(v, key, out);
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| find(i, key, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    find(code, span, &mut found);
    match found.as_slice() {
        [one] => one.as_f64(),
        _ => None,
    }
}

#[test]
fn defaults_stated_in_passing_are_kubecasts_and_the_charts() {
    let code = code_defaults();
    let chart = parse_yaml(&read("charts/kubecast/values.yaml"));
    let mut compared = 0;
    let mut problems = Vec::new();
    for f in user_docs() {
        for (span, n) in stated_defaults(&std::fs::read_to_string(&f).unwrap()) {
            let Some(actual) = default_of(&span, &code, &chart) else { continue };
            compared += 1;
            if actual != n {
                problems.push(format!("{}: `{span}` (default {n}): the default is {actual}", rel(&f)));
            }
        }
    }
    assert!(compared >= 4, "only {compared} defaults stated in passing were found");
    assert!(
        problems.is_empty(),
        "defaults stated in the docs that are not the code's or the chart's:\n{}",
        problems.join("\n")
    );
    // The check can fail: a wrong figure, in bytes and in a chart value, is found.
    let bad = "`[sink.kafka] max_uncommitted_bytes` (default 32 MiB) and \
               `metrics.prometheusRule.checkpointAgeSeconds` (default 600) but `stall_after_seconds`, default 60";
    let found: Vec<_> = stated_defaults(bad)
        .into_iter()
        .filter(|(span, n)| default_of(span, &code, &chart).is_some_and(|a| a != *n))
        .collect();
    assert_eq!(found.len(), 2, "{found:?}");
}

/// The exit statuses the troubleshooting page states are kubecast's: each one it names comes
/// from the binary in the case the page gives (a clean run, an error, a usage error, an empty
/// `KUBECAST_CONFIG`), and 130, a second signal during the drain, is where `main.rs` exits.
#[test]
fn the_exit_statuses_troubleshooting_states_are_kubecasts() {
    let page = std::fs::read_to_string(repo().join("docs/troubleshooting.md")).unwrap();
    let start = page.find("Exit status:").expect("docs/troubleshooting.md states the exit statuses");
    let para = &page[start..start + page[start..].find("\n\n").unwrap_or(page.len() - start)];
    let para = para.replace('\n', " ");
    for (code, says) in [
        ("0", "0 after a clean stop"),
        ("1", "1 when kubecast stopped on an error"),
        ("2", "2 for a command line it does not understand"),
        ("2", "an empty `KUBECAST_CONFIG`"),
        ("130", "130 when a second signal aborts the drain"),
    ] {
        assert!(para.contains(says), "the page no longer says {says:?} (exit {code}): {para}");
    }
    let run = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = std::process::Command::new(common::bin());
        c.args(args).env_remove("KUBECAST_CONFIG").env("RUST_LOG", "error");
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().expect("run kubecast");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    let config = "[cluster]\nname = \"exit-codes\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n";
    std::fs::write(&good, config).unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, format!("{config}no_such_key = 1\n")).unwrap();
    let good = good.to_str().unwrap();
    let bad = bad.to_str().unwrap();
    assert_eq!(run(&["check-config", "--config", good], &[]).0, Some(0), "a clean run");
    let (code, err) = run(&["check-config", "--config", bad], &[]);
    assert_eq!(code, Some(1), "an error: {err}");
    let (code, err) = run(&["--no-such-flag"], &[]);
    assert_eq!(code, Some(2), "a usage error: {err}");
    let (code, err) = run(&["check-config"], &[("KUBECAST_CONFIG", "")]);
    assert_eq!(code, Some(2), "an empty KUBECAST_CONFIG: {err}");
    assert!(err.contains("KUBECAST_CONFIG is set but empty"), "{err}");
    let main = std::fs::read_to_string(repo().join("src/main.rs")).unwrap();
    assert!(main.contains("std::process::exit(130)"), "a second signal exits 130 in src/main.rs");
}
