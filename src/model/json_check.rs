//! A fast structural check of JSON text that builds nothing: the text is one object or array
//! whose brackets balance and match, whose strings all end, hold no raw control characters
//! and only valid escapes, with nothing but whitespace around it. UTF-8 is checked separately
//! (`simdutf8`).
//!
//! What it does not check: the grammar between the brackets (commas, colons, that keys are
//! strings, the spelling of numbers and literals). kubecast passes each object's text through
//! as the apiserver wrote it (Go's JSON encoder, which writes only valid JSON); what it must
//! prove is that the text it cut out of a watch line is one whole object: not truncated, not
//! running into the envelope around it. A full grammar check costs 64k–92k instructions per
//! 8 KB Pod (serde_json, a byte-at-a-time scan or a token walk: Kubernetes objects are mostly
//! short strings and punctuation, ~1700 tokens per Pod), more than all the rest of kubecast's
//! work per event; this check costs ~17k (AVX2), ~1.5 µs.
//!
//! How: like simdjson's first stage, it classifies 64 bytes at a time into bit masks (quotes,
//! backslashes, brackets, control characters; SSE2, part of every x86_64 CPU, with a portable
//! fallback elsewhere), derives with a few word operations which bytes are escaped and which
//! are inside strings, and then walks only the brackets. Control characters, backslashes and
//! escapes, rare in what the apiserver writes, cost one test per block unless present.

/// Where and why the text is not one whole JSON object or array.
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

/// Bit masks of one 64-byte block (bit `k`: byte `k`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Classes {
    quote: u64,
    backslash: u64,
    /// The control characters (below 0x20).
    control: u64,
    /// `{ } [ ]`
    bracket: u64,
}

/// [`classify_sse2`] 32 bytes at a time. Not inlined: inlined into the check's loop, LLVM
/// turns the bracket mask into 64 separate bits and back (hundreds of instructions a block).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
fn classify_avx2(block: &[u8; 64]) -> Classes {
    use std::arch::x86_64::*;
    let mut c = Classes::default();
    let (space, below_space) = (_mm256_set1_epi8(0x20), _mm256_set1_epi8(0x1f));
    let (quote, backslash) = (_mm256_set1_epi8(b'"' as i8), _mm256_set1_epi8(b'\\' as i8));
    let (open, close) = (_mm256_set1_epi8(b'{' as i8), _mm256_set1_epi8(b'}' as i8));
    for k in 0..2 {
        // SAFETY: bytes 32k..32k+32 are inside the 64-byte block; unaligned loads are allowed.
        let x = unsafe { _mm256_loadu_si256(block.as_ptr().add(32 * k).cast()) };
        let shift = 32 * k;
        let folded = _mm256_or_si256(x, space);
        let bracket = _mm256_or_si256(_mm256_cmpeq_epi8(folded, open), _mm256_cmpeq_epi8(folded, close));
        let control = _mm256_cmpeq_epi8(_mm256_max_epu8(x, below_space), below_space);
        c.quote |= (_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, quote)) as u32 as u64) << shift;
        c.backslash |= (_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, backslash)) as u32 as u64) << shift;
        c.control |= (_mm256_movemask_epi8(control) as u32 as u64) << shift;
        c.bracket |= (_mm256_movemask_epi8(bracket) as u32 as u64) << shift;
    }
    c
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse2")]
fn classify_sse2(block: &[u8; 64]) -> Classes {
    use std::arch::x86_64::*;
    let mut c = Classes::default();
    let (space, below_space) = (_mm_set1_epi8(0x20), _mm_set1_epi8(0x1f));
    let (quote, backslash) = (_mm_set1_epi8(b'"' as i8), _mm_set1_epi8(b'\\' as i8));
    let (open, close) = (_mm_set1_epi8(b'{' as i8), _mm_set1_epi8(b'}' as i8));
    for k in 0..4 {
        // SAFETY: bytes 16k..16k+16 are inside the 64-byte block; unaligned loads are allowed.
        let x = unsafe { _mm_loadu_si128(block.as_ptr().add(16 * k).cast()) };
        let shift = 16 * k;
        // `[` and `]` differ from `{` and `}` only in bit 0x20.
        let folded = _mm_or_si128(x, space);
        let bracket = _mm_or_si128(_mm_cmpeq_epi8(folded, open), _mm_cmpeq_epi8(folded, close));
        let control = _mm_cmpeq_epi8(_mm_max_epu8(x, below_space), below_space);
        c.quote |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, quote)) as u16 as u64) << shift;
        c.backslash |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, backslash)) as u16 as u64) << shift;
        c.control |= (_mm_movemask_epi8(control) as u16 as u64) << shift;
        c.bracket |= (_mm_movemask_epi8(bracket) as u16 as u64) << shift;
    }
    c
}

/// The classification a byte at a time (the tests check that all implementations agree).
#[cfg(any(test, not(target_arch = "x86_64")))]
fn classify_portable(block: &[u8; 64]) -> Classes {
    let mut c = Classes::default();
    for (k, &b) in block.iter().enumerate() {
        let bit = 1u64 << k;
        match b {
            b'"' => c.quote |= bit,
            b'\\' => c.backslash |= bit,
            b'{' | b'}' | b'[' | b']' => c.bracket |= bit,
            0..0x20 => c.control |= bit,
            _ => {}
        }
    }
    c
}

/// The characters escaped by a backslash (the byte after an odd run of backslashes), given the
/// block's backslashes and whether its first byte is escaped (`carry`, updated for the next
/// block). Adding the starts of the runs that begin on odd positions to the backslashes
/// carries through each such run and lands just past its end: together with the even mask
/// that tells which runs have odd length (simdjson's method).
fn escaped(backslash: u64, carry: &mut u64) -> u64 {
    const EVEN: u64 = 0x5555_5555_5555_5555;
    let backslash = backslash & !*carry;
    let follows = (backslash << 1) | *carry;
    let odd_starts = backslash & !EVEN & !follows;
    let (even_carried, overflow) = odd_starts.overflowing_add(backslash);
    *carry = overflow as u64;
    (EVEN ^ (even_carried << 1)) & follows
}

/// Bit `k` set when an odd number of bits `0..=k` of `x` are set: with `x` the unescaped
/// quotes, the bytes inside strings (opening quote included, closing quote not).
fn prefix_xor(mut x: u64) -> u64 {
    for shift in [1, 2, 4, 8, 16, 32] {
        x ^= x << shift;
    }
    x
}

/// Checks that `text` is one whole JSON object or array (see the module's documentation for
/// what that covers).
pub fn check_structure(text: &[u8]) -> Result<(), SyntaxError> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("pclmulqdq") {
            // SAFETY: the CPU has AVX2 and PCLMULQDQ (checked just above; std caches the answer).
            unsafe { check_avx2(text) }
        } else {
            check_with(
                text,
                |block| {
                    // SAFETY: SSE2 is part of the x86_64 baseline: every x86_64 CPU has it.
                    unsafe { classify_sse2(block) }
                },
                prefix_xor,
            )
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    check_with(text, classify_portable, prefix_xor)
}

/// The whole check compiled for AVX2, with the carry-less multiplication for the prefix XOR.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,pclmulqdq")]
fn check_avx2(text: &[u8]) -> Result<(), SyntaxError> {
    check_with(text, |block| classify_avx2(block), |x| prefix_xor_clmul(x))
}

/// [`prefix_xor`] in one instruction: a carry-less multiplication by all ones.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "pclmulqdq")]
fn prefix_xor_clmul(x: u64) -> u64 {
    use std::arch::x86_64::*;
    let product = _mm_clmulepi64_si128(_mm_set_epi64x(0, x as i64), _mm_set1_epi8(-1), 0);
    _mm_cvtsi128_si64(product) as u64
}

/// Containers nested deeper than this are refused (kubecast then parses the text with
/// serde_json instead): the bracket stack is a fixed 256 bytes.
const MAX_DEPTH: usize = 256;

#[inline(always)]
fn check_with(
    text: &[u8],
    classify: impl Fn(&[u8; 64]) -> Classes,
    prefix_xor: impl Fn(u64) -> u64,
) -> Result<(), SyntaxError> {
    let err = |offset: usize, expected: &'static str| SyntaxError { offset: offset.min(text.len()), expected };
    let first = text.iter().position(|b| !b.is_ascii_whitespace()).ok_or(err(text.len(), "'{' or '['"))?;
    if !matches!(text[first], b'{' | b'[') {
        return Err(err(first, "'{' or '['"));
    }
    // The opening bracket of each open container.
    let mut stack = [0u8; MAX_DEPTH];
    let mut depth = 0usize;
    // Where the outer value closed.
    let mut closed_at: Option<usize> = None;
    let (mut escape_carry, mut string_carry) = (0u64, 0u64);
    // The last, partial block, padded with spaces (whitespace: changes nothing).
    let mut padded = [b' '; 64];
    let mut base = 0;
    while base < text.len() {
        let block: &[u8; 64] = match text[base..].first_chunk() {
            Some(full) => full,
            None => {
                padded[..text.len() - base].copy_from_slice(&text[base..]);
                &padded
            }
        };
        let classes = classify(block);
        // Most blocks have no backslash (and none escaped from the block before).
        let escaped =
            if classes.backslash | escape_carry == 0 { 0 } else { escaped(classes.backslash, &mut escape_carry) };
        let quotes = classes.quote & !escaped;
        let in_string = prefix_xor(quotes) ^ string_carry;
        string_carry = ((in_string as i64) >> 63) as u64;
        // Control characters, backslashes outside strings and escapes are rare in what the
        // apiserver writes: one test for all of them, the details out of line.
        if classes.control | (classes.backslash & !in_string) | escaped != 0 {
            rare_bytes(text, base, &classes, in_string, escaped)?;
        }
        let mut brackets = classes.bracket & !in_string;
        if brackets != 0 {
            if closed_at.is_some() {
                return Err(err(base + brackets.trailing_zeros() as usize, "the end of the text"));
            }
            while brackets != 0 {
                let at = brackets.trailing_zeros() as usize;
                brackets &= brackets - 1;
                // `{` 0x7b, `}` 0x7d, `[` 0x5b, `]` 0x5d: bit 0x02 tells opening; a closing
                // bracket is its opening one plus 2.
                let byte = block[at % 64];
                if byte & 0x02 != 0 {
                    if depth == MAX_DEPTH {
                        return Err(err(base + at, "nesting at most 256 deep"));
                    }
                    stack[depth] = byte;
                    depth += 1;
                } else {
                    let Some(d) = depth.checked_sub(1) else { return Err(err(base + at, "'{' or '['")) };
                    let open = stack[d % MAX_DEPTH];
                    if open.wrapping_add(2) != byte {
                        return Err(err(base + at, if open == b'{' { "'}'" } else { "']'" }));
                    }
                    depth = d;
                    if depth == 0 {
                        closed_at = Some(base + at);
                        if brackets != 0 {
                            return Err(err(base + brackets.trailing_zeros() as usize, "the end of the text"));
                        }
                    }
                }
            }
        }
        base += 64;
    }
    if string_carry != 0 {
        return Err(err(text.len(), "'\"' closing the string"));
    }
    let Some(end) = closed_at else { return Err(err(text.len(), "the close of the outer object or array")) };
    match text[end + 1..].iter().position(|b| !b.is_ascii_whitespace()) {
        Some(at) => Err(err(end + 1 + at, "the end of the text")),
        None => Ok(()),
    }
}

/// The checks of control characters, backslashes and escapes of the block at `base`, in this
/// order: no control character inside a string, no backslash outside one, outside strings
/// only tab, newline and carriage return of the control characters, every escape a known
/// character or `u` and four hex digits.
#[cold]
#[inline(never)]
fn rare_bytes(text: &[u8], base: usize, classes: &Classes, in_string: u64, escaped: u64) -> Result<(), SyntaxError> {
    let err = |offset: usize, expected: &'static str| SyntaxError { offset: offset.min(text.len()), expected };
    let first_bit = |mask: u64| base + mask.trailing_zeros() as usize;
    let control = classes.control;
    if control & in_string != 0 {
        return Err(err(first_bit(control & in_string), "no control character in a string"));
    }
    if classes.backslash & !in_string != 0 {
        return Err(err(first_bit(classes.backslash & !in_string), "no backslash outside a string"));
    }
    let mut outside = control & !in_string;
    while outside != 0 {
        let at = first_bit(outside);
        if !matches!(text.get(at), Some(b'\t' | b'\n' | b'\r') | None) {
            return Err(err(at, "no control character but whitespace"));
        }
        outside &= outside - 1;
    }
    let mut escapes = escaped;
    while escapes != 0 {
        let at = first_bit(escapes);
        let ok = match text.get(at) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => true,
            Some(b'u') => text.get(at + 1..at + 5).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)),
            _ => false,
        };
        if !ok {
            return Err(err(at, "a valid escape"));
        }
        escapes &= escapes - 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// [`check_structure`], after checking that every classification gives the same answer.
    fn check(text: &[u8]) -> Result<(), SyntaxError> {
        let portable = check_with(text, classify_portable, prefix_xor);
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: SSE2 is part of the x86_64 baseline.
            let sse2 = check_with(text, |block| unsafe { classify_sse2(block) }, prefix_xor);
            assert_eq!(sse2, portable, "SSE2 vs portable: {:?}", String::from_utf8_lossy(text));
        }
        assert_eq!(check_structure(text), portable, "fastest vs portable");
        portable
    }

    fn serde_ok(text: &[u8]) -> bool {
        serde_json::from_slice::<serde::de::IgnoredAny>(text).is_ok()
    }

    #[test]
    fn whole_objects_and_arrays() {
        let good: &[&str] = &[
            "{}",
            " { } ",
            "[]",
            "[1,2]",
            r#"{"a":1}"#,
            r#"{"a":{"b":[true,false,null,"x",-0.5e+10,0,10,1E5]}}"#,
            r#"{"s":"\u00e9\n\t\"\\\/\b\f\r{[","t":"}]"}"#,
            "{\"e\":\"\u{e9}\u{1F600}\"}",
            "{\n\t\"a\" :\r\n [ ]\n}\n",
        ];
        for case in good {
            assert_eq!(check(case.as_bytes()), Ok(()), "{case:?}");
            assert!(serde_ok(case.as_bytes()), "{case:?}");
        }
        let bad: &[(&str, usize, &str)] = &[
            ("", 0, "'{' or '['"),
            ("  ", 2, "'{' or '['"),
            ("{", 1, "the close of the outer object or array"),
            ("}", 0, "'{' or '['"),
            ("{]", 1, "'}'"),
            ("[}", 1, "']'"),
            ("{}}", 2, "the end of the text"),
            ("{} {}", 3, "the end of the text"),
            ("{}x", 2, "the end of the text"),
            (r#"{"a":"b}"#, 8, "'\"' closing the string"),
            (r#"{"a":"\"}"#, 9, "'\"' closing the string"),
            (r#"{"a":"\x"}"#, 7, "a valid escape"),
            (r#"{"a":"\u12G4"}"#, 7, "a valid escape"),
            (r#"{"a":"\u12"}"#, 7, "a valid escape"),
            ("{\"a\":\"\u{1}\"}", 6, "no control character in a string"),
            ("{\"a\":\"tab\there\"}", 9, "no control character in a string"),
            ("{\"a\":1,\u{0}}", 7, "no control character but whitespace"),
            (r#"{"a":\"x"}"#, 5, "no backslash outside a string"),
        ];
        for (case, offset, expected) in bad {
            let e = check(case.as_bytes()).unwrap_err();
            assert_eq!((e.offset, e.expected), (*offset, *expected), "{case:?}");
            assert!(!serde_ok(case.as_bytes()), "{case:?}");
        }
        // Valid JSON, but not an object or array.
        for case in ["7", r#""s""#, "null"] {
            assert_eq!(check(case.as_bytes()).unwrap_err().expected, "'{' or '['");
        }
        // The grammar between brackets is not checked (documented): serde_json rejects these.
        for case in [r#"{"a" 1}"#, "[1 2]", "{a:1}", "[tru]", "[01]", r#"{"a":1,}"#] {
            assert_eq!(check(case.as_bytes()), Ok(()), "{case:?}");
            assert!(!serde_ok(case.as_bytes()), "{case:?}");
        }
    }

    #[test]
    fn backslash_runs_and_strings_across_block_boundaries() {
        // Runs of 0..6 backslashes before a quote, at every offset around the 64-byte edges.
        for run in 0..7 {
            for pad in 0..140 {
                let body = format!("{}{}\"", "a".repeat(pad), "\\".repeat(run));
                for text in [format!("[\"{body}]"), format!("[\"{body},\"b\"]"), format!("{{\"k\":\"{body}}}")] {
                    assert_eq!(check(text.as_bytes()).is_ok(), serde_ok(text.as_bytes()), "{text:?}");
                }
            }
        }
        // Brackets inside strings that cross a block edge.
        for pad in 50..140 {
            let text = format!("{{\"k\":\"{}{{[\",\"v\":[\"]}}\"]}}", "a".repeat(pad));
            assert_eq!(check(text.as_bytes()), Ok(()), "{text:?}");
        }
    }

    #[test]
    fn deep_nesting() {
        let too_deep = format!("{}{}", "[".repeat(257), "]".repeat(257));
        assert_eq!(check(too_deep.as_bytes()).unwrap_err().expected, "nesting at most 256 deep");
        for depth in [1, 63, 64, 65, 200, 256] {
            let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            assert_eq!(check(text.as_bytes()), Ok(()));
            let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth - 1));
            assert!(check(text.as_bytes()).is_err());
        }
    }

    /// Arbitrary JSON documents.
    fn json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i64>().prop_map(serde_json::Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
            "\\PC{0,20}|[\"\\\\\u{0}-\u{1f}{}\\[\\]a-z]{0,12}".prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(6, 64, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(serde_json::Value::from),
                prop::collection::btree_map("[a-z\"\\\\{}]{0,6}", inner, 0..8)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A document of a few hundred bytes or more (several 64-byte blocks).
    fn document() -> impl Strategy<Value = Vec<u8>> {
        (json(), any::<bool>()).prop_map(|(v, pretty)| {
            let doc = serde_json::json!({"a": v, "b": [v, v]});
            if pretty { serde_json::to_vec_pretty(&doc) } else { serde_json::to_vec(&doc) }.unwrap()
        })
    }

    /// Bytes whose single insertion, deletion or replacement the check must notice whenever
    /// serde_json does. (Not quotes and backslashes: one edit of those can join two strings
    /// (`"a""b"`), which only the grammar forbids.)
    const STRUCTURAL: &[u8] = b"{}[]\x01";

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn both_classifiers_agree(block in prop::array::uniform32(any::<u8>()), more in prop::array::uniform32(prop::sample::select(b"{}[]:,\"\\ \t\n\r\x00\x1f\x20\x21\x5b\x5d\x7b\x7d\x80\xff".to_vec()))) {
            let mut full = [0u8; 64];
            full[..32].copy_from_slice(&block);
            full[32..].copy_from_slice(&more);
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: SSE2 is part of the x86_64 baseline; AVX2 is checked.
                prop_assert_eq!(unsafe { classify_sse2(&full) }, classify_portable(&full));
                if std::is_x86_feature_detected!("avx2") {
                    prop_assert_eq!(unsafe { classify_avx2(&full) }, classify_portable(&full));
                }
            }
        }

        #[test]
        fn both_prefix_xors_agree(x in any::<u64>()) {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("pclmulqdq") {
                // SAFETY: the CPU has PCLMULQDQ (checked).
                prop_assert_eq!(unsafe { prefix_xor_clmul(x) }, prefix_xor(x));
            }
            let naive = (0..64).fold((0u64, 0u64), |(acc, parity), k| {
                let parity = parity ^ (x >> k & 1);
                (acc | parity << k, parity)
            }).0;
            prop_assert_eq!(prefix_xor(x), naive);
        }

        #[test]
        fn valid_documents_are_accepted(text in document()) {
            prop_assert_eq!(check(&text), Ok(()));
        }

        #[test]
        fn cut_documents_are_rejected(text in document(), cut in any::<prop::sample::Index>()) {
            let end = text.iter().rposition(|b| !b.is_ascii_whitespace()).unwrap();
            let cut = cut.index(end);
            prop_assert!(check(&text[..=cut.min(end - 1)]).is_err());
        }

        /// One structural byte inserted, deleted or replaced: the check agrees with serde_json.
        #[test]
        fn one_structural_edit_agrees_with_serde_json(
            text in document(),
            at in any::<prop::sample::Index>(),
            op in 0u8..3,
            byte in prop::sample::select(STRUCTURAL.to_vec()),
        ) {
            let mut text = text;
            let at = at.index(text.len());
            match op {
                0 => text.insert(at, byte),
                1 if STRUCTURAL.contains(&text[at]) => { text.remove(at); }
                _ if STRUCTURAL.contains(&text[at]) || STRUCTURAL.contains(&byte) => text[at] = byte,
                _ => return Ok(()),
            }
            prop_assert_eq!(check(&text).is_ok(), serde_ok(&text), "{:?}", String::from_utf8_lossy(&text));
        }

        /// Any edits: whatever serde_json accepts, the check accepts.
        #[test]
        fn never_rejects_what_serde_json_accepts(
            text in document(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), 0u8..3, prop::sample::select(
                b"{}[]\",:\\ 0123456789.eE+-tfnulrsa\x01\t".to_vec())), 1..4),
        ) {
            let mut text = text;
            for (at, op, byte) in edits {
                if text.is_empty() { break; }
                let at = at.index(text.len());
                match op {
                    0 => text[at] = byte,
                    1 => text.insert(at, byte),
                    _ => { text.remove(at); }
                }
            }
            if serde_ok(&text) && matches!(text.iter().find(|b| !b.is_ascii_whitespace()), Some(b'{' | b'[')) {
                prop_assert_eq!(check(&text), Ok(()), "{:?}", String::from_utf8_lossy(&text));
            }
        }
    }
}
