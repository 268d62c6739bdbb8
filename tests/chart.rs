//! Packaging: the Helm chart (`charts/kubecast`) and the container image (`docker/`).
//!
//! helm is the one `tests/env/tools` builds from Go modules (`HELM` in the env file). Every
//! rendering is parsed and validated by the real apiserver of `tests/env` (server-side apply,
//! dry run), `helm install` runs against it, and the RBAC proof runs the real kubecast binary
//! with a token of the chart's ServiceAccount and the chart's own config.

use kubecast_kit as common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::{Once, OnceLock};
use std::time::Duration;

use common::{Kubecast, TestNamespace};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const WAIT: Duration = Duration::from_secs(60);

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> String {
    repo().join("charts/kubecast").display().to_string()
}

/// `charts/kubecast/ci/<name>-values.yaml`
fn ci_values(name: &str) -> String {
    repo().join(format!("charts/kubecast/ci/{name}-values.yaml")).display().to_string()
}

const CI_VALUES: [&str; 9] =
    ["minimal", "kafka-sasl", "nats-creds", "sidecar", "pvc", "servicemonitor", "ha", "monitoring", "http"];

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// helm from the env file, with its own config/cache/data dirs and the test apiserver.
fn helm(args: &[&str]) -> Output {
    static HOME: OnceLock<tempfile::TempDir> = OnceLock::new();
    let home = HOME.get_or_init(|| tempfile::tempdir().unwrap()).path();
    let bin = common::env().get("HELM").cloned().unwrap_or_else(|| {
        panic!("HELM is not in the test environment file: build helm with tests/env/tools (tests/run does)")
    });
    Command::new(bin)
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
    kubectl_as(&common::kubeconfig(), args, stdin)
}

fn kubectl_as(kubeconfig: &str, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(common::env_var("KUBECTL"))
        .args(args)
        .env("KUBECONFIG", kubeconfig)
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

/// stdout of a command that must succeed.
fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what} failed ({}):\n{}\n{}", out.status, text(&out.stderr), text(&out.stdout));
    text(&out.stdout)
}

/// Once per test process: the release namespace `kc` and the namespaces the ci values files
/// name, the ServiceMonitor CRD (prometheus-operator is not installed on the test apiserver;
/// tests/chart/ has a reduced one) and prometheus-operator's own PrometheusRule CRD (from its
/// Go module, fetched by tests/env/tools).
fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        for ns in ["kc", "shop", "billing"] {
            let manifest = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}).to_string();
            ok(kubectl(&["apply", "--server-side", "-f", "-"], Some(&manifest)), "create namespace");
        }
        let crd = repo().join("tests/chart/servicemonitor-crd.yaml");
        ok(kubectl(&["apply", "--server-side", "-f", crd.to_str().unwrap()], None), "install the ServiceMonitor CRD");
        ok(
            kubectl(
                &["wait", "--for=condition=established", "--timeout=60s", "crd/servicemonitors.monitoring.coreos.com"],
                None,
            ),
            "wait for the ServiceMonitor CRD",
        );
        let crds = common::env().get("PROMETHEUS_OPERATOR_CRDS").cloned().unwrap_or_else(|| {
            panic!("PROMETHEUS_OPERATOR_CRDS is not in the test environment file: run tests/env/tools (tests/run does)")
        });
        let crd = Path::new(&crds).join("monitoring.coreos.com_prometheusrules.yaml");
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

/// `helm template` (release `k` in namespace `kc`) of a ci values file plus `--set`s.
fn template(values: &str, sets: &[&str]) -> Output {
    let file = ci_values(values);
    let mut args = vec!["template", "k", "--namespace", "kc", "-f", &file];
    for s in sets {
        args.extend(["--set", s]);
    }
    let chart = chart();
    args.push(&chart);
    helm(&args)
}

/// Sends manifests to the apiserver as a server-side apply dry run (full validation:
/// schemas, strict fields, admission) and returns the objects as the server would store them.
fn server_dry_run(manifests: &str) -> Vec<Value> {
    setup();
    let out = ok(
        kubectl(&["apply", "--server-side", "--dry-run=server", "-o", "json", "-f", "-"], Some(manifests)),
        "server-side dry run of the rendered manifests",
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    match v["kind"].as_str() {
        Some("List") => v["items"].as_array().unwrap().clone(),
        _ => vec![v],
    }
}

/// The rendered objects of a ci values file, validated by the apiserver.
fn render(values: &str, sets: &[&str]) -> Vec<Value> {
    let manifests = ok(template(values, sets), &format!("helm template -f {values}"));
    server_dry_run(&manifests)
}

/// Each of `lines` is in the rendered kubecast.toml.
fn assert_has_lines(toml: &str, lines: &[&str]) {
    for line in lines {
        assert!(toml.contains(line), "no {line:?} in\n{toml}");
    }
}

fn kinds(objs: &[Value]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for o in objs {
        *m.entry(o["kind"].as_str().unwrap().to_string()).or_default() += 1;
    }
    m
}

fn kind_counts(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, n)| (k.to_string(), *n)).collect()
}

fn one<'a>(objs: &'a [Value], kind: &str) -> &'a Value {
    let v: Vec<_> = objs.iter().filter(|o| o["kind"] == kind).collect();
    assert_eq!(v.len(), 1, "expected one {kind}, got {}", v.len());
    v[0]
}

/// The kubecast.toml of the config ConfigMap.
fn config_toml(objs: &[Value]) -> String {
    config_map(objs)["data"]["kubecast.toml"].as_str().unwrap().to_string()
}

/// The config ConfigMap (the dashboard's ConfigMap, when rendered, is another): named
/// `k-kubecast-config-` + the first 10 hex digits of the sha256 of its kubecast.toml (as
/// stored, what `sha256sum` of the mounted file says), and immutable.
fn config_map(objs: &[Value]) -> &Value {
    let v: Vec<_> =
        objs.iter().filter(|o| o["kind"] == "ConfigMap" && o["data"]["kubecast.toml"].is_string()).collect();
    assert_eq!(v.len(), 1, "expected one ConfigMap with kubecast.toml, got {}", v.len());
    let cm = v[0];
    assert_eq!(cm["immutable"], true, "the config ConfigMap must be immutable: {cm}");
    let name = cm["metadata"]["name"].as_str().unwrap();
    let toml = cm["data"]["kubecast.toml"].as_str().unwrap();
    let digest = hex(&Sha256::digest(toml.as_bytes()));
    let fullname = name.split("-config-").next().unwrap();
    assert_eq!(name, format!("{fullname}-config-{}", &digest[..10]), "named after its content");
    cm
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The NOTES helm prints after an install (`helm install --dry-run=client`, release `k` in
/// `kc`) of a ci values file plus `--set`s.
fn notes(values: &str, sets: &[&str]) -> String {
    let file = ci_values(values);
    let chart = chart();
    let mut args = vec!["install", "k", &chart, "--namespace", "kc", "--dry-run=client", "-f", &file];
    for s in sets {
        args.extend(["--set", s]);
    }
    let out = ok(helm(&args), &format!("helm install --dry-run -f {values} {sets:?}"));
    let at = out.find("NOTES:\n").unwrap_or_else(|| panic!("no NOTES in\n{out}"));
    out[at..].to_string()
}

/// (kind, namespace) of each Role / ClusterRole -> its rules as (group, resource, verbs).
/// (group, resource, "verb,verb,...") of each rule.
type Rules = BTreeSet<(String, String, String)>;

fn rbac(objs: &[Value]) -> BTreeMap<(String, String), Rules> {
    let mut m = BTreeMap::new();
    // The identity role (get on namespaces/kube-system) is checked on its own.
    for o in objs.iter().filter(|o| {
        (o["kind"] == "Role" || o["kind"] == "ClusterRole")
            && !o["metadata"]["name"].as_str().unwrap_or("").ends_with("-identity")
    }) {
        let mut rules = BTreeSet::new();
        for r in o["rules"].as_array().unwrap() {
            let groups = r["apiGroups"].as_array().unwrap();
            let resources = r["resources"].as_array().unwrap();
            let verbs: Vec<&str> = r["verbs"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
            for g in groups {
                for res in resources {
                    rules.insert((g.as_str().unwrap().into(), res.as_str().unwrap().into(), verbs.join(",")));
                }
            }
        }
        let ns = o["metadata"]["namespace"].as_str().unwrap_or("").to_string();
        m.insert((o["kind"].as_str().unwrap().to_string(), ns), rules);
    }
    m
}

/// The cluster's identity: get on namespaces/kube-system, nothing else, bound to the chart's
/// ServiceAccount.
fn assert_identity_role(objs: &[Value]) {
    let role = objs
        .iter()
        .find(|o| o["kind"] == "ClusterRole" && o["metadata"]["name"] == "kc-k-kubecast-identity")
        .expect("the identity ClusterRole");
    assert_eq!(
        role["rules"],
        json!([{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": ["kube-system"], "verbs": ["get"]}])
    );
    let binding = objs
        .iter()
        .find(|o| o["kind"] == "ClusterRoleBinding" && o["metadata"]["name"] == "kc-k-kubecast-identity")
        .expect("its binding");
    assert_eq!(binding["roleRef"]["name"], "kc-k-kubecast-identity");
}

fn read_only(rules: &[(&str, &str)]) -> Rules {
    rules.iter().map(|(g, r)| (g.to_string(), r.to_string(), "get,list,watch".to_string())).collect()
}

/// The subject of every (Cluster)RoleBinding, and that each binds the chart's own role.
fn binding_subjects(objs: &[Value]) -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    for b in objs.iter().filter(|o| o["kind"] == "RoleBinding" || o["kind"] == "ClusterRoleBinding") {
        let role_kind = if b["kind"] == "RoleBinding" { "Role" } else { "ClusterRole" };
        assert_eq!(b["roleRef"]["kind"], role_kind, "{b}");
        let role = objs
            .iter()
            .find(|o| {
                o["kind"] == role_kind
                    && o["metadata"]["name"] == b["roleRef"]["name"]
                    && o["metadata"]["namespace"] == b["metadata"]["namespace"]
            })
            .unwrap_or_else(|| panic!("{} binds a {role_kind} the chart does not render: {b}", b["kind"]));
        assert!(role["rules"].is_array());
        for subj in b["subjects"].as_array().unwrap() {
            assert_eq!(subj["kind"], "ServiceAccount", "{b}");
            s.insert(format!("{}/{}", subj["namespace"].as_str().unwrap(), subj["name"].as_str().unwrap()));
        }
    }
    s
}

fn pod_spec(objs: &[Value]) -> &Value {
    &one(objs, "Deployment")["spec"]["template"]["spec"]
}

fn kubecast_container(spec: &Value) -> &Value {
    let c = spec["containers"].as_array().unwrap();
    c.iter().find(|c| c["name"] == "kubecast").expect("a container named kubecast")
}

fn env_of<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"].as_array().and_then(|e| e.iter().find(|e| e["name"] == name))
}

fn mount_path(container: &Value, volume: &str) -> Option<String> {
    container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume)
        .map(|m| m["mountPath"].as_str().unwrap().to_string())
}

fn volume<'a>(spec: &'a Value, name: &str) -> &'a Value {
    let v = spec["volumes"].as_array().unwrap().iter().find(|v| v["name"] == name);
    v.unwrap_or_else(|| panic!("no volume {name} in {}", spec["volumes"]))
}

/// What the chart promises of every kubecast container: restricted security context, the
/// probes, the config, checkpoint and /tmp mounts, the admin port.
fn assert_kubecast_container(c: &Value, admin_port: u64) {
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true, "{sc}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{sc}");
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{sc}");
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{sc}");
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault", "{sc}");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    assert_eq!(c["ports"][0]["name"], "admin");
    assert_eq!(c["ports"][0]["containerPort"], admin_port);
    assert_eq!(env_of(c, "KUBECAST_ADMIN__LISTEN").unwrap()["value"], format!("0.0.0.0:{admin_port}"));
    assert_eq!(env_of(c, "KUBECAST_CHECKPOINT__DIR").unwrap()["value"], "/var/lib/kubecast");
    assert_eq!(c["args"], json!(["run", "--config", "/etc/kubecast/config/kubecast.toml"]));
    assert_eq!(mount_path(c, "kubecast-config").as_deref(), Some("/etc/kubecast/config"));
    assert_eq!(mount_path(c, "kubecast-state").as_deref(), Some("/var/lib/kubecast"));
    assert_eq!(mount_path(c, "kubecast-tmp").as_deref(), Some("/tmp"));
    // Whatever the values, no plain-text value of any variable looks like a credential.
    for e in c["env"].as_array().unwrap() {
        let name = e["name"].as_str().unwrap().to_ascii_lowercase();
        if ["password", "token", "secret"].iter().any(|s| name.contains(s)) {
            assert!(e["value"].is_null() && e["valueFrom"]["secretKeyRef"].is_object(), "inline secret: {e}");
        }
    }
}

/// No Secret object anywhere: credentials only come from Secrets that exist.
fn assert_no_secret_objects(objs: &[Value]) {
    assert!(objs.iter().all(|o| o["kind"] != "Secret"), "the chart rendered a Secret");
}

/// Every rule of every role is exactly get/list/watch on named resources: no wildcards.
fn assert_only_read_rules(objs: &[Value]) {
    for rules in rbac(objs).values() {
        for (g, r, verbs) in rules {
            assert_eq!(verbs, "get,list,watch", "{g}/{r}");
            assert!(!r.contains('*') && !g.contains('*'), "wildcard rule {g}/{r}");
        }
    }
}

/// (kind, name) of every object `helm template` renders: each document's `kind:` and its
/// `metadata.name`.
fn rendered_names(manifests: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for doc in manifests.split("\n---") {
        let kind = doc.lines().find_map(|l| l.strip_prefix("kind: "));
        let meta = doc.lines().skip_while(|l| *l != "metadata:").skip(1);
        let name = meta.take_while(|l| l.starts_with(' ')).find_map(|l| l.strip_prefix("  name: "));
        if let (Some(kind), Some(name)) = (kind, name) {
            out.push((kind.trim().to_string(), name.trim().trim_matches('"').to_string()));
        }
    }
    out
}

/// RBAC objects keep their whole names (Kubernetes allows 253 characters): with a long
/// namespace the identity ClusterRole does not take the main one's name, and two releases in
/// it do not take each other's.
#[test]
fn long_namespace_and_release_names_give_distinct_rbac_objects() {
    let ns = "platform-observability-kubernetes-change-events";
    let chart = chart();
    let mut all = BTreeSet::new();
    for release in ["events-eu", "events-us"] {
        let out = ok(helm(&["template", release, "--namespace", ns, &chart]), "helm template");
        let names = rendered_names(&out);
        assert!(names.iter().any(|(k, _)| k == "ClusterRole"), "{out}");
        for (kind, name) in names {
            assert!(name.len() <= 253, "{kind} {name}: longer than Kubernetes allows");
            assert!(all.insert((kind.clone(), name.clone())), "{kind} {name} rendered twice (release {release})");
        }
    }
}

#[test]
fn helm_lint_strict_passes_for_the_defaults_and_every_ci_values_file() {
    let chart = chart();
    let out = ok(helm(&["lint", "--strict", &chart]), "helm lint --strict");
    assert!(out.contains("1 chart(s) linted, 0 chart(s) failed"), "{out}");
    for v in CI_VALUES {
        let file = ci_values(v);
        let out = ok(helm(&["lint", "--strict", "-f", &file, &chart]), &format!("helm lint --strict -f {v}"));
        assert!(out.contains("0 chart(s) failed"), "{v}: {out}");
    }
}

#[test]
fn minimal_values_render_one_restricted_replica_and_a_read_only_cluster_role() {
    let objs = render("minimal", &[]);
    assert_eq!(
        kinds(&objs),
        kind_counts(&[
            ("ClusterRole", 2),
            ("ClusterRoleBinding", 2),
            ("ConfigMap", 1),
            ("Deployment", 1),
            ("Service", 1),
            ("ServiceAccount", 1)
        ])
    );
    assert_identity_role(&objs);
    // A stdout sink: the positions go to the checkpoint volume.
    assert_has_lines(&config_toml(&objs), &["store = \"file\""]);
    assert_eq!(
        rbac(&objs),
        BTreeMap::from([(("ClusterRole".into(), "".into()), read_only(&[("apps", "deployments")]))])
    );
    assert_eq!(binding_subjects(&objs), BTreeSet::from(["kc/k-kubecast".to_string()]));
    let deploy = one(&objs, "Deployment");
    assert_eq!(deploy["spec"]["replicas"], 1);
    assert_eq!(deploy["spec"]["strategy"]["type"], "Recreate");
    for o in &objs {
        let labels = &o["metadata"]["labels"];
        for l in ["name", "instance", "version", "managed-by", "component", "part-of"] {
            assert!(labels[format!("app.kubernetes.io/{l}")].is_string(), "{} has no app.kubernetes.io/{l}", o["kind"]);
        }
    }
    let spec = pod_spec(&objs);
    assert_eq!(spec["serviceAccountName"], "k-kubecast");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault");
    let c = kubecast_container(spec);
    assert_kubecast_container(c, 9090);
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(c["image"], "kubecast/kubecast:0.1.0", "default tag: the appVersion");
    assert!(volume(spec, "kubecast-state")["emptyDir"].is_object(), "emptyDir by default");
    assert_eq!(volume(spec, "kubecast-config")["configMap"]["name"], config_map(&objs)["metadata"]["name"]);
    let annotations = &deploy["spec"]["template"]["metadata"]["annotations"];
    assert!(annotations["checksum/config"].is_string());
    assert!(annotations["prometheus.io/scrape"].is_null(), "metrics annotations are off by default");
    let toml = config_toml(&objs);
    assert_has_lines(
        &toml,
        &[
            "type = \"stdout\"",
            "api_version = \"apps/v1\"",
            "kind = \"Deployment\"",
            "qps = 20",
            "dir = \"/var/lib/kubecast\"",
        ],
    );
    assert!(!toml.contains("resource ="), "the chart's `resource` key must not reach kubecast.toml:\n{toml}");
    assert!(!toml.contains("20.0"), "whole numbers must be integers:\n{toml}");
    assert_only_read_rules(&objs);
    assert_no_secret_objects(&objs);
}

#[test]
fn kafka_sasl_values_read_the_password_from_the_secret_and_render_namespaced_roles() {
    let objs = render("kafka-sasl", &[]);
    // Namespaced entries only: Roles in shop and billing, no cluster-wide access at all.
    assert_eq!(
        rbac(&objs),
        BTreeMap::from([
            (("Role".into(), "billing".into()), read_only(&[("apps", "deployments")])),
            (("Role".into(), "shop".into()), read_only(&[("apps", "deployments"), ("", "services")])),
        ])
    );
    assert_eq!(kinds(&objs).get("ClusterRole"), Some(&1), "only the identity role is cluster-wide");
    assert_identity_role(&objs);
    assert_has_lines(&config_toml(&objs), &["store = \"kafka\""]);
    assert_eq!(kinds(&objs)["RoleBinding"], 2);
    // Named after the release's namespace too: another release "k" elsewhere does not clash.
    for o in objs.iter().filter(|o| o["kind"] == "Role" || o["kind"] == "RoleBinding") {
        assert_eq!(o["metadata"]["name"], "kc-k-kubecast", "{o}");
    }
    assert_eq!(binding_subjects(&objs), BTreeSet::from(["kc/k-kubecast".to_string()]));
    let spec = pod_spec(&objs);
    let c = kubecast_container(spec);
    assert_kubecast_container(c, 9090);
    let pw = env_of(c, "KAFKA_PASSWORD").expect("KAFKA_PASSWORD from secretEnv");
    assert_eq!(pw["valueFrom"]["secretKeyRef"], json!({"name": "kafka-creds", "key": "password"}));
    assert_eq!(mount_path(c, "kafka-ca").as_deref(), Some("/etc/kubecast/kafka-ca"));
    assert_eq!(volume(spec, "kafka-ca")["secret"]["secretName"], "kafka-ca");
    let toml = config_toml(&objs);
    assert_has_lines(
        &toml,
        &[
            "type = \"kafka\"",
            "[sink.kafka.properties]",
            "\"sasl.password\" = \"${env:KAFKA_PASSWORD}\"",
            "\"linger.ms\" = \"20\"",
            "queue_capacity = 20000",
            "[delivery.dead_letter]",
            "namespaces = [\"shop\", \"billing\"]",
            "page_size = 200",
        ],
    );
    assert_only_read_rules(&objs);
    assert_no_secret_objects(&objs);
}

#[test]
fn nats_values_mount_the_creds_file_and_grant_core_and_crd_resources_cluster_wide() {
    let objs = render("nats-creds", &[]);
    // A broker sink with no dead letter of its own: the chart's, on the broker.
    assert_has_lines(
        &config_toml(&objs),
        &["store = \"nats\"", "[delivery.dead_letter]", "type = \"broker\"", "destination = \"kubecast.dead-letter\""],
    );
    assert!(!config_toml(&render("minimal", &[])).contains("[delivery.dead_letter]"), "not with a stdout sink");
    // Another subject prefix: the default dead letter under it, where the events' stream covers it.
    assert_has_lines(
        &config_toml(&render("nats-creds", &["config.sink.nats.subject=orders.{namespace}"])),
        &["destination = \"orders.dead-letter\""],
    );
    assert!(
        !config_toml(&render("nats-creds", &["config.brokerDeadLetter="])).contains("[delivery.dead_letter]"),
        "emptied: kubecast's default"
    );
    assert_eq!(
        rbac(&objs),
        BTreeMap::from([(
            ("ClusterRole".into(), "".into()),
            read_only(&[("", "namespaces"), ("example.com", "widgets")])
        )])
    );
    let spec = pod_spec(&objs);
    let c = kubecast_container(spec);
    assert_kubecast_container(c, 9090);
    assert_eq!(mount_path(c, "nats-creds").as_deref(), Some("/etc/kubecast/nats"));
    let secret = &volume(spec, "nats-creds")["secret"];
    assert_eq!(secret["secretName"], "nats-creds");
    assert_eq!(secret["items"], json!([{"key": "nats.creds", "path": "nats.creds"}]));
    assert!(c["volumeMounts"].as_array().unwrap().iter().all(|m| m["name"] != "nats-creds" || m["readOnly"] == true));
    let toml = config_toml(&objs);
    assert_has_lines(
        &toml,
        &[
            "type = \"nats\"",
            "[sink.nats]",
            "credentials_file = \"/etc/kubecast/nats/nats.creds\"",
            "jetstream = true",
            "label_selector = \"tier=gold\"",
        ],
    );
    assert_only_read_rules(&objs);
    assert_no_secret_objects(&objs);
}

#[test]
fn sidecar_values_render_the_container_in_a_pod_template_and_bind_the_other_pods_account() {
    let objs = render("sidecar", &[]);
    assert_eq!(
        kinds(&objs),
        kind_counts(&[
            ("ClusterRole", 1),
            ("ClusterRoleBinding", 1),
            ("ConfigMap", 1),
            ("PodTemplate", 1),
            ("Role", 2),
            ("RoleBinding", 2)
        ]),
        "no Deployment, Service or ServiceAccount in sidecar mode with an existing account (the cluster role: the identity; the second role: the Lease)"
    );
    assert_identity_role(&objs);
    let lease_role = objs.iter().find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "k-kubecast-lease").unwrap();
    assert_eq!(lease_role["rules"][0]["resourceNames"], json!(["k-kubecast"]));
    let without_lease: Vec<Value> =
        objs.iter().filter(|o| o["metadata"]["name"] != "k-kubecast-lease").cloned().collect();
    assert_eq!(
        rbac(&without_lease),
        BTreeMap::from([(("Role".into(), "shop".into()), read_only(&[("", "configmaps")]))])
    );
    assert_has_lines(&config_toml(&objs), &["[coordination]", "enabled = true"]);
    assert_eq!(binding_subjects(&objs), BTreeSet::from(["kc/shop-app".to_string()]));
    let tpl = one(&objs, "PodTemplate");
    assert_eq!(tpl["metadata"]["name"], "k-kubecast-sidecar");
    let spec = &tpl["template"]["spec"];
    assert_eq!(spec["serviceAccountName"], "shop-app");
    assert_eq!(spec["containers"].as_array().unwrap().len(), 1);
    let c = kubecast_container(spec);
    assert_kubecast_container(c, 9191);
    assert!(c["readinessProbe"].is_null(), "readinessProbe: null removes it");
    assert_eq!(env_of(c, "POD_NAME").unwrap()["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    let names: BTreeSet<_> = spec["volumes"].as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names, BTreeSet::from(["kubecast-config", "kubecast-state", "kubecast-tmp"]));
    let toml = config_toml(&objs);
    assert!(toml.contains("listen = \"0.0.0.0:9191\"") && toml.contains("type = \"file\""), "{toml}");
}

#[test]
fn pvc_values_put_the_checkpoints_on_a_claim_and_add_a_disruption_budget() {
    let objs = render("pvc", &[]);
    let pvc = one(&objs, "PersistentVolumeClaim");
    assert_eq!(pvc["metadata"]["name"], "k-kubecast");
    assert_eq!(pvc["spec"]["storageClassName"], "standard");
    assert_eq!(pvc["spec"]["resources"]["requests"]["storage"], "2Gi");
    assert_eq!(pvc["spec"]["accessModes"], json!(["ReadWriteOnce"]));
    assert_eq!(pvc["metadata"]["annotations"]["helm.sh/resource-policy"], "keep");
    let spec = pod_spec(&objs);
    assert_eq!(volume(spec, "kubecast-state")["persistentVolumeClaim"]["claimName"], "k-kubecast");
    assert_eq!(mount_path(kubecast_container(spec), "kubecast-state").as_deref(), Some("/var/lib/kubecast"));
    let pdb = one(&objs, "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"], "k");
    assert!(config_toml(&objs).contains("flush_interval_ms = 500"));
    // An existing claim: used, none created.
    let objs = render("pvc", &["persistence.existingClaim=my-claim"]);
    assert_eq!(kinds(&objs).get("PersistentVolumeClaim"), None);
    assert_eq!(volume(pod_spec(&objs), "kubecast-state")["persistentVolumeClaim"]["claimName"], "my-claim");
    // With coordination too (one replica): still Recreate, as a surge pod would wait for the
    // claim the old pod holds, and the rollout with it.
    let objs = render("pvc", &["coordination.enabled=true"]);
    assert_eq!(one(&objs, "Deployment")["spec"]["strategy"]["type"], "Recreate");
}

#[test]
fn service_monitor_is_off_by_default_and_scrapes_metrics_on_the_admin_port_when_on() {
    let off = render("minimal", &[]);
    assert_eq!(kinds(&off).get("ServiceMonitor"), None);
    assert_eq!(kinds(&off).get("PodDisruptionBudget"), None, "no PDB by default");
    let on = render("servicemonitor", &[]);
    let sm = one(&on, "ServiceMonitor");
    assert_eq!(sm["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
    assert_eq!(
        sm["spec"]["endpoints"],
        json!([{"port": "admin", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}])
    );
    // It selects the Service, whose port `admin` exists and targets the container's port.
    let svc = one(&on, "Service");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["spec"]["selector"][k], v);
        assert_eq!(&svc["metadata"]["labels"][k], v);
    }
    assert_eq!(svc["spec"]["ports"][0]["name"], "admin");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], "admin");
    let annotations = &one(&on, "Deployment")["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9090");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    // Without the Service a ServiceMonitor has nothing to select: a clear error.
    let out = template("servicemonitor", &["service.enabled=false"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("metrics.serviceMonitor.enabled needs service.enabled"),
        "{}",
        text(&out.stderr)
    );
}

/// The monitoring values: the PrometheusRule (prometheus-operator's real CRD validates it) and
/// the dashboard ConfigMap next to the ServiceMonitor (tests/alerts.rs tests the alerts and the
/// dashboard themselves).
#[test]
fn monitoring_values_render_the_alerts_and_the_dashboard_for_the_grafana_sidecar() {
    let objs = render("monitoring", &[]);
    assert_eq!(kinds(&objs).get("ServiceMonitor"), Some(&1));
    let rule = one(&objs, "PrometheusRule");
    assert_eq!(rule["metadata"]["labels"]["release"], "prometheus");
    let rules = rule["spec"]["groups"][0]["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 8);
    assert!(rules.iter().all(|r| r["labels"]["team"] == "platform"), "{rules:?}");
    // kubecast's own threshold for the commits: 3 intervals (1 s by default), at least 30 s.
    let commits = rules.iter().find(|r| r["alert"] == "KubecastExactlyOnceCommitsFailing").unwrap();
    assert_eq!(
        commits["expr"],
        r#"kubecast_exactly_once_commit_failing_seconds{job="k-kubecast",namespace="kc"} > 30"#
    );
    let age = rules.iter().find(|r| r["alert"] == "KubecastCheckpointTooOld").unwrap();
    assert_eq!(age["expr"], r#"kubecast_checkpoint_age_seconds{job="k-kubecast",namespace="kc"} > 600"#);
    let dashboards: Vec<_> =
        objs.iter().filter(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "k-kubecast-dashboard").collect();
    assert_eq!(dashboards.len(), 1);
    let d = dashboards[0];
    assert_eq!(d["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(d["metadata"]["annotations"]["grafana_folder"], "kubecast");
    let json: Value = serde_json::from_str(d["data"]["kubecast.json"].as_str().unwrap()).unwrap();
    assert_eq!(json["uid"], "kubecast");
    // Both are off by default.
    let off = render("minimal", &[]);
    assert_eq!(kinds(&off).get("PrometheusRule"), None);
    assert_eq!(kinds(&off).get("ConfigMap"), Some(&1), "only the config");
}

/// The chart's config, written out, passes kubecast's own validation (unknown keys, types).
#[test]
fn every_rendered_config_passes_kubecast_check_config() {
    let dir = tempfile::tempdir().unwrap();
    for v in CI_VALUES {
        let objs = render(v, &[]);
        let path = dir.path().join(format!("{v}.toml"));
        std::fs::write(&path, config_toml(&objs)).unwrap();
        let mut cmd = Command::new(common::bin());
        cmd.args(["check-config", "--config"]).arg(&path);
        // The environment of the container (none of this shell's KUBECAST_* variables): values
        // as rendered, a placeholder for those the kubelet would take from a Secret.
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("KUBECAST_")) {
            cmd.env_remove(k);
        }
        let pod = objs.iter().find(|o| o["kind"] == "Deployment" || o["kind"] == "PodTemplate").unwrap();
        let spec =
            if pod["kind"] == "Deployment" { &pod["spec"]["template"]["spec"] } else { &pod["template"]["spec"] };
        for e in kubecast_container(spec)["env"].as_array().unwrap() {
            let value = e["value"].as_str().unwrap_or("from-a-secret");
            cmd.env(e["name"].as_str().unwrap(), value);
        }
        let out = cmd.output().unwrap();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        // Files mounted from Secrets exist only in the pod: "cannot be read" for a path under one
        // of the container's mounts is the only problem allowed here.
        let mounts: Vec<String> = kubecast_container(spec)["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str().map(str::to_string))
            .collect();
        let problems: Vec<&str> = stderr.lines().filter(|l| l.trim_start().starts_with("- ")).collect();
        let only_mounted_files = !problems.is_empty()
            && problems.iter().all(|l| l.contains("cannot be read") && mounts.iter().any(|m| l.contains(m.as_str())));
        if !out.status.success() && only_mounted_files {
            eprintln!("{v}: only files mounted in the pod are missing here: {problems:?}");
            continue;
        }
        assert!(out.status.success(), "{v}: kubecast check-config refused the chart's config:\n{stderr}");
        assert!(stdout.starts_with("config OK"), "{v}: {stdout}");
    }
}

/// librdkafka properties written as YAML numbers or booleans (`linger.ms: 20`) reach
/// kubecast as the strings it takes, for the sink and the state store's own connection.
#[test]
fn kafka_properties_given_as_numbers_or_booleans_render_as_strings() {
    let objs = render(
        "minimal",
        &[
            "config.sink.type=kafka",
            "config.sink.kafka.brokers=k:9092",
            "config.sink.kafka.properties.linger\\.ms=20",
            "config.sink.kafka.properties.enable\\.ssl\\.certificate\\.verification=false",
            "config.sink.kafka.properties.queue\\.buffering\\.backpressure\\.threshold=0.5",
            "config.checkpoint.store=kafka",
            "config.checkpoint.kafka.brokers=k2:9092",
            "config.checkpoint.kafka.properties.socket\\.timeout\\.ms=30000",
        ],
    );
    let toml = config_toml(&objs);
    assert_has_lines(
        &toml,
        &[
            "\"linger.ms\" = \"20\"",
            "\"enable.ssl.certificate.verification\" = \"false\"",
            "\"queue.buffering.backpressure.threshold\" = \"0.5\"",
            "\"socket.timeout.ms\" = \"30000\"",
        ],
    );
}

#[test]
fn a_secret_written_inline_is_refused_and_never_rendered() {
    let cases: [(&str, &[&str], &str); 5] = [
        (
            "minimal",
            &[
                "config.sink.type=kafka",
                "config.sink.kafka.brokers=k:9092",
                "config.sink.kafka.properties.sasl\\.password=hunter2",
            ],
            "sink.kafka.properties.\"sasl.password\"",
        ),
        (
            "minimal",
            &[
                "config.sink.type=kafka",
                "config.sink.kafka.brokers=k:9092",
                "config.sink.kafka.properties.sasl\\.oauthbearer\\.client\\.secret=hunter2",
            ],
            "sasl.oauthbearer.client.secret",
        ),
        ("nats-creds", &["config.sink.nats.password=hunter2"], "sink.nats.password"),
        ("nats-creds", &["config.sink.nats.token=hunter2"], "sink.nats.token"),
        (
            "minimal",
            &[
                "config.checkpoint.store=kafka",
                "config.checkpoint.kafka.brokers=k:9092",
                "config.checkpoint.kafka.properties.sasl\\.password=hunter2",
            ],
            "checkpoint.kafka.properties.\"sasl.password\"",
        ),
    ];
    for (values, sets, key) in cases {
        let out = template(values, sets);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{sets:?} rendered:\n{stdout}");
        assert!(stderr.contains(key) && stderr.contains("${env:NAME}") && stderr.contains("secretEnv"), "{stderr}");
        assert!(!stderr.contains("hunter2") && !stdout.contains("hunter2"), "the secret leaked:\n{stderr}");
    }
    // References are fine.
    let objs = render(
        "nats-creds",
        &["config.sink.nats.user=kubecast", "config.sink.nats.password=${file:/etc/kubecast/nats/password}"],
    );
    assert!(config_toml(&objs).contains("password = \"${file:/etc/kubecast/nats/password}\""));
}

#[test]
fn config_raw_is_used_verbatim_and_must_watch_what_rbac_grants() {
    let raw = "[cluster]\nname = \"raw\"\n[sink]\ntype = \"stdout\"\n[[resources]]\napi_version = \"apps/v1\"\nkind = \"Deployment\"\n";
    let objs = render("minimal", &[&format!("config.raw={raw}")]);
    assert_eq!(config_toml(&objs).trim(), raw.trim());
    assert_eq!(rbac(&objs).values().next().unwrap(), &read_only(&[("apps", "deployments")]));
    // A raw config that watches something config.resources (hence RBAC) does not have.
    let other = raw.replace("Deployment", "StatefulSet");
    let out = template("minimal", &[&format!("config.raw={other}")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("config.raw watches [apps/v1|StatefulSet|]") && err.contains("config.resources"), "{err}");
    // Inline secrets are refused in raw configs too.
    let secret =
        format!("{raw}[sink.kafka]\nbrokers = \"k:9092\"\n[sink.kafka.properties]\n\"sasl.password\" = \"hunter2\"\n")
            .replace("type = \"stdout\"", "type = \"kafka\"");
    let out = template("minimal", &[&format!("config.raw={secret}")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("config.raw: sink.kafka.properties.\"sasl.password\"") && !err.contains("hunter2"), "{err}");
    // Shards in the raw config must be the chart's (its Role names the shard Leases).
    let sharded = format!("{raw}[coordination]\nenabled = true\nshards = 4\n");
    let out = template("minimal", &[&format!("config.raw={sharded}"), "coordination.enabled=true"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("shards = 4 but coordination.shards is 1") && err.contains("coordination.shards = 4"),
        "{err}"
    );
    // Not TOML at all.
    let out = template("minimal", &["config.raw=[cluster"]);
    assert!(
        !out.status.success() && text(&out.stderr).contains("config.raw is not valid TOML"),
        "{}",
        text(&out.stderr)
    );
}

/// NOTES warn about an emptyDir only when the positions are there (file store, no persistence)
/// or the dead letters of a broker sink (the default file), and about blocked node drains only
/// when the PodDisruptionBudget allows no eviction (replicas <= minAvailable).
#[test]
fn the_notes_say_only_what_holds_for_the_rendered_values() {
    let empty_dir = "WARNING: stream positions are kept in an emptyDir";
    let drains = "blocks node drains";
    let dead_letter = "go to\nthe dead-letter file in an emptyDir";
    // The Kafka store (store "auto" with a Kafka sink), 2 replicas and a PDB.
    let n = notes("ha", &[]);
    assert!(!n.contains(empty_dir), "the Kafka store needs no volume:\n{n}");
    assert!(!n.contains(drains), "2 replicas, minAvailable 1: a drain evicts one pod:\n{n}");
    // The file store without persistence: the warning; no PDB: no drain note.
    let n = notes("minimal", &[]);
    assert!(n.contains(empty_dir), "{n}");
    assert!(!n.contains(drains), "{n}");
    // One replica with a PDB (and the file store on a claim: no warning).
    let n = notes("pvc", &[]);
    assert!(n.contains(drains) && n.contains("with 1 replica blocks"), "{n}");
    assert!(!n.contains(empty_dir), "{n}");
    // One replica with a PDB and the Kafka store.
    let n = notes("ha", &["replicas=1"]);
    assert!(n.contains(drains), "{n}");
    assert!(!n.contains(empty_dir), "{n}");
    // minAvailable as a percentage of 2 replicas: 50% lets one go, 100% none.
    assert!(!notes("ha", &["podDisruptionBudget.minAvailable=50%"]).contains(drains));
    let n = notes("ha", &["podDisruptionBudget.minAvailable=100%"]);
    assert!(n.contains(drains) && n.contains("with 2 replicas blocks"), "{n}");
    assert!(notes("ha", &["podDisruptionBudget.minAvailable=2"]).contains(drains));
    // The NATS store (JetStream sink), and NATS without JetStream (the file store).
    assert!(!notes("nats-creds", &[]).contains(empty_dir));
    assert!(notes("nats-creds", &["config.sink.nats.jetstream=false"]).contains(empty_dir));
    // The file store chosen explicitly with a Kafka sink.
    assert!(
        notes("ha", &["config.checkpoint.store=file", "replicas=1", "coordination.enabled=false"]).contains(empty_dir)
    );
    // config.raw: its own [checkpoint] store (kubecast's default: file).
    let raw = "[cluster]\nname = \"raw\"\n[sink]\ntype = \"kafka\"\n[sink.kafka]\nbrokers = \"k:9092\"\n[[resources]]\napi_version = \"apps/v1\"\nkind = \"Deployment\"\n";
    assert!(notes("minimal", &[&format!("config.raw={raw}")]).contains(empty_dir));
    let kafka = format!("{raw}[checkpoint]\nstore = \"kafka\"\n");
    assert!(!notes("minimal", &[&format!("config.raw={kafka}")]).contains(empty_dir));
    // A broker sink: the chart's broker dead letter, named; with config.brokerDeadLetter
    // emptied, the default file on an emptyDir: the warning; not with a broker dead letter, a
    // volume, or a stdout sink.
    let n = notes("ha", &[]);
    assert!(!n.contains(dead_letter), "{n}");
    assert!(n.contains("Dead letter: Kafka topic \"kubecast.dead-letter\" (config.brokerDeadLetter)"), "{n}");
    assert!(notes("ha", &["config.brokerDeadLetter="]).contains(dead_letter));
    assert!(notes("ha", &["config.delivery.dead_letter.type=file"]).contains(dead_letter));
    assert!(notes("nats-creds", &[]).contains("Dead letter: NATS subject \"kubecast.dead-letter\""));
    assert!(
        !notes("ha", &["config.delivery.dead_letter.type=broker", "config.delivery.dead_letter.destination=dl"])
            .contains(dead_letter)
    );
    assert!(!notes("minimal", &[]).contains(dead_letter));
    assert!(
        !notes("pvc", &["config.sink.type=kafka", "config.sink.kafka.brokers=k:9092", "config.brokerDeadLetter="])
            .contains(dead_letter)
    );
    // rbac.create: false: what to grant besides the watched resources.
    let n = notes("ha", &["rbac.create=false"]);
    assert!(
        n.contains("get on namespaces/kube-system")
            && n.contains("get, watch and update on leases.coordination.k8s.io k-kubecast"),
        "{n}"
    );
    assert!(!notes("ha", &[]).contains("get on namespaces/kube-system"), "rbac.create: the chart grants it");
    // Sidecar mode renders no PDB: no drain note.
    assert!(!notes("sidecar", &["podDisruptionBudget.enabled=true"]).contains(drains));
}

/// The config ConfigMap is named after its content and immutable, and the pod template (the
/// Deployment's and the sidecar PodTemplate's) mounts that name: a changed config is a new
/// ConfigMap and a new pod template; anything else keeps both.
#[test]
fn the_config_map_is_named_after_its_content_and_the_pod_template_mounts_that_name() {
    let name_in = |objs: &[Value]| config_map(objs)["metadata"]["name"].as_str().unwrap().to_string();
    let mounted = |spec: &Value| volume(spec, "kubecast-config")["configMap"]["name"].as_str().unwrap().to_string();
    let base = render("minimal", &[]);
    let name = name_in(&base);
    assert!(name.starts_with("k-kubecast-config-") && name.len() == "k-kubecast-config-".len() + 10, "{name}");
    assert_eq!(mounted(pod_spec(&base)), name);
    // Rendered again: the same name.
    assert_eq!(name_in(&render("minimal", &[])), name);
    // Pod labels are not in kubecast.toml: same ConfigMap.
    assert_eq!(name_in(&render("minimal", &["podLabels.team=a"])), name);
    // A config change: another name, and the pod template follows it.
    let changed = render("minimal", &["config.cluster.name=other"]);
    let other = name_in(&changed);
    assert_ne!(other, name);
    assert_eq!(mounted(pod_spec(&changed)), other);
    // Sidecar mode: the PodTemplate mounts the same hashed name as the ConfigMap's.
    let sidecar = render("sidecar", &[]);
    assert_eq!(mounted(&one(&sidecar, "PodTemplate")["template"]["spec"]), name_in(&sidecar));
}

/// On the real apiserver: `helm upgrade` with a changed config creates the new ConfigMap,
/// points the Deployment at it and deletes the old one; the ConfigMap cannot be changed in
/// place; an upgrade that keeps the config keeps the ConfigMap; `helm rollback` brings the
/// old name back.
#[tokio::test]
async fn helm_upgrade_replaces_the_immutable_config_map_and_the_pod_template_follows() {
    setup();
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "kc-upgrade").await;
    let release = common::unique("up");
    let deployment = format!("{release}-kubecast");
    let chart = chart();
    let file = ci_values("ha");
    let helm_in = |args: &[&str], what: &str| {
        let mut a = args.to_vec();
        a.extend(["-n", ns.name.as_str(), "-f", file.as_str()]);
        ok(helm(&a), what)
    };
    let config_maps = || {
        let out = ok(
            kubectl(
                &[
                    "get",
                    "configmap",
                    "-n",
                    &ns.name,
                    "-l",
                    &format!("app.kubernetes.io/instance={release}"),
                    "-o",
                    "name",
                ],
                None,
            ),
            "list the release's ConfigMaps",
        );
        out.lines().map(|l| l.trim_start_matches("configmap/").to_string()).collect::<BTreeSet<_>>()
    };
    helm_in(&["install", &release, &chart, "--set", "replicas=1"], "helm install");
    let first = mounted_config_name(&deployment, &ns.name);
    assert_eq!(config_maps(), BTreeSet::from([first.clone()]));
    // Immutable: the apiserver refuses a change in place.
    let patch = kubectl(
        &["patch", "configmap", &first, "-n", &ns.name, "--type", "merge", "-p", r#"{"data":{"kubecast.toml":"x"}}"#],
        None,
    );
    assert!(!patch.status.success(), "an immutable ConfigMap was changed");
    assert!(text(&patch.stderr).contains("immutable"), "{}", text(&patch.stderr));

    // 1 -> 2 replicas with a new config: a new ConfigMap, the pod template names it, the old
    // one is gone.
    helm_in(
        &["upgrade", &release, &chart, "--set", "replicas=2", "--set", "config.cluster.name=prod-eu-3"],
        "helm upgrade",
    );
    let second = mounted_config_name(&deployment, &ns.name);
    assert_ne!(second, first);
    assert_eq!(config_maps(), BTreeSet::from([second.clone()]), "the old config is deleted");
    assert!(installed_config(&deployment, &ns.name).contains("name = \"prod-eu-3\""));
    // The same config again (only the replica count changes): the same ConfigMap.
    helm_in(
        &["upgrade", &release, &chart, "--set", "replicas=3", "--set", "config.cluster.name=prod-eu-3"],
        "helm upgrade",
    );
    assert_eq!(mounted_config_name(&deployment, &ns.name), second);
    assert_eq!(config_maps(), BTreeSet::from([second.clone()]));
    let replicas = ok(
        kubectl(&["get", "deployment", &deployment, "-n", &ns.name, "-o", "jsonpath={.spec.replicas}"], None),
        "read the Deployment's replicas",
    );
    assert_eq!(replicas, "3", "the upgrade was applied");
    // Rollback to the first revision: its config under its old name.
    ok(helm(&["rollback", &release, "1", "-n", &ns.name]), "helm rollback");
    assert_eq!(mounted_config_name(&deployment, &ns.name), first);
    assert_eq!(config_maps(), BTreeSet::from([first.clone()]));
    ok(helm(&["uninstall", &release, "-n", &ns.name]), "helm uninstall");
}

/// Two replicas, one active through a Lease: the rendered config elects, each pod has its
/// identity, RollingUpdate (a new pod starts as a standby), RBAC for that one Lease only; and
/// more than one replica without coordination is refused.
#[test]
fn ha_values_render_two_replicas_a_lease_and_its_role() {
    let objs = render("ha", &[]);
    let deploy = one(&objs, "Deployment");
    assert_eq!(deploy["spec"]["replicas"], 2);
    assert_eq!(deploy["spec"]["strategy"]["type"], "RollingUpdate");
    assert_eq!(deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    assert_has_lines(
        &config_toml(&objs),
        &["[coordination]", "enabled = true", "lease_name = \"k-kubecast\"", "lease_namespace = \"kc\""],
    );
    // The positions live in the Kafka sink's cluster: no volume needed.
    assert_has_lines(&config_toml(&objs), &["store = \"kafka\""]);
    assert!(!objs.iter().any(|o| o["kind"] == "PersistentVolumeClaim"));
    assert_eq!(one(&objs, "PodDisruptionBudget")["spec"]["minAvailable"], 1);
    let c = kubecast_container(pod_spec(&objs));
    assert_eq!(env_of(c, "POD_NAME").unwrap()["valueFrom"]["fieldRef"]["fieldPath"], "metadata.name");
    assert_eq!(env_of(c, "POD_NAMESPACE").unwrap()["valueFrom"]["fieldRef"]["fieldPath"], "metadata.namespace");
    let role = objs
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "k-kubecast-lease")
        .expect("the lease role");
    assert_eq!(role["metadata"]["namespace"], "kc");
    assert_eq!(
        role["rules"],
        json!([
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["k-kubecast"], "verbs": ["get", "watch", "update"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "create", "update", "delete"]}
        ])
    );
    let out = template("minimal", &["replicas=2"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("replicas = 2 needs coordination.enabled = true"), "{}", text(&out.stderr));
    // A standby would take over without the leader's state if it is in files on the leader's pod.
    let out = template("minimal", &["replicas=2", "coordination.enabled=true"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("replicas = 2 with the state in files") && err.contains("config.checkpoint.store"), "{err}");
}

/// `coordination.shards`: the config runs that many shards, and the Role names each shard's
/// Lease (`<lease>-<i>-of-<N>`) and allows the replicas' member Leases; shards without
/// coordination or with the state on a volume are refused.
#[test]
fn sharded_values_render_the_shards_and_every_shard_lease_s_role() {
    let objs = render("ha", &["coordination.shards=4", "replicas=3"]);
    assert_has_lines(&config_toml(&objs), &["[coordination]", "enabled = true", "shards = 4"]);
    let role = objs
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "k-kubecast-lease")
        .expect("the lease role");
    let names = ["k-kubecast-0-of-4", "k-kubecast-1-of-4", "k-kubecast-2-of-4", "k-kubecast-3-of-4"];
    assert_eq!(
        role["rules"],
        json!([
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": names, "verbs": ["get", "update"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "create", "update", "delete"]}
        ])
    );
    assert!(!config_toml(&render("ha", &[])).contains("shards"), "1 shard: nothing rendered");
    let out = template("ha", &["coordination.shards=2", "coordination.enabled=false", "replicas=1"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("coordination.shards = 2 needs coordination.enabled = true"),
        "{}",
        text(&out.stderr)
    );
    let out = template("minimal", &["coordination.shards=2", "coordination.enabled=true"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("needs the state in Kafka or NATS"), "{}", text(&out.stderr));
}

/// kubecast stops within `shutdown_timeout_seconds`; the grace period before the kubelet's
/// SIGKILL is derived from it, and a shorter one is refused.
#[test]
fn the_grace_period_follows_the_shutdown_timeout_and_a_shorter_one_is_refused() {
    let grace = |sets: &[&str]| pod_spec(&render("minimal", sets))["terminationGracePeriodSeconds"].clone();
    assert_eq!(grace(&[]), 45, "default shutdown_timeout_seconds 30 + 15");
    assert_eq!(grace(&["config.delivery.shutdown_timeout_seconds=100"]), 115);
    assert_eq!(grace(&["terminationGracePeriodSeconds=40"]), 40, "long enough: kept");
    let out = template("minimal", &["terminationGracePeriodSeconds=20"]);
    assert!(!out.status.success(), "a grace period shorter than the shutdown timeout was accepted");
    let err = text(&out.stderr);
    assert!(err.contains("terminationGracePeriodSeconds = 20") && err.contains("at least 35"), "{err}");
}

#[test]
fn values_that_violate_the_schema_are_rejected_naming_the_value() {
    let cases: [(&[&str], &[&str]); 6] = [
        (&["mode=daemonset"], &["/mode", "standalone", "sidecar"]),
        (&["replicas=0"], &["/replicas"]),
        (&["config.resources[0].resource=null"], &["/config/resources/0/resource"]),
        (&["config.resources[0].verbs={create}"], &["/config/resources/0", "verbs"]),
        (&["admin.port=70000"], &["/admin/port"]),
        (&["config.cluster.name=Prod_EU"], &["/config/cluster/name"]),
    ];
    for (sets, fragments) in cases {
        let out = template("minimal", sets);
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{sets:?} was accepted");
        assert!(err.contains("values don't meet the specifications of the schema"), "{sets:?}: {err}");
        for f in fragments {
            assert!(err.contains(f), "{sets:?}: no {f:?} in\n{err}");
        }
    }
}

/// The pod the Deployment would create passes the `restricted` Pod Security Standard, as the
/// apiserver's PodSecurity admission enforces it (dry run of a Pod in an enforcing namespace).
#[tokio::test]
async fn the_pod_meets_the_restricted_pod_security_standard() {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "kc-psa").await;
    ok(
        kubectl(&["label", "namespace", &ns.name, "pod-security.kubernetes.io/enforce=restricted"], None),
        "label namespace",
    );
    // The ServiceAccount admission plugin (on while the node runs) wants the pod's account.
    let sa = pod_spec(&render("minimal", &[]))["serviceAccountName"].as_str().unwrap().to_string();
    ok(kubectl(&["-n", &ns.name, "create", "serviceaccount", &sa], None), "create serviceaccount");
    let pod_from = |sets: &[&str]| {
        let objs = render("minimal", sets);
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kubecast", "namespace": ns.name},
               "spec": pod_spec(&objs)})
        .to_string()
    };
    let out = kubectl(&["create", "--dry-run=server", "-f", "-"], Some(&pod_from(&[])));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!text(&out.stderr).contains("violate"), "{}", text(&out.stderr));
    // The check can fail: the same pod with privilege escalation allowed is refused.
    let out = kubectl(
        &["create", "--dry-run=server", "-f", "-"],
        Some(&pod_from(&["securityContext.allowPrivilegeEscalation=true"])),
    );
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("violates PodSecurity \"restricted"), "{}", text(&out.stderr));
}

/// `helm install` of every ci values file on the real apiserver, each in a new namespace.
#[tokio::test]
async fn helm_install_works_on_the_real_apiserver_for_every_ci_values_file() {
    setup();
    let client = common::client().await;
    let chart = chart();
    for v in CI_VALUES {
        let ns = TestNamespace::new(&client, "kc-install").await;
        let release = common::unique("kc");
        let file = ci_values(v);
        let out =
            ok(helm(&["install", &release, &chart, "-n", &ns.name, "-f", &file]), &format!("helm install -f {v}"));
        assert!(out.contains("STATUS: deployed"), "{v}: {out}");
        // NOTES.txt lists what is watched.
        assert!(out.contains("Watched resources (RBAC: get, list, watch, nothing else"), "{v}: {out}");
        let status = ok(helm(&["status", &release, "-n", &ns.name, "-o", "json"]), "helm status");
        let status: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(status["info"]["status"], "deployed");
        // The objects are there, as the manifest says.
        let manifest = ok(helm(&["get", "manifest", &release, "-n", &ns.name]), "helm get manifest");
        let got = ok(kubectl(&["get", "-f", "-", "-o", "json"], Some(&manifest)), "kubectl get the release's objects");
        let got: Value = serde_json::from_str(&got).unwrap();
        let rendered = server_dry_run(&manifest);
        assert_eq!(kinds(got["items"].as_array().unwrap()), kinds(&rendered), "{v}");
        if v == "sidecar" {
            assert!(out.contains(&format!("get podtemplate {release}-kubecast-sidecar")), "{out}");
        }
        // Cluster-scoped objects are the release's: uninstall removes them.
        ok(helm(&["uninstall", &release, "-n", &ns.name]), "helm uninstall");
        let left = kubectl(&["get", "clusterrole", &format!("{}-{release}-kubecast", ns.name)], None);
        assert!(!left.status.success(), "{v}: the ClusterRole outlived the release");
    }
}

/// The RBAC proof: kubecast runs with a token of the chart's ServiceAccount and the chart's
/// config; it watches the configured resources (namespaced Role and ClusterRole) and is
/// forbidden on one the chart did not grant.
#[tokio::test(flavor = "multi_thread")]
async fn the_charts_service_account_may_watch_exactly_the_configured_resources() {
    let client = common::client().await;
    let home = TestNamespace::new(&client, "kc-home").await;
    let watched = TestNamespace::new(&client, "kc-watched").await;
    let other = TestNamespace::new(&client, "kc-other").await;
    let release = common::unique("proof");
    let sa = format!("{release}-kubecast");
    let values = json!({
        "config": {
            "cluster": {"name": "rbac-proof"},
            "resources": [
                {"api_version": "v1", "kind": "ConfigMap", "resource": "configmaps", "namespaces": [watched.name]},
                {"api_version": "apps/v1", "kind": "Deployment", "resource": "deployments"},
            ]
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let values_path = dir.path().join("values.json"); // JSON is YAML
    std::fs::write(&values_path, values.to_string()).unwrap();
    let chart = chart();
    ok(helm(&["install", &release, &chart, "-n", &home.name, "-f", values_path.to_str().unwrap()]), "helm install");

    let kubeconfig = service_account_kubeconfig(&sa, &home.name, dir.path());

    // What the identity may do: read (get, list, watch) the configured resources, nothing else.
    let who =
        ok(kubectl_as(&kubeconfig, &["auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"], None), "whoami");
    assert_eq!(who, format!("system:serviceaccount:{}:{sa}", home.name));
    let can = |args: &[&str]| {
        let mut a = vec!["auth", "can-i"];
        a.extend(args);
        text(&kubectl_as(&kubeconfig, &a, None).stdout).trim().to_string()
    };
    for verb in ["get", "list", "watch"] {
        assert_eq!(can(&[verb, "configmaps", "-n", &watched.name]), "yes", "{verb} configmaps");
        assert_eq!(can(&[verb, "deployments.apps", "--all-namespaces"]), "yes", "{verb} deployments");
    }
    for (what, args) in [
        ("configmaps of another namespace", vec!["list", "configmaps", "-n", &other.name]),
        ("configmaps cluster-wide", vec!["watch", "configmaps", "--all-namespaces"]),
        ("writing configmaps", vec!["create", "configmaps", "-n", &watched.name]),
        ("deleting deployments", vec!["delete", "deployments.apps", "-n", &watched.name]),
        ("secrets", vec!["list", "secrets", "-n", &watched.name]),
        ("pods", vec!["list", "pods", "-n", &watched.name]),
        ("leases", vec!["create", "leases.coordination.k8s.io", "-n", &home.name]),
    ] {
        assert_eq!(can(&args), "no", "{what} must be denied");
    }

    // kubecast with the chart's own config: only the sink and the checkpoint directory are
    // replaced (by the harness's file sink and a temp dir), as the chart's are for a pod.
    let installed = installed_config(&sa, &home.name);
    let config = tables(&installed, &["sink", "checkpoint"], false);
    assert!(config.contains("[[resources]]") && config.contains(&watched.name), "{config}");
    let mut kc = Kubecast::start_with(&config, &[("KUBECONFIG", &kubeconfig)]);
    kc.wait_log("list complete", 2).await;
    common::create_cm(&client, &watched.name, "seen", json!({}), json!({"k": "v"})).await;
    common::create_cm(&client, &other.name, "unseen", json!({}), json!({"k": "v"})).await;
    let deploy = json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": {"metadata": {"labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}});
    let deploy = serde_json::to_string(&deploy).unwrap();
    ok(kubectl(&["create", "-n", &watched.name, "-f", "-"], Some(&deploy)), "create deployment");
    let cm_subject = format!("{}/seen", watched.name);
    let dep_subject = format!("{}/web", watched.name);
    let evs = kc
        .wait_for("the ConfigMap and the Deployment", WAIT, |evs| {
            !common::about(evs, &cm_subject).is_empty() && !common::about(evs, &dep_subject).is_empty()
        })
        .await;
    assert_eq!(common::about(&evs, &cm_subject)[0]["type"], "io.kubecast.core.ConfigMap.added");
    assert_eq!(common::about(&evs, &dep_subject)[0]["type"], "io.kubecast.apps.Deployment.added");
    assert!(common::about(&evs, &format!("{}/unseen", other.name)).is_empty());
    assert!(
        evs.iter().all(|e| e["source"].as_str().unwrap().starts_with("k8s://rbac-proof/")),
        "{}",
        common::pretty(&evs)
    );
    kc.wait_ready(200).await;
    assert!(kc.stop().success(), "{}", kc.log());

    // Not granted: Secrets of the watched namespace, and ConfigMaps beyond it (cluster-wide).
    for (entry, resource) in [
        (format!("api_version = \"v1\"\nkind = \"Secret\"\nnamespaces = [\"{}\"]", watched.name), "secrets"),
        ("api_version = \"v1\"\nkind = \"ConfigMap\"".to_string(), "configmaps"),
    ] {
        let mut kc =
            Kubecast::start_with(&format!("{config}\n[[resources]]\n{entry}\n"), &[("KUBECONFIG", &kubeconfig)]);
        let status = kc.wait_exit(WAIT).await;
        let log = kc.log();
        assert!(!status.success(), "kubecast ran without permission on {resource}:\n{log}");
        assert!(
            log.contains("forbidden") && log.contains(&format!("grant get, list and watch on {resource}")),
            "{log}"
        );
    }
    ok(helm(&["uninstall", &release, "-n", &home.name]), "helm uninstall");
}

/// The name of the ConfigMap the pod template of Deployment `deployment` mounts.
fn mounted_config_name(deployment: &str, ns: &str) -> String {
    let path = "jsonpath={.spec.template.spec.volumes[?(@.name==\"kubecast-config\")].configMap.name}";
    ok(kubectl(&["get", "deployment", deployment, "-n", ns, "-o", path], None), "read the Deployment's config volume")
}

/// The kubecast.toml the pods of Deployment `deployment` run with (its ConfigMap's name carries
/// a hash of the content: read it from the pod template, as the chart README shows).
fn installed_config(deployment: &str, ns: &str) -> String {
    let name = mounted_config_name(deployment, ns);
    assert!(name.starts_with(&format!("{deployment}-config-")), "{name}");
    ok(
        kubectl(&["get", "configmap", &name, "-n", ns, "-o", "jsonpath={.data.kubecast\\.toml}"], None),
        "read the chart's ConfigMap",
    )
}

/// A kubeconfig with a token of ServiceAccount `sa` of `ns` (and nothing else), in `dir`.
fn service_account_kubeconfig(sa: &str, ns: &str, dir: &Path) -> String {
    let token = ok(kubectl(&["create", "token", sa, "-n", ns, "--duration=1h"], None), "kubectl create token");
    let kubeconfig = dir.join("kubeconfig");
    let kc = json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": {
            "server": common::env_var("KUBECAST_TEST_APISERVER"),
            "certificate-authority": common::env_var("KUBECAST_TEST_CA")}}],
        "users": [{"name": "sa", "user": {"token": token.trim()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": "sa"}}],
        "current-context": "sa"
    });
    std::fs::write(&kubeconfig, kc.to_string()).unwrap();
    kubeconfig.to_str().unwrap().to_string()
}

/// With coordination, the chart's ServiceAccount may take, renew and watch its one Lease, and
/// keep a member Lease of its own (list, create, update, delete on leases of the release
/// namespace, as a leader-elected controller's Role does), and no lease elsewhere; kubecast
/// with the chart's config and that identity holds it, in its group.
#[tokio::test]
async fn the_charts_service_account_may_hold_its_lease_in_its_namespace_only() {
    let client = common::client().await;
    let home = TestNamespace::new(&client, "kc-lease").await;
    let release = common::unique("lease");
    let sa = format!("{release}-kubecast");
    let values = json!({
        "coordination": {"enabled": true},
        "config": {"cluster": {"name": "lease-proof"},
            "resources": [{"api_version": "v1", "kind": "ConfigMap", "resource": "configmaps", "namespaces": [home.name]}]}
    });
    let dir = tempfile::tempdir().unwrap();
    let values_path = dir.path().join("values.json");
    std::fs::write(&values_path, values.to_string()).unwrap();
    ok(helm(&["install", &release, &chart(), "-n", &home.name, "-f", values_path.to_str().unwrap()]), "helm install");
    let kubeconfig = service_account_kubeconfig(&sa, &home.name, dir.path());
    let can = |args: &[&str]| {
        let mut a = vec!["auth", "can-i"];
        a.extend(args);
        a.extend(["-n", home.name.as_str()]);
        text(&kubectl_as(&kubeconfig, &a, None).stdout).trim().to_string()
    };
    let lease = format!("leases.coordination.k8s.io/{sa}");
    assert_eq!(can(&["get", &lease]), "yes");
    assert_eq!(can(&["update", &lease]), "yes");
    assert_eq!(can(&["watch", &lease]), "yes");
    assert_eq!(can(&["create", "leases.coordination.k8s.io"]), "yes");
    // The cluster's identity, and no other namespace.
    assert_eq!(can(&["get", "namespaces/kube-system"]), "yes");
    assert_eq!(can(&["get", "namespaces/default"]), "no");
    assert_eq!(can(&["list", "namespaces"]), "no");
    // Its member Lease (a name not known in advance) and the group's list.
    assert_eq!(can(&["list", "leases.coordination.k8s.io"]), "yes");
    assert_eq!(can(&["delete", "leases.coordination.k8s.io/member"]), "yes");
    let elsewhere = |verb: &str| {
        let a = ["auth", "can-i", verb, "leases.coordination.k8s.io", "-n", "default"];
        text(&kubectl_as(&kubeconfig, &a, None).stdout).trim().to_string()
    };
    for verb in ["get", "list", "create", "update", "delete"] {
        assert_eq!(elsewhere(verb), "no", "{verb} on leases of another namespace must be denied");
    }
    for (what, args) in [
        ("patching leases", vec!["patch", lease.as_str()]),
        ("configmaps", vec!["create", "configmaps"]),
        ("secrets", vec!["get", "secrets"]),
    ] {
        assert_eq!(can(&args), "no", "{what} must be denied");
    }
    let installed = installed_config(&sa, &home.name);
    assert!(installed.contains("[coordination]"), "{installed}");
    let config = tables(&installed, &["sink", "checkpoint"], false);
    let mut kc = Kubecast::start_with(&config, &[("KUBECONFIG", &kubeconfig), ("POD_NAME", "proof-0")]);
    kc.wait_log("holding the lease", 1).await;
    let holder = ok(
        kubectl(&["get", "lease", &sa, "-n", &home.name, "-o", "jsonpath={.spec.holderIdentity}"], None),
        "read the lease",
    );
    assert!(holder.starts_with("proof-0-"), "{holder}");
    // Renewed with that identity (the chart's Role allows the update): renewTime moves on, the
    // holder stays.
    let read = |field: &str| {
        let path = format!("jsonpath={{.spec.{field}}}");
        ok(kubectl(&["get", "lease", &sa, "-n", &home.name, "-o", &path], None), "read the lease")
    };
    let first = read("renewTime");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while read("renewTime") == first {
        assert!(std::time::Instant::now() < deadline, "the lease was not renewed within 60 s:\n{}", kc.log());
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert_eq!(read("holderIdentity"), holder, "renewed by the same holder");
    assert!(!kc.log().contains("lost the lease"), "{}", kc.log());
    assert!(!kc.log().contains("cannot read the kube-system namespace"), "the identity is readable:\n{}", kc.log());
    assert!(!kc.log().contains("other shard counts cannot be seen"), "the Role lets it join its group:\n{}", kc.log());
    let members = ok(
        kubectl(&["get", "leases", "-n", &home.name, "-l", "kubecast.io/lease-role=member", "-o", "name"], None),
        "list the member leases",
    );
    assert_eq!(members.lines().count(), 1, "its member Lease: {members}");
    // A standby with the same identity watches the Lease (RBAC: watch on that one Lease) and
    // takes it as soon as the holder gives it up at its stop.
    let mut standby = Kubecast::start_with(&config, &[("KUBECONFIG", &kubeconfig), ("POD_NAME", "proof-1")]);
    standby.wait_log("standby: another process holds the lease", 1).await;
    assert!(kc.stop().success(), "{}", kc.log());
    standby.wait_log("holding the lease", 1).await;
    let log = standby.log();
    assert!(!log.contains("cannot watch the lease"), "the chart's Role allows the watch:\n{log}");
    assert!(standby.stop().success(), "{log}");
    ok(helm(&["uninstall", &release, "-n", &home.name]), "helm uninstall");
}

fn tables(toml: &str, names: &[&str], keep: bool) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in toml.lines() {
        let t = line.trim_start();
        if t.starts_with('[') {
            let header = t.trim_start_matches('[').trim_end_matches(']');
            inside = names.iter().any(|n| header == *n || header.starts_with(&format!("{n}.")));
        }
        if inside == keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The runtime image (distroless/cc) has glibc and libgcc_s and nothing else: the binary must
/// need nothing more (OpenSSL, zlib, zstd, librdkafka are linked in statically).
#[test]
fn the_binary_needs_only_the_libraries_of_the_distroless_cc_image() {
    let out = ok(Command::new("ldd").arg(common::bin()).output().expect("ldd"), "ldd");
    let allowed =
        ["linux-vdso.so", "ld-linux", "libc.so", "libm.so", "libgcc_s.so", "libpthread.so", "libdl.so", "librt.so"];
    let libs: Vec<&str> = out.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    assert!(libs.iter().any(|l| l.starts_with("libc.so")), "{out}");
    for l in &libs {
        assert!(allowed.iter().any(|a| l.contains(a)), "the binary needs {l:?}, which distroless/cc lacks:\n{out}");
    }
}

#[test]
fn the_dockerfile_passes_hadolint() {
    let out = Command::new(repo().join("docker/lint")).output().expect("docker/lint");
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    assert!(text(&out.stdout).contains("found nothing"));
}

/// Every value of the schema (which `helm lint` holds values.yaml to: additionalProperties is
/// false) has a row in the chart README's table.
#[test]
fn the_chart_readme_documents_every_value() {
    let schema: Value =
        serde_json::from_slice(&std::fs::read(repo().join("charts/kubecast/values.schema.json")).unwrap()).unwrap();
    let readme = std::fs::read_to_string(repo().join("charts/kubecast/README.md")).unwrap();
    let mut paths = Vec::new();
    leaf_paths(&schema, "", &mut paths);
    assert!(paths.len() > 50, "{paths:?}");
    let missing: Vec<_> = paths.iter().filter(|p| !readme.contains(&format!("| `{p}` |"))).collect();
    assert!(missing.is_empty(), "values without a row in charts/kubecast/README.md: {missing:?}");
}

/// Dotted paths of the schema's values: objects with fixed properties are walked into,
/// everything else (open objects such as config.sink, arrays, scalars) is a value.
fn leaf_paths(schema: &Value, prefix: &str, out: &mut Vec<String>) {
    let walk = schema["properties"].is_object() && schema["additionalProperties"] == false;
    if !walk {
        out.push(prefix.to_string());
        return;
    }
    for (k, v) in schema["properties"].as_object().unwrap() {
        let p = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        leaf_paths(v, &p, out);
    }
}

/// Sidecar mode from a parent chart: its pod includes the named templates "kubecast.container"
/// and "kubecast.volumes" with the subchart's context, as the chart README shows; the subchart
/// renders the ConfigMap, ServiceAccount and RBAC, and no Deployment of its own.
#[test]
fn a_parent_chart_adds_the_sidecar_with_the_named_templates() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host");
    std::fs::create_dir_all(host.join("templates")).unwrap();
    std::fs::create_dir_all(host.join("charts")).unwrap();
    ok(
        Command::new("cp").arg("-r").arg(chart()).arg(host.join("charts/kubecast")).output().unwrap(),
        "copy the chart into the parent's charts/",
    );
    std::fs::write(host.join("Chart.yaml"), "apiVersion: v2\nname: host\nversion: 1.0.0\n").unwrap();
    let values = json!({"kubecast": {"mode": "sidecar", "config": {"cluster": {"name": "host"}, "resources": [
        {"api_version": "v1", "kind": "ConfigMap", "resource": "configmaps", "namespaces": ["shop"]}]}}});
    std::fs::write(host.join("values.yaml"), values.to_string()).unwrap();
    // The snippet of the chart README, "Sidecar mode", 2.
    let deployment = r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: host
spec:
  replicas: 1
  selector:
    matchLabels: {app: host}
  template:
    metadata:
      labels: {app: host}
    spec:
      serviceAccountName: {{ include "kubecast.serviceAccountName" .Subcharts.kubecast }}
      containers:
        - name: app
          image: my/app
        {{- include "kubecast.container" .Subcharts.kubecast | nindent 8 }}
      volumes:
        {{- include "kubecast.volumes" .Subcharts.kubecast | nindent 8 }}
"#;
    std::fs::write(host.join("templates/deployment.yaml"), deployment).unwrap();
    let out =
        ok(helm(&["template", "h", host.to_str().unwrap(), "--namespace", "kc"]), "helm template the parent chart");
    let objs = server_dry_run(&out);
    let deployments: Vec<_> = objs.iter().filter(|o| o["kind"] == "Deployment").collect();
    assert_eq!(deployments.len(), 1, "only the parent's Deployment");
    let spec = &deployments[0]["spec"]["template"]["spec"];
    let names: Vec<_> = spec["containers"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["app", "kubecast"]);
    assert_kubecast_container(kubecast_container(spec), 9090);
    let sa = one(&objs, "ServiceAccount")["metadata"]["name"].as_str().unwrap().to_string();
    assert_eq!(spec["serviceAccountName"], sa.as_str());
    assert_eq!(binding_subjects(&objs), BTreeSet::from([format!("kc/{sa}")]));
    let cm = one(&objs, "ConfigMap")["metadata"]["name"].clone();
    assert_eq!(volume(spec, "kubecast-config")["configMap"]["name"], cm);
    assert!(config_toml(&objs).contains("name = \"host\""));
}

/// Kafka credentials come from the Secret the chart references: kubecast runs with the
/// chart's own Kafka sink against the SASL listener of the test Kafka, with the environment
/// the kubelet would give the container (each `secretKeyRef` read from the Secret). The right
/// Secret authenticates and the snapshot arrives; a Secret with a wrong password does not.
/// The password appears neither in the rendered manifests nor in kubecast's log.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_credentials_come_from_the_secret_the_chart_references() {
    let client = common::client().await;
    let ns = TestNamespace::new(&client, "kc-kafka").await;
    let right = common::env_var("KAFKA_SASL_PASSWORD");
    let wrong = "not-the-password-4711";
    for (secret, password) in [("kafka-creds", right.as_str()), ("kafka-wrong", wrong)] {
        let literal = format!("--from-literal=password={password}");
        ok(kubectl(&["create", "secret", "generic", secret, "-n", &ns.name, &literal], None), "create secret");
    }
    common::create_cm(&client, &ns.name, "seen", json!({}), json!({"k": "v"})).await;
    let cluster = common::unique("chart");
    let topic = format!("{cluster}.configmaps");
    let values = |secret: &str| {
        json!({
            "config": {
                "cluster": {"name": cluster},
                "sink": {"type": "kafka", "kafka": {
                    "brokers": common::env_var("KAFKA_SASL_BROKERS"),
                    "topic": "{cluster}.{resource}",
                    "properties": {
                        "security.protocol": "SASL_PLAINTEXT",
                        "sasl.mechanism": "PLAIN",
                        "sasl.username": common::env_var("KAFKA_SASL_USER"),
                        "sasl.password": "${env:KAFKA_PASSWORD}"
                    }}},
                "delivery": {"shutdown_timeout_seconds": 2},
                "resources": [{"api_version": "v1", "kind": "ConfigMap", "resource": "configmaps", "namespaces": [ns.name]}]
            },
            "secretEnv": [{"name": "KAFKA_PASSWORD", "secretName": secret, "key": "password"}]
        })
    };
    let dir = tempfile::tempdir().unwrap();
    let chart = chart();
    let start = |secret: &str| {
        let path = dir.path().join(format!("{secret}.json"));
        std::fs::write(&path, values(secret).to_string()).unwrap();
        let manifests = ok(
            helm(&["template", "k", &chart, "-n", &ns.name, "-f", path.to_str().unwrap()]),
            "helm template with the Kafka sink",
        );
        assert!(!manifests.contains(&right) && !manifests.contains(wrong), "a password in the manifests");
        let objs = server_dry_run(&manifests);
        let toml = config_toml(&objs);
        // The kubelet's part: every secretKeyRef of the container, read from its Secret.
        let mut env = Vec::new();
        for e in kubecast_container(pod_spec(&objs))["env"].as_array().unwrap() {
            let Some(r) = e["valueFrom"]["secretKeyRef"].as_object() else { continue };
            let tpl = format!("go-template={{{{index .data \"{}\" | base64decode}}}}", r["key"].as_str().unwrap());
            let value = ok(
                kubectl(&["get", "secret", r["name"].as_str().unwrap(), "-n", &ns.name, "-o", &tpl], None),
                "read the referenced Secret",
            );
            env.push((e["name"].as_str().unwrap().to_string(), value));
        }
        assert_eq!(env.len(), 1, "{env:?}");
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        // The chart's config and sink; only the checkpoint directory is the harness's.
        let sink = tables(&toml, &["sink"], true);
        Kubecast::start_with_sink(&tables(&toml, &["sink", "checkpoint"], false), &sink, "", &env)
    };

    let mut kc = start("kafka-wrong");
    kc.wait_ready_reason("sink: broker not reachable").await;
    assert!(kc.stop().success(), "{}", kc.log());
    assert!(!kc.log().contains(wrong), "the password was logged:\n{}", kc.log());

    let mut kc = start("kafka-creds");
    kc.wait_ready(200).await;
    let consumer = Command::new(repo().join("tests/env/kafka-console-consumer"))
        .args(["--bootstrap-server", &common::env_var("KAFKA_BROKERS"), "--topic", &topic, "--from-beginning"])
        .args(["--max-messages", "1", "--timeout-ms", "60000", "--property", "print.headers=true"])
        .output()
        .expect("kafka-console-consumer");
    let record = text(&consumer.stdout);
    assert!(record.contains(&format!("ce_subject:{}/seen", ns.name)), "{record}\n{}", text(&consumer.stderr));
    assert!(kc.stop().success(), "{}", kc.log());
    assert!(!kc.log().contains(&right), "the password was logged:\n{}", kc.log());
}
