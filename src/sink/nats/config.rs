//! `[sink.nats]`: settings, their checks, and subject templates.

use std::borrow::Cow;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::model::{Fields, Problem};
use crate::sink::secret;
use crate::sink::template::Template;

pub const DEFAULT_SUBJECT: &str = "kubecast.{cluster}.{group}.{resource}.{namespace}";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Binary,
    #[default]
    Structured,
}

/// `[sink.nats]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated: `nats://nats-0:4222,nats://nats-1:4222`.
    pub url: String,
    /// Subject template over the same fields as Kafka topics.
    #[serde(default = "default_subject")]
    pub subject: String,
    /// JetStream publish with PubAck (at-least-once, deduplicated) or core NATS (at-most-once).
    #[serde(default = "yes")]
    pub jetstream: bool,
    #[serde(default)]
    pub mode: Mode,
    /// How long to wait for a PubAck (JetStream) or a flush (core) before retrying.
    #[serde(default = "d_ack_timeout_ms")]
    pub ack_timeout_ms: u64,
    /// Connection name shown by the server (`nats server report connections`).
    #[serde(default = "d_name")]
    pub name: String,
    /// Create the JetStream stream at start when no stream covers the subjects.
    #[serde(default)]
    pub create_stream: bool,
    #[serde(default)]
    pub stream: StreamSettings,
    pub user: Option<String>,
    /// `${env:NAME}` or `${file:/path}` recommended.
    pub password: Option<String>,
    pub token: Option<String>,
    /// An nkey seed (`SU...`); `${file:/path}` recommended.
    pub nkey_seed: Option<String>,
    /// A `.creds` file (JWT + nkey seed), as written by `nsc` / `nats context`.
    pub credentials_file: Option<PathBuf>,
    #[serde(default)]
    pub tls: TlsSettings,
}

/// `[sink.nats.stream]`: the stream kubecast creates when `create_stream = true`.
/// The longest stream duration setting accepted: ten years (the server takes nanoseconds in
/// an i64; much larger values would wrap).
const MAX_STREAM_SECONDS: u64 = 10 * 365 * 24 * 3600;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSettings {
    #[serde(default = "d_stream_name")]
    pub name: String,
    /// Default: the subject template's literal prefix + `>` (`kubecast.>` for the default).
    #[serde(default)]
    pub subjects: Vec<String>,
    /// How long JetStream remembers message ids to drop duplicates. It must cover the longest
    /// time an event can be retried or replayed (a restart after a crash). Default: 600.
    #[serde(default = "d_duplicate_window")]
    pub duplicate_window_seconds: u64,
    /// 0 = keep messages forever (until max_bytes).
    #[serde(default)]
    pub max_age_seconds: u64,
    /// -1 = unlimited.
    #[serde(default = "minus_one")]
    pub max_bytes: i64,
    #[serde(default)]
    pub storage: Storage,
    #[serde(default = "one")]
    pub replicas: usize,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            name: d_stream_name(),
            subjects: Vec::new(),
            duplicate_window_seconds: d_duplicate_window(),
            max_age_seconds: 0,
            max_bytes: -1,
            storage: Storage::File,
            replicas: 1,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    #[default]
    File,
    Memory,
}

/// `[sink.nats.tls]`
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    /// Refuse to connect without TLS (also implied by a `tls://` URL).
    #[serde(default)]
    pub required: bool,
    /// CA certificate(s) (PEM) to trust in addition to the system roots.
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key (PEM) for mutual TLS; both or neither.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// TLS before the NATS INFO (servers with `handshake_first`).
    #[serde(default)]
    pub handshake_first: bool,
}

fn default_subject() -> String {
    DEFAULT_SUBJECT.to_string()
}
fn yes() -> bool {
    true
}
fn d_ack_timeout_ms() -> u64 {
    10_000
}
fn d_name() -> String {
    "kubecast".into()
}
fn d_stream_name() -> String {
    "KUBECAST".into()
}
fn d_duplicate_window() -> u64 {
    600
}
fn minus_one() -> i64 {
    -1
}
fn one() -> usize {
    1
}

/// What is wrong with `url` (one or more NATS server addresses, comma-separated), shown
/// without its secrets, and the fix.
pub fn url_problem(url: &str) -> Option<(String, &'static str)> {
    if url.trim().is_empty() {
        return Some(("is empty".into(), "set the server URL(s), e.g. \"nats://nats:4222\""));
    }
    for u in url.split(',').map(str::trim) {
        // `scheme://[user[:password]@]host[:port]`: async-nats' parser takes more (a path,
        // spaces), which would only fail when connecting, again and again.
        let authority = u.split_once("://").map_or(u, |(_, rest)| rest).trim_end_matches('/');
        if u.is_empty() || u.parse::<async_nats::ServerAddr>().is_err() || authority.contains(['/', ' ', '\t']) {
            let shown = crate::sink::secret::url_for_display(u);
            return Some((
                format!("{shown:?} is not a NATS server address"),
                "write scheme://host:port, e.g. \"nats://nats:4222\" (several: comma-separated); a `/` in a password or token written in the URL is percent-encoded (%2F), or give it in the password or token key instead",
            ));
        }
    }
    None
}

impl NatsConfig {
    pub fn problems(&self) -> Vec<Problem> {
        let mut out = Vec::new();
        let mut p = |k: &str, m: String, f: &str| out.push(Problem::new(format!("sink.nats.{k}"), m, f));
        if let Some((m, f)) = url_problem(&self.url) {
            p("url", m, f);
        }
        if let Err(e) = subject_template(&self.subject) {
            p("subject", e, &format!("e.g. {DEFAULT_SUBJECT:?}"));
        }
        if self.ack_timeout_ms == 0 {
            p("ack_timeout_ms", "must be at least 1".into(), "e.g. 10000");
        }
        let auth =
            [self.user.is_some(), self.token.is_some(), self.nkey_seed.is_some(), self.credentials_file.is_some()];
        if auth.iter().filter(|x| **x).count() > 1 {
            p(
                "user",
                "more than one of user/password, token, nkey_seed and credentials_file is set".into(),
                "keep the one your server expects",
            );
        }
        if self.user.is_some() != self.password.is_some() {
            p("password", "user and password go together".into(), "set both, or neither");
        }
        for (k, v) in [("password", &self.password), ("token", &self.token), ("nkey_seed", &self.nkey_seed)] {
            match v.as_deref().map(secret::resolve) {
                Some(Err(e)) => p(k, e, "set that variable or create that file"),
                // Checked here, as the sink checks it at start: the connection would be refused
                // again and again.
                Some(Ok(seed)) if k == "nkey_seed" && nkeys::KeyPair::from_seed(seed.trim()).is_err() => p(
                    k,
                    "is not a valid nkey seed (its value not shown)".into(),
                    "an `SU...` user seed, e.g. from `nsc` or `nk -gen user`",
                ),
                _ => {}
            }
        }
        for (k, f) in [
            ("credentials_file", &self.credentials_file),
            ("tls.ca_file", &self.tls.ca_file),
            ("tls.cert_file", &self.tls.cert_file),
            ("tls.key_file", &self.tls.key_file),
        ] {
            let Some(f) = f else { continue };
            match std::fs::read(f) {
                Err(e) => p(k, format!("{} cannot be read: {e}", f.display()), "fix the path or mount the file"),
                // Certificates and keys are PEM; a file without a PEM block (a DER file, the
                // wrong file) would fail every connection attempt, retried without end.
                Ok(bytes) if k.starts_with("tls.") && !bytes.windows(11).any(|w| w == b"-----BEGIN ") => p(
                    k,
                    format!("{} holds no PEM block (-----BEGIN ...)", f.display()),
                    "give the PEM file (convert DER with `openssl x509 -inform der`)",
                ),
                Ok(_) => {}
            }
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            p(
                "tls.key_file",
                "tls.cert_file and tls.key_file go together".into(),
                "set both for mutual TLS, or neither",
            );
        }
        let s = &self.stream;
        if self.create_stream {
            if s.name.is_empty() || s.name.contains(['.', '*', '>', ' ', '/', '\\']) {
                p("stream.name", format!("{:?} is not a valid stream name", s.name), "use e.g. \"KUBECAST\"");
            }
            if s.subjects.is_empty() && self.stream_subjects().is_empty() {
                p(
                    "stream.subjects",
                    "cannot be derived: the subject template starts with a {field}".into(),
                    "list the stream's subjects, e.g. [\"kubecast.>\"]",
                );
            }
            // Zero would be the server's default (2 minutes), shorter than a restart may take.
            if s.duplicate_window_seconds == 0 || s.duplicate_window_seconds > MAX_STREAM_SECONDS {
                p(
                    "stream.duplicate_window_seconds",
                    format!("is {}; it must be 1 to {MAX_STREAM_SECONDS}", s.duplicate_window_seconds),
                    "e.g. 600 (the default): longer than kubecast can take to send an event again",
                );
            } else if s.max_age_seconds > 0 && s.duplicate_window_seconds > s.max_age_seconds {
                p(
                    "stream.duplicate_window_seconds",
                    format!(
                        "({}) is longer than stream.max_age_seconds ({}): the server refuses such a stream",
                        s.duplicate_window_seconds, s.max_age_seconds
                    ),
                    "shorten the window, or keep messages longer",
                );
            }
            if s.max_age_seconds > MAX_STREAM_SECONDS {
                p(
                    "stream.max_age_seconds",
                    format!("is {}; at most {MAX_STREAM_SECONDS} (ten years)", s.max_age_seconds),
                    "e.g. 604800 (a week), or 0 to keep messages until max_bytes",
                );
            }
            if s.max_bytes < -1 {
                p("stream.max_bytes", format!("is {}; -1 (no limit) or a size in bytes", s.max_bytes), "e.g. -1");
            }
            if s.replicas == 0 || s.replicas > 5 {
                p("stream.replicas", "must be 1 to 5".into(), "e.g. 1, or 3 in a cluster");
            }
        }
        if !self.jetstream && self.create_stream {
            p("create_stream", "needs jetstream = true".into(), "remove create_stream, or enable jetstream");
        }
        out
    }

    /// The subjects of a stream kubecast creates: configured, or the template's literal
    /// prefix + `>`.
    pub fn stream_subjects(&self) -> Vec<String> {
        if !self.stream.subjects.is_empty() {
            return self.stream.subjects.clone();
        }
        let prefix = &self.subject[..self.subject.find('{').unwrap_or(self.subject.len())];
        match prefix.rfind('.') {
            Some(i) if i > 0 => vec![format!("{}.>", &prefix[..i])],
            _ => Vec::new(),
        }
    }
}

/// Parses a subject template and checks that what it renders is a valid subject.
pub fn subject_template(s: &str) -> Result<Template, String> {
    let t = Template::parse(s)?;
    let sample = Fields::sample();
    let rendered = t.render(&sample, clean_subject_token);
    if let Some(why) = subject_problem(&rendered) {
        return Err(format!("{s:?} does not make a valid NATS subject (e.g. {rendered:?}): {why}"));
    }
    Ok(t)
}

/// Why `s` is not a subject one can publish to (wildcards, an empty token), in words; `None`
/// if it is one.
pub fn subject_problem(s: &str) -> Option<&'static str> {
    let valid = !s.is_empty()
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>']) && !t.chars().any(char::is_whitespace));
    (!valid).then_some("tokens are separated by single dots, no empty token, no '*', '>' or whitespace")
}

/// Field values become subject tokens: ASCII letters, digits, `-` and `_` stay; every other
/// character (the dots of API groups such as `apps.example.com`, `*`, `>`, whitespace,
/// non-ASCII) becomes `_`; an empty value (the namespace of a cluster-scoped object) becomes
/// `_`. So `{group}` of `cert-manager.io` is `cert-manager_io`.
pub fn clean_subject_token(s: &str) -> Cow<'_, str> {
    crate::sink::template::clean_with(s, |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_sanitized() {
        assert_eq!(clean_subject_token("apps"), "apps");
        assert_eq!(clean_subject_token("cert-manager.io"), "cert-manager_io");
        assert_eq!(clean_subject_token(""), "_");
        assert_eq!(clean_subject_token("a*b>c d"), "a_b_c_d");
    }

    #[test]
    fn templates_are_checked() {
        assert!(subject_template(DEFAULT_SUBJECT).is_ok());
        assert!(subject_template("kubecast..{kind}").is_err());
        assert!(subject_template("kubecast.*.{kind}").is_err());
        assert!(subject_template("kubecast.{kind}.").is_err());
        assert!(subject_template("kube cast.{kind}").is_err());
    }

    #[test]
    fn stream_subjects_from_the_template() {
        let cfg: NatsConfig = toml_cfg("url = \"nats://x:4222\"");
        assert_eq!(cfg.stream_subjects(), vec!["kubecast.>".to_string()]);
        let cfg: NatsConfig = toml_cfg("url = \"nats://x:4222\"\nsubject = \"{cluster}.x\"");
        assert!(cfg.stream_subjects().is_empty());
        let cfg: NatsConfig = toml_cfg("url = \"nats://x:4222\"\nsubject = \"a.b.{cluster}\"");
        assert_eq!(cfg.stream_subjects(), vec!["a.b.>".to_string()]);
    }

    #[test]
    fn a_url_refused_is_shown_without_its_secret() {
        for url in ["nats://kubecast:Ab3/xY9+q==@nats:4222", "nats://T0k/en==@nats:4222"] {
            let (message, fix) = url_problem(url).expect("a `/` in the user part is refused");
            assert!(!message.contains("xY9") && !message.contains("T0k"), "{message}");
            assert!(fix.contains("%2F"), "{fix}");
        }
        assert!(url_problem("nats://kubecast:Ab3%2FxY9@nats:4222").is_none(), "percent-encoded");
    }

    fn toml_cfg(s: &str) -> NatsConfig {
        use figment::providers::Format;
        figment::Figment::from(figment::providers::Toml::string(s)).extract().unwrap()
    }
}
