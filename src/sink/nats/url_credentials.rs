//! Credentials written in a NATS URL (`nats://user:password@host`, `nats://token@host`).
//! async-nats parses them but does not send them (0.51): a server that requires them refuses
//! the connection, and one with a `no_auth_user` lets it in as that user, with that user's
//! permissions, quietly. kubecast takes them out of the URL and gives them to the client.

/// What a URL's user part holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UrlCredentials {
    UserPassword(String, String),
    Token(String),
}

/// The first credentials in `urls` (comma-separated), percent-decoded.
pub fn url_credentials(urls: &str) -> Option<UrlCredentials> {
    urls.split(',').find_map(|one| {
        let u = url::Url::parse(one.trim()).ok()?;
        if u.username().is_empty() {
            return None;
        }
        let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        Some(match u.password() {
            Some(p) => UrlCredentials::UserPassword(decode(u.username()), decode(p)),
            None => UrlCredentials::Token(decode(u.username())),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_read_from_the_first_url_that_has_them() {
        assert_eq!(url_credentials("nats://nats:4222"), None);
        assert_eq!(
            url_credentials("nats://a:4222, nats://kubecast:s%2Fecret@b:4222"),
            Some(UrlCredentials::UserPassword("kubecast".into(), "s/ecret".into()))
        );
        assert_eq!(url_credentials("tls://T0ken@nats:4222"), Some(UrlCredentials::Token("T0ken".into())));
    }
}
