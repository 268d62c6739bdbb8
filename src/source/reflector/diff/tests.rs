use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;
use crate::model::{Index, UidList};
use crate::source::reflector::view::testkit::Stream;

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

/// Diffs one listed object and emits its change, as `Reflector::diff_item` does.
fn list_one(s: &mut Stream, uid: &str, e: &IndexEntry) -> Option<Verb> {
    let verb = listed(&s.view, uid, e)?;
    s.emit(Effect::Diffed(IndexOp::Upsert(uid.into(), e.clone())));
    Some(verb)
}

#[test]
fn a_listed_object_is_added_modified_or_unchanged() {
    let mut s = Stream::new(index(&[("u1", "1"), ("u2", "2")]));
    assert_eq!(list_one(&mut s, "u3", &entry("u3", "3")), Some(Verb::Added));
    assert_eq!(s.view.get("u3"), Some(entry("u3", "3")), "the emitted change is in the view at once");
    assert_eq!(list_one(&mut s, "u1", &entry("u1", "5")), Some(Verb::Modified));
    assert_eq!(s.view.get("u1"), Some(entry("u1", "5")));
    assert_eq!(list_one(&mut s, "u2", &entry("u2", "2")), None);
    assert_eq!(list_one(&mut s, "u3", &entry("u3", "3")), None, "against the emitted, not yet acknowledged");
    let want = index(&[("u1", "5"), ("u2", "2"), ("u3", "3")]);
    assert_eq!(s.view.to_index(), want);
    assert_eq!(s.acked(), index(&[("u1", "1"), ("u2", "2")]), "nothing acknowledged yet");
    s.ack_all();
    assert_eq!(s.acked(), want);
    assert_eq!(s.view.len(), 3);
}

#[test]
fn tombstones_are_what_the_list_did_not_contain() {
    let mut s = Stream::new(index(&[("u1", "1"), ("u2", "2"), ("u3", "3")]));
    // u4 emitted and not yet acknowledged, u3 removed by an item still in flight.
    s.emit(Effect::Diffed(IndexOp::Upsert("u4".into(), entry("u4", "4"))));
    s.emit(Effect::Watched { op: IndexOp::Remove("u3".into()), rv: "5".into() });
    let mut seen = UidList::new();
    seen.insert("u2");
    let seen = seen.into_set();
    let mut gone = s.view.absent_from(&seen);
    gone.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(gone, vec![("u1".into(), entry("u1", "1")), ("u4".into(), entry("u4", "4"))]);
    for (uid, _) in gone {
        s.emit(Effect::Diffed(IndexOp::Remove(uid)));
    }
    assert_eq!(s.view.to_index(), index(&[("u2", "2")]));
    assert!(s.view.absent_from(&seen).is_empty());
    s.ack_all();
    assert_eq!(s.acked(), index(&[("u2", "2")]));
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
fn a_watch_event_changes_the_index_and_the_resume_point() {
    let mut ahead = HashSet::new();
    let w = watched(&mut ahead, Verb::Modified, "u1".into(), entry("u1", "4"));
    let want = Effect::Watched { op: IndexOp::Upsert("u1".into(), entry("u1", "4")), rv: "4".into() };
    assert_eq!(w, Watched { effect: want, rv: "4".into(), already_sent: false });
    let w = watched(&mut ahead, Verb::Added, "u2".into(), entry("u2", "5"));
    assert_eq!(w.rv, "5");
    let w = watched(&mut ahead, Verb::Deleted, "u1".into(), entry("u1", "6"));
    assert_eq!(
        w,
        Watched {
            effect: Effect::Watched { op: IndexOp::Remove("u1".into()), rv: "6".into() },
            rv: "6".into(),
            already_sent: false
        }
    );
}

#[test]
fn a_watch_event_delivered_before_a_restart_is_not_sent_again_once() {
    let mut ahead: HashSet<(String, String)> = [("u1".to_string(), "3".to_string())].into();
    assert!(!watched(&mut ahead, Verb::Added, "u1".into(), entry("u1", "2")).already_sent);
    let w = watched(&mut ahead, Verb::Modified, "u1".into(), entry("u1", "3"));
    assert!(w.already_sent);
    // Still an index change and a resume point.
    assert_eq!(w.rv, "3");
    assert_eq!(w.effect.op(), Some(&IndexOp::Upsert("u1".into(), entry("u1", "3"))));
    assert!(ahead.is_empty());
    // A second delivery of the same change (a re-watch from an earlier rv) is sent.
    assert!(!watched(&mut ahead, Verb::Modified, "u1".into(), entry("u1", "3")).already_sent);
}

/// The uid of object `u`: a UUID for even `u` (kept compact), text for odd ones.
fn uid(u: u8) -> String {
    if u.is_multiple_of(2) { format!("{u:08x}-0000-4000-8000-000000000000") } else { format!("u{u}") }
}

/// The resourceVersion `rv`: decimal, except 3 (kept as text).
fn rv_text(rv: u8) -> String {
    if rv == 3 { "r3".into() } else { rv.to_string() }
}

fn entry_of(u: u8, rv: u8) -> IndexEntry {
    entry(&format!("n{u}"), &rv_text(rv))
}

/// uid -> resourceVersion, from a small space so lists and indexes overlap.
fn objects() -> impl Strategy<Value = BTreeMap<u8, u8>> {
    proptest::collection::btree_map(0u8..24, 0u8..4, 0..16)
}

fn as_index(objects: &BTreeMap<u8, u8>) -> Index {
    objects.iter().map(|(u, rv)| (uid(*u), entry_of(*u, *rv))).collect()
}

/// Watch events `(verb, u, rv)` (`rv` 0..6).
fn events() -> impl Strategy<Value = Vec<(u8, u8, u8)>> {
    proptest::collection::vec((0u8..3, 0u8..24, 0u8..6), 0..24)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// A list diffed against the index (what it holds after the watch events emitted before
    /// it, acknowledged or not) emits exactly the changes between them, and leaves the index
    /// equal to the list, however the acknowledgements interleave.
    #[test]
    fn diffing_a_list_emits_exactly_the_changes(
        start in objects(),
        before_list in events(),
        list in objects(),
        order in proptest::collection::vec(any::<prop::sample::Index>(), 0..16),
        acks in proptest::collection::vec(0usize..4, 64),
    ) {
        let mut s = Stream::new(as_index(&start));
        let mut acks = acks.into_iter().cycle();
        // The index before the list: the start and the watch events after it.
        let mut before = start.clone();
        for (verb, u, rv) in before_list {
            let verb = Verb::ALL[verb as usize];
            s.emit(watched(&mut HashSet::new(), verb, uid(u), entry_of(u, rv % 4)).effect);
            if verb == Verb::Deleted { before.remove(&u); } else { before.insert(u, rv % 4); }
            s.ack(acks.next().unwrap());
        }
        let old = as_index(&before);
        prop_assert_eq!(s.view.to_index(), old.clone());
        let mut listing: Vec<(String, IndexEntry)> = as_index(&list).into_iter().collect();
        // Any order of the list's objects.
        for (i, at) in order.iter().enumerate() {
            if !listing.is_empty() {
                let (n, j) = (listing.len(), at.index(listing.len()));
                listing.swap(i % n, j);
            }
        }
        let mut emitted: BTreeMap<String, Verb> = BTreeMap::new();
        let mut seen = UidList::new();
        for (u, e) in &listing {
            seen.insert(u);
            if let Some(verb) = list_one(&mut s, u, e) {
                prop_assert!(emitted.insert(u.clone(), verb).is_none(), "one change per uid");
            }
            s.ack(acks.next().unwrap());
        }
        let absent = s.view.absent_from(&seen.into_set());
        // What lets a first list collect no uids (`Reflector::seen_list`).
        prop_assert!(!old.is_empty() || absent.is_empty(), "a list after an empty index misses nothing");
        for (u, e) in absent {
            prop_assert_eq!(Some(&e), old.get(&u), "the last known entry");
            prop_assert!(emitted.insert(u.clone(), Verb::Deleted).is_none(), "one change per uid");
            s.emit(Effect::Diffed(IndexOp::Remove(u)));
            s.ack(acks.next().unwrap());
        }
        let mut want = BTreeMap::new();
        for (u, rv) in &list {
            match before.get(u) {
                None => { want.insert(uid(*u), Verb::Added); }
                Some(old) if old != rv => { want.insert(uid(*u), Verb::Modified); }
                Some(_) => {}
            }
        }
        for u in before.keys().filter(|u| !list.contains_key(u)) {
            want.insert(uid(*u), Verb::Deleted);
        }
        prop_assert_eq!(emitted, want);
        prop_assert_eq!(s.view.to_index(), as_index(&list));
        prop_assert_eq!(s.view.len(), list.len());
        prop_assert!(s.view.pending() <= s.in_flight(), "the overlay holds no more than what is in flight");
        s.ack_all();
        prop_assert_eq!(s.acked(), as_index(&list));
        prop_assert_eq!(s.view.pending(), 0, "nothing in flight, nothing in the overlay");
    }

    /// Watch events keep the index equal to a model of it, move the resume point to each
    /// event's resourceVersion, and skip each change delivered before a restart once.
    #[test]
    fn watch_events_follow_a_model_of_the_index(
        before in objects(),
        events in events(),
        ahead in proptest::collection::btree_set((0u8..24, 0u8..6), 0..6),
        acks in proptest::collection::vec(0usize..3, 24),
    ) {
        let mut s = Stream::new(as_index(&before));
        let mut model = before.clone();
        let mut acked: HashSet<(String, String)> =
            ahead.iter().map(|(u, rv)| (uid(*u), rv_text(*rv))).collect();
        let mut unsent: BTreeSet<(u8, u8)> = ahead.clone();
        let mut last_rv = None;
        for ((verb, u, rv), ack) in events.into_iter().zip(acks.into_iter().cycle()) {
            let verb = Verb::ALL[verb as usize];
            let w = watched(&mut acked, verb, uid(u), entry_of(u, rv));
            if verb == Verb::Deleted {
                model.remove(&u);
                prop_assert_eq!(&w.effect, &Effect::Watched { op: IndexOp::Remove(uid(u)), rv: rv_text(rv) });
            } else {
                model.insert(u, rv);
            }
            prop_assert_eq!(&w.rv, &rv_text(rv));
            prop_assert_eq!(w.already_sent, unsent.remove(&(u, rv)));
            last_rv = Some(w.rv);
            s.emit(w.effect);
            s.ack(ack);
            prop_assert_eq!(s.view.to_index(), as_index(&model));
            prop_assert_eq!(s.view.len(), model.len());
        }
        prop_assert_eq!(acked.len(), unsent.len());
        s.ack_all();
        prop_assert_eq!(s.acked(), as_index(&model));
        prop_assert_eq!(s.resume, last_rv, "resumes after the last event");
    }
}
