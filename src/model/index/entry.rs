//! An index entry and the plain index, as callers, the stores and the effects speak them.

use std::collections::HashMap;

/// What the stream knows about one delivered object (never the whole object).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexEntry {
    pub namespace: Option<String>,
    pub name: String,
    pub resource_version: String,
}

/// uid -> entry, as loaded and written (foldhash: the uids come from the apiserver).
pub type Index = HashMap<String, IndexEntry, foldhash::fast::RandomState>;
