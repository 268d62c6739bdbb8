//! `[sink.http]`: settings and their checks.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::Problem;
use crate::sink::secret;

/// The variable Knative's SinkBinding and ContainerSource set to the resolved sink URL.
pub const K_SINK: &str = "K_SINK";
/// The variable they set to `{"extensions": {...}}`, added to every event.
pub const K_CE_OVERRIDES: &str = "K_CE_OVERRIDES";

/// How the event travels in the request (CloudEvents HTTP binding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The data as the body, attributes as `ce-*` headers, `Content-Type` from
    /// `datacontenttype` (what Knative's own senders use).
    #[default]
    Binary,
    /// The whole event as JSON, `Content-Type: application/cloudevents+json`.
    Structured,
}

/// Which events: kubecast's own, or the ones Knative's ApiServerSource sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    #[default]
    Kubecast,
    /// ApiServerSource mode `Resource`: `dev.knative.apiserver.resource.add|update|delete`,
    /// the object as data.
    ApiserversourceResource,
    /// ApiServerSource mode `Reference`: `dev.knative.apiserver.ref.add|update|delete`, a
    /// reference to the object as data.
    ApiserversourceReference,
}

/// Which HTTP version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
pub enum HttpVersion {
    /// HTTP/2 where the server offers it in the TLS handshake (ALPN), HTTP/1.1 otherwise.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "1.1")]
    Http1,
    /// HTTP/2 only; over `http://` without an upgrade (prior knowledge, h2c).
    #[serde(rename = "2")]
    Http2,
}

/// `[sink.http]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Where events are POSTed. Unset: the `K_SINK` environment variable.
    pub url: Option<String>,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub format: Format,
    /// How long one request may take (connecting, sending, the whole response) before it is
    /// retried.
    #[serde(default = "d_timeout_ms")]
    pub timeout_ms: u64,
    /// The longest `Retry-After` (429, 503) waited for; 0: `Retry-After` is ignored and the
    /// backoff alone decides.
    #[serde(default = "d_retry_after_max")]
    pub retry_after_max_seconds: u64,
    #[serde(default)]
    pub http_version: HttpVersion,
    /// Extra request headers; values may be `${env:NAME}` or `${file:/path}`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// A bearer token file, read again whenever it changes (a projected ServiceAccount token).
    pub bearer_token_file: Option<PathBuf>,
    /// Basic auth; `${env:NAME}` or `${file:/path}` recommended for the password.
    pub username: Option<String>,
    pub password: Option<String>,
    #[serde(default)]
    pub tls: TlsSettings,
}

/// `[sink.http.tls]`: the same names as `[sink.nats.tls]`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// CA certificate(s) (PEM) that sign the receiver's certificate. Unset: the system roots.
    pub ca_file: Option<PathBuf>,
    /// Trust the system roots as well as `ca_file`.
    #[serde(default)]
    pub system_cas: bool,
    /// Client certificate and key (PEM) for mutual TLS; both or neither.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

fn d_timeout_ms() -> u64 {
    10_000
}
fn d_retry_after_max() -> u64 {
    60
}

/// Headers kubecast sets itself: a configured one would contradict the event.
fn reserved_header(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with("ce-")
        || matches!(n.as_str(), "content-type" | "content-length" | "host" | "traceparent" | "tracestate")
}

impl HttpConfig {
    /// The URL events go to: `url`, else `K_SINK`.
    pub fn resolved_url(&self) -> Result<String, Problem> {
        let from_env = || std::env::var(K_SINK).ok().filter(|v| !v.trim().is_empty());
        let (raw, key) = match &self.url {
            Some(u) => (u.clone(), "sink.http.url"),
            None => match from_env() {
                Some(u) => (u, K_SINK),
                None => {
                    return Err(Problem::new(
                        "sink.http.url",
                        "is not set, and neither is the K_SINK environment variable",
                        "set sink.http.url = \"https://receiver.example/\", or run kubecast where a Knative SinkBinding or ContainerSource sets K_SINK",
                    ));
                }
            },
        };
        match url::Url::parse(raw.trim()) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(raw.trim().to_string()),
            Ok(u) => Err(Problem::new(
                key,
                format!(
                    "{:?} is not an http:// or https:// URL (scheme {:?})",
                    secret::url_for_display(&raw),
                    u.scheme()
                ),
                "e.g. \"http://broker-ingress.knative-eventing.svc.cluster.local/default/default\"",
            )),
            Err(e) => Err(Problem::new(
                key,
                format!("{:?} is not a URL: {e}", secret::url_for_display(&raw)),
                "e.g. \"https://receiver.example/events\"",
            )),
        }
    }

    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        if let Err(p) = self.resolved_url() {
            out.push(p);
        }
        let mut p = |k: &str, m: String, f: &str| out.push(Problem::new(format!("sink.http.{k}"), m, f));
        if self.timeout_ms == 0 {
            p("timeout_ms", "must be at least 1".into(), "e.g. 10000");
        }
        for (name, value) in &self.headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                p(&format!("headers.{name}"), "is not a valid header name".into(), "letters, digits and '-'");
            } else if reserved_header(name) {
                p(
                    &format!("headers.{name}"),
                    "is set by kubecast from the event".into(),
                    "remove it (CloudEvents attributes come from the event; K_CE_OVERRIDES adds extensions)",
                );
            }
            match secret::resolve(value) {
                Err(e) => p(&format!("headers.{name}"), e, "set that variable or create that file"),
                Ok(v) if http::HeaderValue::from_str(&v).is_err() => p(
                    &format!("headers.{name}"),
                    "is not a valid header value (its value not shown)".into(),
                    "visible ASCII only, no line breaks",
                ),
                Ok(_) => {}
            }
        }
        if self.username.is_some() != self.password.is_some() {
            p("password", "username and password go together".into(), "set both, or neither");
        }
        if self.username.is_some() && self.bearer_token_file.is_some() {
            p(
                "bearer_token_file",
                "is set together with username/password".into(),
                "keep the one your receiver expects",
            );
        }
        for (k, v) in [("username", &self.username), ("password", &self.password)] {
            if let Some(Err(e)) = v.as_deref().map(secret::resolve) {
                p(k, e, "set that variable or create that file");
            }
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            p(
                "tls.key_file",
                "the client certificate and its key go together".into(),
                "set tls.cert_file and tls.key_file, or neither",
            );
        }
        for (k, f) in [
            ("bearer_token_file", &self.bearer_token_file),
            ("tls.ca_file", &self.tls.ca_file),
            ("tls.cert_file", &self.tls.cert_file),
            ("tls.key_file", &self.tls.key_file),
        ] {
            if let Some(path) = f
                && let Err(e) = std::fs::metadata(path)
            {
                p(k, format!("{}: {e}", path.display()), "mount the file, or fix the path");
            }
        }
        if let Err(e) = overrides_from_env() {
            out.push(Problem::new(K_CE_OVERRIDES, e, "{\"extensions\": {\"name\": \"value\"}}: lowercase letters and digits as names, strings, numbers or booleans as values"));
        }
        out
    }
}

/// `K_CE_OVERRIDES` (`{"extensions": {...}}`): the extensions to add to every event; empty
/// when the variable is unset.
pub fn overrides_from_env() -> Result<Vec<(String, serde_json::Value)>, String> {
    match std::env::var(K_CE_OVERRIDES) {
        Ok(v) if !v.trim().is_empty() => parse_overrides(&v),
        _ => Ok(Vec::new()),
    }
}

/// The extensions of a `K_CE_OVERRIDES` value.
pub fn parse_overrides(text: &str) -> Result<Vec<(String, serde_json::Value)>, String> {
    #[derive(Deserialize)]
    struct Overrides {
        #[serde(default)]
        extensions: serde_json::Map<String, serde_json::Value>,
    }
    let o: Overrides = serde_json::from_str(text).map_err(|e| format!("is not {{\"extensions\": {{...}}}}: {e}"))?;
    let mut out = Vec::new();
    for (name, value) in o.extensions {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
            return Err(format!("extension name {name:?} is not lowercase letters and digits (CloudEvents)"));
        }
        if ["id", "source", "specversion", "type", "datacontenttype", "dataschema", "subject", "time", "data"]
            .contains(&name.as_str())
            || ["origin", "partitionkey", "resourceversion"].contains(&name.as_str())
        {
            return Err(format!(
                "{name:?} is an attribute kubecast sets from the change, not an extension to override"
            ));
        }
        match &value {
            serde_json::Value::String(_) | serde_json::Value::Bool(_) => {}
            serde_json::Value::Number(n) if n.is_i64() => {}
            other => return Err(format!("extension {name:?}: {other} is not a string, an integer or a boolean")),
        }
        out.push((name, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(toml_text: &str) -> HttpConfig {
        use figment::providers::Format as _;
        figment::Figment::from(figment::providers::Toml::string(toml_text)).extract().unwrap()
    }

    #[test]
    fn overrides_are_read_as_knative_writes_them() {
        let o = parse_overrides(r#"{"extensions":{"team":"a","prio":3,"ok":true}}"#).unwrap();
        assert_eq!(o.len(), 3);
        assert_eq!(o[0], ("ok".to_string(), serde_json::json!(true)));
        assert!(parse_overrides("{}").unwrap().is_empty());
        assert!(parse_overrides(r#"{"extensions":{"Team":"a"}}"#).unwrap_err().contains("lowercase"));
        assert!(parse_overrides(r#"{"extensions":{"id":"a"}}"#).unwrap_err().contains("kubecast sets"));
        assert!(parse_overrides(r#"{"extensions":{"a":[1]}}"#).unwrap_err().contains("not a string"));
        assert!(parse_overrides("not json").unwrap_err().contains("extensions"));
    }

    #[test]
    fn problems_name_the_setting() {
        let keys = |c: &HttpConfig| c.problems().into_iter().map(|p| p.key).collect::<Vec<_>>();
        assert!(keys(&cfg("url = \"http://r:8080/\"")).is_empty());
        assert_eq!(keys(&cfg("url = \"ftp://r/\"")), ["sink.http.url"]);
        assert_eq!(keys(&cfg("url = \"http://r/\"\ntimeout_ms = 0")), ["sink.http.timeout_ms"]);
        assert_eq!(keys(&cfg("url = \"http://r/\"\nheaders = { ce-id = \"x\" }")), ["sink.http.headers.ce-id"]);
        assert_eq!(keys(&cfg("url = \"http://r/\"\nusername = \"u\"")), ["sink.http.password"]);
        assert_eq!(
            keys(&cfg("url = \"http://r/\"\n[tls]\ncert_file = \"/nonexistent/c.pem\"")),
            ["sink.http.tls.key_file", "sink.http.tls.cert_file"]
        );
    }

    #[test]
    fn modes_and_formats_read_as_documented() {
        let c = cfg(
            "url = \"http://r/\"\nmode = \"structured\"\nformat = \"apiserversource-reference\"\nhttp_version = \"2\"",
        );
        assert_eq!(c.mode, Mode::Structured);
        assert_eq!(c.format, Format::ApiserversourceReference);
        assert_eq!(c.http_version, HttpVersion::Http2);
        let d = cfg("url = \"http://r/\"");
        assert_eq!(
            (d.mode, d.format, d.http_version, d.timeout_ms),
            (Mode::Binary, Format::Kubecast, HttpVersion::Auto, 10_000)
        );
    }
}
