//! Destination templates (`topic`, later NATS `subject`): text with `{field}` placeholders.

use std::fmt;

use crate::model::Fields;

pub const FIELD_NAMES: [&str; 7] = ["cluster", "group", "version", "kind", "resource", "namespace", "verb"];

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Field(usize),
}

/// A parsed template, e.g. `kubecast.{cluster}.{group}.{resource}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

impl Template {
    pub fn parse(s: &str) -> Result<Template, String> {
        if s.is_empty() {
            return Err("is empty".into());
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_string()));
            }
            let close = rest[open..].find('}').ok_or_else(|| format!("unclosed '{{' in {s:?}"))? + open;
            let name = &rest[open + 1..close];
            let idx = FIELD_NAMES.iter().position(|f| *f == name).ok_or_else(|| {
                format!(
                    "unknown field {{{name}}} in {s:?}; known: {}",
                    FIELD_NAMES.map(|f| format!("{{{f}}}")).join(", ")
                )
            })?;
            parts.push(Part::Field(idx));
            rest = &rest[close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("unbalanced '}}' in {s:?}"));
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Ok(Template { source: s.to_string(), parts })
    }

    /// Renders with each field value passed through `clean` (the sink's naming rules).
    pub fn render<'a>(&self, f: &'a Fields, clean: impl Fn(&'a str) -> std::borrow::Cow<'a, str>) -> String {
        let mut out = String::with_capacity(self.source.len() + 32);
        for p in &self.parts {
            match p {
                Part::Text(t) => out.push_str(t),
                Part::Field(i) => {
                    let t = f.of_type;
                    let v = match i {
                        0 => &t.cluster,
                        1 => &t.group,
                        2 => &t.version,
                        3 => &t.kind,
                        4 => &t.resource,
                        5 => &f.namespace,
                        _ => f.verb,
                    };
                    out.push_str(&clean(v));
                }
            }
        }
        out
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// A field value as a destination part: characters `ok` refuses become `_`, an empty value
/// (the namespace of a cluster-scoped object) becomes `_`; borrowed when nothing changes.
pub fn clean_with(s: &str, ok: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    use std::borrow::Cow;
    if s.is_empty() {
        Cow::Borrowed("_")
    } else if s.chars().all(&ok) {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(s.chars().map(|c| if ok(c) { c } else { '_' }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TypeFields;

    #[test]
    fn parse_and_render() {
        let t = Template::parse("kubecast.{cluster}.{group}.{resource}-{verb}").unwrap();
        let f = Fields {
            of_type: TypeFields {
                cluster: "c".into(),
                group: "apps".into(),
                resource: "deployments".into(),
                ..Default::default()
            }
            .intern(),
            verb: "added",
            ..Default::default()
        };
        assert_eq!(t.render(&f, std::borrow::Cow::Borrowed), "kubecast.c.apps.deployments-added");
        let unknown = Template::parse("x.{nope}").unwrap_err();
        assert!(unknown.contains("unknown field {nope}") && unknown.contains("known: {cluster}, {group}"), "{unknown}");
        assert!(unknown.contains("{verb}"), "every known field listed: {unknown}");
        assert!(Template::parse("x.{cluster").unwrap_err().contains("unclosed '{'"));
        assert!(Template::parse("x}").unwrap_err().contains("unbalanced '}'"));
        assert_eq!(Template::parse("").unwrap_err(), "is empty");
    }
}
