//! The HTTP sink: one POST per event, accepted on a 2xx only.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::sync::Semaphore;
use tracing::info;

use super::config::{HttpConfig, HttpVersion, Mode};
use super::encode::encode;
use super::tls;
use super::token::TokenFile;
use super::verdict::{Verdict, verdict};
use crate::sink::outbound::{Outbound, SendError, SinkError};
use crate::sink::secret;

/// How much of an error response's body is kept for the log and the dead letter.
pub const BODY_START: usize = 1024;
/// How much of a response's body is read (so that the connection can be used again).
const BODY_READ_MAX: usize = 1 << 20;

pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
    /// The URL as it may be shown (no password).
    shown: String,
    mode: Mode,
    headers: HeaderMap,
    token: Option<TokenFile>,
    basic: Option<(String, String)>,
    retry_after_max: Duration,
    /// Requests in flight in this process (shared by the sinks of every shard).
    in_flight: Arc<Semaphore>,
    connected: Arc<AtomicBool>,
    unreachable_cause: Arc<Mutex<Option<String>>>,
    server: Vec<opentelemetry::KeyValue>,
}

/// The process's bound on requests in flight: the first sink opened sets it.
fn process_in_flight(max: usize) -> Arc<Semaphore> {
    static SHARED: OnceLock<Arc<Semaphore>> = OnceLock::new();
    SHARED.get_or_init(|| Arc::new(Semaphore::new(max.max(1)))).clone()
}

impl HttpSink {
    /// Builds the client (no request is made: a receiver need not answer anything but events).
    pub fn open(cfg: &HttpConfig, max_in_flight: usize) -> Result<Self, SinkError> {
        let raw = cfg.resolved_url().map_err(|p| SinkError::Config(p.to_string()))?;
        let url = reqwest::Url::parse(&raw).map_err(|e| SinkError::Config(format!("sink.http.url: {e}")))?;
        let shown = secret::url_for_display(&raw);
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let mut builder = reqwest::Client::builder()
            .tls_backend_preconfigured(tls::client_config(&cfg.tls, cfg.http_version)?)
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(10)))
            .redirect(reqwest::redirect::Policy::none())
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_keepalive(Duration::from_secs(30))
            .user_agent(concat!("kubecast/", env!("CARGO_PKG_VERSION")));
        builder = match cfg.http_version {
            HttpVersion::Auto => builder,
            HttpVersion::Http1 => builder.http1_only(),
            HttpVersion::Http2 => builder.http2_prior_knowledge(),
        };
        let client = builder.build().map_err(|e| SinkError::Config(format!("sink.http: {e}")))?;
        let mut headers = HeaderMap::new();
        for (name, value) in &cfg.headers {
            let value =
                secret::resolve(value).map_err(|e| SinkError::Config(format!("sink.http.headers.{name}: {e}")))?;
            let name = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| SinkError::Config(format!("sink.http.headers.{name}: not a header name")))?;
            let mut value = HeaderValue::from_str(&value)
                .map_err(|_| SinkError::Config(format!("sink.http.headers.{name}: not a header value (not shown)")))?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        let token = cfg.bearer_token_file.clone().map(TokenFile::open).transpose().map_err(SinkError::Config)?;
        let basic = match (&cfg.username, &cfg.password) {
            (Some(u), Some(p)) => Some((
                secret::resolve(u).map_err(|e| SinkError::Config(format!("sink.http.username: {e}")))?,
                secret::resolve(p).map_err(|e| SinkError::Config(format!("sink.http.password: {e}")))?,
            )),
            _ => None,
        };
        let port = url.port_or_known_default().unwrap_or(80);
        let server =
            crate::observe::trace::server_attributes(&format!("{}:{port}", url.host_str().unwrap_or_default()), port);
        info!(url = %shown, mode = ?cfg.mode, format = ?cfg.format, http_version = ?cfg.http_version, "HTTP sink ready");
        Ok(Self {
            client,
            url,
            shown,
            mode: cfg.mode,
            headers,
            token,
            basic,
            retry_after_max: Duration::from_secs(cfg.retry_after_max_seconds),
            in_flight: process_in_flight(max_in_flight),
            connected: Arc::new(AtomicBool::new(true)),
            unreachable_cause: Arc::default(),
            server,
        })
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The URL events go to (without a password).
    pub fn destination(&self) -> &str {
        &self.shown
    }

    pub fn trace_attributes(&self) -> Vec<opentelemetry::KeyValue> {
        self.server.clone()
    }

    /// Whether the receiver answered the last request (any status); true until a request fails.
    pub fn connected(&self) -> Arc<AtomicBool> {
        self.connected.clone()
    }

    /// Why the receiver cannot be reached (a TLS failure, in words naming the setting).
    pub fn unreachable_cause(&self) -> Arc<Mutex<Option<String>>> {
        self.unreachable_cause.clone()
    }

    /// Sends one event; `Ok` on a 2xx.
    pub async fn send(&self, msg: &Outbound) -> Result<(), SendError> {
        let (headers, body) = encode(&msg.event, self.mode);
        self.post(&self.url, &self.shown, headers, body).await
    }

    /// A request made elsewhere (`kubecast dead-letter replay`: an entry as it was) to the
    /// sink's URL.
    pub async fn send_raw(&self, headers: HeaderMap, body: Bytes) -> Result<(), SendError> {
        self.post(&self.url, &self.shown, headers, body).await
    }

    /// A dead letter to `url`: the event in binary mode with Knative's dead-letter extensions
    /// (`knativeerrordest`, `knativeerrorcode` when the reason was a status, `knativeerrordata`:
    /// the reason, base64) and `Kubecast-Dead-Letter-Reason`.
    pub async fn send_dead_letter(&self, url: &str, msg: &Outbound, reason: &str) -> Result<(), SendError> {
        use base64::Engine;
        let to = reqwest::Url::parse(url)
            .map_err(|e| SendError::Fatal(format!("[delivery.dead_letter] destination {url:?}: {e}")))?;
        let (mut headers, body) = encode(&msg.event, Mode::Binary);
        let value = |s: &str| HeaderValue::from_str(&crate::sink::header_value(s)).expect("percent-encoded");
        headers.insert("ce-knativeerrordest", value(&self.shown));
        if let Some(code) =
            reason.strip_prefix("HTTP ").and_then(|r| r.get(..3)).filter(|c| c.bytes().all(|b| b.is_ascii_digit()))
        {
            headers.insert("ce-knativeerrorcode", value(code));
        }
        let data = &reason.as_bytes()[..reason.len().min(BODY_START)];
        headers.insert("ce-knativeerrordata", value(&base64::engine::general_purpose::STANDARD.encode(data)));
        headers.insert("kubecast-dead-letter-reason", value(&reason.replace(['\r', '\n'], " ")));
        let shown = secret::url_for_display(url);
        self.post(&to, &shown, headers, body).await
    }

    async fn post(&self, url: &reqwest::Url, shown: &str, headers: HeaderMap, body: Bytes) -> Result<(), SendError> {
        let _permit = self.in_flight.acquire().await.expect("the semaphore is never closed");
        let mut request = self.client.post(url.clone()).headers(self.headers.clone()).headers(headers).body(body);
        if let Some(t) = &self.token {
            request = request.header(http::header::AUTHORIZATION, t.header());
        } else if let Some((u, p)) = &self.basic {
            request = request.basic_auth(u, Some(p));
        }
        let mut response = match request.send().await {
            Ok(r) => r,
            Err(e) => return Err(self.transport_error(shown, &e)),
        };
        self.connected.store(true, Ordering::Relaxed);
        self.unreachable_cause.lock().expect("cause").take();
        let status = response.status();
        let retry_after =
            response.headers().get(http::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let v = verdict(status.as_u16(), retry_after.as_deref(), self.retry_after_max, SystemTime::now());
        // The body: read so that the connection can be used again; its start kept for errors.
        let mut start = Vec::new();
        let mut read = 0usize;
        while read < BODY_READ_MAX {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    read += chunk.len();
                    if start.len() < BODY_START {
                        start.extend_from_slice(&chunk[..chunk.len().min(BODY_START - start.len())]);
                    }
                }
                _ => break,
            }
        }
        let said = || {
            let body = String::from_utf8_lossy(&start).replace(['\r', '\n'], " ");
            let body = body.trim();
            let sep = if body.is_empty() { "" } else { ": " };
            format!("HTTP {status} from {shown}{sep}{body}")
        };
        match v {
            Verdict::Accepted => Ok(()),
            Verdict::Retry(Some(after)) => {
                Err(SendError::RetryAfter { reason: format!("{} (Retry-After: {} s)", said(), after.as_secs()), after })
            }
            Verdict::Retry(None) => Err(SendError::Retriable(said())),
            Verdict::Refused(refusal) => Err(SendError::Refused { refusal, reason: said() }),
            Verdict::DeadLetter => Err(SendError::Permanent(said())),
        }
    }

    /// A request that got no response: retried; a TLS failure is also named for readiness.
    fn transport_error(&self, shown: &str, e: &reqwest::Error) -> SendError {
        self.connected.store(false, Ordering::Relaxed);
        let mut chain = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            chain.push_str(": ");
            chain.push_str(&s.to_string());
            source = s.source();
        }
        let what = if e.is_timeout() {
            "timed out"
        } else if e.is_connect() {
            "cannot connect"
        } else {
            "request failed"
        };
        match tls::fix_for(&chain) {
            Some(fix) => {
                *self.unreachable_cause.lock().expect("cause") = Some(format!("HTTP receiver {shown}: {fix}"));
                SendError::Retriable(format!("{shown}: TLS: {fix} ({chain})"))
            }
            None => SendError::Retriable(format!("{shown}: {what}: {chain}")),
        }
    }
}
