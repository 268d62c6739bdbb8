//! The NATS connection and publishing: JetStream with PubAcks (or core NATS), stream checks
//! at start, and which failures are retriable.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use async_nats::{Client, ConnectOptions, HeaderMap};
use bytes::Bytes;
use tracing::{debug, error, info, warn};

use super::config::{Mode, NatsConfig, Storage, StreamSettings, clean_subject_token, subject_template};
use super::encode::encode;
use super::permissions::Refused;
use super::url_credentials::{UrlCredentials, url_credentials};
use crate::model::{Fields, Refusal};
use crate::sink::outbound::{Outbound, SendError, SinkError};
use crate::sink::secret;
use crate::sink::template::Template;

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
    /// Subjects the server refused publishes on (its permissions).
    refused: Refused,
    /// `server.address` / `server.port` of send spans: the first server of `url`.
    server: Vec<opentelemetry::KeyValue>,
}

impl NatsSink {
    /// Connects (retrying in the background forever when the server is not reachable yet) and
    /// waits up to `wait` for the first connection.
    pub async fn open(cfg: &NatsConfig, max_in_flight: usize, wait: Duration) -> Result<Self, SinkError> {
        let connected = Arc::new(AtomicBool::new(false));
        let refused = Refused::default();
        let opts = connect_options(cfg, connected.clone(), refused.clone()).await?;
        let client = opts
            .connect(cfg.url.as_str())
            .await
            .map_err(|e| SinkError::Config(format!("sink.nats.url {:?}: {e}", secret::url_for_display(&cfg.url))))?;
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
            refused,
            server: crate::observe::trace::server_attributes(&cfg.url, 4222),
        };
        let deadline = tokio::time::Instant::now() + wait;
        while !sink.is_connected() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        info!(url = %secret::url_for_display(&cfg.url), subject = %cfg.subject, jetstream = cfg.jetstream, mode = ?cfg.mode, connected = sink.is_connected(), "NATS client created");
        Ok(sink)
    }

    /// The connection: the NATS state store uses it too.
    pub fn client(&self) -> &Client {
        &self.client
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

    /// The JetStream context (`None` on core NATS), for readers of the broker's streams.
    pub fn jetstream_context(&self) -> Option<&jetstream::Context> {
        self.js.as_ref()
    }

    pub fn destination(&self, msg: &Outbound) -> String {
        msg.route.as_deref().unwrap_or(&self.subject).render(&msg.fields, clean_subject_token)
    }

    /// The subject `fields` go to with `route` (or the sink's template).
    pub fn subject_for(&self, route: Option<&Template>, fields: &Fields) -> String {
        route.unwrap_or(&self.subject).render(fields, clean_subject_token)
    }

    /// The JetStream stream that covers `subject`: `Ok(None)` when JetStream says none does,
    /// `Err` when it cannot answer (or core NATS).
    pub async fn stream_for(&self, subject: &str) -> Result<Option<String>, String> {
        let Some(js) = &self.js else { return Err("core NATS (sink.nats.jetstream = false): no streams".into()) };
        match js.stream_by_subject(subject).await {
            Ok(name) => Ok(Some(name)),
            Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    /// `[sink.nats] create_stream`.
    pub fn creates_stream(&self) -> bool {
        self.create_stream
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

    /// The send span's attributes known before the send: the (first) server of `url`.
    pub fn trace_attributes(&self) -> Vec<opentelemetry::KeyValue> {
        self.server.clone()
    }

    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        let subject = self.destination(msg);
        let (payload, headers) = encode(&msg.event, self.mode);
        let ack = self.publish_acked(subject, headers, payload, msg.event.id()).await?;
        if let (Some(t), Some(ack)) = (&msg.trace, ack) {
            // No messaging convention for JetStream: kubecast's own names.
            t.record_send(vec![
                opentelemetry::KeyValue::new("kubecast.jetstream.stream", ack.stream),
                opentelemetry::KeyValue::new("kubecast.jetstream.sequence", ack.sequence as i64),
                opentelemetry::KeyValue::new("kubecast.jetstream.duplicate", ack.duplicate),
            ]);
        }
        Ok(())
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
        self.publish_acked(subject, headers, payload, id).await.map(|_| ())
    }

    /// [`NatsSink::publish`], with JetStream's PubAck (`None` on core NATS).
    async fn publish_acked(
        &self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
        id: &str,
    ) -> Result<Option<jetstream::publish::PublishAck>, SendError> {
        // Both steps that hand the message to the client are boxed: inline, their state (~900
        // bytes when this was written) would be part of every in-flight event's future, which
        // then waits for its PubAck holding only the acknowledgement's (boxed) future.
        let Some(js) = &self.js else {
            return Box::pin(self.publish_core(subject, headers, payload)).await.map(|()| None);
        };
        let message = PublishMessage::build().payload(payload).headers(headers).message_id(message_id(id, &subject));
        // Shared with the request (a reference count), kept for the error messages.
        let subject = async_nats::Subject::from(subject);
        let ack = match Box::pin(js.send_publish(subject.clone(), message)).await {
            Ok(ack) => ack,
            Err(e) => return Err(Box::pin(classify_checked(js, &subject, e)).await),
        };
        let ack = match ack.await {
            Ok(ack) => ack,
            // No PubAck because the server refused the publish itself (its permissions).
            Err(e) if let Some(said) = self.refused.recent(subject.as_str()) => {
                return Err(SendError::Refused {
                    refusal: Refusal::SubjectNotPermitted,
                    reason: format!("NATS subject {:?}: {said} ({e})", subject.as_str()),
                });
            }
            Err(e) => return Err(Box::pin(classify_checked(js, &subject, e)).await),
        };
        if ack.duplicate {
            debug!(event_id = id, subject = subject.as_str(), stream = %ack.stream, "JetStream dropped a duplicate (sent before); counted as acknowledged");
        }
        Ok(Some(ack))
    }

    /// Core NATS (at-most-once): publish, then flush so the message left the client.
    async fn publish_core(&self, subject: String, headers: HeaderMap, payload: Bytes) -> Result<(), SendError> {
        self.client.publish_with_headers(subject.clone(), headers, payload).await.map_err(|e| {
            use async_nats::PublishErrorKind as Core;
            let reason = format!("NATS publish to {subject:?}: {e}");
            match e.kind() {
                // Refused by the client before sending, the same at every attempt: the dead
                // letter (which may drop the data to fit).
                Core::MaxPayloadExceeded | Core::InvalidSubject => SendError::Permanent(reason),
                Core::Send => SendError::Retriable(reason),
            }
        })?;
        match tokio::time::timeout(self.ack_timeout, self.client.flush()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SendError::Retriable(format!("NATS flush: {e}"))),
            Err(_) => Err(SendError::Retriable(format!("NATS flush: not done within {:?}", self.ack_timeout))),
        }
    }
}

async fn connect_options(
    cfg: &NatsConfig,
    connected: Arc<AtomicBool>,
    refused: Refused,
) -> Result<ConnectOptions, SinkError> {
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
    // Written in the URL, when no key gives credentials (async-nats would not send them).
    let keyed = cfg.user.is_some() || cfg.token.is_some() || cfg.nkey_seed.is_some() || cfg.credentials_file.is_some();
    match url_credentials(&cfg.url).filter(|_| !keyed) {
        Some(UrlCredentials::UserPassword(user, password)) => opts = opts.user_and_password(user, password),
        Some(UrlCredentials::Token(token)) => opts = opts.token(token),
        None => {}
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
    let server = Arc::new(secret::url_for_display(&cfg.url));
    Ok(opts
        .name(&cfg.name)
        .retry_on_initial_connect()
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(5))
        .reconnect_delay_callback({
            let delay = super::reconnect::ReconnectDelay::default();
            move |attempts| delay.before(attempts)
        })
        .event_callback(move |event| {
            let connected = connected.clone();
            let server = server.clone();
            let refused = refused.clone();
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
                    async_nats::Event::ServerError(async_nats::ServerError::Other(m)) if refused.note(m) => {
                        warn!(target: "kubecast::nats", "NATS refused a publish: {m} (fix: allow the NATS user to publish on the subject, its permissions.publish)");
                    }
                    async_nats::Event::ServerError(e) => error!(target: "kubecast::nats", "NATS server error: {e}"),
                    // Connection attempts report their failures as client errors.
                    async_nats::Event::ClientError(e) if is_auth_failure(&e.to_string()) => {
                        connected.store(false, Ordering::Relaxed);
                        error!(target: "kubecast::nats", "NATS refused the credentials: {e} (fix: check sink.nats user/password, token, nkey_seed or credentials_file)");
                    }
                    async_nats::Event::ClientError(e) => error!(
                        target: "kubecast::nats",
                        url = %server,
                        "NATS client error: {e} (fix: check sink.nats.url, and that the NATS server runs and is reachable from here)"
                    ),
                    other => info!(target: "kubecast::nats", "NATS: {other}"),
                }
            }
        }))
}

fn is_auth_failure(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("authorization") || m.contains("authentication")
}

/// [`classify`], and for "no stream" (no responders) asks JetStream whether a stream covers
/// the subject: when it answers that none does, that is a set-up mistake ([`Refusal`]: the
/// event is held, not dead-lettered, until a stream covers the subject); when it cannot
/// answer (a server restarting), retried.
async fn classify_checked(js: &jetstream::Context, subject: &str, e: jetstream::context::PublishError) -> SendError {
    if e.kind() != PublishErrorKind::StreamNotFound {
        return classify(subject, e);
    }
    match js.stream_by_subject(subject).await {
        Err(lookup) if lookup.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => SendError::Refused {
            refusal: Refusal::MissingStream,
            reason: format!("NATS subject {subject:?}: JetStream says no stream covers it"),
        },
        _ => classify(subject, e),
    }
}

/// `Nats-Msg-Id`: the event id on its subject. JetStream drops a message whose id it stored
/// within the duplicate window in the same stream, whatever the subject: two `[[resources]]`
/// entries that both see an object send the same event id to their own subjects, and the
/// second must not be dropped as a repeat of the first. A retry or a replay after a restart
/// sends the same event to the same subject: the same id, dropped as meant.
fn message_id(event_id: &str, subject: &str) -> String {
    format!("{event_id}@{subject}")
}

fn classify(subject: &str, e: jetstream::context::PublishError) -> SendError {
    use jetstream::ErrorCode;
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => SendError::Permanent(format!("NATS publish to {subject:?}: {e}")),
        // Retried: it can also mean JetStream is briefly unavailable (server restarting).
        PublishErrorKind::StreamNotFound => SendError::Retriable(format!(
            "no JetStream stream answered for subject {subject:?} (a server restarting, or no stream covers it: fix: add it to a stream's subjects, or route this resource elsewhere with `subject`)"
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
