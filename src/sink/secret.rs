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

#[cfg(test)]
mod tests {
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
