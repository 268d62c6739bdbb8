//! The apiserver client's HTTP stack: the one kube builds (`ClientBuilder::try_from`), layer
//! for layer (TLS, timeouts, base URI, retries of 5xx, authentication, extra headers, tracing),
//! with two differences: its TCP connections gather watch events that arrive in quick
//! succession ([`super::gather`]), and its requests and the bytes of its responses' bodies are
//! counted (`kubecast_apiserver_requests_total` by verb and resource,
//! `kubecast_apiserver_received_bytes_total`: what the apiserver sent this process).
//!
//! Where kube's own stack does more than this one can repeat, kube's is used as it is
//! (gathering off, nothing counted): a proxy in the kubeconfig, or credentials from an exec
//! plugin (a client certificate it hands out expires, which only kube's builder can tell the
//! client).

use std::time::Duration;

use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ConfigExt};
use kube::{Client, Config};
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};
use tower_http::ServiceExt as _;
use tower_http::classify::ServerErrorsFailureClass;
use tower_http::trace::TraceLayer;
use tracing::Span;

use super::gather::{Gather, GatherConnector};

/// A client for `config`, its connections gathering as `gather` says where it can (see the
/// module's text for where it cannot).
pub fn client(config: Config, gather: Gather) -> Result<Client, kube::Error> {
    if config.proxy_url.is_some() || uses_exec(&config) {
        return Client::try_from(config);
    }
    let default_ns = config.default_namespace.clone();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let connector = config.rustls_https_connector_with_connector(GatherConnector::new(http, gather))?;
    let mut connector = TimeoutConnector::new(connector);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let http_client: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Builder::new(TokioExecutor::new()).build(connector);

    let service = ServiceBuilder::new()
        .map_request(count_request)
        .layer(config.base_uri_layer())
        .option_layer(config.default_retry.then_some(RetryLayer::new(RetryPolicy::server_retry())))
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .layer(
            // As kube's: attribute names follow OpenTelemetry's semantic conventions.
            TraceLayer::new_for_http()
                .make_span_with(|req: &Request<Body>| {
                    tracing::debug_span!(
                        "HTTP",
                        http.method = %req.method(),
                        http.url = %req.uri(),
                        http.status_code = tracing::field::Empty,
                        otel.name = req.extensions().get::<&'static str>().unwrap_or(&"HTTP"),
                        otel.kind = "client",
                        otel.status_code = tracing::field::Empty,
                    )
                })
                .on_request(|_: &Request<Body>, _: &Span| tracing::debug!("requesting"))
                .on_response(|res: &Response<Incoming>, _: Duration, span: &Span| {
                    let status = res.status();
                    span.record("http.status_code", status.as_u16());
                    if status.is_client_error() || status.is_server_error() {
                        span.record("otel.status_code", "ERROR");
                    }
                })
                .on_body_chunk(())
                .on_eos(|_: Option<&HeaderMap>, _: Duration, _: &Span| tracing::debug!("stream closed"))
                // At DEBUG, where kube logs an ERROR: a failed request reaches its caller, whose
                // log says what failed, with the cause and the fix (`observe::kube_error`); the
                // bare "failed with error client error (Connect)" beside it only repeated it.
                .on_failure(|ec: ServerErrorsFailureClass, _: Duration, span: &Span| {
                    span.record("otel.status_code", "ERROR");
                    match ec {
                        ServerErrorsFailureClass::StatusCode(status) => {
                            span.record("http.status_code", status.as_u16());
                            tracing::debug!("failed with status {}", status)
                        }
                        ServerErrorsFailureClass::Error(err) => tracing::debug!("failed with error {}", err),
                    }
                }),
        )
        .map_err(BoxError::from)
        .service(http_client)
        .map_response_body(counted);
    Ok(Client::new(service, default_ns))
}

/// Counts a request by verb and resource, once (retries of a 5xx happen below this layer).
fn count_request(req: Request<Body>) -> Request<Body> {
    let (verb, resource) = super::api_request::classify(req.method(), req.uri().path(), req.uri().query());
    let label = crate::observe::metrics::ApiRequest { verb, resource };
    crate::observe::metrics::get().apiserver_requests.get_or_create(&label).inc();
    req
}

/// A response body whose data is counted as it arrives.
fn counted<B>(body: B) -> impl hyper::body::Body<Data = bytes::Bytes, Error = BoxError>
where
    B: hyper::body::Body<Data = bytes::Bytes>,
    B::Error: Into<BoxError>,
{
    use http_body_util::BodyExt;
    body.map_frame(count_received).map_err(Into::into)
}

/// Counts a frame's data.
fn count_received(frame: hyper::body::Frame<bytes::Bytes>) -> hyper::body::Frame<bytes::Bytes> {
    if let Some(data) = frame.data_ref() {
        crate::observe::metrics::get().apiserver_received_bytes.inc_by(data.len() as u64);
    }
    frame
}

/// Credentials from an exec plugin (see the module's text).
fn uses_exec(config: &Config) -> bool {
    config.auth_info.exec.is_some()
}
