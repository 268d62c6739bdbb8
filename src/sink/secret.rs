//! Secret references in sink settings: `${env:NAME}` reads the variable NAME, `${file:/path}`
//! reads the file (a trailing newline dropped). Values are never logged; errors name the
//! variable or file, never a value.

/// `${env:NAME}` / `${file:/path}` -> the value; anything else as it is.
pub fn resolve(v: &str) -> Result<String, String> {
    if let Some(name) = v.strip_prefix("${env:").and_then(|r| r.strip_suffix('}')) {
        return std::env::var(name).map_err(|_| format!("environment variable {name} is not set"));
    }
    if let Some(path) = v.strip_prefix("${file:").and_then(|r| r.strip_suffix('}')) {
        return std::fs::read_to_string(path)
            .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
            .map_err(|e| format!("file {path} cannot be read: {e}"));
    }
    Ok(v.to_string())
}

/// `url` (one or more, comma-separated) as it may be shown: a password or a token in a URL's
/// user part replaced by `***` (`nats://user:***@host`, `nats://***@host`). Everything before
/// the entry's last `@` counts as the user part, a `/` in it too: an unencoded base64 secret
/// often holds one, and such a URL is shown in the error that refuses it.
pub fn url_for_display(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let (scheme, rest) = one.split_once("://").map_or(("", one), |(s, r)| (s, r));
            let Some(at) = rest.rfind('@') else { return one.to_string() };
            let user = match rest[..at].split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                // A user part without a password is a token.
                None => "***".to_string(),
            };
            let sep = if scheme.is_empty() { "" } else { "://" };
            format!("{scheme}{sep}{user}@{}", &rest[at + 1..])
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #[test]
    fn urls_are_shown_without_their_secrets() {
        use super::url_for_display as shown;
        assert_eq!(shown("nats://nats:4222"), "nats://nats:4222");
        assert_eq!(shown("nats://kubecast:S3cr3t@nats:4222"), "nats://kubecast:***@nats:4222");
        assert_eq!(shown("nats://T0ken@nats:4222"), "nats://***@nats:4222");
        assert_eq!(shown("tls://a:p@x:1, nats://y:2"), "tls://a:***@x:1, nats://y:2");
        assert_eq!(shown("u:p@host:4222"), "u:***@host:4222");
        assert_eq!(shown("nats://a:p@@b@host"), "nats://a:***@host");
        // A `/` in the secret (unencoded base64) does not end the user part.
        assert_eq!(shown("nats://kubecast:Ab3/xY9+q==@nats:4222"), "nats://kubecast:***@nats:4222");
        assert_eq!(shown("nats://T0k/en==@nats:4222"), "nats://***@nats:4222");
        assert_eq!(shown("nats://host/path"), "nats://host/path");
    }

    #[test]
    fn references() {
        assert_eq!(super::resolve("plain").unwrap(), "plain");
        assert!(super::resolve("${env:KUBECAST_SURELY_NOT_SET_X}").unwrap_err().contains("KUBECAST_SURELY_NOT_SET_X"));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        std::fs::write(&p, "hunter2\n").unwrap();
        assert_eq!(super::resolve(&format!("${{file:{}}}", p.display())).unwrap(), "hunter2");
    }
}
