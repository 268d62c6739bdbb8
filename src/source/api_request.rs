//! What a request to the apiserver is, read from its method and URL, for
//! `kubecast_apiserver_requests_total{verb, resource}`: the verb as the apiserver names it
//! (`list` and `get` are both a GET, told apart by whether the path names one object; a GET
//! with `watch=true` is a `watch`, which is also what a streaming list is) and the plural
//! resource. Paths outside the resource API (`/api`, `/apis`, `/version`, `/openapi/...`) are
//! `discovery`.

use http::Method;

/// `(verb, resource)` of a request.
pub fn classify(method: &Method, path: &str, query: Option<&str>) -> (&'static str, String) {
    let segments: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    // After `/api/<version>` or `/apis/<group>/<version>`.
    let rest = match segments.as_slice() {
        ["api", _version, rest @ ..] => rest,
        ["apis", _group, _version, rest @ ..] => rest,
        _ => &[][..],
    };
    // `namespaces/<ns>/<resource>...` is namespaced; `namespaces` alone, or `namespaces/<name>`,
    // is the Namespace resource itself.
    let rest = match rest {
        ["namespaces", _ns, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let Some(resource) = rest.first() else { return ("discovery", String::new()) };
    let named = rest.len() >= 2;
    let watching = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match *method {
        Method::GET if watching => "watch",
        Method::GET if named => "get",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "other",
    };
    (verb, (*resource).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(method: Method, url: &str) -> (&'static str, String) {
        let (path, query) = match url.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (url, None),
        };
        classify(&method, path, query)
    }

    #[test]
    fn each_request_kubecast_makes_gets_its_verb_and_resource() {
        let cases = [
            (Method::GET, "/api/v1/namespaces/shop/configmaps?limit=500", ("list", "configmaps")),
            (Method::GET, "/api/v1/configmaps?limit=500&continue=abc", ("list", "configmaps")),
            (
                Method::GET,
                "/api/v1/namespaces/shop/configmaps?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
                ("watch", "configmaps"),
            ),
            (Method::GET, "/apis/apps/v1/deployments?allowWatchBookmarks=true&watch=true", ("watch", "deployments")),
            (Method::GET, "/apis/coordination.k8s.io/v1/namespaces/ops/leases/kubecast", ("get", "leases")),
            (Method::PUT, "/apis/coordination.k8s.io/v1/namespaces/ops/leases/kubecast", ("update", "leases")),
            (Method::POST, "/apis/coordination.k8s.io/v1/namespaces/ops/leases", ("create", "leases")),
            (Method::DELETE, "/apis/coordination.k8s.io/v1/namespaces/ops/leases/m-1", ("delete", "leases")),
            (Method::GET, "/apis/coordination.k8s.io/v1/namespaces/ops/leases?labelSelector=g", ("list", "leases")),
            (Method::GET, "/api/v1/namespaces", ("list", "namespaces")),
            (Method::GET, "/api/v1/namespaces/shop", ("get", "namespaces")),
            (Method::GET, "/api/v1/namespaces/shop/pods/web-0/status", ("get", "pods")),
            (Method::PATCH, "/apis/example.com/v1/namespaces/shop/widgets/w", ("patch", "widgets")),
            (Method::GET, "/apis", ("discovery", "")),
            (Method::GET, "/api", ("discovery", "")),
            (Method::GET, "/apis/example.com/v1", ("discovery", "")),
            (Method::GET, "/version", ("discovery", "")),
            (Method::GET, "/openapi/v3", ("discovery", "")),
        ];
        for (method, url, (verb, resource)) in cases {
            assert_eq!(of(method, url), (verb, resource.to_string()), "{url}");
        }
    }
}
