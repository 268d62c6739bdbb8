//! `type = "nats"`: async-nats, JetStream by default.
//!
//! **JetStream** (`jetstream = true`, default): every event is published with
//! `Nats-Msg-Id` = the CloudEvent `id` and counts as accepted only when its PubAck arrives.
//! Publishes are pipelined (one per object at a time, up to `[delivery] max_in_flight` objects
//! at once). A retry or a replay after a crash carries the same `Nats-Msg-Id`, so the stream's
//! duplicate window drops it; a PubAck with `duplicate = true` counts as accepted.
//!
//! **Core NATS** (`jetstream = false`): at-most-once. There is no broker acknowledgement: an
//! event counts as accepted once the client wrote it to the connection (publish + flush).
//! Events in flight when the connection or kubecast dies can be lost.
//!
//! CloudEvents NATS protocol binding: structured mode by default (payload = the JSON event,
//! header `Content-Type: application/cloudevents+json; charset=UTF-8`), binary mode as an
//! option (payload = data, every attribute and extension as a `ce-<name>` header, values
//! percent-encoded as the binding says).
//!
//! Subjects come from a template (see [`clean_subject_token`] for how field values become
//! subject tokens).

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use async_nats::{Client, ConnectOptions, HeaderMap, HeaderName};
use bytes::Bytes;
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};
use serde::{Deserialize, Serialize};
use tracing::{debug, error, info, warn};

use super::template::{Fields, Template, TypeFields};
use super::{Outbound, SendError, SinkError, secret};
use crate::event::{AttributeValue, CloudEvent};

pub const DEFAULT_SUBJECT: &str = "kubecast.{cluster}.{group}.{resource}.{namespace}";
const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

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

impl NatsConfig {
    /// `(key, message, fix)` for each problem.
    pub fn problems(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        let mut p = |k: &str, m: String, f: &str| out.push((format!("sink.nats.{k}"), m, f.to_string()));
        if self.url.trim().is_empty() {
            p("url", "is empty".into(), "set the server URL(s), e.g. \"nats://nats:4222\"");
        }
        for u in self.url.split(',') {
            if !u.trim().is_empty() && u.trim().parse::<async_nats::ServerAddr>().is_err() {
                p("url", format!("{:?} is not a NATS server address", u.trim()), "write e.g. \"nats://nats:4222\"");
            }
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
            if let Some(v) = v {
                if let Err(e) = secret::resolve(v) {
                    p(k, e, "set that variable or create that file");
                }
            }
        }
        for (k, f) in [
            ("credentials_file", &self.credentials_file),
            ("tls.ca_file", &self.tls.ca_file),
            ("tls.cert_file", &self.tls.cert_file),
            ("tls.key_file", &self.tls.key_file),
        ] {
            if let Some(f) = f {
                if let Err(e) = std::fs::metadata(f) {
                    p(k, format!("{} cannot be read: {e}", f.display()), "fix the path or mount the file");
                }
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
    let sample = Fields {
        of_type: TypeFields {
            cluster: "c".into(),
            group: "g".into(),
            version: "v".into(),
            kind: "K".into(),
            resource: "r".into(),
        }
        .intern(),
        namespace: String::new(),
        verb: "added",
    };
    let rendered = t.render(&sample, clean_subject_token);
    if !is_valid_subject(&rendered) {
        return Err(format!(
            "{s:?} does not make a valid NATS subject (e.g. {rendered:?}): tokens are separated by single dots, no empty token, no '*', '>' or whitespace"
        ));
    }
    Ok(t)
}

fn is_valid_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| !t.is_empty() && !t.contains(['*', '>']) && !t.chars().any(char::is_whitespace))
}

/// Field values become subject tokens: ASCII letters, digits, `-` and `_` stay; every other
/// character (the dots of API groups such as `apps.example.com`, `*`, `>`, whitespace,
/// non-ASCII) becomes `_`; an empty value (the namespace of a cluster-scoped object) becomes
/// `_`. So `{group}` of `cert-manager.io` is `cert-manager_io`.
pub fn clean_subject_token(s: &str) -> Cow<'_, str> {
    super::template::clean_with(s, |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'))
}

pub struct NatsSink {
    client: Client,
    js: Option<jetstream::Context>,
    subject: Template,
    mode: Mode,
    ack_timeout: Duration,
    create_stream: bool,
    stream: StreamSettings,
    stream_subjects: Vec<String>,
    connected: Arc<AtomicBool>,
}

impl NatsSink {
    /// Connects (retrying in the background forever when the server is not reachable yet) and
    /// waits up to `wait` for the first connection.
    pub async fn open(cfg: &NatsConfig, max_in_flight: usize, wait: Duration) -> Result<Self, SinkError> {
        let connected = Arc::new(AtomicBool::new(false));
        let opts = connect_options(cfg, connected.clone()).await?;
        let client = opts
            .connect(cfg.url.as_str())
            .await
            .map_err(|e| SinkError::Config(format!("sink.nats.url {:?}: {e}", cfg.url)))?;
        let ack_timeout = Duration::from_millis(cfg.ack_timeout_ms);
        let js = cfg.jetstream.then(|| {
            jetstream::ContextBuilder::new()
                .timeout(ack_timeout)
                .max_ack_inflight(max_in_flight.max(1))
                .backpressure_on_inflight(true)
                .build(client.clone())
        });
        let sink = Self {
            client,
            js,
            subject: subject_template(&cfg.subject)
                .map_err(|e| SinkError::Config(format!("sink.nats.subject: {e}")))?,
            mode: cfg.mode,
            ack_timeout,
            create_stream: cfg.create_stream,
            stream: cfg.stream.clone(),
            stream_subjects: cfg.stream_subjects(),
            connected,
        };
        let deadline = tokio::time::Instant::now() + wait;
        while !sink.is_connected() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        info!(url = %cfg.url, subject = %cfg.subject, jetstream = cfg.jetstream, mode = ?cfg.mode, connected = sink.is_connected(), "NATS client created");
        Ok(sink)
    }

    pub fn is_connected(&self) -> bool {
        let up = self.client.connection_state() == async_nats::connection::State::Connected;
        self.connected.store(up, Ordering::Relaxed);
        up
    }

    /// Whether the server is reachable (kept by the connection's events).
    pub fn connected(&self) -> Arc<AtomicBool> {
        self.connected.clone()
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn jetstream(&self) -> bool {
        self.js.is_some()
    }

    pub fn destination(&self, msg: &Outbound) -> String {
        msg.route.as_deref().unwrap_or(&self.subject).render(&msg.fields, clean_subject_token)
    }

    /// The subject `fields` go to with `route` (or the sink's template).
    pub fn subject_for(&self, route: Option<&Template>, fields: &Fields) -> String {
        route.unwrap_or(&self.subject).render(fields, clean_subject_token)
    }

    /// Checks that a JetStream stream covers each subject; creates the configured stream when
    /// `create_stream = true` and one does not. `Err` names the subject and the fix.
    pub async fn ensure_streams(&self, subjects: &[String]) -> Result<(), SinkError> {
        let Some(js) = &self.js else { return Ok(()) };
        for subject in subjects {
            match js.stream_by_subject(subject.as_str()).await {
                Ok(name) => debug!(subject, stream = %name, "JetStream stream covers subject"),
                Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                    if !self.create_stream {
                        return Err(SinkError::Config(format!(
                            "no JetStream stream covers subject {subject:?} (fix: create one, e.g. `nats stream add KUBECAST --subjects '{}' --dupe-window 10m`, or set sink.nats.create_stream = true)",
                            self.stream_subjects.first().map_or("kubecast.>", String::as_str)
                        )));
                    }
                    self.create_stream(js).await?;
                    js.stream_by_subject(subject.as_str()).await.map_err(|_| {
                        SinkError::Config(format!(
                            "stream {:?} was created with subjects {:?}, but they do not cover subject {subject:?} (fix: set sink.nats.stream.subjects)",
                            self.stream.name, self.stream_subjects
                        ))
                    })?;
                }
                Err(e) => {
                    return Err(SinkError::Config(format!("JetStream: cannot look up the stream of {subject:?}: {e}")));
                }
            }
        }
        Ok(())
    }

    async fn create_stream(&self, js: &jetstream::Context) -> Result<(), SinkError> {
        let s = &self.stream;
        let config = jetstream::stream::Config {
            name: s.name.clone(),
            subjects: self.stream_subjects.clone(),
            duplicate_window: Duration::from_secs(s.duplicate_window_seconds),
            max_age: Duration::from_secs(s.max_age_seconds),
            max_bytes: s.max_bytes,
            storage: match s.storage {
                Storage::File => jetstream::stream::StorageType::File,
                Storage::Memory => jetstream::stream::StorageType::Memory,
            },
            num_replicas: s.replicas,
            ..Default::default()
        };
        js.get_or_create_stream(config).await.map_err(|e| {
            SinkError::Config(format!(
                "cannot create JetStream stream {:?} with subjects {:?}: {e} (fix: check sink.nats.stream, or create the stream yourself)",
                s.name, self.stream_subjects
            ))
        })?;
        info!(stream = %s.name, subjects = ?self.stream_subjects, duplicate_window_seconds = s.duplicate_window_seconds, "JetStream stream created");
        Ok(())
    }

    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        let subject = self.destination(msg);
        let (payload, headers) = encode(&msg.event, self.mode);
        self.publish(subject, headers, payload, msg.event.id()).await
    }

    /// Publishes with the given headers (the dead-letter destination). `id` is the
    /// `Nats-Msg-Id`.
    pub async fn publish(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
        id: &str,
    ) -> Result<(), SendError> {
        // Both steps that hand the message to the client are boxed: inline, their state (~900
        // bytes when this was written) would be part of every in-flight event's future, which
        // then waits for its PubAck holding only the acknowledgement's (boxed) future.
        let Some(js) = &self.js else {
            return Box::pin(self.publish_core(subject, headers, payload)).await;
        };
        let message = PublishMessage::build().payload(payload).headers(headers).message_id(id);
        // Shared with the request (a reference count), kept for the error messages.
        let subject = async_nats::Subject::from(subject);
        let ack = Box::pin(js.send_publish(subject.clone(), message)).await.map_err(|e| classify(&subject, e))?;
        let ack = ack.await.map_err(|e| classify(&subject, e))?;
        if ack.duplicate {
            debug!(event_id = id, subject = subject.as_str(), stream = %ack.stream, "JetStream dropped a duplicate (sent before); counted as acknowledged");
        }
        Ok(())
    }

    /// Core NATS (at-most-once): publish, then flush so the message left the client.
    async fn publish_core(&self, subject: String, headers: HeaderMap, payload: Bytes) -> Result<(), SendError> {
        self.client
            .publish_with_headers(subject.clone(), headers, payload)
            .await
            .map_err(|e| SendError::Retriable(format!("NATS publish to {subject:?}: {e}")))?;
        match tokio::time::timeout(self.ack_timeout, self.client.flush()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SendError::Retriable(format!("NATS flush: {e}"))),
            Err(_) => Err(SendError::Retriable(format!("NATS flush: not done within {:?}", self.ack_timeout))),
        }
    }
}

async fn connect_options(cfg: &NatsConfig, connected: Arc<AtomicBool>) -> Result<ConnectOptions, SinkError> {
    let secret =
        |key: &str, v: &str| secret::resolve(v).map_err(|e| SinkError::Config(format!("sink.nats.{key}: {e}")));
    let mut opts = match &cfg.credentials_file {
        Some(path) => ConnectOptions::with_credentials_file(path).await.map_err(|e| {
            SinkError::Config(format!(
                "sink.nats.credentials_file {}: {e} (fix: a .creds file from nsc)",
                path.display()
            ))
        })?,
        None => ConnectOptions::new(),
    };
    if let (Some(user), Some(password)) = (&cfg.user, &cfg.password) {
        opts = opts.user_and_password(user.clone(), secret("password", password)?);
    }
    if let Some(token) = &cfg.token {
        opts = opts.token(secret("token", token)?);
    }
    if let Some(seed) = &cfg.nkey_seed {
        let seed = secret("nkey_seed", seed)?;
        // Checked here: async-nats would only fail on the first connection, with less detail.
        nkeys::KeyPair::from_seed(seed.trim()).map_err(|_| {
            SinkError::Config("sink.nats.nkey_seed: not a valid nkey seed (fix: an `SU...` user seed)".into())
        })?;
        opts = opts.nkey(seed.trim().to_string());
    }
    if cfg.tls.required {
        opts = opts.require_tls(true);
    }
    if cfg.tls.handshake_first {
        opts = opts.tls_first();
    }
    if let Some(ca) = &cfg.tls.ca_file {
        opts = opts.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&cfg.tls.cert_file, &cfg.tls.key_file) {
        opts = opts.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(opts
        .name(&cfg.name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(5))
        .reconnect_delay_callback(|attempts| {
            // 0, 100 ms, 200 ms, ... up to 5 s, jittered, forever.
            let base = Duration::from_millis(100u64.saturating_mul(1 << attempts.min(6) as u64)).min(Duration::from_secs(5));
            if attempts == 0 { Duration::ZERO } else { base.mul_f64(0.5 + rand_fraction() * 0.5) }
        })
        .event_callback(move |event| {
            let connected = connected.clone();
            async move {
                match &event {
                    async_nats::Event::Connected => {
                        connected.store(true, Ordering::Relaxed);
                        info!(target: "kubecast::nats", "connected to NATS");
                    }
                    async_nats::Event::Disconnected => {
                        connected.store(false, Ordering::Relaxed);
                        warn!(target: "kubecast::nats", "disconnected from NATS; reconnecting");
                    }
                    async_nats::Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
                        connected.store(false, Ordering::Relaxed);
                        error!(target: "kubecast::nats", "NATS refused the credentials: authorization violation (fix: check sink.nats user/password, token, nkey_seed or credentials_file, and the user's permissions)");
                    }
                    async_nats::Event::ServerError(e) => error!(target: "kubecast::nats", "NATS server error: {e}"),
                    // Connection attempts report their failures as client errors.
                    async_nats::Event::ClientError(e) if is_auth_failure(&e.to_string()) => {
                        connected.store(false, Ordering::Relaxed);
                        error!(target: "kubecast::nats", "NATS refused the credentials: {e} (fix: check sink.nats user/password, token, nkey_seed or credentials_file)");
                    }
                    async_nats::Event::ClientError(e) => error!(target: "kubecast::nats", "NATS client error: {e}"),
                    other => info!(target: "kubecast::nats", "NATS: {other}"),
                }
            }
        }))
}

fn is_auth_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("authorization") || m.contains("authentication")
}

/// A cheap jitter source (no crypto needed).
fn rand_fraction() -> f64 {
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    f64::from(n % 1000) / 1000.0
}

fn classify(subject: &str, e: jetstream::context::PublishError) -> SendError {
    use jetstream::ErrorCode;
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => SendError::Permanent(format!("NATS publish to {subject:?}: {e}")),
        // Retried: it can also mean JetStream is briefly unavailable (server restarting).
        PublishErrorKind::StreamNotFound => SendError::Retriable(format!(
            "no JetStream stream covers subject {subject:?} (fix: add it to a stream's subjects, or route this resource elsewhere with `subject`)"
        )),
        PublishErrorKind::Other => {
            let source = std::error::Error::source(&e);
            let code = source.and_then(|s| s.downcast_ref::<jetstream::Error>()).map(|j| j.error_code());
            if code == Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) {
                SendError::Permanent(format!(
                    "NATS publish to {subject:?}: {e}: {}",
                    source.map(|s| s.to_string()).unwrap_or_default()
                ))
            } else {
                SendError::Retriable(format!(
                    "NATS publish to {subject:?}: {e}{}",
                    source.map(|s| format!(": {s}")).unwrap_or_default()
                ))
            }
        }
        _ => SendError::Retriable(format!("NATS publish to {subject:?}: {e}")),
    }
}

/// Header values of binary mode: space, `"`, `%` and everything outside printable ASCII are
/// percent-encoded (CloudEvents NATS binding).
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

fn header_value(v: &str) -> String {
    // Most values (ids, times, names, versions) need no escape: copied as they are.
    if v.bytes().all(|b| matches!(b, 0x21..=0x7e) && b != b'"' && b != b'%') {
        return v.to_owned();
    }
    Cow::from(utf8_percent_encode(v, HEADER_VALUE)).into_owned()
}

/// `ce-<name>` of binary mode, without an allocation for the attributes and extensions
/// kubecast sets.
fn ce_header(name: &str) -> Option<HeaderName> {
    Some(HeaderName::from_static(match name {
        "specversion" => "ce-specversion",
        "id" => "ce-id",
        "type" => "ce-type",
        "source" => "ce-source",
        "datacontenttype" => "ce-datacontenttype",
        "dataschema" => "ce-dataschema",
        "subject" => "ce-subject",
        "time" => "ce-time",
        "partitionkey" => "ce-partitionkey",
        "resourceversion" => "ce-resourceversion",
        "origin" => "ce-origin",
        _ => return None,
    }))
}

/// The payload and headers of `event` in `mode` (without `Nats-Msg-Id`). Binary mode shares
/// the event's data (no copy).
pub fn encode(event: &CloudEvent, mode: Mode) -> (Bytes, HeaderMap) {
    let mut headers = HeaderMap::new();
    // W3C trace context as plain headers too (traces on), so consumers continue the trace.
    for name in ["traceparent", "tracestate"] {
        if let Some(AttributeValue::Str(v)) = event.attributes.extension(name) {
            headers.insert(name, v);
        }
    }
    match mode {
        Mode::Structured => {
            headers.insert("Content-Type", STRUCTURED_CONTENT_TYPE);
            (event.structured_bytes(), headers)
        }
        Mode::Binary => {
            // `value`: already percent-encoded.
            let mut put = |name: &str, value: String| match ce_header(name) {
                Some(n) => headers.insert(n, value),
                None => headers.insert(format!("ce-{name}"), value),
            };
            for (name, value) in event.attributes.all() {
                match value {
                    // Digits, `-`, `:`, `.`, `T`, `Z`, or `true` / `false`: nothing to encode.
                    AttributeValue::Str(s) => put(name, header_value(s)),
                    other => put(name, other.text().into_owned()),
                }
            }
            (event.data.clone(), headers)
        }
    }
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
    fn binary_header_values_are_percent_encoded() {
        assert_eq!(header_value("ns/name"), "ns/name");
        assert_eq!(header_value("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(header_value("grüße\n"), "gr%C3%BC%C3%9Fe%0A");
        // The edges of what is copied as it is.
        assert_eq!(header_value("!~2026-11-22T03:04:05.123Z"), "!~2026-11-22T03:04:05.123Z");
        assert_eq!(header_value("\x7f"), "%7F");
        assert_eq!(header_value("a%"), "a%25");
        assert_eq!(header_value(""), "");
    }

    #[test]
    fn binary_header_names() {
        for name in [
            "specversion",
            "id",
            "type",
            "source",
            "datacontenttype",
            "dataschema",
            "subject",
            "time",
            "partitionkey",
            "resourceversion",
            "origin",
        ] {
            assert_eq!(ce_header(name).unwrap().to_string(), format!("ce-{name}"));
        }
        assert!(ce_header("other").is_none());
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

    fn toml_cfg(s: &str) -> NatsConfig {
        use figment::providers::Format;
        figment::Figment::from(figment::providers::Toml::string(s)).extract().unwrap()
    }
}
