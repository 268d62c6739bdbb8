//! A `kube::Error` in words, for logs and error messages. kube's own text of an apiserver
//! answer repeats the whole status structure after the message (`ApiError: ...: Forbidden
//! (Status { status: Some(Failure), code: 403, ... })`), and its text of a failed connection
//! names only the outermost layer (`ServiceError: client error (Connect)`), leaving out the
//! cause a user can act on (`Connection refused`, a certificate the client does not trust).

use std::error::Error as _;
use std::fmt;

/// `e` in words: an apiserver answer as its code, reason and message; any other error with the
/// causes it wraps, each once.
pub fn in_words(e: &kube::Error) -> InWords<'_> {
    InWords(e)
}

/// See [`in_words`].
pub struct InWords<'a>(&'a kube::Error);

impl fmt::Display for InWords<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let kube::Error::Api(s) = self.0 {
            write!(f, "the apiserver answered {}", s.code)?;
            if !s.reason.is_empty() {
                write!(f, " {}", s.reason)?;
            }
            return if s.message.is_empty() { Ok(()) } else { write!(f, ": {}", s.message) };
        }
        let mut text = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            // Layers often repeat the text of the one they wrap: each cause once.
            let t = c.to_string();
            if !t.is_empty() && !text.contains(&t) {
                text.push_str(": ");
                text.push_str(&t);
            }
            cause = c.source();
        }
        f.write_str(&text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str, message: &str) -> kube::Error {
        let s = kube::core::Status::failure(message, reason).with_code(code);
        kube::Error::Api(Box::new(s))
    }

    #[test]
    fn an_apiserver_answer_is_its_code_reason_and_message_without_the_structure() {
        let e = status(403, "Forbidden", "leases.coordination.k8s.io \"x\" is forbidden: User \"u\" cannot get");
        let text = in_words(&e).to_string();
        assert_eq!(
            text,
            "the apiserver answered 403 Forbidden: leases.coordination.k8s.io \"x\" is forbidden: User \"u\" cannot get"
        );
        assert!(e.to_string().contains("Status {"), "kube's own text, for contrast: {e}");
        assert_eq!(in_words(&status(500, "", "")).to_string(), "the apiserver answered 500");
    }

    #[test]
    fn a_wrapped_cause_is_named_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)");
        let e = kube::Error::Service(Box::new(io));
        let text = in_words(&e).to_string();
        assert_eq!(text.matches("Connection refused").count(), 1, "{text}");
        assert!(text.starts_with("ServiceError"), "{text}");
    }

    #[tokio::test]
    async fn a_refused_connection_names_the_refusal() {
        // A port nothing listens on: kube's text names only the outer layer; ours the cause.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let config = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = kube::Api::default_namespaced(client);
        let e = api.get("x").await.unwrap_err();
        let text = in_words(&e).to_string();
        assert!(text.to_lowercase().contains("refused"), "{text} (kube's own: {e})");
    }
}
