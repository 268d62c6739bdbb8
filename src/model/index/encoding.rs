//! The compact forms of an index entry's strings, each exact (it gives back the very text it
//! was made from) or refused (the caller keeps the text as it is): a uid in the canonical
//! UUID form as its 16 bytes, a resourceVersion in canonical decimal as a `u64`.

use std::fmt;

/// Positions of the dashes of `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
const DASHES: [usize; 4] = [8, 13, 18, 23];
const UUID_LEN: usize = 36;
const HEX: &[u8; 16] = b"0123456789abcdef";

/// The 16 bytes of a uid in the canonical UUID form (lowercase hex, dashed, as the apiserver
/// writes them); `None` for any other uid (upper case, braces, not a UUID at all).
pub fn parse_uuid(uid: &str) -> Option<[u8; 16]> {
    let text = uid.as_bytes();
    if text.len() != UUID_LEN {
        return None;
    }
    let mut out = [0u8; 16];
    let mut nibbles = 0;
    for (i, &c) in text.iter().enumerate() {
        if DASHES.contains(&i) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        let v = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        out[nibbles / 2] |= if nibbles % 2 == 0 { v << 4 } else { v };
        nibbles += 1;
    }
    Some(out)
}

/// The uid text of 16 bytes from [`parse_uuid`].
pub struct Uuid<'a>(pub &'a [u8; 16]);

impl fmt::Display for Uuid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = [0u8; UUID_LEN];
        let mut at = 0;
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                text[at] = b'-';
                at += 1;
            }
            text[at] = HEX[usize::from(b >> 4)];
            text[at + 1] = HEX[usize::from(b & 0xf)];
            at += 2;
        }
        f.write_str(std::str::from_utf8(&text).expect("hex digits and dashes"))
    }
}

/// A uid read from the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UidRef<'a> {
    Uuid(&'a [u8; 16]),
    Text(&'a str),
}

impl fmt::Display for UidRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UidRef::Uuid(b) => Uuid(b).fmt(f),
            UidRef::Text(t) => f.write_str(t),
        }
    }
}

/// A resourceVersion in canonical decimal (digits, no sign, no leading zero, fits a `u64`):
/// what every apiserver we test writes. `None` for any other text, kept as text.
pub fn parse_rv(rv: &str) -> Option<u64> {
    let text = rv.as_bytes();
    if text.is_empty() || text.len() > 20 || (text[0] == b'0' && text.len() > 1) {
        return None;
    }
    text.iter().try_fold(0u64, |n, &c| {
        if !c.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(c - b'0'))
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_canonical_uuid_is_its_16_bytes() {
        let uid = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
        let bytes = parse_uuid(uid).expect("canonical");
        assert_eq!(bytes[0], 0x0f);
        assert_eq!(bytes[15], 0xf0);
        assert_eq!(Uuid(&bytes).to_string(), uid);
    }

    #[test]
    fn other_uids_are_not_uuids() {
        for uid in [
            "",
            "u1",
            "0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0",
            "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
            "{0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f}",
            "0f1e2d3c-4b5a-6978-8796_a5b4c3d2e1f0",
            "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fg",
            "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0 ",
        ] {
            assert_eq!(parse_uuid(uid), None, "{uid:?}");
        }
    }

    #[test]
    fn only_canonical_decimal_resource_versions_are_numbers() {
        assert_eq!(parse_rv("0"), Some(0));
        assert_eq!(parse_rv("123456"), Some(123_456));
        assert_eq!(parse_rv("18446744073709551615"), Some(u64::MAX));
        for rv in ["", "01", "18446744073709551616", "99999999999999999999", "-1", "+1", "1a", " 1", "１"] {
            assert_eq!(parse_rv(rv), None, "{rv:?}");
        }
    }

    proptest! {
        /// Whatever a parser accepts it gives back exactly.
        #[test]
        fn compact_forms_round_trip(
            // Random text, and text shaped like a uid (the parser's accepting branch), in upper
            // or lower case.
            text in prop_oneof![
                "[0-9a-fA-F-]{0,40}",
                "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
                "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
            ],
            bytes in any::<[u8; 16]>(),
            n in any::<u64>(),
        ) {
            if let Some(b) = parse_uuid(&text) {
                prop_assert_eq!(Uuid(&b).to_string(), text.clone());
            }
            // Exactly the canonical form (lowercase, dashes at 8, 13, 18, 23) is taken compact.
            let canonical = text.len() == 36
                && text.bytes().enumerate().all(|(i, c)| {
                    if [8, 13, 18, 23].contains(&i) { c == b'-' } else { c.is_ascii_digit() || (b'a'..=b'f').contains(&c) }
                });
            prop_assert_eq!(parse_uuid(&text).is_some(), canonical, "{}", text);
            if let Some(v) = parse_rv(&text) {
                prop_assert_eq!(v.to_string(), text);
            }
            prop_assert_eq!(parse_uuid(&Uuid(&bytes).to_string()), Some(bytes));
            prop_assert_eq!(parse_rv(&n.to_string()), Some(n));
        }
    }
}
