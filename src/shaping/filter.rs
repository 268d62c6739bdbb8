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

pub const VARIABLES: [&str; 3] = ["object", "oldObject", "verb"];

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
        let filter = Filter { program, source: source.to_string() };
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
        }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the event passes (`true`: deliver).
    pub fn eval(&self, object: &Value, old: Option<&Value>, verb: &str) -> Result<bool, EvalError> {
        let mut ctx = Context::with_env(env());
        ctx.add_variable("object", object)
            .map_err(|e| EvalError::Exec(ExecutionError::function_error("object", e.to_string())))?;
        match old {
            Some(o) => ctx
                .add_variable("oldObject", o)
                .map_err(|e| EvalError::Exec(ExecutionError::function_error("oldObject", e.to_string())))?,
            None => ctx.add_variable_from_value("oldObject", CelValue::Null),
        }
        ctx.add_variable_from_value("verb", verb.to_string());
        match self.program.execute(&ctx).map_err(EvalError::Exec)? {
            CelValue::Bool(b) => Ok(b),
            other => Err(EvalError::NotBool(format!("{:?}", other.type_of()))),
        }
    }
}

#[derive(Debug)]
pub enum EvalError {
    Exec(ExecutionError),
    NotBool(String),
}

impl std::fmt::Display for EvalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalError::Exec(e) => write!(f, "{e}"),
            EvalError::NotBool(t) => write!(f, "the result is a {t}, not a bool"),
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
    fn runtime_errors_are_errors_not_panics() {
        let f = Filter::compile("object.spec.replicas > 2", false).unwrap();
        assert!(f.eval(&json!({"spec": {}}), None, "added").is_err());
        assert!(f.eval(&json!({"spec": {"replicas": 3}}), None, "added").unwrap());
    }
}
