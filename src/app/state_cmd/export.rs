//! The export document of `kubecast state export` / `import`: versioned, with the cluster's
//! identity and, per stream, its key, position and index rows.

use serde::{Deserialize, Serialize};

use crate::model::{IndexEntry, ObjectIndex, Position};
use crate::state::store::StreamKey;

/// Format of the export document.
pub const EXPORT_FORMAT: u32 = 1;

/// The export document: every stream of a store, with what kubecast needs to resume it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Export {
    pub format: u32,
    /// `[cluster] name` of the exporting config.
    pub cluster_name: String,
    /// The uid of the `kube-system` namespace of the cluster at export time.
    pub cluster_uid: Option<String>,
    /// Where it came from (`directory ./state`, `Kafka topic kubecast-state`...).
    pub source: String,
    pub exported_at: String,
    pub streams: Vec<ExportedStream>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedStream {
    /// [`StreamKey::id`] (informative; the key is what counts).
    pub id: String,
    pub key: StreamKey,
    pub cluster_uid: Option<String>,
    pub resource_version: Option<String>,
    #[serde(default)]
    pub acked_ahead: Vec<(String, String)>,
    /// `[uid, namespace, name, resourceVersion]`, namespace `""` when cluster-scoped.
    pub objects: Vec<(String, String, String, String)>,
    /// The next list emits every object (a `reset --to snapshot` not run yet).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot: bool,
}

impl Export {
    pub fn parse(bytes: &[u8]) -> Result<Export, String> {
        #[derive(Deserialize)]
        struct Versioned {
            format: u32,
        }
        const FIX: &str = "(fix: give a file that `kubecast state export` wrote)";
        if bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|b| *b != b'{') {
            return Err(format!("not a kubecast state export: it is not a JSON object {FIX}"));
        }
        let v: Versioned = serde_json::from_slice(bytes).map_err(|e| {
            let what = if e.is_data() {
                "it is not a JSON object with a \"format\" number".to_string()
            } else {
                // Syntax or a cut-off file: where.
                e.to_string()
            };
            format!("not a kubecast state export: {what} {FIX}")
        })?;
        if v.format != EXPORT_FORMAT {
            return Err(format!(
                "export format {} (this kubecast reads format {EXPORT_FORMAT}; import it with the kubecast version that exported it)",
                v.format
            ));
        }
        let doc: Export =
            serde_json::from_slice(bytes).map_err(|e| format!("not a kubecast state export: {e} {FIX}"))?;
        let mut seen = std::collections::HashSet::new();
        for s in &doc.streams {
            if s.id != s.key.id() {
                return Err(format!("stream {:?}: its id does not match its key (edited?)", s.id));
            }
            if !seen.insert(&s.id) {
                return Err(format!("stream {:?} is in the file twice (fix: keep one of them)", s.id));
            }
            // The apiserver's resourceVersions are etcd revisions: decimal numbers. Anything
            // else would be refused at every watch (and "" would start one at the current
            // state, sending every object again as a change).
            if let Some(rv) = &s.resource_version
                && (rv.is_empty() || !rv.bytes().all(|b| b.is_ascii_digit()))
            {
                return Err(format!(
                    "stream {:?}: resource_version {rv:?} is not a resourceVersion (a decimal number) (fix: the number the export gave, or null to list the resource again)",
                    s.id
                ));
            }
        }
        Ok(doc)
    }
}

impl ExportedStream {
    pub(super) fn position(&self) -> Position {
        let mut objects = ObjectIndex::new();
        for (uid, ns, name, rv) in &self.objects {
            let e = IndexEntry {
                namespace: (!ns.is_empty()).then(|| ns.clone()),
                name: name.clone(),
                resource_version: rv.clone(),
            };
            objects.insert(uid, &e);
        }
        Position {
            resource_version: self.resource_version.clone(),
            objects,
            acked_ahead: self.acked_ahead.clone(),
            snapshot: self.snapshot,
            adopted_from: None,
            floors: Vec::new(),
        }
    }
}
