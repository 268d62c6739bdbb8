use proptest::prelude::*;

use super::*;

const U1: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";
const U2: &str = "aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";

fn entry(ns: Option<&str>, name: &str, rv: &str) -> IndexEntry {
    IndexEntry { namespace: ns.map(Into::into), name: name.into(), resource_version: rv.into() }
}

#[test]
fn entries_read_back_as_inserted_whichever_way_they_are_kept() {
    let mut idx = ObjectIndex::new();
    let cases = [
        (U1, entry(Some("shop"), "a", "10")),
        (U2, entry(None, "node-1", "11")),
        ("u3", entry(Some("shop"), "b", "12")),
        ("0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0", entry(Some("shop"), "c", "13")),
        ("bbbbbbbb-bbbb-cccc-dddd-eeeeeeeeeeee", entry(Some("web"), "d", "opaque/14")),
        ("cccccccc-bbbb-cccc-dddd-eeeeeeeeeeee", entry(Some("web"), "e", "015")),
    ];
    for (uid, e) in &cases {
        idx.insert(uid, e);
    }
    assert_eq!(idx.len(), cases.len());
    assert_eq!(idx.slots.len(), 2, "UUID uid and decimal rv: compact");
    assert_eq!(idx.namespaces(), 1, "interned for compact entries: shop (U2 is cluster-scoped)");
    for (uid, e) in &cases {
        let got = idx.get(uid).unwrap_or_else(|| panic!("{uid}"));
        assert!(got.is(e), "{uid}: {got:?}");
        assert_eq!(got.to_entry(), *e);
        assert!(got.resource_version.is(&e.resource_version));
    }
    assert!(idx.get("u4").is_none() && idx.get("dddddddd-bbbb-cccc-dddd-eeeeeeeeeeee").is_none());
    let plain = idx.to_index();
    assert_eq!(plain.len(), cases.len());
    for (uid, e) in &cases {
        assert_eq!(plain[*uid], *e);
    }
    assert_eq!(ObjectIndex::from(plain), idx);
}

#[test]
fn an_entry_moves_between_compact_and_text_when_its_resource_version_does() {
    let mut idx = ObjectIndex::new();
    idx.insert(U1, &entry(Some("shop"), "a", "1"));
    idx.insert(U1, &entry(Some("shop"), "a", "v2"));
    assert_eq!((idx.slots.len(), idx.loose.len()), (0, 1));
    assert_eq!(idx.get(U1).unwrap().to_entry(), entry(Some("shop"), "a", "v2"));
    idx.insert(U1, &entry(Some("shop"), "a", "3"));
    assert_eq!((idx.slots.len(), idx.loose.len()), (1, 0));
    assert_eq!(idx.remove(U1), Some(entry(Some("shop"), "a", "3")));
    assert!(idx.is_empty());
    assert_eq!(idx.remove(U1), None);
}

#[test]
fn removing_fills_the_hole_with_the_last_slot_and_frees_what_it_held() {
    let mut idx = ObjectIndex::new();
    let uids: Vec<String> = (0..3000u32).map(|i| format!("{i:08x}-0000-4000-8000-000000000000")).collect();
    for (i, uid) in uids.iter().enumerate() {
        idx.insert(uid, &entry(Some(&format!("ns{}", i % 3)), &format!("object-{i}"), &i.to_string()));
    }
    for uid in uids.iter().step_by(2) {
        assert!(idx.remove(uid).is_some());
    }
    for (i, uid) in uids.iter().enumerate() {
        let want = (i % 2 == 1).then(|| entry(Some(&format!("ns{}", i % 3)), &format!("object-{i}"), &i.to_string()));
        assert_eq!(idx.get(uid).map(|e| e.to_entry()), want, "{uid}");
    }
    assert!(idx.names.live_bytes() < 1500 * 12, "removed names are no longer live");
    for uid in &uids {
        idx.remove(uid);
    }
    assert!(idx.is_empty());
    assert_eq!(idx.namespaces(), 0, "no namespace is kept without an object in it");
    assert_eq!(idx.slots.capacity(), 0, "memory given back: {}", idx.slots.capacity());
    assert!(idx.table.capacity() <= 2048, "memory given back: {}", idx.table.capacity());
}

#[test]
fn a_renamed_uid_is_held_under_its_new_name() {
    let mut idx = ObjectIndex::new();
    idx.insert(U1, &entry(Some("shop"), "a", "1"));
    idx.insert(U1, &entry(Some("web"), "b", "2"));
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.get(U1).unwrap().to_entry(), entry(Some("web"), "b", "2"));
    assert_eq!(idx.namespaces(), 1);
}

/// A uid: a few UUIDs, their upper-case spelling, and other texts.
fn uid() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0u8..6).prop_map(|i| format!("{i:08x}-0000-4000-8000-00000000000{i}")),
        1 => (0u8..2).prop_map(|i| format!("{i:08X}-0000-4000-8000-00000000000{i}")),
        1 => "[a-z0-9]{0,4}",
    ]
}

fn rv() -> impl Strategy<Value = String> {
    prop_oneof![4 => (0u64..50).prop_map(|n| n.to_string()), 1 => "[0-9a-z/]{0,3}", 1 => Just(u64::MAX.to_string())]
}

fn index_entry() -> impl Strategy<Value = IndexEntry> {
    let ns = prop_oneof![Just(None), Just(Some("shop".to_string())), Just(Some("web".to_string()))];
    (ns, "[a-zé-]{0,6}", rv()).prop_map(|(namespace, name, resource_version)| IndexEntry {
        namespace,
        name,
        resource_version,
    })
}

#[derive(Debug, Clone)]
enum Op {
    Insert(String, IndexEntry),
    Remove(String),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![3 => (uid(), index_entry()).prop_map(|(u, e)| Op::Insert(u, e)), 2 => uid().prop_map(Op::Remove)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The compact index behaves like a `HashMap<String, IndexEntry>` for any sequence of
    /// inserts and removes, including uids that are not UUIDs and non-numeric
    /// resourceVersions.
    #[test]
    fn behaves_like_a_map(ops in proptest::collection::vec(op(), 0..80)) {
        let mut idx = ObjectIndex::new();
        let mut model = Index::default();
        for op in ops {
            match op {
                Op::Insert(u, e) => {
                    idx.insert(&u, &e);
                    model.insert(u, e);
                }
                Op::Remove(u) => prop_assert_eq!(idx.remove(&u), model.remove(&u)),
            }
            prop_assert_eq!(idx.len(), model.len());
            prop_assert_eq!(idx.to_index(), model.clone());
        }
        for (u, e) in &model {
            prop_assert!(idx.contains(u));
            prop_assert!(idx.get(u).unwrap().is(e));
        }
        prop_assert_eq!(&ObjectIndex::from(model.clone()), &idx);
        prop_assert!(idx.namespaces() <= 2);
        for u in model.keys() {
            idx.remove(u);
        }
        prop_assert!(idx.is_empty());
        prop_assert_eq!((idx.namespaces(), idx.names.live_bytes()), (0, 0), "nothing kept of removed entries");
    }
}
