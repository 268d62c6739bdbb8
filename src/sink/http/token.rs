//! A bearer token read from a file and read again when the file changes: a projected
//! ServiceAccount token is replaced by the kubelet (a new file behind a symbolic link) before
//! it expires. The file's identity is looked at no more than once a second.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use http::HeaderValue;

/// How often the file is looked at.
const LOOK_EVERY: Duration = Duration::from_secs(1);

pub struct TokenFile {
    path: PathBuf,
    state: Mutex<State>,
}

struct State {
    header: HeaderValue,
    /// What the file was when read: (modified, length, inode).
    stamp: (Option<SystemTime>, u64, u64),
    looked: Instant,
}

fn stamp(path: &std::path::Path) -> std::io::Result<(Option<SystemTime>, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((m.modified().ok(), m.len(), m.ino()))
}

fn read(path: &std::path::Path) -> Result<HeaderValue, String> {
    let token =
        std::fs::read_to_string(path).map_err(|e| format!("sink.http.bearer_token_file {}: {e}", path.display()))?;
    let mut v = HeaderValue::from_str(&format!("Bearer {}", token.trim())).map_err(|_| {
        format!("sink.http.bearer_token_file {}: not a token (a line of visible characters)", path.display())
    })?;
    v.set_sensitive(true);
    Ok(v)
}

impl TokenFile {
    pub fn open(path: PathBuf) -> Result<Self, String> {
        let stamp = stamp(&path).map_err(|e| format!("sink.http.bearer_token_file {}: {e}", path.display()))?;
        let header = read(&path)?;
        Ok(Self { path, state: Mutex::new(State { header, stamp, looked: Instant::now() }) })
    }

    /// The `Authorization` header: the file's token, read again if the file changed. A file
    /// that cannot be read keeps the last token (a swap in progress), with a warning.
    pub fn header(&self) -> HeaderValue {
        let mut s = self.state.lock().expect("token state");
        if s.looked.elapsed() >= LOOK_EVERY {
            s.looked = Instant::now();
            match stamp(&self.path) {
                Ok(now) if now != s.stamp => match read(&self.path) {
                    Ok(h) => {
                        tracing::info!(path = %self.path.display(), "the bearer token file changed; using the new token");
                        s.header = h;
                        s.stamp = now;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the bearer token file changed but cannot be read; keeping the last token")
                    }
                },
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "the bearer token file cannot be looked at; keeping the last token")
                }
            }
        }
        s.header.clone()
    }

    #[cfg(test)]
    fn look_now(&self) {
        self.state.lock().unwrap().looked = Instant::now() - LOOK_EVERY;
    }
}

#[cfg(test)]
mod tests {
    use super::TokenFile;

    #[test]
    fn a_replaced_token_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "first\n").unwrap();
        let t = TokenFile::open(path.clone()).unwrap();
        assert_eq!(t.header(), "Bearer first");
        assert!(t.header().is_sensitive(), "never logged");
        // Replaced as the kubelet does: a new file moved over the old one.
        let new = dir.path().join("token.new");
        std::fs::write(&new, "second-token").unwrap();
        std::fs::rename(&new, &path).unwrap();
        t.look_now();
        assert_eq!(t.header(), "Bearer second-token");
        std::fs::remove_file(&path).unwrap();
        t.look_now();
        assert_eq!(t.header(), "Bearer second-token", "a file that disappears keeps the last token");
        assert!(TokenFile::open(dir.path().join("none")).err().unwrap().contains("bearer_token_file"));
    }
}
