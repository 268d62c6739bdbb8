//! The reflector's decisions, as pure functions (no I/O, no channel, no clock): what a listed
//! object, the end of a list and a watch event do to the index of delivered objects, and
//! what each of them emits. The reflector (`list.rs`, `watching.rs`) does the I/O around them.

use std::collections::HashSet;

use kube::api::{ApiResource, ObjectMeta};

use crate::model::{Effect, Index, IndexEntry, IndexOp, RawObject, Verb};

/// An object's uid and what the index keeps of it; `None` for an object without uid, name or
/// resourceVersion (it cannot be tracked).
pub(super) fn index_entry(meta: &ObjectMeta) -> Option<(String, IndexEntry)> {
    Some((
        meta.uid.clone().filter(|u| !u.is_empty())?,
        IndexEntry {
            namespace: meta.namespace.clone().filter(|n| !n.is_empty()),
            name: meta.name.clone()?,
            resource_version: meta.resource_version.clone().filter(|r| !r.is_empty())?,
        },
    ))
}

/// One listed object against the index: `None` when the index has it at this resourceVersion
/// (unchanged: nothing to emit); otherwise `added` (a new uid) or `modified` (another
/// resourceVersion), and the index now holds `entry` for `uid`.
pub(super) fn listed(index: &mut Index, uid: &str, entry: &IndexEntry) -> Option<Verb> {
    let verb = match index.get(uid) {
        None => Verb::Added,
        Some(old) if old.resource_version != entry.resource_version => Verb::Modified,
        Some(_) => return None,
    };
    index.insert(uid.to_owned(), entry.clone());
    Some(verb)
}

/// After a completed list whose uids are `seen`: the objects the index has but the list did
/// not contain were deleted while the stream was not watching. Removes them from the index
/// and returns them with their last known entry, in the index's order.
pub(super) fn tombstones(index: &mut Index, seen: &HashSet<String>) -> Vec<(String, IndexEntry)> {
    let gone: Vec<String> = index.keys().filter(|uid| !seen.contains(*uid)).cloned().collect();
    gone.into_iter()
        .map(|uid| {
            let entry = index.remove(&uid).expect("listed from the index");
            (uid, entry)
        })
        .collect()
}

/// The last known identity of an object deleted while the stream was not watching.
pub(super) fn tombstone(ar: &ApiResource, uid: &str, entry: &IndexEntry) -> RawObject {
    let mut metadata = serde_json::json!({"name": entry.name, "uid": uid, "resourceVersion": entry.resource_version});
    if let Some(ns) = &entry.namespace {
        metadata["namespace"] = ns.clone().into();
    }
    RawObject::from_value(&serde_json::json!({"apiVersion": ar.api_version, "kind": ar.kind, "metadata": metadata}))
        .expect("a tombstone is valid JSON")
}

/// What one watch event does; see [`watched`].
#[derive(Debug, PartialEq)]
pub(super) struct Watched {
    /// The item's effect: the index change, and resume after the event.
    pub effect: Effect,
    /// Where the watch resumes now: the event's resourceVersion.
    pub rv: String,
    /// The change was delivered before a restart (out of order, recorded in `acked_ahead`):
    /// the item is emitted with `delivered_before`, so it is not sent again (shaping still
    /// sees it).
    pub already_sent: bool,
}

/// A watch event `verb` of the object `(uid, entry)`: updates the index (removes the uid for
/// `deleted`, else holds `entry`), and takes the change out of `acked_ahead` if it was
/// delivered before a restart.
pub(super) fn watched(
    index: &mut Index,
    acked_ahead: &mut HashSet<(String, String)>,
    verb: Verb,
    uid: String,
    entry: IndexEntry,
) -> Watched {
    let rv = entry.resource_version.clone();
    let already_sent = !acked_ahead.is_empty() && acked_ahead.remove(&(uid.clone(), rv.clone()));
    let op = if verb == Verb::Deleted {
        index.remove(&uid);
        IndexOp::Remove(uid)
    } else {
        index.insert(uid.clone(), entry.clone());
        IndexOp::Upsert(uid, entry)
    };
    Watched { effect: Effect::Watched { op, rv: rv.clone() }, rv, already_sent }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    fn entry(name: &str, rv: &str) -> IndexEntry {
        IndexEntry { namespace: Some("ns".into()), name: name.into(), resource_version: rv.into() }
    }

    fn index(objects: &[(&str, &str)]) -> Index {
        objects.iter().map(|(uid, rv)| (uid.to_string(), entry(uid, rv))).collect()
    }

    #[test]
    fn index_entry_needs_uid_name_and_resource_version() {
        let meta = ObjectMeta {
            uid: Some("u1".into()),
            name: Some("a".into()),
            namespace: Some("ns".into()),
            resource_version: Some("7".into()),
            ..Default::default()
        };
        assert_eq!(index_entry(&meta), Some(("u1".into(), entry("a", "7"))));
        let cluster = ObjectMeta { namespace: Some(String::new()), ..meta.clone() };
        assert_eq!(index_entry(&cluster).unwrap().1.namespace, None);
        for broken in [
            ObjectMeta { uid: None, ..meta.clone() },
            ObjectMeta { uid: Some(String::new()), ..meta.clone() },
            ObjectMeta { name: None, ..meta.clone() },
            ObjectMeta { resource_version: Some(String::new()), ..meta.clone() },
        ] {
            assert_eq!(index_entry(&broken), None, "{broken:?}");
        }
    }

    #[test]
    fn a_listed_object_is_added_modified_or_unchanged() {
        let mut idx = index(&[("u1", "1"), ("u2", "2")]);
        assert_eq!(listed(&mut idx, "u3", &entry("u3", "3")), Some(Verb::Added));
        assert_eq!(idx["u3"], entry("u3", "3"));
        assert_eq!(listed(&mut idx, "u1", &entry("u1", "5")), Some(Verb::Modified));
        assert_eq!(idx["u1"], entry("u1", "5"));
        assert_eq!(listed(&mut idx, "u2", &entry("u2", "2")), None);
        assert_eq!(idx, index(&[("u1", "5"), ("u2", "2"), ("u3", "3")]));
    }

    #[test]
    fn tombstones_are_what_the_list_did_not_contain() {
        let mut idx = index(&[("u1", "1"), ("u2", "2"), ("u3", "3")]);
        let seen: HashSet<String> = ["u2".to_string()].into();
        let mut gone = tombstones(&mut idx, &seen);
        gone.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(gone, vec![("u1".into(), entry("u1", "1")), ("u3".into(), entry("u3", "3"))]);
        assert_eq!(idx, index(&[("u2", "2")]));
        assert!(tombstones(&mut idx, &seen).is_empty());
    }

    #[test]
    fn a_tombstone_carries_the_last_known_identity() {
        let ar = ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        let obj = tombstone(&ar, "u1", &entry("a", "9"));
        assert_eq!(obj.metadata.uid.as_deref(), Some("u1"));
        assert_eq!(obj.metadata.name.as_deref(), Some("a"));
        assert_eq!(obj.metadata.namespace.as_deref(), Some("ns"));
        assert_eq!(obj.metadata.resource_version.as_deref(), Some("9"));
        let cluster = tombstone(&ar, "u2", &IndexEntry { namespace: None, ..entry("b", "1") });
        assert_eq!(cluster.metadata.namespace, None);
    }

    #[test]
    fn a_watch_event_updates_the_index_and_the_resume_point() {
        let mut idx = index(&[("u1", "1")]);
        let mut ahead = HashSet::new();
        let w = watched(&mut idx, &mut ahead, Verb::Modified, "u1".into(), entry("u1", "4"));
        let want = Effect::Watched { op: IndexOp::Upsert("u1".into(), entry("u1", "4")), rv: "4".into() };
        assert_eq!(w, Watched { effect: want, rv: "4".into(), already_sent: false });
        assert_eq!(idx, index(&[("u1", "4")]));
        let w = watched(&mut idx, &mut ahead, Verb::Added, "u2".into(), entry("u2", "5"));
        assert_eq!(w.rv, "5");
        assert_eq!(idx, index(&[("u1", "4"), ("u2", "5")]));
        let w = watched(&mut idx, &mut ahead, Verb::Deleted, "u1".into(), entry("u1", "6"));
        assert_eq!(
            w,
            Watched {
                effect: Effect::Watched { op: IndexOp::Remove("u1".into()), rv: "6".into() },
                rv: "6".into(),
                already_sent: false
            }
        );
        assert_eq!(idx, index(&[("u2", "5")]));
    }

    #[test]
    fn a_watch_event_delivered_before_a_restart_is_not_sent_again_once() {
        let mut idx = Index::default();
        let mut ahead: HashSet<(String, String)> = [("u1".to_string(), "3".to_string())].into();
        assert!(!watched(&mut idx, &mut ahead, Verb::Added, "u1".into(), entry("u1", "2")).already_sent);
        let w = watched(&mut idx, &mut ahead, Verb::Modified, "u1".into(), entry("u1", "3"));
        assert!(w.already_sent);
        // Still applied to the index and the resume point.
        assert_eq!(w.rv, "3");
        assert_eq!(idx, index(&[("u1", "3")]));
        assert!(ahead.is_empty());
        // A second delivery of the same change (a re-watch from an earlier rv) is sent.
        assert!(!watched(&mut idx, &mut ahead, Verb::Modified, "u1".into(), entry("u1", "3")).already_sent);
    }

    /// uid -> resourceVersion, from a small space so lists and indexes overlap.
    fn objects() -> impl Strategy<Value = BTreeMap<u8, u8>> {
        proptest::collection::btree_map(0u8..24, 0u8..4, 0..16)
    }

    fn as_index(objects: &BTreeMap<u8, u8>) -> Index {
        objects.iter().map(|(u, rv)| (format!("u{u}"), entry(&format!("n{u}"), &rv.to_string()))).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// A list diffed against an index emits exactly the changes between them, and leaves
        /// the index equal to the list.
        #[test]
        fn diffing_a_list_emits_exactly_the_changes(
            before in objects(),
            list in objects(),
            order in proptest::collection::vec(any::<prop::sample::Index>(), 0..16),
        ) {
            let old = as_index(&before);
            let mut idx = old.clone();
            let mut listing: Vec<(String, IndexEntry)> = as_index(&list).into_iter().collect();
            // Any order of the list's objects.
            for (i, at) in order.iter().enumerate() {
                if !listing.is_empty() {
                    let (n, j) = (listing.len(), at.index(listing.len()));
                    listing.swap(i % n, j);
                }
            }
            let mut emitted: BTreeMap<String, Verb> = BTreeMap::new();
            let mut seen = HashSet::new();
            for (uid, e) in &listing {
                seen.insert(uid.clone());
                if let Some(verb) = listed(&mut idx, uid, e) {
                    prop_assert!(emitted.insert(uid.clone(), verb).is_none(), "one change per uid");
                }
            }
            for (uid, e) in tombstones(&mut idx, &seen) {
                prop_assert_eq!(Some(&e), old.get(&uid), "the last known entry");
                prop_assert!(emitted.insert(uid, Verb::Deleted).is_none(), "one change per uid");
            }
            let mut want = BTreeMap::new();
            for (u, rv) in &list {
                match before.get(u) {
                    None => { want.insert(format!("u{u}"), Verb::Added); }
                    Some(old) if old != rv => { want.insert(format!("u{u}"), Verb::Modified); }
                    Some(_) => {}
                }
            }
            for u in before.keys().filter(|u| !list.contains_key(u)) {
                want.insert(format!("u{u}"), Verb::Deleted);
            }
            prop_assert_eq!(emitted, want);
            prop_assert_eq!(idx, as_index(&list));
        }

        /// Watch events keep the index equal to a model of it, move the resume point to each
        /// event's resourceVersion, and skip each change delivered before a restart once.
        #[test]
        fn watch_events_follow_a_model_of_the_index(
            before in objects(),
            events in proptest::collection::vec((0u8..3, 0u8..24, 0u8..6), 0..24),
            ahead in proptest::collection::btree_set((0u8..24, 0u8..6), 0..6),
        ) {
            let mut idx = as_index(&before);
            let mut model = before.clone();
            let mut acked: HashSet<(String, String)> =
                ahead.iter().map(|(u, rv)| (format!("u{u}"), rv.to_string())).collect();
            let mut unsent: BTreeSet<(u8, u8)> = ahead.clone();
            for (verb, u, rv) in events {
                let verb = Verb::ALL[verb as usize];
                let w = watched(&mut idx, &mut acked, verb, format!("u{u}"), entry(&format!("n{u}"), &rv.to_string()));
                if verb == Verb::Deleted {
                    model.remove(&u);
                    prop_assert_eq!(&w.effect, &Effect::Watched { op: IndexOp::Remove(format!("u{u}")), rv: rv.to_string() });
                } else {
                    model.insert(u, rv);
                }
                prop_assert_eq!(w.rv, rv.to_string());
                prop_assert_eq!(w.already_sent, unsent.remove(&(u, rv)));
                prop_assert_eq!(&idx, &as_index(&model));
            }
            prop_assert_eq!(acked.len(), unsent.len());
        }
    }
}
