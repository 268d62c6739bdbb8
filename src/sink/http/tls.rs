//! TLS of the HTTP sink: rustls with the ring provider (as the apiserver client), the CA file
//! or the system roots, an optional client certificate, ALPN for HTTP/2; and TLS failures in
//! words that name the setting to change.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::config::{HttpVersion, TlsSettings};
use crate::sink::outbound::SinkError;

/// The client's TLS configuration.
pub fn client_config(tls: &TlsSettings, version: HttpVersion) -> Result<rustls::ClientConfig, SinkError> {
    let err = |key: &str, e: String| SinkError::Config(format!("sink.http.tls.{key}: {e}"));
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = &tls.ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| err("ca_file", format!("{}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(err("ca_file", format!("{}: no PEM certificate in it", path.display())));
        }
        for c in certs {
            roots.add(c).map_err(|e| err("ca_file", format!("{}: {e}", path.display())))?;
        }
    }
    if tls.ca_file.is_none() || tls.system_cas {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 && tls.ca_file.is_none() {
            tracing::warn!(
                "no system CA certificate found: an https:// receiver cannot be verified; set sink.http.tls.ca_file to the receiver's CA file, or install the ca-certificates package"
            );
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| SinkError::Config(format!("sink.http.tls: {e}")))?
        .with_root_certificates(roots);
    let mut config = match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<_, _>>())
                .map_err(|e| err("cert_file", format!("{}: {e}", cert.display())))?;
            let key =
                PrivateKeyDer::from_pem_file(key).map_err(|e| err("key_file", format!("{}: {e}", key.display())))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| err("cert_file", format!("the certificate and its key do not go together: {e}")))?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = match version {
        HttpVersion::Auto => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        HttpVersion::Http1 => vec![b"http/1.1".to_vec()],
        HttpVersion::Http2 => vec![b"h2".to_vec()],
    };
    Ok(config)
}

/// What to change when a request failed in the TLS handshake (`chain`: the error and its
/// causes, as text); `None` when it was not a TLS failure.
pub fn fix_for(chain: &str) -> Option<&'static str> {
    let m = chain.to_ascii_lowercase();
    if m.contains("notvalidforname") || m.contains("not valid for name") {
        Some(
            "the receiver's certificate does not name the host in sink.http.url: use a host from the certificate's subject alternative names, or have the certificate reissued",
        )
    } else if m.contains("unknownissuer") || m.contains("invalid peer certificate") || m.contains("certificate verify")
    {
        Some(
            "the receiver's certificate could not be verified: no CA kubecast trusts signed it (set sink.http.tls.ca_file to the receiver's CA file; without it kubecast trusts the system CA bundle)",
        )
    } else if m.contains("certificaterequired")
        || m.contains("certificate required")
        || m.contains("bad certificate")
        || m.contains("badcertificate")
        || m.contains("unknownca")
        || m.contains("unknown ca")
    {
        Some(
            "the receiver refused the TLS handshake, most often the client certificate: set sink.http.tls.cert_file and key_file to a certificate signed by a CA the receiver trusts",
        )
    } else if m.contains("corrupt message") || m.contains("invalidcontenttype") || m.contains("received corrupt") {
        Some("the receiver does not speak TLS on that port: use http:// in sink.http.url, or the receiver's TLS port")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::fix_for;

    #[test]
    fn tls_failures_name_the_setting() {
        let unknown = "error sending request for url (https://127.0.0.1:1/): client error (Connect): invalid peer certificate: UnknownIssuer";
        assert!(fix_for(unknown).unwrap().contains("sink.http.tls.ca_file"));
        assert!(fix_for("invalid peer certificate: NotValidForName").unwrap().contains("subject alternative names"));
        assert!(fix_for("received fatal alert: CertificateRequired").unwrap().contains("cert_file"));
        assert!(fix_for("connection refused").is_none());
    }
}
