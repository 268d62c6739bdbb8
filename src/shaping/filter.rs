//! `filter`: a CEL expression (the language of Kubernetes' admission policies) over `object`,
//! `oldObject` and `verb`, evaluated with the `cel` crate and its string extension
//! (`lowerAscii()`, `split()`, `replace()`, ... besides the standard `startsWith()`,
//! `endsWith()`, `contains()`, `matches()`, `size()`, `has()`, `all()`, `exists()`).

use std::sync::{Arc, OnceLock};

use cel::{Context, Env, ExecutionError, Program, Value as CelValue};
use serde_json::{Value, json};

pub struct Filter {
    program: Program,
    source: String,
    /// The top-level fields of `object` / `oldObject` the expression reads (`object.<field>`
    /// only); `None`: it uses the object as a whole. Only those fields are decoded and
    /// converted for an evaluation.
    object_fields: Option<Vec<String>>,
    old_fields: Option<Vec<String>>,
}

/// Why an expression is refused (check-config and start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterError(pub String);

fn env() -> Arc<Env> {
    static ENV: OnceLock<Arc<Env>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Env::stdlib();
        env.add_extension(cel::extensions::strings).expect("the strings extension declares");
        Arc::new(env)
    })
    .clone()
}

impl Filter {
    /// Compiles `source`; refuses syntax errors (with their position), unknown variables or
    /// functions, and expressions that are not boolean, found by a trial run on a sample object.
    pub fn compile(source: &str, has_old_object: bool) -> Result<Filter, FilterError> {
        let program = env().compile(source).map_err(|e| FilterError(format!("CEL syntax error: {e}")))?;
        // (Variables are checked by the trial run below: `references()` also lists the
        // variables that macros such as `exists(c, ...)` bind.)
        let refs = program.references();
        if refs.has_variable("oldObject") && !has_old_object {
            return Err(FilterError("`oldObject` needs keep_previous = true".into()));
        }
        let filter = Filter {
            object_fields: fields_used(program.expression(), "object"),
            old_fields: fields_used(program.expression(), "oldObject"),
            program,
            source: source.to_string(),
        };
        let sample = json!({
            "apiVersion": "v1", "kind": "Sample",
            "metadata": {"name": "sample", "namespace": "default", "uid": "u", "resourceVersion": "1",
                         "labels": {"app": "x"}, "annotations": {"a": "b"}},
            "spec": {}, "status": {}
        });
        match filter.eval(&sample, Some(&sample), "modified") {
            Ok(_) => Ok(filter),
            // Depends on the object: fine here, decided per event at run time.
            Err(EvalError::Exec(ExecutionError::NoSuchKey(_))) => Ok(filter),
            Err(EvalError::NotBool(got)) => {
                Err(FilterError(format!("must evaluate to a bool (true: deliver), but gives {got}")))
            }
            Err(EvalError::Exec(e @ ExecutionError::UndeclaredReference(_))) => {
                Err(FilterError(format!("CEL: {e} (unknown function or variable)")))
            }
            Err(EvalError::Exec(e)) => Err(FilterError(format!("CEL type error on a sample object: {e}"))),
            Err(EvalError::Decode(e)) => Err(FilterError(e)),
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    #[cfg(test)]
    /// The fields of `object` the expression reads (`None`: all).
    pub fn object_fields(&self) -> Option<&[String]> {
        self.object_fields.as_deref()
    }

    /// Whether the event passes (`true`: deliver).
    pub fn eval(&self, object: &Value, old: Option<&Value>, verb: &str) -> Result<bool, EvalError> {
        let object = to_cel(subset(object, self.object_fields.as_deref()).as_ref())?;
        let old = match old {
            Some(o) => to_cel(subset(o, self.old_fields.as_deref()).as_ref())?,
            None => CelValue::Null,
        };
        self.eval_cel(object, old, verb)
    }

    /// Like [`Filter::eval`] without `oldObject`, for an object given as JSON text: decodes
    /// only the fields the expression reads.
    pub fn eval_text(&self, object: &str, verb: &str) -> Result<bool, EvalError> {
        let decode = |e: serde_json::Error| EvalError::Decode(e.to_string());
        let value = match &self.object_fields {
            None => cel_from_json(object).map_err(decode)?,
            Some(fields) => {
                let mut map = std::collections::HashMap::new();
                for (k, raw) in super::json::select(object, fields).map_err(decode)? {
                    map.insert(
                        cel::objects::Key::String(Arc::new(k.into_owned())),
                        cel_from_json(raw.get()).map_err(decode)?,
                    );
                }
                CelValue::Map(cel::objects::Map { map: Arc::new(map) })
            }
        };
        self.eval_cel(value, CelValue::Null, verb)
    }

    fn eval_cel(&self, object: CelValue, old: CelValue, verb: &str) -> Result<bool, EvalError> {
        let mut ctx = Context::with_env(env());
        ctx.add_variable_from_value("object", object);
        ctx.add_variable_from_value("oldObject", old);
        ctx.add_variable_from_value("verb", verb.to_string());
        match self.program.execute(&ctx).map_err(EvalError::Exec)? {
            CelValue::Bool(b) => Ok(b),
            other => Err(EvalError::NotBool(format!("{:?}", other.type_of()))),
        }
    }
}

/// JSON text straight to a CEL value (no serde_json::Value in between).
fn cel_from_json(text: &str) -> Result<CelValue, serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let v = CelSeed.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

struct CelSeed;

impl<'de> serde::de::DeserializeSeed<'de> for CelSeed {
    type Value = CelValue;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<CelValue, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for CelSeed {
    type Value = CelValue;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("JSON")
    }
    fn visit_bool<E>(self, v: bool) -> Result<CelValue, E> {
        Ok(CelValue::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<CelValue, E> {
        Ok(CelValue::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<CelValue, E> {
        // As cel::to_value does for JSON numbers: signed when it fits.
        Ok(i64::try_from(v).map_or(CelValue::UInt(v), CelValue::Int))
    }
    fn visit_f64<E>(self, v: f64) -> Result<CelValue, E> {
        Ok(CelValue::Float(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<CelValue, E> {
        Ok(CelValue::String(Arc::new(v.to_string())))
    }
    fn visit_string<E>(self, v: String) -> Result<CelValue, E> {
        Ok(CelValue::String(Arc::new(v)))
    }
    fn visit_unit<E>(self) -> Result<CelValue, E> {
        Ok(CelValue::Null)
    }
    fn visit_none<E>(self) -> Result<CelValue, E> {
        Ok(CelValue::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<CelValue, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(v) = seq.next_element_seed(CelSeed)? {
            out.push(v);
        }
        Ok(CelValue::List(Arc::new(out)))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<CelValue, A::Error> {
        let mut out = std::collections::HashMap::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value_seed(CelSeed)?;
            out.insert(cel::objects::Key::String(Arc::new(k)), v);
        }
        Ok(CelValue::Map(cel::objects::Map { map: Arc::new(out) }))
    }
}

fn to_cel(v: &Value) -> Result<CelValue, EvalError> {
    cel::to_value(v).map_err(|e| EvalError::Decode(e.to_string()))
}

/// `v` with only `fields` (borrowed when all are wanted).
fn subset<'v>(v: &'v Value, fields: Option<&[String]>) -> std::borrow::Cow<'v, Value> {
    match (fields, v) {
        (Some(fields), Value::Object(map)) => std::borrow::Cow::Owned(Value::Object(
            map.iter().filter(|(k, _)| fields.iter().any(|f| f == *k)).map(|(k, x)| (k.clone(), x.clone())).collect(),
        )),
        _ => std::borrow::Cow::Borrowed(v),
    }
}

type FieldSet = std::collections::BTreeSet<String>;

/// The top-level fields of variable `var` that `e` selects; `None` when `var` is used other
/// than as `var.<field>` (then the whole object is needed).
fn fields_used(e: &cel::IdedExpr, var: &str) -> Option<Vec<String>> {
    let mut fields = FieldSet::new();
    let mut whole = false;
    walk(e, var, &mut fields, &mut whole);
    (!whole).then(|| fields.into_iter().collect())
}

fn walk(e: &cel::IdedExpr, var: &str, fields: &mut FieldSet, whole: &mut bool) {
    use cel::common::ast::{EntryExpr, Expr};
    match &e.expr {
        Expr::Select(s) => match &s.operand.expr {
            Expr::Ident(name) if name == var => {
                fields.insert(s.field.clone());
            }
            _ => walk(&s.operand, var, fields, whole),
        },
        Expr::Ident(name) if name == var => *whole = true,
        Expr::Call(c) => {
            for x in c.target.iter().map(|t| &**t).chain(&c.args) {
                walk(x, var, fields, whole);
            }
        }
        Expr::Comprehension(c) => {
            for x in [&c.iter_range, &c.accu_init, &c.loop_cond, &c.loop_step, &c.result] {
                walk(x, var, fields, whole);
            }
        }
        Expr::List(l) => {
            for x in &l.elements {
                walk(x, var, fields, whole);
            }
        }
        Expr::Map(cel::common::ast::MapExpr { entries, .. })
        | Expr::Struct(cel::common::ast::StructExpr { entries, .. }) => {
            for en in entries {
                match &en.expr {
                    EntryExpr::StructField(f) => walk(&f.value, var, fields, whole),
                    EntryExpr::MapEntry(m) => {
                        walk(&m.key, var, fields, whole);
                        walk(&m.value, var, fields, whole);
                    }
                }
            }
        }
        _ => {}
    }
}

#[derive(Debug)]
pub enum EvalError {
    Exec(ExecutionError),
    NotBool(String),
    Decode(String),
}

impl std::fmt::Display for EvalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalError::Exec(e) => write!(f, "{e}"),
            EvalError::NotBool(t) => write!(f, "the result is a {t}, not a bool"),
            EvalError::Decode(e) => write!(f, "object cannot be read: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(phase: &str, labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "web-1", "namespace": "shop", "labels": labels},
               "spec": {"containers": [{"name": "a", "image": "nginx:1.27"}, {"name": "b", "image": "busybox"}]},
               "status": {"phase": phase}})
    }

    /// (expression, object, old object, verb, expected)
    #[test]
    fn expressions() {
        let running = pod("Running", json!({"app": "web", "tier": "frontend"}));
        let pending = pod("Pending", json!({"app": "web"}));
        let cases: &[(&str, &Value, Option<&Value>, &str, bool)] = &[
            ("object.metadata.labels.app == 'web'", &running, None, "added", true),
            ("'tier' in object.metadata.labels", &pending, None, "added", false),
            ("has(object.metadata.labels.tier)", &running, None, "added", true),
            ("has(object.spec.nodeName)", &running, None, "added", false),
            ("verb != 'deleted'", &running, None, "deleted", false),
            ("size(object.spec.containers) == 2", &running, None, "added", true),
            ("object.spec.containers.exists(c, c.image.startsWith('nginx'))", &running, None, "added", true),
            ("object.spec.containers.all(c, c.image.contains(':'))", &running, None, "added", false),
            ("object.metadata.name.endsWith('-1')", &running, None, "added", true),
            ("object.metadata.name.matches('^web-[0-9]+$')", &running, None, "added", true),
            ("object.metadata.namespace.upperAscii() == 'SHOP'", &running, None, "added", true),
            (
                "verb == 'modified' && oldObject.status.phase == 'Pending' && object.status.phase == 'Running'",
                &running,
                Some(&pending),
                "modified",
                true,
            ),
            ("oldObject == null || oldObject.status.phase != object.status.phase", &running, None, "added", true),
            ("oldObject.status.phase != object.status.phase", &running, Some(&running), "modified", false),
            ("object.metadata.labels.filter(k, k.startsWith('t')).size() == 1", &running, None, "added", true),
        ];
        for (expr, obj, old, verb, want) in cases {
            let f = Filter::compile(expr, true).unwrap_or_else(|e| panic!("{expr}: {}", e.0));
            assert_eq!(f.eval(obj, *old, verb).unwrap(), *want, "{expr}");
        }
    }

    #[test]
    fn invalid_expressions_are_refused() {
        let bad: &[(&str, &str)] = &[
            ("object.metadata.name ==", "syntax error"),
            ("object.metadata.labels.app == 'web' &&& true", "syntax error"),
            ("obj.metadata.name == 'x'", "Undeclared reference to 'obj'"),
            ("object.metadata.name", "must evaluate to a bool"),
            ("nosuchfunction(object) == 1", "unknown function"),
            ("object.metadata.name + 1 == 2", "type error"),
        ];
        for (expr, want) in bad {
            let e = Filter::compile(expr, true).err().unwrap_or_else(|| panic!("{expr} accepted"));
            assert!(e.0.contains(want), "{expr}: {}", e.0);
        }
        let e = Filter::compile("oldObject.status != object.status", false).err().unwrap();
        assert!(e.0.contains("keep_previous"), "{}", e.0);
    }

    #[test]
    fn only_the_fields_read_are_decoded() {
        let f = Filter::compile("object.metadata.name == 'a' && object.spec.containers.exists(c, c.x)", true).unwrap();
        assert_eq!(f.object_fields(), Some(&["metadata".to_string(), "spec".to_string()][..]));
        let f = Filter::compile("object == oldObject", true).unwrap();
        assert_eq!(f.object_fields(), None);
        let f = Filter::compile("has(object.status) || verb == 'deleted'", true).unwrap();
        assert_eq!(f.object_fields(), Some(&["status".to_string()][..]));
        let text = r#"{"metadata":{"name":"a"},"spec":{"huge":[1,2,3]},"status":{}}"#;
        let f = Filter::compile("object.metadata.name == 'a' && !has(object.spec)", false).unwrap();
        assert!(!f.eval_text(text, "added").unwrap(), "spec is decoded when read");
        let f = Filter::compile("object.metadata.name == 'a'", false).unwrap();
        assert!(f.eval_text(text, "added").unwrap());
    }

    #[test]
    fn json_text_converts_like_cel_to_value() {
        let v = json!({"a": [1, -2, 2.5, "s", true, null, {"b": {}}], "big": 18446744073709551615u64});
        assert_eq!(cel_from_json(&v.to_string()).unwrap(), cel::to_value(&v).unwrap());
    }

    #[test]
    fn runtime_errors_are_errors_not_panics() {
        let f = Filter::compile("object.spec.replicas > 2", false).unwrap();
        assert!(f.eval(&json!({"spec": {}}), None, "added").is_err());
        assert!(f.eval(&json!({"spec": {"replicas": 3}}), None, "added").unwrap());
    }
}
