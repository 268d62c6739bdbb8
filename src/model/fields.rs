//! The fields of an event that destination templates (`topic`, `subject`) and metrics use.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// The fields a destination template can use, for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    /// Those of its resource type, shared by all its events (interned: no reference count
    /// to change per event, on two threads).
    pub of_type: &'static TypeFields,
    /// Empty for cluster-scoped objects.
    pub namespace: String,
    /// `added`, `modified` or `deleted`.
    pub verb: &'static str,
}

impl Fields {
    /// Sample values, to check what a destination template makes: `c`, `g`, `v`, `K`, `r`,
    /// an empty namespace (a cluster-scoped object's), `added`.
    pub fn sample() -> Self {
        let of_type = TypeFields {
            cluster: "c".into(),
            group: "g".into(),
            version: "v".into(),
            kind: "K".into(),
            resource: "r".into(),
        }
        .intern();
        Fields { of_type, namespace: String::new(), verb: "added" }
    }
}

impl Default for Fields {
    fn default() -> Self {
        static NONE: TypeFields = TypeFields {
            cluster: String::new(),
            group: String::new(),
            version: String::new(),
            kind: String::new(),
            resource: String::new(),
        };
        Fields { of_type: &NONE, namespace: String::new(), verb: "" }
    }
}

/// The fields of one resource type (in one cluster).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct TypeFields {
    pub cluster: String,
    /// `core` for the core group.
    pub group: String,
    pub version: String,
    pub kind: String,
    /// The plural resource name, e.g. `configmaps`.
    pub resource: String,
}

impl TypeFields {
    pub fn new(cluster: &str, ar: &kube::api::ApiResource) -> Self {
        Self {
            cluster: cluster.to_string(),
            group: if ar.group.is_empty() { "core".into() } else { ar.group.clone() },
            version: ar.version.clone(),
            kind: ar.kind.clone(),
            resource: ar.plural.clone(),
        }
    }

    /// These fields for the rest of the process, the same reference for equal fields (one per
    /// watched resource type: a bounded set).
    pub fn intern(self) -> &'static TypeFields {
        static KNOWN: OnceLock<Mutex<HashSet<&'static TypeFields>>> = OnceLock::new();
        let mut known = KNOWN.get_or_init(Default::default).lock().expect("interned type fields");
        if let Some(k) = known.get(&self) {
            return k;
        }
        let leaked: &'static TypeFields = Box::leak(Box::new(self));
        known.insert(leaked);
        leaked
    }
}
