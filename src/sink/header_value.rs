//! `ce-*` header values of the binary mode of the NATS and HTTP bindings: space, `"`, `%` and
//! everything outside printable ASCII are percent-encoded (both bindings say so).

use std::borrow::Cow;

use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// `v` as a binary-mode header value.
pub fn header_value(v: &str) -> String {
    // Most values (ids, times, names, versions) need no escape: copied as they are.
    if v.bytes().all(|b| matches!(b, 0x21..=0x7e) && b != b'"' && b != b'%') {
        return v.to_owned();
    }
    Cow::from(utf8_percent_encode(v, HEADER_VALUE)).into_owned()
}

#[cfg(test)]
mod tests {
    use super::header_value;

    #[test]
    fn binary_header_values_are_percent_encoded() {
        assert_eq!(header_value("ns/name"), "ns/name");
        assert_eq!(header_value("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(header_value("grüße\n"), "gr%C3%BC%C3%9Fe%0A");
        // The edges of what is copied as it is.
        assert_eq!(header_value("!~2026-11-22T03:04:05.123Z"), "!~2026-11-22T03:04:05.123Z");
        assert_eq!(header_value("\x7f"), "%7F");
        assert_eq!(header_value("a%"), "a%25");
        assert_eq!(header_value(""), "");
    }
}
