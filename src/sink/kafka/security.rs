//! TLS and SASL in a Kafka connection's properties (`[sink.kafka]`, `[checkpoint.kafka]`):
//! the contradictions `check-config` refuses, the system CA bundle kubecast sets when the
//! user set none, and what a TLS or SASL failure in librdkafka's log means and how to fix it.

use std::collections::BTreeMap;
use std::path::Path;

use rdkafka::ClientConfig;
use tracing::{debug, warn};

use crate::model::Problem;
use crate::sink::secret;

/// System CA bundles, most common first: Debian, Ubuntu, Alpine and distroless images;
/// RHEL, Fedora, Amazon Linux; openSUSE; Alpine's and BSD's other name. The vendored OpenSSL
/// that librdkafka is linked with looks in `/usr/local/ssl`, which no distribution fills.
pub const SYSTEM_CA_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// Properties that name a CA: with none of them set, librdkafka trusts OpenSSL's default paths.
const CA_PROPERTIES: [&str; 3] = ["ssl.ca.location", "ssl.ca.pem", "ssl.ca.certificate.stores"];

/// SASL mechanisms this build of librdkafka has (no Kerberos/GSSAPI library, no curl for
/// OAUTHBEARER's OIDC token fetch).
const SASL_MECHANISMS: [&str; 3] = ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"];

fn get<'a>(props: &'a BTreeMap<String, String>, keys: &[&str]) -> Option<(&'a str, String)> {
    keys.iter().find_map(|k| props.get_key_value(*k)).map(|(k, v)| (k.as_str(), secret::resolve(v).unwrap_or_default()))
}

/// Whether the properties' `security.protocol` uses TLS.
pub fn uses_tls(protocol: Option<&str>) -> bool {
    protocol.is_some_and(|p| p.eq_ignore_ascii_case("ssl") || p.eq_ignore_ascii_case("sasl_ssl"))
}

/// Contradictions in TLS and SASL settings, keys under `section` (e.g. `sink.kafka.properties`).
pub fn problems(section: &str, props: &BTreeMap<String, String>) -> Vec<Problem> {
    let key = |k: &str| format!("{section}.\"{k}\"");
    let mut out = Vec::new();
    let protocol = get(props, &["security.protocol"]).map(|(_, v)| v.to_ascii_uppercase());
    let sasl = protocol.as_deref().is_some_and(|p| p.starts_with("SASL_"));
    let mechanism = get(props, &["sasl.mechanism", "sasl.mechanisms"]);
    if sasl {
        match &mechanism {
            None => out.push(Problem::new(
                key("sasl.mechanism"),
                "is not set: librdkafka's default is GSSAPI (Kerberos), which kubecast is not built with",
                format!("set it to one of {}", SASL_MECHANISMS.join(", ")),
            )),
            Some((k, m)) if SASL_MECHANISMS.contains(&m.to_ascii_uppercase().as_str()) => {
                for needed in ["sasl.username", "sasl.password"] {
                    if get(props, &[needed]).is_none_or(|(_, v)| v.is_empty()) {
                        out.push(Problem::new(
                            key(needed),
                            format!("is not set, but {k} = {m} needs a user name and a password"),
                            format!("set {needed} (a secret as \"${{env:NAME}}\" or \"${{file:/path}}\")"),
                        ));
                    }
                }
            }
            Some((k, m)) => out.push(Problem::new(
                key(k),
                format!("{m} is not supported: kubecast's librdkafka is built without Kerberos (GSSAPI) and without curl (OAUTHBEARER's OIDC token fetch)"),
                format!("use one of {} (managed services offer SCRAM-SHA-512 or PLAIN over SASL_SSL)", SASL_MECHANISMS.join(", ")),
            )),
        }
    } else if let Some((k, _)) = mechanism.as_ref().or(get(props, &["sasl.username"]).as_ref()) {
        out.push(Problem::new(
            key(k),
            format!(
                "is set, but security.protocol is {}: no SASL login would happen",
                protocol.as_deref().unwrap_or("not set (PLAINTEXT)")
            ),
            "set security.protocol = \"SASL_SSL\" (or \"SASL_PLAINTEXT\" without TLS)",
        ));
    }
    let ssl_keys: Vec<&String> = props.keys().filter(|k| k.starts_with("ssl.")).collect();
    if !uses_tls(protocol.as_deref())
        && let Some(k) = ssl_keys.first()
    {
        out.push(Problem::new(
            key(k),
            format!(
                "is set, but security.protocol is {}: the connection would not use TLS",
                protocol.as_deref().unwrap_or("not set (PLAINTEXT)")
            ),
            "set security.protocol = \"SSL\" (or \"SASL_SSL\" with a SASL login)",
        ));
    }
    for k in ssl_keys.iter().filter(|k| k.ends_with(".location")) {
        let path = secret::resolve(&props[k.as_str()]).unwrap_or_default();
        if path.is_empty() || (k.as_str() == "ssl.ca.location" && path == "probe") {
            continue;
        }
        if !Path::new(&path).exists() {
            out.push(Problem::new(
                key(k),
                format!("the file {path} cannot be read (it does not exist)"),
                "give the path of an existing file (a mounted Secret's file, for instance)",
            ));
        }
    }
    let cert = get(props, &["ssl.certificate.location", "ssl.certificate.pem"]);
    let private = get(props, &["ssl.key.location", "ssl.key.pem"]);
    match (cert, private) {
        (Some((k, _)), None) => out.push(Problem::new(
            key(k),
            "is set without the client certificate's private key",
            "set ssl.key.location (or ssl.key.pem)",
        )),
        (None, Some((k, _))) => out.push(Problem::new(
            key(k),
            "is set without the client certificate",
            "set ssl.certificate.location (or ssl.certificate.pem)",
        )),
        _ => {}
    }
    out
}

/// With TLS and no CA set, the first system CA bundle that exists as `ssl.ca.location`
/// (librdkafka's vendored OpenSSL would otherwise trust no CA at all on Linux). Left alone
/// when `SSL_CERT_FILE` or `SSL_CERT_DIR` is set (not empty): OpenSSL's default paths honour them.
pub fn set_system_ca(cc: &mut ClientConfig) {
    set_ca_from(cc, SYSTEM_CA_BUNDLES, |v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
}

fn set_ca_from(cc: &mut ClientConfig, bundles: &[&str], env_set: impl Fn(&str) -> bool) {
    if !uses_tls(cc.get("security.protocol")) || CA_PROPERTIES.iter().any(|k| cc.get(k).is_some()) {
        return;
    }
    if let Some(var) = ["SSL_CERT_FILE", "SSL_CERT_DIR"].into_iter().find(|v| env_set(v)) {
        debug!(variable = var, "Kafka TLS: no ssl.ca.location set; OpenSSL reads the trusted CAs from {var}");
        return;
    }
    match bundles.iter().find(|p| Path::new(p).is_file()) {
        Some(path) => {
            debug!(path, "Kafka TLS: no ssl.ca.location set; trusting the system CA bundle");
            cc.set("ssl.ca.location", *path);
        }
        None => warn!(
            tried = ?bundles,
            "Kafka TLS: no ssl.ca.location set and no system CA bundle found: no broker certificate can be verified; set ssl.ca.location to your Kafka service's CA file, or install the ca-certificates package"
        ),
    }
}

/// What a librdkafka error or log line about TLS or SASL means and how to fix it.
pub fn fix_for(msg: &str) -> Option<&'static str> {
    let m = msg.to_ascii_lowercase();
    let hint = if m.contains("hostname mismatch") || m.contains("ip address mismatch") {
        "the broker's certificate does not name the address kubecast connected to: use a broker address from the certificate's subject alternative names in brokers (the brokers also advertise addresses of their own), or have the certificate reissued"
    } else if m.contains("certificate verify failed") {
        // OpenSSL's message does not say which check failed.
        "the broker's certificate could not be verified: either no CA kubecast trusts signed it (set ssl.ca.location to your Kafka service's CA file, or ssl.ca.pem; without it kubecast trusts the system CA bundle), or it does not name the broker address kubecast connected to (use an address from the certificate's subject alternative names in brokers, or have the certificate reissued)"
    } else if m.contains("no matching issuer found")
        || m.contains("certificate required")
        || m.contains("alert bad certificate")
        || m.contains("alert unknown ca")
        || m.contains("alert certificate unknown")
        || m.contains("alert handshake failure")
    {
        "the broker refused the TLS handshake, most often the client certificate: set ssl.certificate.location and ssl.key.location (or .pem) to a certificate signed by a CA the broker trusts"
    } else if m.contains("authentication failed") || m.contains("sasl authentication error") {
        "the broker refused the SASL login: check sasl.mechanism (the one the listener enables), sasl.username and sasl.password"
    } else if m.contains("bad decrypt")
        || m.contains("ssl.key.password")
        || m.contains("ssl.key") && m.contains("pem lib")
    {
        "the client key cannot be read: set ssl.key.password to its password (if it is encrypted), and check that it is a PEM private key"
    } else if m.contains("ssl handshake failed") && m.contains("wrong version number")
        || m.contains("broker might require sasl")
    {
        "the broker and kubecast disagree on the protocol: set security.protocol to the listener's (SSL, SASL_SSL, SASL_PLAINTEXT or PLAINTEXT)"
    } else {
        return None;
    };
    Some(hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn keys(problems: &[Problem]) -> Vec<&str> {
        problems.iter().map(|p| p.key.as_str()).collect()
    }

    #[test]
    fn a_sasl_mechanism_needs_a_user_and_a_password() {
        let p = problems(
            "s",
            &props(&[("security.protocol", "SASL_SSL"), ("sasl.mechanism", "SCRAM-SHA-512"), ("sasl.username", "u")]),
        );
        assert_eq!(keys(&p), ["s.\"sasl.password\""]);
        assert!(p[0].message.contains("SCRAM-SHA-512"), "{}", p[0]);
        let p =
            problems("s", &props(&[("security.protocol", "sasl_ssl"), ("sasl.username", "u"), ("sasl.password", "p")]));
        assert_eq!(keys(&p), ["s.\"sasl.mechanism\""], "GSSAPI by default: {p:?}");
        let p = problems("s", &props(&[("security.protocol", "SASL_SSL"), ("sasl.mechanism", "OAUTHBEARER")]));
        assert!(p[0].message.contains("not supported"), "{}", p[0]);
    }

    #[test]
    fn sasl_or_ssl_settings_without_the_protocol_are_refused() {
        let p = problems("s", &props(&[("sasl.mechanism", "PLAIN"), ("sasl.username", "u"), ("sasl.password", "p")]));
        assert_eq!(keys(&p), ["s.\"sasl.mechanism\""]);
        assert!(p[0].fix.contains("SASL_SSL"));
        let p = problems(
            "s",
            &props(&[
                ("security.protocol", "SASL_PLAINTEXT"),
                ("sasl.mechanism", "PLAIN"),
                ("sasl.username", "u"),
                ("sasl.password", "p"),
                ("ssl.ca.location", "/"),
            ]),
        );
        assert_eq!(keys(&p), ["s.\"ssl.ca.location\""]);
    }

    #[test]
    fn a_missing_location_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("client.crt");
        std::fs::write(&cert, "x").unwrap();
        let gone = dir.path().join("client.key");
        let p = problems(
            "s",
            &props(&[
                ("security.protocol", "SSL"),
                ("ssl.certificate.location", cert.to_str().unwrap()),
                ("ssl.key.location", gone.to_str().unwrap()),
                ("ssl.ca.location", "probe"),
            ]),
        );
        assert_eq!(keys(&p), ["s.\"ssl.key.location\""]);
        assert!(p[0].message.contains(gone.to_str().unwrap()), "{}", p[0]);
        let p = problems("s", &props(&[("security.protocol", "SSL"), ("ssl.key.pem", "k")]));
        assert_eq!(keys(&p), ["s.\"ssl.key.pem\""], "a key without its certificate");
    }

    #[test]
    fn the_system_bundle_is_set_only_for_tls_without_a_ca() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("ca.crt");
        std::fs::write(&bundle, "x").unwrap();
        let bundles = ["/nonexistent/ca.crt", bundle.to_str().unwrap()];
        let with = |kv: &[(&str, &str)], env: bool| {
            let mut cc = ClientConfig::new();
            for (k, v) in kv {
                cc.set(*k, *v);
            }
            set_ca_from(&mut cc, &bundles, |_| env);
            cc.get("ssl.ca.location").map(str::to_string)
        };
        assert_eq!(with(&[("security.protocol", "SASL_SSL")], false).as_deref(), bundle.to_str());
        assert_eq!(with(&[("security.protocol", "ssl")], false).as_deref(), bundle.to_str());
        assert_eq!(with(&[("security.protocol", "SASL_SSL")], true), None, "SSL_CERT_FILE set");
        assert_eq!(with(&[("security.protocol", "SASL_PLAINTEXT")], false), None);
        assert_eq!(with(&[("security.protocol", "SSL"), ("ssl.ca.pem", "x")], false), None);
        assert_eq!(with(&[("security.protocol", "SSL"), ("ssl.ca.location", "/x")], false).as_deref(), Some("/x"));
    }

    #[test]
    fn tls_and_sasl_failures_get_a_fix() {
        let verify = "ssl://127.0.0.1:19097/bootstrap: SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate could not be verified";
        assert!(fix_for(verify).unwrap().contains("ssl.ca.location"));
        assert!(
            fix_for(verify).unwrap().contains("subject alternative names"),
            "or the address is not in the certificate"
        );
        let refused = "Receive failed: error:0A000412:SSL routines::ssl/tls alert bad certificate: SSL alert number 42";
        assert!(fix_for(refused).unwrap().contains("ssl.certificate.location"));
        assert!(
            fix_for("SSL handshake failed: certificate verify failed: Hostname mismatch")
                .unwrap()
                .contains("subject alternative names")
        );
        assert!(
            fix_for("SSL handshake failed: tlsv13 alert certificate required")
                .unwrap()
                .contains("ssl.certificate.location")
        );
        assert!(fix_for("SASL authentication error: Authentication failed during authentication due to invalid credentials with SASL mechanism SCRAM-SHA-512").unwrap().contains("sasl.password"));
        let key = "Client creation error: ssl.key.location failed: error:0A080009:SSL routines::PEM lib";
        assert!(fix_for(key).unwrap().contains("ssl.key.password"));
        assert_eq!(fix_for("Connection refused"), None);
    }
}
