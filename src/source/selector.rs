//! Client-side syntax checks of label and field selectors, so that `check-config` catches a
//! typo before the apiserver does. The server stays the authority: a selector accepted here is
//! sent verbatim.

/// Checks Kubernetes label selector syntax (`apimachinery/pkg/labels` grammar):
/// `key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (a,b)`, `key notin (a,b)`, `key>1`, `key<1`.
pub fn validate_label_selector(s: &str) -> Result<(), String> {
    if s.trim().is_empty() {
        return Ok(());
    }
    for req in split_top_level(s)? {
        let req = req.trim();
        if req.is_empty() {
            return Err("empty requirement (two commas in a row, or a trailing comma)".into());
        }
        if let Some(key) = req.strip_prefix('!') {
            check_label_key(key.trim())?;
            continue;
        }
        if let Some((key, rest)) = split_set_op(req) {
            check_label_key(key)?;
            let rest = rest.trim();
            let inner = rest
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| format!("`{req}`: the values of in/notin must be in parentheses, e.g. (a,b)"))?;
            for v in inner.split(',') {
                check_label_value(v.trim())?;
            }
            continue;
        }
        let ops = ["==", "!=", "=", ">", "<"];
        match ops.iter().find_map(|op| req.find(op).map(|i| (i, *op))) {
            Some((i, op)) => {
                let (key, value) = (req[..i].trim(), req[i + op.len()..].trim());
                check_label_key(key)?;
                if op == ">" || op == "<" {
                    if value.parse::<i64>().is_err() {
                        return Err(format!("`{req}`: {op} needs an integer value"));
                    }
                } else {
                    check_label_value(value)?;
                }
            }
            None => check_label_key(req)?,
        }
    }
    Ok(())
}

/// Checks field selector syntax: comma-separated `key=value`, `key==value` or `key!=value`;
/// `\,`, `\=` and `\\` escape inside values.
pub fn validate_field_selector(s: &str) -> Result<(), String> {
    if s.trim().is_empty() {
        return Ok(());
    }
    for part in split_unescaped_commas(s)? {
        let p = part.trim();
        if p.is_empty() {
            return Err("empty requirement (two commas in a row, or a trailing comma)".into());
        }
        let Some((key, op, _)) = field_requirement(p) else {
            return Err(format!("`{p}` has no operator: use key=value, key==value or key!=value"));
        };
        let key = key.trim();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '/')) {
            return Err(format!("`{p}`: {key:?} is not a field path (e.g. metadata.name) before {op}"));
        }
    }
    Ok(())
}

fn unescaped_eq(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    (0..b.len()).find(|&i| b[i] == b'=' && (i == 0 || b[i - 1] != b'\\'))
}

/// A label selector written one way for all its spellings that select the same objects
/// (`app==web` and ` app=web`, requirements in any order, `in (b, a)` and `in (a,b)`), for
/// telling equal selectors apart; the selector as written is what is sent. An invalid one is
/// returned trimmed.
pub fn canonical_label_selector(s: &str) -> String {
    let Ok(reqs) = split_top_level(s) else { return s.trim().to_string() };
    let mut out: Vec<String> = reqs
        .iter()
        .map(|req| {
            let req = req.trim();
            if let Some(key) = req.strip_prefix('!') {
                return format!("!{}", key.trim());
            }
            if let Some((key, rest)) = split_set_op(req) {
                let op = if req[key.len()..].trim_start().starts_with("notin") { "notin" } else { "in" };
                let inner = rest.trim().trim_start_matches('(').trim_end_matches(')');
                let mut values: Vec<&str> = inner.split(',').map(str::trim).collect();
                values.sort_unstable();
                values.dedup();
                return format!("{key} {op} ({})", values.join(","));
            }
            match ["==", "!=", "=", ">", "<"].iter().find_map(|op| req.find(op).map(|i| (i, *op))) {
                Some((i, op)) => {
                    let op = if op == "==" { "=" } else { op };
                    let skip = if req[i..].starts_with("==") || req[i..].starts_with("!=") { 2 } else { 1 };
                    format!("{}{op}{}", req[..i].trim(), req[i + skip..].trim())
                }
                None => req.to_string(),
            }
        })
        .filter(|r| !r.is_empty())
        .collect();
    out.sort_unstable();
    out.dedup();
    out.join(",")
}

/// A field selector written one way for its spellings that select the same objects
/// (`==` as `=`, spaces, requirements in any order).
pub fn canonical_field_selector(s: &str) -> String {
    let Ok(parts) = split_unescaped_commas(s) else { return s.trim().to_string() };
    let mut out: Vec<String> = parts
        .iter()
        .map(|p| match field_requirement(p.trim()) {
            Some((key, op, value)) => format!("{}{}{}", key.trim(), if op == "==" { "=" } else { op }, value.trim()),
            None => p.trim().to_string(),
        })
        .filter(|p| !p.is_empty())
        .collect();
    out.sort_unstable();
    out.dedup();
    out.join(",")
}

/// Splits a field selector on its commas that are not escaped (`\,`); only `\,`, `\=` and
/// `\\` may be escaped.
fn split_unescaped_commas(s: &str) -> Result<Vec<String>, String> {
    let (mut parts, mut cur, mut chars) = (Vec::new(), String::new(), s.chars());
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(n @ (',' | '=' | '\\')) => {
                    cur.push('\\');
                    cur.push(n);
                }
                _ => return Err("invalid escape: only \\, \\= and \\\\ are allowed".into()),
            },
            ',' => parts.push(std::mem::take(&mut cur)),
            c => cur.push(c),
        }
    }
    parts.push(cur);
    Ok(parts)
}

/// A field requirement's key, operator (`!=`, `==` or `=`) and value, untrimmed.
fn field_requirement(p: &str) -> Option<(&str, &'static str, &str)> {
    let (i, op) = if let Some(i) = p.find("!=") {
        (i, "!=")
    } else if let Some(i) = p.find("==") {
        (i, "==")
    } else {
        (unescaped_eq(p)?, "=")
    };
    Some((&p[..i], op, &p[i + op.len()..]))
}

/// Splits on commas that are not inside parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut out) = (0i32, 0usize, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err("unbalanced ')'".into());
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unbalanced '('".into());
    }
    out.push(&s[start..]);
    Ok(out)
}

/// `key in (..)` / `key notin (..)` -> (key, "(..)").
fn split_set_op(req: &str) -> Option<(&str, &str)> {
    let mut words = req.splitn(2, char::is_whitespace);
    let key = words.next()?.trim();
    let rest = words.next()?.trim_start();
    for op in ["notin", "in"] {
        if let Some(r) = rest.strip_prefix(op)
            && r.starts_with(|c: char| c.is_whitespace() || c == '(')
        {
            return Some((key, r));
        }
    }
    None
}

fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix {
        let ok = !p.is_empty()
            && p.len() <= 253
            && p.split('.').all(|l| {
                !l.is_empty()
                    && l.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        if !ok {
            return Err(format!("label key {key:?}: prefix {p:?} must be a DNS subdomain"));
        }
    }
    if name.is_empty() || !is_label_name(name) {
        return Err(format!(
            "label key {key:?} is not valid: at most 63 characters, alphanumeric at both ends, '-', '_' or '.' between"
        ));
    }
    Ok(())
}

fn check_label_value(v: &str) -> Result<(), String> {
    if v.is_empty() || is_label_name(v) {
        Ok(())
    } else {
        Err(format!(
            "label value {v:?} is not valid: at most 63 characters, alphanumeric at both ends, '-', '_' or '.' between"
        ))
    }
}

fn is_label_name(s: &str) -> bool {
    s.len() <= 63
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_selectors() {
        for ok in [
            "",
            "app",
            "!app",
            "app=web",
            "app==web",
            "app!=web",
            "tier in (a, b)",
            "tier notin (a)",
            "example.com/app=x,env",
            "replicas>2",
            "app=",
            "a=b,c in (d),!e",
        ] {
            assert!(validate_label_selector(ok).is_ok(), "{ok} should be valid");
        }
        for bad in ["app=web,", "app=(web", "tier in a,b", "-app=x", "app=we b", "Example.com/a=b", "n>x", ","] {
            assert!(validate_label_selector(bad).is_err(), "{bad} should be invalid");
        }
    }

    #[test]
    fn field_selectors() {
        for ok in
            ["", "metadata.name=foo", "metadata.namespace!=kube-system,status.phase==Running", "metadata.name=a\\,b"]
        {
            assert!(validate_field_selector(ok).is_ok(), "{ok} should be valid");
        }
        for bad in ["metadata.name", "=foo", "metadata.name=a,", "a b=c", "x=\\q"] {
            assert!(validate_field_selector(bad).is_err(), "{bad} should be invalid");
        }
    }

    #[test]
    fn equal_selectors_have_one_canonical_form() {
        let same = |a: &str, b: &str| assert_eq!(canonical_label_selector(a), canonical_label_selector(b), "{a} / {b}");
        same("app=web", "app==web");
        same("app=web,tier=db", " tier = db , app==web");
        same("env in (b, a)", "env in (a,b)");
        same("!old,app", "app, !old");
        assert_ne!(canonical_label_selector("app=web"), canonical_label_selector("app!=web"));
        assert_ne!(canonical_label_selector("env in (a)"), canonical_label_selector("env notin (a)"));
        assert_eq!(canonical_label_selector(""), "");
        let same = |a: &str, b: &str| assert_eq!(canonical_field_selector(a), canonical_field_selector(b), "{a} / {b}");
        same("metadata.name=a,status.phase=Running", "status.phase==Running, metadata.name = a");
        same("metadata.name=a\\,b", "metadata.name==a\\,b");
        assert_ne!(canonical_field_selector("metadata.name=a"), canonical_field_selector("metadata.name!=a"));
    }
}
