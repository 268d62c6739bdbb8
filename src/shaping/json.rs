//! JSON surgery on an object's text without decoding what is not touched: the span of a
//! top-level key, the entries of an object, field paths to redact or skip, a hash that skips
//! paths.

use std::borrow::Cow;
use std::fmt;
use std::hash::Hasher;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

/// A dotted field path: `spec.password`, `data.*`, `spec.containers.*.env`. `*` matches every
/// key of an object and every element of a list; a number also matches that list index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldPath(pub Vec<String>);

impl FieldPath {
    pub fn parse(s: &str) -> Result<FieldPath, String> {
        let parts: Vec<String> = s.split('.').map(str::to_string).collect();
        if s.is_empty() || parts.iter().any(String::is_empty) {
            return Err(format!("{s:?} is not a field path"));
        }
        Ok(FieldPath(parts))
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join("."))
    }
}

fn segment_matches(segment: &str, key: &str) -> bool {
    segment == "*" || segment == key
}

/// Replaces every value `path` reaches with `with`. Returns how many were replaced.
pub fn redact(v: &mut Value, path: &[String], with: &Value) -> usize {
    let Some((first, rest)) = path.split_first() else {
        *v = with.clone();
        return 1;
    };
    match v {
        Value::Object(map) => {
            map.iter_mut().filter(|(k, _)| segment_matches(first, k)).map(|(_, child)| redact(child, rest, with)).sum()
        }
        Value::Array(items) => items
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| first == "*" || first.parse::<usize>().ok() == Some(*i))
            .map(|(_, child)| redact(child, rest, with))
            .sum(),
        _ => 0,
    }
}

/// A 64-bit hash of `v` that ignores the values `skip` paths reach. An object left empty by
/// the skipping counts as absent (adding `metadata.annotations.heartbeat` to an object without
/// annotations changes nothing when that path is skipped).
pub fn hash_skipping(v: &Value, skip: &[FieldPath]) -> u64 {
    let mut path: Vec<&str> = Vec::new();
    digest(v, skip, &mut path).unwrap_or(0)
}

fn skipped(path: &[&str], skip: &[FieldPath]) -> bool {
    skip.iter().any(|p| p.0.len() == path.len() && p.0.iter().zip(path).all(|(s, k)| segment_matches(s, k)))
}

/// `None`: an object with nothing left after skipping.
fn digest<'a>(v: &'a Value, skip: &[FieldPath], path: &mut Vec<&'a str>) -> Option<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match v {
        Value::Null => h.write_u8(0),
        Value::Bool(b) => h.write_u8(1 + u8::from(*b)),
        Value::Number(n) => {
            h.write_u8(3);
            h.write(n.to_string().as_bytes());
        }
        Value::String(s) => {
            h.write_u8(4);
            h.write(s.as_bytes());
        }
        Value::Array(items) => {
            h.write_u8(5);
            h.write_usize(items.len());
            for item in items {
                h.write_u64(digest(item, skip, path).unwrap_or(0));
            }
        }
        Value::Object(map) => {
            h.write_u8(6);
            let mut any = false;
            // serde_json's map is sorted by key: the hash does not depend on key order.
            for (k, child) in map {
                path.push(k);
                if !skipped(path, skip)
                    && let Some(d) = digest(child, skip, path)
                {
                    h.write(k.as_bytes());
                    h.write_u8(0xfe);
                    h.write_u64(d);
                    any = true;
                }
                path.pop();
            }
            if !any {
                return None;
            }
        }
    }
    Some(h.finish())
}

/// [`hash_skipping`] for an object given as text: top-level values that no skip path reaches
/// into are hashed as text (the apiserver writes the same content as the same text), only
/// those a path reaches into are decoded. Equal for equal content under one `skip`.
pub fn text_hash(text: &str, skip: &[FieldPath]) -> u64 {
    let Ok(entries) = entries(text) else {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write(text.as_bytes());
        return h.finish();
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for (k, raw) in entries {
        let key: &str = &k;
        if skipped(&[key], skip) {
            continue;
        }
        let reaches_into = skip.iter().any(|p| p.0.len() > 1 && segment_matches(&p.0[0], key));
        let d = if reaches_into {
            match serde_json::from_str::<Value>(raw.get()) {
                Ok(v) => match digest(&v, skip, &mut vec![key]) {
                    Some(d) => d,
                    None => continue, // emptied by the skipping: as if absent
                },
                Err(_) => 0,
            }
        } else {
            let mut e = std::collections::hash_map::DefaultHasher::new();
            e.write(raw.get().as_bytes());
            e.finish()
        };
        h.write(key.as_bytes());
        h.write_u8(0xfe);
        h.write_u64(d);
    }
    h.finish()
}

/// The value of top-level `key` of the object `text`, as a slice of `text`, found without
/// decoding the other values (and without reading past it).
pub fn top_level<'t>(text: &'t str, key: &str) -> Option<&'t RawValue> {
    let mut found = None;
    let mut de = serde_json::Deserializer::from_str(text);
    // The seed stops the parse with an error as soon as it has the key: what follows it is
    // never read.
    let _ = FindKey { key, found: &mut found }.deserialize(&mut de);
    found
}

struct FindKey<'k, 'f, 't> {
    key: &'k str,
    found: &'f mut Option<&'t RawValue>,
}

impl<'t> DeserializeSeed<'t> for FindKey<'_, '_, 't> {
    type Value = ();
    fn deserialize<D: Deserializer<'t>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'t> Visitor<'t> for FindKey<'_, '_, 't> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'t>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Cow<'t, str>>()? {
            if k == self.key {
                *self.found = Some(map.next_value::<&'t RawValue>()?);
                return Err(de::Error::custom("found"));
            }
            map.next_value::<IgnoredAny>()?;
        }
        Ok(())
    }
}

/// The entries of the object `text` whose keys are in `keys`, values undecoded; the parse
/// stops once it has them all (the rest of the text is not read).
pub fn select<'t>(text: &'t str, keys: &[String]) -> Result<Vec<(Cow<'t, str>, &'t RawValue)>, serde_json::Error> {
    struct Select<'k, 'o, 't> {
        keys: &'k [String],
        out: &'o mut Vec<(Cow<'t, str>, &'t RawValue)>,
    }
    impl<'t> DeserializeSeed<'t> for Select<'_, '_, 't> {
        type Value = ();
        fn deserialize<D: Deserializer<'t>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'t> Visitor<'t> for Select<'_, '_, 't> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'t>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(k) = map.next_key::<Cow<'t, str>>()? {
                if self.keys.iter().any(|w| *w == k) {
                    let v = map.next_value::<&'t RawValue>()?;
                    self.out.push((k, v));
                    if self.out.len() == self.keys.len() {
                        return Err(de::Error::custom(ALL_FOUND));
                    }
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(())
        }
    }
    const ALL_FOUND: &str = "kubecast: all selected keys found";
    let mut out = Vec::new();
    if keys.is_empty() {
        return Ok(out);
    }
    let mut de = serde_json::Deserializer::from_str(text);
    match (Select { keys, out: &mut out }).deserialize(&mut de) {
        Ok(()) => Ok(out),
        Err(e) if e.to_string().starts_with(ALL_FOUND) => Ok(out),
        Err(e) => Err(e),
    }
}

/// The entries of the object `text`, values undecoded, in order.
pub fn entries(text: &str) -> Result<Vec<(Cow<'_, str>, &RawValue)>, serde_json::Error> {
    struct Entries;
    impl<'t> Visitor<'t> for Entries {
        type Value = Vec<(Cow<'t, str>, &'t RawValue)>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'t>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(k) = map.next_key::<Cow<'t, str>>()? {
                out.push((k, map.next_value::<&'t RawValue>()?));
            }
            Ok(out)
        }
    }
    serde_json::Deserializer::from_str(text).deserialize_map(Entries)
}

/// Writes `{"k":v,...}` from entries.
pub fn write_object(out: &mut Vec<u8>, entries: &[(Cow<'_, str>, &RawValue)]) {
    out.push(b'{');
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut *out, k.as_ref()).expect("a string serialises");
        out.push(b':');
        out.extend_from_slice(v.get().as_bytes());
    }
    out.push(b'}');
}

/// The offset of `part` (a slice of `whole`) in `whole`.
pub fn offset_in(whole: &str, part: &str) -> usize {
    part.as_ptr() as usize - whole.as_ptr() as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn top_level_finds_the_key_not_nested_ones() {
        let text = r#"{"spec":{"metadata":{"x":1}},"kind":"K","metadata":{"name":"a\"b"},"status":{}}"#;
        let m = top_level(text, "metadata").unwrap();
        assert_eq!(m.get(), r#"{"name":"a\"b"}"#);
        assert_eq!(&text[offset_in(text, m.get())..][..4], r#"{"na"#);
        assert!(top_level(text, "nope").is_none());
        assert!(top_level("[1]", "metadata").is_none());
    }

    #[test]
    fn select_stops_early_and_finds_what_exists() {
        let text = r#"{"a":1,"metadata":{"x":"}"},"spec":{"b":2},"bad": nonsense"#;
        let got = select(text, &["metadata".into()]).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1.get(), r#"{"x":"}"}"#);
        let got = select(r#"{"a":1,"spec":{}}"#, &["metadata".into(), "spec".into()]).unwrap();
        assert_eq!(got.len(), 1, "absent keys are absent");
    }

    #[test]
    fn entries_round_trip() {
        let text = r#"{"a":1,"b":{"c":[1,2]},"d\"e":"x"}"#;
        let e = entries(text).unwrap();
        let mut out = Vec::new();
        write_object(&mut out, &e);
        assert_eq!(String::from_utf8(out).unwrap(), text);
    }

    #[test]
    fn redact_paths_with_wildcards_and_indexes() {
        let mut v =
            json!({"spec": {"password": "p", "list": [{"s": 1}, {"s": 2}], "m": {"a": {"s": 3}, "b": {"s": 4}}}});
        let r = json!("<redacted>");
        assert_eq!(redact(&mut v, &FieldPath::parse("spec.password").unwrap().0, &r), 1);
        assert_eq!(redact(&mut v, &FieldPath::parse("spec.list.1.s").unwrap().0, &r), 1);
        assert_eq!(redact(&mut v, &FieldPath::parse("spec.m.*.s").unwrap().0, &r), 2);
        assert_eq!(redact(&mut v, &FieldPath::parse("spec.absent").unwrap().0, &r), 0);
        assert_eq!(
            v,
            json!({"spec": {"password": "<redacted>", "list": [{"s": 1}, {"s": "<redacted>"}], "m": {"a": {"s": "<redacted>"}, "b": {"s": "<redacted>"}}}})
        );
    }

    #[test]
    fn hash_skips_paths_and_ignores_key_order() {
        let skip = vec![FieldPath::parse("status").unwrap(), FieldPath::parse("metadata.resourceVersion").unwrap()];
        let a = json!({"metadata": {"name": "x", "resourceVersion": "1"}, "spec": {"r": 1}, "status": {"p": "a"}});
        let b = json!({"status": {"p": "b"}, "spec": {"r": 1}, "metadata": {"resourceVersion": "2", "name": "x"}});
        let c = json!({"metadata": {"name": "x", "resourceVersion": "1"}, "spec": {"r": 2}, "status": {"p": "a"}});
        assert_eq!(hash_skipping(&a, &skip), hash_skipping(&b, &skip));
        assert_ne!(hash_skipping(&a, &skip), hash_skipping(&c, &skip));
        let with_skipped =
            json!({"metadata": {"name": "x", "resourceVersion": "1", "annotations": {"hb": "1"}}, "spec": {"r": 1}});
        let skip2 = vec![
            FieldPath::parse("metadata.annotations.hb").unwrap(),
            FieldPath::parse("metadata.resourceVersion").unwrap(),
            FieldPath::parse("status").unwrap(),
        ];
        assert_eq!(
            hash_skipping(&a, &skip2),
            hash_skipping(&with_skipped, &skip2),
            "an emptied object counts as absent"
        );
        let t = |v: &Value| text_hash(&serde_json::to_string(v).unwrap(), &skip2);
        assert_eq!(t(&a), t(&with_skipped), "text hash: same rules");
        assert_ne!(t(&a), t(&c));
        assert!(FieldPath::parse("a..b").is_err());
        assert!(FieldPath::parse("").is_err());
    }
}
