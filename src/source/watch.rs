//! A watch request and its event stream, decoded the way kubecast needs it.
//!
//! It does what kube's `Api::watch` does (same request, same client and its middleware, same
//! error responses, same handling of a connection that ends mid-stream), with its own framing
//! and decoding: the body is split into lines (one JSON watch event each, as the apiserver
//! writes them), and for the usual `{"type":"ADDED|MODIFIED|DELETED","object":{...}}` line the
//! object's text is cut out of the line after a structural check ([`crate::model::json_check`])
//! instead of being parsed into a `RawValue` by serde_json: 46k instead of 123k instructions
//! per event on ~8 KB Pods (`examples/path_cost`, steps `decode` and `serde`). Any other line (bookmarks, errors,
//! another key order or spacing) goes through serde_json, as before, and is counted in
//! `kubecast_watch_objects_slow_decoded_total` when it carries an object.

use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt as _};
use http_body_util::BodyExt;
use kube::api::{Api, WatchEvent, WatchParams};
use kube::core::Status;
use tracing::debug;

use crate::model::{RawObject, Shard};

/// Starts `GET <resource>?watch=true&resourceVersion=<rv>&...` (with a shard's
/// `shardSelector`) and returns its events.
pub async fn start(
    api: &Api<RawObject>,
    wp: &WatchParams,
    rv: &str,
    shard: Option<&Shard>,
) -> Result<impl Stream<Item = Result<WatchEvent<RawObject>, kube::Error>> + use<>, kube::Error> {
    let mut request = kube::core::Request::new(api.resource_url()).watch(wp, rv).map_err(kube::Error::BuildRequest)?;
    if let Some(s) = shard {
        super::sharding::add_query(&mut request, super::sharding::SHARD_SELECTOR_PARAM, &s.selector())?;
    }
    // As kube does: watch streams opt out of compression (the apiserver gzips each event as
    // its own member, which the client's decompression does not handle).
    request.headers_mut().insert(http::header::ACCEPT_ENCODING, http::HeaderValue::from_static("identity"));
    request.extensions_mut().insert("watch");
    let client = api.clone().into_client();
    let response = client.send(request.map(kube::client::Body::from)).await?;
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        let body = response.into_body().collect().await?.to_bytes();
        return Err(api_error(status, &body));
    }
    Ok(events(response.into_body()))
}

/// An error response as kube reports it: its `Status`, or one made from the text.
fn api_error(status: http::StatusCode, body: &[u8]) -> kube::Error {
    let status = serde_json::from_slice::<Status>(body).unwrap_or_else(|_| {
        Status::failure(String::from_utf8_lossy(body).trim(), "Failed to parse error data").with_code(status.as_u16())
    });
    kube::Error::Api(status.boxed())
}

/// The longest watch line kept while its end has not come: the apiserver refuses objects
/// larger than its 3 MiB request limit (etcd's own is 1.5 MiB), and an object's JSON in a
/// watch event is at most about a third larger (base64 of binary data); 16 MiB leaves ample
/// margin. A line past it is no event of a sane apiserver (a proxy sending something else, a
/// stream that never ends a line): the watch fails rather than buffering without bound.
pub const MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// The events of a watch response body, one per line.
fn events(body: kube::client::Body) -> impl Stream<Item = Result<WatchEvent<RawObject>, kube::Error>> {
    lines(body).map(|line| line.and_then(|l| decode_line(&l)))
}

/// The non-empty lines of a watch response body, undecoded (the benchmarks read a watch
/// through kubecast's client with it).
pub fn lines(body: kube::client::Body) -> impl Stream<Item = Result<Bytes, kube::Error>> {
    let state = Lines { body, split: LineSplitter::default(), ended: false };
    futures::stream::unfold(state, |mut lines| async move { Some((lines.next().await?, lines)) })
}

struct Lines {
    body: kube::client::Body,
    split: LineSplitter,
    ended: bool,
}

impl Lines {
    /// The next non-empty line (without its newline), `None` at the end of the body.
    async fn next(&mut self) -> Option<Result<Bytes, kube::Error>> {
        loop {
            if let Some(line) = self.split.next_line() {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Some(Ok(line));
            }
            let partial = self.split.partial_len();
            if partial > MAX_LINE_BYTES {
                self.split = LineSplitter::default();
                self.ended = true;
                return Some(Err(line_too_long(partial)));
            }
            if self.ended {
                let partial = self.split.partial_len();
                if partial > 0 {
                    // The connection ended inside an event: it was not delivered, and the
                    // watch resumes from the last whole one.
                    debug!(bytes = partial, "watch ended inside an event; dropping the partial line");
                    self.split = LineSplitter::default();
                }
                return None;
            }
            match self.body.frame().await {
                None => self.ended = true,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.split.push(data);
                    }
                }
                Some(Err(e)) => {
                    self.ended = true;
                    if !ends_resumably(&e) {
                        return Some(Err(e));
                    }
                    // Like kube: a connection cut mid-chunk (common after minutes of watching)
                    // ends the stream; the reflector re-watches from its resourceVersion.
                    debug!(error = %crate::observe::kube_error::in_words(&e), "watch connection ended");
                }
            }
        }
    }
}

fn line_too_long(bytes: usize) -> kube::Error {
    kube::Error::ReadEvents(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "a watch event line reached {bytes} bytes without its end, more than the {MAX_LINE_BYTES} kubecast accepts (the apiserver's objects are at most a few MiB): the response is not a Kubernetes watch (check a proxy between kubecast and the apiserver); the watch is dropped"
        ),
    ))
}

/// Splits the body's frames into lines without copying a line that lies within one frame: it
/// is a slice of the frame (which itself shares the HTTP client's read buffer). The apiserver
/// flushes each watch event as it is written, so a large object usually arrives as one frame
/// holding exactly its line; many small events share a frame (the apiserver's 2 KB write
/// buffer), and a line cut by a frame boundary is joined into a buffer of its own. A queued
/// event keeps its frame's buffer alive until it is delivered.
#[derive(Default)]
struct LineSplitter {
    /// What is left of the last frame pushed, after the lines taken from it.
    frame: Bytes,
    /// The start of a line that began in an earlier frame.
    partial: Partial,
}

#[derive(Default)]
enum Partial {
    #[default]
    Empty,
    /// One frame's tail, kept as it is (no copy while the line's end may come next, alone).
    Piece(Bytes),
    /// Pieces of several frames, joined.
    Joined(BytesMut),
}

impl LineSplitter {
    /// Adds the next frame; call only once [`Self::next_line`] returned `None`.
    fn push(&mut self, frame: Bytes) {
        debug_assert!(self.frame.is_empty(), "a frame pushed before the last one was split");
        self.frame = frame;
    }

    /// The next complete line (without its newline), or `None` until more frames come.
    fn next_line(&mut self) -> Option<Bytes> {
        if self.frame.is_empty() {
            return None;
        }
        let Some(at) = memchr::memchr(b'\n', &self.frame) else {
            let piece = std::mem::take(&mut self.frame);
            self.partial = match std::mem::take(&mut self.partial) {
                Partial::Empty => Partial::Piece(piece),
                Partial::Piece(first) => Partial::Joined(joined(&first, &piece)),
                Partial::Joined(mut start) => {
                    start.extend_from_slice(&piece);
                    Partial::Joined(start)
                }
            };
            return None;
        };
        let piece = self.frame.split_to(at);
        self.frame.advance(1);
        Some(match std::mem::take(&mut self.partial) {
            Partial::Empty => piece,
            Partial::Piece(first) if piece.is_empty() => first,
            Partial::Piece(first) => joined(&first, &piece).freeze(),
            Partial::Joined(mut start) => {
                start.extend_from_slice(&piece);
                start.freeze()
            }
        })
    }

    /// Bytes of a line begun and not ended yet (the body ended inside it when it is > 0).
    fn partial_len(&self) -> usize {
        self.frame.len()
            + match &self.partial {
                Partial::Empty => 0,
                Partial::Piece(b) => b.len(),
                Partial::Joined(b) => b.len(),
            }
    }
}

fn joined(first: &[u8], second: &[u8]) -> BytesMut {
    let mut out = BytesMut::with_capacity(first.len() + second.len());
    out.extend_from_slice(first);
    out.extend_from_slice(second);
    out
}

/// An end of stream kube also treats as the end of the watch rather than an error: an
/// unexpected EOF anywhere in the error's chain, or a chunked body cut short.
fn ends_resumably(e: &kube::Error) -> bool {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    for _ in 0..16 {
        let Some(err) = current else { break };
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && matches!(io.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        if err.to_string().contains("unexpected EOF during chunk") {
            return true;
        }
        current = err.source();
    }
    false
}

/// The text between `{"type":"` and the type's closing quote, and what follows it, for the
/// line layout the apiserver writes.
const TYPE_PREFIX: &[u8] = b"{\"type\":\"";
const OBJECT_KEY: &[u8] = b"\",\"object\":";

/// Decodes one watch event line. On the fast path the object's text is a slice of `line`
/// (shared, not copied): it keeps the line's buffer alive until the event is delivered.
pub fn decode_line(line: &Bytes) -> Result<WatchEvent<RawObject>, kube::Error> {
    if let Some(event) = fast_path(line) {
        return Ok(event);
    }
    let event = serde_json::from_slice::<WatchEvent<RawObject>>(line).map_err(|e| {
        // A line that is not an event may be a Status (kube does the same).
        match serde_json::from_slice::<Status>(line) {
            Ok(status) if status.code != 0 => kube::Error::Api(status.boxed()),
            _ => kube::Error::SerdeError(e),
        }
    })?;
    if matches!(event, WatchEvent::Added(_) | WatchEvent::Modified(_) | WatchEvent::Deleted(_)) {
        crate::observe::metrics::get().watch_objects_slow.inc();
    }
    Ok(event)
}

/// `{"type":"ADDED|MODIFIED|DELETED","object":<object>}`: the object's text is cut out of the
/// line (a slice sharing its buffer), after a full check. `None` for anything else (the
/// caller parses it with serde_json).
fn fast_path(line: &Bytes) -> Option<WatchEvent<RawObject>> {
    let rest = line.strip_prefix(TYPE_PREFIX)?;
    let quote = memchr::memchr(b'"', rest)?;
    let ty = &rest[..quote];
    let object = rest[quote..].strip_prefix(OBJECT_KEY)?;
    let end = object.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if object[end] != b'}' {
        return None;
    }
    // The event's closing brace is not part of the object; `from_json` checks that what is
    // left is exactly one object (a line with another key after `object` fails here).
    let start = line.len() - object.len();
    let object = RawObject::from_json(line.slice(start..start + end)).ok()?;
    match ty {
        b"ADDED" => Some(WatchEvent::Added(object)),
        b"MODIFIED" => Some(WatchEvent::Modified(object)),
        b"DELETED" => Some(WatchEvent::Deleted(object)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(ev: &WatchEvent<RawObject>) -> (&'static str, Option<String>, Vec<u8>) {
        let (verb, o) = match ev {
            WatchEvent::Added(o) => ("ADDED", o),
            WatchEvent::Modified(o) => ("MODIFIED", o),
            WatchEvent::Deleted(o) => ("DELETED", o),
            other => panic!("{other:?}"),
        };
        (verb, o.metadata.uid.clone(), o.text().to_vec())
    }

    /// All lines of `frames`, and for each whether it shares a frame's buffer (not copied).
    fn split_all(frames: &[Bytes]) -> (Vec<Vec<u8>>, Vec<bool>, usize) {
        let mut split = LineSplitter::default();
        let (mut lines, mut shared) = (Vec::new(), Vec::new());
        for frame in frames {
            split.push(frame.clone());
            while let Some(line) = split.next_line() {
                let inside = |f: &Bytes| {
                    let range = f.as_ptr() as usize..f.as_ptr() as usize + f.len() + 1;
                    range.contains(&(line.as_ptr() as usize))
                };
                shared.push(!line.is_empty() && frames.iter().any(inside));
                lines.push(line.to_vec());
            }
        }
        (lines, shared, split.partial_len())
    }

    #[test]
    fn a_bare_status_line_is_the_apiserver_s_error() {
        // Some servers and proxies write a 410 as a Status line, not as an ERROR event: the
        // reflector relists on either (`is_gone`).
        let line = Bytes::from_static(
            br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 5 (90)","reason":"Expired","code":410}"#,
        );
        match decode_line(&line) {
            Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_line_within_one_frame_is_not_copied() {
        let frames = [
            Bytes::from_static(b"{\"a\":1}\n{\"b\":2}\n{\"c\""),
            Bytes::from_static(b":3}\n"),
            // A large event as the apiserver flushes it: the line, then its newline alone.
            Bytes::from_static(b"{\"big\":true}"),
            Bytes::from_static(b"\n"),
            Bytes::from_static(b"{\"d\""),
            Bytes::from_static(b":"),
            Bytes::from_static(b"4}\n{\"e\":"),
        ];
        let (lines, shared, partial) = split_all(&frames);
        let text: Vec<&str> = lines.iter().map(|l| std::str::from_utf8(l).unwrap()).collect();
        assert_eq!(text, [r#"{"a":1}"#, r#"{"b":2}"#, r#"{"c":3}"#, r#"{"big":true}"#, r#"{"d":4}"#]);
        assert_eq!(shared, [true, true, false, true, false], "only lines across frames are copied");
        assert_eq!(partial, r#"{"e":"#.len());
    }

    proptest::proptest! {
        #[test]
        fn frames_split_anywhere_give_the_same_lines(
            lines in proptest::collection::vec("[a-z{}\":, ]{0,40}", 0..12),
            cuts in proptest::collection::vec(0usize..600, 0..10),
        ) {
            let body: Vec<u8> = lines.iter().flat_map(|l| l.bytes().chain([b'\n'])).collect();
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c < body.len()).collect();
            cuts.sort_unstable();
            cuts.dedup();
            let mut frames = Vec::new();
            let mut start = 0;
            for c in cuts.into_iter().chain([body.len()]) {
                frames.push(Bytes::copy_from_slice(&body[start..c]));
                start = c;
            }
            let (got, _, partial) = split_all(&frames);
            let want: Vec<Vec<u8>> = lines.iter().map(|l| l.as_bytes().to_vec()).collect();
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(partial, 0);
        }
    }

    /// The lines of a body (one frame), or the first error.
    async fn lines_of(body: Vec<u8>) -> Vec<Result<Bytes, String>> {
        let mut lines = Lines { body: kube::client::Body::from(body), split: LineSplitter::default(), ended: false };
        let mut out = Vec::new();
        while let Some(line) = lines.next().await {
            let failed = line.is_err();
            out.push(line.map_err(|e| e.to_string()));
            if failed {
                break;
            }
        }
        out
    }

    #[tokio::test]
    async fn a_line_without_end_past_the_cap_fails_the_watch() {
        let mut body = b"{\"a\":1}\n".to_vec();
        body.resize(body.len() + MAX_LINE_BYTES + 1, b'x');
        let got = lines_of(body).await;
        assert_eq!(got.len(), 2, "the whole line, then the error");
        assert_eq!(got[0].as_deref().unwrap(), b"{\"a\":1}");
        let err = got[1].as_ref().unwrap_err();
        assert!(err.contains("without its end") && err.contains(&MAX_LINE_BYTES.to_string()), "{err}");
        // A line as long, ended, is a line (the decoding judges it).
        let mut body = vec![b'y'; MAX_LINE_BYTES];
        body.push(b'\n');
        let got = lines_of(body).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].as_ref().unwrap().len(), MAX_LINE_BYTES);
    }

    #[test]
    fn the_fast_path_agrees_with_serde_json() {
        let object = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"a","namespace":"n","uid":"u","resourceVersion":"7"},"spec":{"s":"}\"{"}}"#;
        for ty in ["ADDED", "MODIFIED", "DELETED"] {
            let line = format!(r#"{{"type":"{ty}","object":{object}}}"#);
            let bytes = Bytes::from(line.clone());
            let fast = fast_path(&bytes).expect("fast path");
            let text = identity(&fast).2;
            let at = bytes.len() - 1 - object.len();
            match &fast {
                WatchEvent::Added(o) | WatchEvent::Modified(o) | WatchEvent::Deleted(o) => {
                    assert_eq!(o.text().as_ptr(), bytes[at..].as_ptr(), "the object shares the line's buffer")
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(text, object.as_bytes());
            let slow: WatchEvent<RawObject> = serde_json::from_str(&line).unwrap();
            assert_eq!(identity(&fast), identity(&slow));
            assert_eq!(identity(&fast).2, object.as_bytes());
            // Trailing whitespace / CR.
            assert_eq!(identity(&fast_path(&Bytes::from(format!("{line} \r"))).unwrap()), identity(&slow));
        }
    }

    #[test]
    fn other_lines_go_through_serde_json() {
        let object = r#"{"metadata":{"name":"a","uid":"u","resourceVersion":"7"}}"#;
        let spaced = format!(r#"{{ "type": "ADDED", "object": {object} }}"#);
        let tabbed = format!("{{\"type\":\t\"ADDED\",\"object\":{object}}}");
        for line in [&spaced, &tabbed] {
            assert!(fast_path(&Bytes::from(line.clone())).is_none(), "{line}");
            assert_eq!(identity(&decode_line(&Bytes::from(line.clone())).unwrap()).1.as_deref(), Some("u"));
        }
        let bookmark = r#"{"type":"BOOKMARK","object":{"kind":"Pod","apiVersion":"v1","metadata":{"resourceVersion":"12","annotations":{"k8s.io/initial-events-end":"true"}}}}"#;
        assert!(fast_path(&Bytes::from(bookmark)).is_none());
        match decode_line(&Bytes::from(bookmark)).unwrap() {
            WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, "12"),
            other => panic!("{other:?}"),
        }
        let gone = r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 1 (5)","reason":"Expired","code":410}}"#;
        match decode_line(&Bytes::from(gone)).unwrap() {
            WatchEvent::Error(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn broken_lines_are_errors_not_events() {
        let good = r#"{"type":"ADDED","object":{"metadata":{"name":"a","uid":"u","resourceVersion":"7"}}}"#;
        // Cut at every position: never an event with a partial object.
        for cut in 1..good.len() {
            assert!(decode_line(&Bytes::copy_from_slice(&good.as_bytes()[..cut])).is_err(), "{}", &good[..cut]);
        }
        // A key after the object, garbage inside it, invalid UTF-8 inside it.
        let extra = r#"{"type":"ADDED","object":{"metadata":{"uid":"u"}},"x":1}"#;
        assert!(fast_path(&Bytes::from(extra)).is_none());
        let line = |text: &'static [u8]| Bytes::from_static(text);
        assert!(decode_line(&line(br#"{"type":"ADDED","object":{"metadata":{"uid":"u"},"spec":[1,]}}"#)).is_err());
        assert!(decode_line(&line(b"{\"type\":\"ADDED\",\"object\":{\"metadata\":{\"uid\":\"\xff\"}}}")).is_err());
        // Valid JSON that is no event (kube would read it as an empty Status).
        assert!(matches!(decode_line(&line(br#"{"a":1}"#)), Err(kube::Error::SerdeError(_))));
        // A Status line (as some proxies send) becomes an API error.
        let status = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"nope","reason":"Forbidden","code":403}"#;
        match decode_line(&Bytes::from(status)) {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 403),
            other => panic!("{other:?}"),
        }
    }
}
