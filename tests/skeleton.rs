//! Walking skeleton against the real kube-apiserver from tests/env: the CloudEvent contract,
//! CRDs, selectors, and clear errors for unknown or forbidden resources.

use kubecast_kit as common;

use std::time::Duration;

use common::{Kubecast, TestNamespace, about, client, create_cm, verb};
use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn has(evs: &[Value], subject: &str, verb_: &str) -> bool {
    evs.iter().any(|e| e["subject"] == subject && verb(e) == verb_)
}

#[tokio::test]
async fn configmap_create_modify_delete_gives_exactly_three_events_with_the_contract() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "cm").await;
    let sentinel = create_cm(&client, &ns.name, "sentinel", json!({}), json!({"s": "1"})).await;

    let mut kc = Kubecast::start(&format!(
        "[cluster]\nname = \"e2e\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n",
        ns.name
    ));
    // The sentinel's snapshot event proves the initial list is done.
    let snap = kc.wait_for("sentinel snapshot", WAIT, |e| has(e, &format!("{}/sentinel", ns.name), "added")).await;
    assert_eq!(snap[0]["origin"], "snapshot");
    assert_eq!(snap[0]["partitionkey"], sentinel.metadata.uid.clone().unwrap().as_str());

    let cms = Api::<ConfigMap>::namespaced(client.clone(), &ns.name);
    let created = create_cm(&client, &ns.name, "demo", json!({"app": "x"}), json!({"a": "1"})).await;
    let modified =
        cms.patch("demo", &PatchParams::default(), &Patch::Merge(json!({"data": {"a": "2"}}))).await.expect("patch");
    cms.delete("demo", &DeleteParams::default()).await.expect("delete");

    let subject = format!("{}/demo", ns.name);
    kc.wait_for("the delete of demo", WAIT, |e| has(e, &subject, "deleted")).await;
    common::settle(&mut kc, &client, &ns.name, json!({})).await;
    let all = kc.events();
    let evs = about(&all, &subject);
    let verbs: Vec<&str> = evs.iter().map(|e| verb(e)).collect();
    assert_eq!(verbs, ["added", "modified", "deleted"], "exactly three events, in order:\n{}", common::pretty(&all));

    let uid = created.metadata.uid.clone().unwrap();
    let rvs = [
        created.metadata.resource_version.clone().unwrap(),
        modified.metadata.resource_version.clone().unwrap(),
        evs[2]["data"]["metadata"]["resourceVersion"].as_str().unwrap().to_string(),
    ];
    for (i, e) in evs.iter().enumerate() {
        let v = verbs[i];
        assert_eq!(e["specversion"], "1.0");
        let id = if v == "deleted" { format!("{uid}:deleted") } else { format!("{uid}:{}:{v}", rvs[i]) };
        assert_eq!(e["id"], id.as_str(), "id = uid:resourceVersion:verb, uid:deleted for a delete");
        assert_eq!(e["source"], "k8s://e2e/api/v1/configmaps");
        assert_eq!(e["type"], format!("io.kubecast.core.ConfigMap.{v}").as_str());
        assert_eq!(e["subject"], subject.as_str());
        assert_eq!(e["datacontenttype"], "application/json");
        assert_eq!(e["partitionkey"], uid.as_str());
        assert_eq!(e["resourceversion"], rvs[i].as_str());
        assert_eq!(e["origin"], "watch");
        chrono::DateTime::parse_from_rfc3339(e["time"].as_str().expect("time")).expect("time is RFC 3339");
        assert_eq!(e["data"]["kind"], "ConfigMap");
        assert_eq!(e["data"]["apiVersion"], "v1");
        assert_eq!(e["data"]["metadata"]["uid"], uid.as_str());
        assert_eq!(e["data"]["metadata"]["resourceVersion"], rvs[i].as_str());
    }
    assert_eq!(evs[0]["data"]["data"]["a"], "1");
    assert_eq!(evs[1]["data"]["data"]["a"], "2");
    assert_ne!(rvs[1], rvs[2], "the delete has its own resourceVersion, so its own id");
    assert_eq!(about(&all, &format!("{}/sentinel", ns.name)).len(), 1, "untouched sentinel: one snapshot event only");

    let status = kc.stop();
    assert!(status.success(), "SIGTERM is a clean exit, got {status}\n{}", kc.log());
    assert!(kc.log().contains("mode=\"streaming\""), "this apiserver serves streaming lists:\n{}", kc.log());
}

const CRD_GROUP: &str = "e2e.kubecast.io";

async fn ensure_widget_crd(client: &Client) {
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": format!("widgets.{CRD_GROUP}")},
        "spec": {
            "group": CRD_GROUP,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                    "spec": {"type": "object", "properties": {"size": {"type": "integer"}}}
                }}}
            }]
        }
    }))
    .unwrap();
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => panic!("create CRD: {e}"),
    }
    // Wait until it is established and served.
    let ar = widget_resource();
    for _ in 0..100 {
        let c = crds.get(&format!("widgets.{CRD_GROUP}")).await.unwrap();
        let established = c
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        if established && Api::<DynamicObject>::all_with(client.clone(), &ar).list(&Default::default()).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("CRD widgets.{CRD_GROUP} never became established");
}

fn widget_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(CRD_GROUP, "v1", "Widget"), "widgets")
}

async fn create_widget(client: &Client, ns: &str, name: &str, size: i64) {
    let ar = widget_resource();
    let mut w = DynamicObject::new(name, &ar).within(ns);
    w.data = json!({"spec": {"size": size}});
    Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar)
        .create(&PostParams::default(), &w)
        .await
        .expect("create widget");
}

#[tokio::test]
async fn custom_resources_of_a_crd_are_watched_by_kind() {
    let client = client().await;
    ensure_widget_crd(&client).await;
    let ns = TestNamespace::new(&client, "crd").await;
    create_widget(&client, &ns.name, "sentinel", 1).await;

    let mut kc = Kubecast::start(&format!(
        "[cluster]\nname = \"e2e\"\n[[resources]]\napi_version = \"{CRD_GROUP}/v1\"\nkind = \"Widget\"\nnamespaces = [\"{}\"]\n",
        ns.name
    ));
    kc.wait_for("widget snapshot", WAIT, |e| has(e, &format!("{}/sentinel", ns.name), "added")).await;
    create_widget(&client, &ns.name, "w1", 3).await;
    let evs = kc.wait_for("widget w1", WAIT, |e| has(e, &format!("{}/w1", ns.name), "added")).await;
    let e = about(&evs, &format!("{}/w1", ns.name))[0];
    assert_eq!(e["type"], format!("io.kubecast.{CRD_GROUP}.Widget.added").as_str());
    assert_eq!(e["source"], format!("k8s://e2e/apis/{CRD_GROUP}/v1/widgets").as_str());
    assert_eq!(e["origin"], "watch");
    assert_eq!(e["data"]["spec"]["size"], 3);
    assert_eq!(e["data"]["apiVersion"], format!("{CRD_GROUP}/v1").as_str());
}

#[tokio::test]
async fn cluster_scoped_objects_have_the_name_as_subject() {
    let client = client().await;
    let label = common::unique("t");
    let mut kc = Kubecast::start(&format!(
        "[cluster]\nname = \"e2e\"\n[[resources]]\napi_version = \"v1\"\nkind = \"Namespace\"\nlabel_selector = \"kubecast-test={label}\"\nevents = [\"added\"]\n"
    ));
    // After the initial (empty) list: changes after it are never lost, but a namespace created
    // before it would come as a snapshot instead of a watch event.
    let name = common::unique("scoped");
    kc.wait_log("list complete", 1).await;
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"kubecast-test": label}}})).unwrap();
    let nsapi = Api::<Namespace>::all(client.clone());
    nsapi.create(&PostParams::default(), &ns).await.unwrap();
    let evs = kc.wait_for("namespace added", WAIT, |e| has(e, &name, "added")).await;
    assert_eq!(evs.len(), 1, "only the labelled namespace: {}", common::pretty(&evs));
    assert_eq!(evs[0]["source"], "k8s://e2e/api/v1/namespaces");
    assert_eq!(evs[0]["subject"], name.as_str(), "a cluster-scoped object's subject is its name");
    assert_eq!(evs[0]["origin"], "watch", "created after the list: a watch event");
    nsapi.delete(&name, &DeleteParams::default()).await.unwrap();
}

#[tokio::test]
async fn namespace_label_field_and_verb_selectors_restrict_the_events() {
    let client = client().await;
    let (ns1, ns2, ns3) = (
        TestNamespace::new(&client, "sel1").await,
        TestNamespace::new(&client, "sel2").await,
        TestNamespace::new(&client, "sel3").await,
    );
    create_cm(&client, &ns1.name, "sentinel", json!({"app": "keep"}), json!({})).await;
    create_cm(&client, &ns2.name, "chosen", json!({}), json!({"v": "1"})).await;

    let mut kc = Kubecast::start(&format!(
        r#"[cluster]
name = "e2e"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
namespaces = ["{ns1}"]
label_selector = "app=keep"
[[resources]]
api_version = "v1"
kind = "ConfigMap"
namespaces = ["{ns2}"]
field_selector = "metadata.name=chosen"
events = ["added", "deleted"]
"#,
        ns1 = ns1.name,
        ns2 = ns2.name
    ));
    let (s1, c2) = (format!("{}/sentinel", ns1.name), format!("{}/chosen", ns2.name));
    kc.wait_for("both snapshots", WAIT, |e| has(e, &s1, "added") && has(e, &c2, "added")).await;

    create_cm(&client, &ns1.name, "a", json!({"app": "keep"}), json!({})).await; // yes
    create_cm(&client, &ns1.name, "b", json!({"app": "drop"}), json!({})).await; // label
    create_cm(&client, &ns3.name, "a", json!({"app": "keep"}), json!({})).await; // namespace
    create_cm(&client, &ns2.name, "other", json!({}), json!({})).await; // field
    let cms2 = Api::<ConfigMap>::namespaced(client.clone(), &ns2.name);
    cms2.patch("chosen", &PatchParams::default(), &Patch::Merge(json!({"data": {"v": "2"}}))).await.unwrap(); // verb
    cms2.delete("chosen", &DeleteParams::default()).await.unwrap(); // yes
    create_cm(&client, &ns1.name, "zz-last", json!({"app": "keep"}), json!({})).await; // yes

    let last = format!("{}/zz-last", ns1.name);
    // Barriers: zz-last is the last change of ns1's stream, the delete of chosen of ns2's
    // (each stream delivers in order), so anything the selectors let through came before.
    kc.wait_for("last events", WAIT, |e| has(e, &last, "added") && has(e, &c2, "deleted")).await;
    let evs = kc.events();
    let mut got: Vec<String> = evs.iter().map(|e| format!("{} {}", e["subject"].as_str().unwrap(), verb(e))).collect();
    got.sort();
    let mut want = vec![
        format!("{s1} added"),
        format!("{}/a added", ns1.name),
        format!("{last} added"),
        format!("{c2} added"),
        format!("{c2} deleted"),
    ];
    want.sort();
    assert_eq!(got, want, "\n{}", common::pretty(&evs));
}

#[tokio::test]
async fn unknown_kind_or_group_is_a_clear_error_naming_the_resource() {
    // missing_kind = "fail": a typo stops kubecast with the resource named.
    let mut kc = Kubecast::start("[[resources]]\napi_version = \"v1\"\nkind = \"Gizmo\"\nmissing_kind = \"fail\"\n");
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = kc.log();
    assert!(log.contains("resources[0]") && log.contains("\"Gizmo\" is not served in \"v1\""), "{log}");

    let mut kc = Kubecast::start(
        "[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\n[[resources]]\napi_version = \"nope.example.com/v1\"\nkind = \"Thing\"\nmissing_kind = \"fail\"\n",
    );
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success());
    let log = kc.log();
    assert!(log.contains("resources[1]") && log.contains("\"nope.example.com/v1\"") && log.contains("fix:"), "{log}");

    // The default, missing_kind = "wait": the same error is logged, naming the resource, and
    // kubecast keeps running, waiting for the kind to be served.
    let mut kc = Kubecast::start("[[resources]]\napi_version = \"v1\"\nkind = \"Gizmo\"\n");
    let deadline = std::time::Instant::now() + WAIT;
    while !kc.log().contains("waiting for it to be served") {
        assert!(std::time::Instant::now() < deadline, "no waiting message:\n{}", kc.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = kc.log();
    assert!(log.contains("resources[0]") && log.contains("Gizmo"), "{log}");
    assert!(kc.stop().success(), "a waiting stream stops cleanly\n{}", kc.log());
}

#[tokio::test]
async fn forbidden_resource_is_a_clear_error_naming_the_resource() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "rbac").await;
    // A service account with no role binding: it may discover, but not list configmaps.
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "nobody"}})).unwrap();
    let sas = Api::<ServiceAccount>::namespaced(client.clone(), &ns.name);
    sas.create(&PostParams::default(), &sa).await.unwrap();
    let tr: TokenRequest = serde_json::from_value(json!({"spec": {"audiences": []}})).unwrap();
    let tr: TokenRequest =
        sas.create_subresource("token", "nobody", &PostParams::default(), &tr).await.expect("token request");
    let token = tr.status.unwrap().token;

    let mut kcfg = kube::config::Kubeconfig::read_from(common::kubeconfig()).unwrap();
    for ai in kcfg.auth_infos.iter_mut() {
        if let Some(info) = ai.auth_info.as_mut() {
            info.token = Some(token.clone().into());
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    // JSON is YAML: kube reads it as a kubeconfig.
    std::fs::write(&path, serde_json::to_vec(&kcfg).unwrap()).unwrap();

    let mut kc = Kubecast::start_with(
        &format!("[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n", ns.name),
        &[("KUBECONFIG", path.to_str().unwrap())],
    );
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success(), "{}", kc.log());
    let log = kc.log();
    assert!(log.contains("forbidden") && log.contains("configmaps") && log.contains(&ns.name), "{log}");
}

#[tokio::test]
async fn a_selector_the_apiserver_refuses_is_a_clear_error_naming_it() {
    // Valid syntax (check-config passes it), but no such field label: the apiserver answers
    // 400 to every list and watch. kubecast stops naming the key instead of retrying forever.
    let mut kc = Kubecast::start(
        "[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nfield_selector = \"metadata.nam==x\"\n",
    );
    let status = kc.wait_exit(WAIT).await;
    assert!(!status.success(), "{}", kc.log());
    let log = kc.log();
    assert!(log.contains("resources[0]") && log.contains("refuses the selector"), "{log}");
    assert!(log.contains("metadata.nam") && log.contains("field_selector"), "{log}");
    // The streaming list's refusal is the selector's, not a sign of an older apiserver.
    assert!(!log.contains("streaming lists not available"), "{log}");
}

/// A server that ends every watch at once (here a proxy in front of the apiserver that answers
/// each watch request with an empty body, as a broken proxy or gateway might): a streaming
/// list cut twice gives way to paginated lists, and a watch that ends at once without an
/// event is opened again after the backoff, not in a loop that would spend the rate limit
/// every stream shares.
/// Every request to a [`proxy`]: when, and its path and query.
type Requests = std::sync::Arc<std::sync::Mutex<Vec<(std::time::Instant, String)>>>;

/// A proxy in front of the test apiserver, as a broken gateway might be: `watch` answers each
/// watch request (given its path and query) with a 200 and the body it returns; every other
/// request is passed on. Returns a kubeconfig for it (in `dir`) and the requests it had.
async fn proxy(client: &Client, dir: &std::path::Path, watch: fn(&str) -> String) -> (std::path::PathBuf, Requests) {
    let requests: Requests = Default::default();
    let app = axum::Router::new().fallback({
        let (client, requests) = (client.clone(), requests.clone());
        move |uri: axum::http::Uri| {
            let (client, requests) = (client.clone(), requests.clone());
            async move {
                let pq = uri.path_and_query().map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
                requests.lock().unwrap().push((std::time::Instant::now(), pq.clone()));
                if is_watch(&pq) {
                    return (axum::http::StatusCode::OK, watch(&pq));
                }
                match client.request_text(http::Request::get(pq).body(Vec::new()).unwrap()).await {
                    Ok(text) => (axum::http::StatusCode::OK, text),
                    Err(kube::Error::Api(s)) => {
                        (axum::http::StatusCode::from_u16(s.code).unwrap(), serde_json::to_string(&s).unwrap())
                    }
                    Err(e) => (axum::http::StatusCode::BAD_GATEWAY, e.to_string()),
                }
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster:\n    server: http://{addr}\ncontexts:\n- name: proxy\n  context:\n    cluster: proxy\n    user: none\ncurrent-context: proxy\nusers:\n- name: none\n  user: {{}}\n"
        ),
    )
    .unwrap();
    (kubeconfig, requests)
}

fn is_watch(path_and_query: &str) -> bool {
    path_and_query.contains("watch=true") || path_and_query.contains("watch=1")
}

/// A proxy in front of the test apiserver that breaks watches (it answers
/// each watch request with an empty body, as a broken proxy or gateway might): a streaming
/// list cut twice gives way to paginated lists, and a watch that ends at once without an
/// event is opened again after the backoff, not in a loop that would spend the rate limit
/// every stream shares.
#[tokio::test]
async fn watches_that_end_at_once_are_opened_again_after_a_backoff_not_in_a_loop() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "quickend").await;
    create_cm(&client, &ns.name, "a", json!({}), json!({"v": "1"})).await;
    let dir = tempfile::tempdir().unwrap();
    let (kubeconfig, requests) = proxy(&client, dir.path(), |_| String::new()).await;
    let config = format!("[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n", ns.name);
    let mut kc = Kubecast::start_with(&config, &[("KUBECONFIG", kubeconfig.to_str().unwrap())]);
    kc.wait_log("using paginated lists for this stream", 1).await;
    let a = format!("{}/a", ns.name);
    kc.wait_for("a from the paginated list", WAIT, |e| about(e, &a).len() == 1).await;
    kc.wait_log("watch ended at once without an event; re-watching after backoff", 2).await;
    // (when, a streaming list) per watch request.
    let seen: Vec<_> = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, pq)| is_watch(pq))
        .map(|(t, pq)| (*t, pq.contains("sendInitialEvents=true")))
        .collect();
    assert!(kc.stop().success(), "{}", kc.log());
    let streaming = seen.iter().filter(|(_, s)| *s).count();
    assert_eq!(streaming, 2, "two streaming lists cut, then paginated lists: {seen:?}");
    let plain: Vec<std::time::Instant> = seen.iter().filter(|(_, s)| !*s).map(|(t, _)| *t).collect();
    // The second quick end was logged before its backoff: two or three watch requests so far,
    // the second at least the minimum backoff (0.8 s) after the first.
    assert!((2..=3).contains(&plain.len()), "{} watch requests: {seen:?}", plain.len());
    let gap = plain[1] - plain[0];
    assert!(gap >= Duration::from_millis(700), "re-watched {gap:?} after a watch that ended at once");
}

/// A proxy in front of the test apiserver answers every watch with 410 Gone, as an apiserver
/// does when a list took longer than the history it keeps: the list is made again after the
/// backoff, not in a loop at the rate limit (the list is what costs the apiserver most).
#[tokio::test]
async fn a_list_whose_watch_is_gone_at_once_is_made_again_after_a_backoff() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "gonelist").await;
    create_cm(&client, &ns.name, "a", json!({}), json!({"v": "1"})).await;
    let dir = tempfile::tempdir().unwrap();
    let (kubeconfig, requests) = proxy(&client, dir.path(), |_| {
        r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version","reason":"Expired","code":410}}"#.to_string() + "\n"
    })
    .await;
    let config = format!(
        "[cluster]\nstreaming_lists = false\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n",
        ns.name
    );
    let mut kc = Kubecast::start_with(&config, &[("KUBECONFIG", kubeconfig.to_str().unwrap())]);
    let a = format!("{}/a", ns.name);
    kc.wait_for("a from the first list", WAIT, |e| about(e, &a).len() == 1).await;
    kc.wait_log("(410 Gone)", 2).await;
    let lists: Vec<std::time::Instant> = requests
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, pq)| pq.contains("/configmaps") && !is_watch(pq))
        .map(|(t, _)| *t)
        .collect();
    assert!(kc.stop().success(), "{}", kc.log());
    // The second 410 was logged before its backoff: two or three lists so far, the second at
    // least the minimum backoff (0.8 s) after the first.
    assert!((2..=3).contains(&lists.len()), "{} lists: {lists:?}", lists.len());
    let gap = lists[1] - lists[0];
    assert!(gap >= Duration::from_millis(700), "listed again {gap:?} after the watch from the list was gone");
    assert!(
        kc.log().contains("the list's resourceVersion was no longer available when its watch began"),
        "{}",
        kc.log()
    );
    let evs = kc.events();
    assert_eq!(
        about(&evs, &a).len(),
        1,
        "a is sent once (the lists after the first are diffed):\n{}",
        common::pretty(&evs)
    );
}
