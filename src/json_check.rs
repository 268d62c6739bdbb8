//! A validating scan of JSON text that builds nothing: it checks that a byte range is exactly
//! one JSON value (RFC 8259 grammar: strings with their escapes and no raw control characters,
//! numbers, literals, nesting) and says where it ends. UTF-8 is checked separately
//! (`simdutf8`), once for the whole text.
//!
//! Why not serde_json: kubecast passes each object's text through untouched, so the only thing
//! it needs from the object's body is the proof that it is well-formed. serde_json proves that
//! while capturing a `RawValue` at ~12 instructions per byte; this scan needs ~3 (strings, most
//! of a Kubernetes object's bytes, go eight bytes at a time). It accepts exactly what serde_json
//! accepts (`tests` compare the two on generated and mutated documents), except that it has no
//! nesting limit (serde_json's is 128 when it builds values; none applies to what it skips).

/// Where and why the text is not one JSON value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntaxError {
    /// Byte offset of the first byte that does not fit (the text's length: it ended too early).
    pub offset: usize,
    pub expected: &'static str,
}

impl std::fmt::Display for SyntaxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invalid JSON at byte {}: expected {}", self.offset, self.expected)
    }
}

impl std::error::Error for SyntaxError {}

/// Checks that `text` is one JSON value with only whitespace around it.
pub fn check(text: &[u8]) -> Result<(), SyntaxError> {
    let end = value_end(text, 0)?;
    let end = skip_ws(text, end);
    if end == text.len() { Ok(()) } else { Err(SyntaxError { offset: end, expected: "the end of the text" }) }
}

/// The offset just past the JSON value that starts at `start` (after optional whitespace).
pub fn value_end(text: &[u8], start: usize) -> Result<usize, SyntaxError> {
    let err = |offset: usize, expected: &'static str| SyntaxError { offset: offset.min(text.len()), expected };
    // Open containers, innermost last: true for an object, false for an array.
    let mut open: Vec<bool> = Vec::new();
    let mut i = start;
    'value: loop {
        i = skip_ws(text, i);
        match text.get(i) {
            Some(b'{') => {
                i = skip_ws(text, i + 1);
                if text.get(i) == Some(&b'}') {
                    i += 1;
                } else {
                    open.push(true);
                    i = key(text, i)?;
                    continue 'value;
                }
            }
            Some(b'[') => {
                i = skip_ws(text, i + 1);
                if text.get(i) == Some(&b']') {
                    i += 1;
                } else {
                    open.push(false);
                    continue 'value;
                }
            }
            Some(b'"') => i = string_end(text, i + 1)?,
            Some(b'-' | b'0'..=b'9') => i = number_end(text, i)?,
            Some(b't') => i = literal(text, i, b"true")?,
            Some(b'f') => i = literal(text, i, b"false")?,
            Some(b'n') => i = literal(text, i, b"null")?,
            _ => return Err(err(i, "a value")),
        }
        // After a value: close containers or go on to the next element.
        loop {
            let Some(&object) = open.last() else { return Ok(i) };
            i = skip_ws(text, i);
            match (object, text.get(i)) {
                (_, Some(b',')) => {
                    i += 1;
                    if object {
                        i = key(text, skip_ws(text, i))?;
                    }
                    continue 'value;
                }
                (true, Some(b'}')) | (false, Some(b']')) => {
                    open.pop();
                    i += 1;
                }
                (true, _) => return Err(err(i, "',' or '}'")),
                (false, _) => return Err(err(i, "',' or ']'")),
            }
        }
    }
}

/// A key and its colon, at `i`; returns where the value may start.
#[inline(always)]
fn key(text: &[u8], i: usize) -> Result<usize, SyntaxError> {
    if text.get(i) != Some(&b'"') {
        return Err(SyntaxError { offset: i.min(text.len()), expected: "a string key" });
    }
    let i = skip_ws(text, string_end(text, i + 1)?);
    if text.get(i) != Some(&b':') {
        return Err(SyntaxError { offset: i.min(text.len()), expected: "':'" });
    }
    Ok(i + 1)
}

#[inline(always)]
fn skip_ws(text: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\n' | b'\r' | b'\t') = text.get(i) {
        i += 1;
    }
    i
}

const ONES: u64 = u64::from_le_bytes([0x01; 8]);
const LOWS: u64 = u64::from_le_bytes([0x7f; 8]);

/// The high bit of each byte of `x` that is zero, and only of those (no carries between bytes:
/// each byte's low seven bits plus 0x7f stay within the byte).
#[inline(always)]
fn zero_bytes(x: u64) -> u64 {
    !(((x & LOWS).wrapping_add(LOWS)) | x | LOWS)
}

/// The high bit of each byte of `x` that is `"`, `\` or a control character (below 0x20).
#[inline(always)]
fn special_bytes(x: u64) -> u64 {
    // Below 0x20: the low seven bits plus 0x60 do not reach 0x80, and the high bit is clear.
    let control = !(((x & LOWS).wrapping_add(ONES * 0x60)) | x | LOWS);
    control | zero_bytes(x ^ (ONES * b'"' as u64)) | zero_bytes(x ^ (ONES * b'\\' as u64))
}

/// The offset past the closing quote of the string whose body starts at `i`.
#[inline(always)]
fn string_end(text: &[u8], mut i: usize) -> Result<usize, SyntaxError> {
    loop {
        // Eight bytes at a time, straight to the first one that needs a look.
        while let Some(chunk) = text.get(i..i + 8) {
            let special = special_bytes(u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
            if special != 0 {
                i += special.trailing_zeros() as usize / 8;
                break;
            }
            i += 8;
        }
        match text.get(i) {
            Some(b'"') => return Ok(i + 1),
            Some(b'\\') => {
                i = match text.get(i + 1) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i + 2,
                    Some(b'u') if text.get(i + 2..i + 6).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) => i + 6,
                    _ => return Err(SyntaxError { offset: (i + 1).min(text.len()), expected: "a valid escape" }),
                };
            }
            Some(0..=0x1f) => return Err(SyntaxError { offset: i, expected: "no control character in a string" }),
            Some(_) => i += 1,
            None => return Err(SyntaxError { offset: text.len(), expected: "'\"' closing the string" }),
        }
    }
}

#[inline(always)]
fn digits_end(text: &[u8], mut i: usize) -> usize {
    while text.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    i
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?` at `i`.
#[inline(always)]
fn number_end(text: &[u8], mut i: usize) -> Result<usize, SyntaxError> {
    let err = |i: usize| SyntaxError { offset: i.min(text.len()), expected: "a digit" };
    if text.get(i) == Some(&b'-') {
        i += 1;
    }
    match text.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => i = digits_end(text, i + 1),
        _ => return Err(err(i)),
    }
    if text.get(i) == Some(&b'.') {
        let end = digits_end(text, i + 1);
        if end == i + 1 {
            return Err(err(end));
        }
        i = end;
    }
    if let Some(b'e' | b'E') = text.get(i) {
        i += 1;
        if let Some(b'+' | b'-') = text.get(i) {
            i += 1;
        }
        let end = digits_end(text, i);
        if end == i {
            return Err(err(end));
        }
        i = end;
    }
    Ok(i)
}

#[inline(always)]
fn literal(text: &[u8], i: usize, word: &'static [u8]) -> Result<usize, SyntaxError> {
    if text.get(i..i + word.len()) == Some(word) {
        Ok(i + word.len())
    } else {
        Err(SyntaxError { offset: i, expected: "true, false or null" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn serde_ok(text: &[u8]) -> bool {
        serde_json::from_slice::<serde::de::IgnoredAny>(text).is_ok()
    }

    #[test]
    fn accepts_and_rejects_like_serde_json() {
        let cases: &[&str] = &[
            "{}",
            " { } ",
            "[]",
            "[1,2]",
            r#"{"a":1}"#,
            r#"{"a":{"b":[true,false,null,"x",-0.5e+10,0,10,1E5]}}"#,
            r#""\u00e9\n\t\"\\\/\b\f\r""#,
            "\"\u{e9}\u{1F600}\"",
            "-0",
            "0.0",
            // Wrong:
            "",
            " ",
            "{",
            "}",
            "[1,]",
            "[,1]",
            r#"{"a":1,}"#,
            r#"{"a"}"#,
            r#"{"a":}"#,
            r#"{a:1}"#,
            r#"{"a" 1}"#,
            r#"{"a":1 "b":2}"#,
            "[1 2]",
            "01",
            "-",
            "1.",
            ".5",
            "1e",
            "1e+",
            "+1",
            "tru",
            "nul",
            "truee",
            "[true false]",
            "\"abc",
            "\"a\\x\"",
            "\"a\\u12\"",
            "\"a\\u12G4\"",
            "\"\u{1}\"",
            "\"tab\there\"",
            "{}}",
            "[]]",
            "[}",
            "{]",
            "{} {}",
            "NaN",
            "Infinity",
        ];
        for case in cases {
            assert_eq!(check(case.as_bytes()).is_ok(), serde_ok(case.as_bytes()), "{case:?}");
        }
    }

    #[test]
    fn value_end_stops_after_the_value() {
        let text = br#"{"type":"ADDED","object":{"a":"}"},"x":1}"#;
        let start = text.windows(9).position(|w| w == b"\"object\":").unwrap() + 9;
        assert_eq!(&text[start..value_end(text, start).unwrap()], br#"{"a":"}"}"#);
        assert_eq!(value_end(b"  7 ", 0), Ok(3));
        let e = value_end(br#"{"a":[1,2}"#, 0).unwrap_err();
        assert_eq!(e.offset, 9);
        assert_eq!(e.expected, "',' or ']'");
    }

    #[test]
    fn special_bytes_are_found_exactly() {
        // Every byte value at every position, among neighbours that could carry into it.
        for fill in [b'a', 0x00, 0x1f, 0x20, 0x7f, 0x80, 0xff, b'"', b'\\'] {
            for pos in 0..8 {
                for b in 0..=255u8 {
                    let mut chunk = [fill; 8];
                    chunk[pos] = b;
                    let got = special_bytes(u64::from_le_bytes(chunk));
                    let want = chunk.iter().enumerate().fold(0u64, |m, (k, &c)| {
                        if c < 0x20 || c == b'"' || c == b'\\' { m | 0x80 << (8 * k) } else { m }
                    });
                    assert_eq!(got, want, "{chunk:?}");
                }
            }
        }
    }

    /// Arbitrary JSON documents, written compactly or pretty.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
            "\\PC{0,20}|[\"\\\\\u{0}-\u{1f}a-z]{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z\"\\\\]{0,6}", inner, 0..8)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn valid_documents_are_accepted(v in json(), pretty in any::<bool>()) {
            let text = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) }.unwrap();
            prop_assert_eq!(check(&text), Ok(()));
        }

        #[test]
        fn mutated_documents_agree_with_serde_json(
            v in json(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), 0u8..4, prop::sample::select(
                b"{}[]\",:\\ 0123456789.eE+-tfnulrsa\x01\t".to_vec())), 1..4),
        ) {
            let mut text = serde_json::to_vec(&v).unwrap();
            for (at, op, byte) in edits {
                if text.is_empty() { break; }
                let at = at.index(text.len());
                match op {
                    0 => text[at] = byte,
                    1 => text.insert(at, byte),
                    2 => { text.remove(at); }
                    _ => text.truncate(at),
                }
            }
            prop_assert_eq!(check(&text).is_ok(), serde_ok(&text), "{:?}", String::from_utf8_lossy(&text));
        }
    }
}
