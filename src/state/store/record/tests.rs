//! Unit tests of the records' fold (`record.rs`): keys, layouts, other shard counts adopted, bad records, epochs.
use super::*;
use std::collections::BTreeSet;

use crate::model::{Index, IndexEntry};
use proptest::prelude::*;

fn key(kind: &str) -> StreamKey {
    StreamKey {
        cluster: "c".into(),
        group: "apps".into(),
        version: "v1".into(),
        kind: kind.into(),
        namespace: Some("shop".into()),
        label_selector: "".into(),
        field_selector: "".into(),
        shard: None,
    }
}

fn owner(epoch: i64, uid: Option<&str>) -> Owner {
    Owner { cluster_uid: uid.map(Into::into), epoch: Some(epoch), writer: "w".into() }
}

#[test]
fn keys_split_back_into_stream_and_uid() {
    let mut odd = key("Widget");
    odd.group = "o.example.com".into();
    let ids: HashMap<String, usize> = [(key("Deployment").id(), 0), (odd.id(), 1)].into_iter().collect();
    let uid = "6f1c1a9e-2b7d-4c1e-9f00-0123456789ab";
    for (id, slot) in &ids {
        assert!(matches!(split_key(&position_key(id), &ids), Some((s, Rest::Position)) if s == *slot));
        assert!(matches!(split_key(&object_key(id, uid), &ids), Some((s, Rest::Object(u))) if s == *slot && u == uid));
    }
    assert!(split_key(&object_key(&key("StatefulSet").id(), uid), &ids).is_none(), "not ours");
}

/// The index records of `objects` (uid, rv) for stream `k`, and its position record.
fn records(k: &StreamKey, objects: &[(&str, &str)], owner: &Owner) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = objects
        .iter()
        .map(|(uid, rv)| (object_key(&k.id(), uid), format!(r#"["shop","{uid}","{rv}"]"#).into_bytes()))
        .collect();
    out.push((position_key(&k.id()), PositionRecord::new(k, owner, Some("10"), &[]).encode()));
    out
}

/// Uids whose shard of `count` is `index`.
fn uids_of(index: u32, count: u32, n: usize) -> Vec<String> {
    let s = Shard::new(index, count).unwrap();
    (0..).map(|i| format!("uid-{i}")).filter(|u| s.owns(u)).take(n).collect()
}

#[test]
fn other_shards_of_the_count_are_skipped_and_another_count_s_state_is_adopted() {
    let whole = key("Deployment");
    let shard = |i, n| whole.with_shard(Shard::new(i, n));
    assert_eq!(shard(1, 4).id(), format!("{}.shard-1-of-4", whole.id()));
    assert_eq!(shard(1, 4).base_id(), whole.id(), "the stream's id does not change without shards");
    let mine = owner(1, None);
    // Written by 2 shards: each its own objects.
    let (a, b) = (uids_of(0, 2, 6), uids_of(1, 2, 6));
    let mut written = Vec::new();
    for (i, uids) in [(0, &a), (1, &b)] {
        let objects: Vec<(&str, &str)> = uids.iter().map(|u| (u.as_str(), "7")).collect();
        written.extend(records(&shard(i, 2), &objects, &mine));
    }
    // Shard 1-of-4 of a new count resumes from them: the objects it owns, no resume point.
    let ours = [shard(1, 4)];
    let mut l = Loader::new("test", &ours, &mine);
    for (order, (k, v)) in written.iter().enumerate() {
        l.apply(k, Some(v), order as u64).unwrap();
    }
    assert_eq!(l.adopting(), [2]);
    let p = l.finish().unwrap().remove(0).expect("adopted");
    assert_eq!(
        (p.resource_version.as_deref(), p.adopted_from),
        (Some("10"), Some(2)),
        "a watch from the oldest position"
    );
    assert_eq!(p.floors, [(Shard::new(0, 2).unwrap(), 10), (Shard::new(1, 2).unwrap(), 10)], "each old shard's floor");
    let four = Shard::new(1, 4).unwrap();
    let want: BTreeSet<String> = a.iter().chain(&b).filter(|u| four.owns(u)).cloned().collect();
    let got: BTreeSet<String> = p.objects.iter().map(|(u, _)| u.to_string()).collect();
    assert_eq!(got, want, "exactly the objects shard 1-of-4 owns, from both old shards");
    assert!(!want.is_empty());
    // One old shard without a position: nothing to resume a watch from, a relist-diff.
    let mut l = Loader::new("test", &ours, &mine);
    for (order, (k, v)) in written.iter().enumerate().filter(|(_, (k, _))| !k.starts_with(&shard(1, 2).id())) {
        l.apply(k, Some(v), order as u64).unwrap();
    }
    let p = l.finish().unwrap().remove(0).unwrap();
    assert_eq!((p.resource_version.as_deref(), p.floors.len()), (None, 0), "{p:?}");
    // Its own state written after theirs: its own, as it is; the other shards of its count
    // are another process's, skipped unread.
    let mut l = Loader::new("test", &ours, &mine);
    for (order, (k, v)) in written.iter().enumerate() {
        l.apply(k, Some(v), order as u64).unwrap();
    }
    l.apply(&position_key(&shard(0, 4).id()), Some(b"not read"), 98).unwrap();
    l.apply(
        &position_key(&shard(1, 4).id()),
        Some(&PositionRecord::new(&shard(1, 4), &mine, Some("99"), &[]).encode()),
        99,
    )
    .unwrap();
    assert!(l.adopting().is_empty());
    let p = l.finish().unwrap().remove(0).unwrap();
    assert_eq!((p.resource_version.as_deref(), p.adopted_from), (Some("99"), None));
    // Back to no shards, after the 2 shards wrote last: adopted, the whole stream's own
    // older objects kept for the diff.
    let plain = [whole.clone()];
    let mut l = Loader::new("test", &plain, &mine);
    for (k, v) in records(&whole, &[("gone-since", "3")], &mine) {
        l.apply(&k, Some(&v), 0).unwrap();
    }
    for (order, (k, v)) in written.iter().enumerate() {
        l.apply(k, Some(v), 1 + order as u64).unwrap();
    }
    let p = l.finish().unwrap().remove(0).unwrap();
    assert_eq!(p.adopted_from, Some(2));
    assert_eq!(p.objects.len(), a.len() + b.len() + 1, "both shards' objects and the older one");
    // Another stream's shards are not this stream's.
    let mut l = Loader::new("test", &plain, &mine);
    l.apply(&position_key(&key("StatefulSet").with_shard(Shard::new(0, 2)).id()), Some(b"x"), 0).unwrap();
    assert!(l.finish().unwrap()[0].is_none());
}

#[test]
fn foreign_cluster_and_bad_records_are_errors() {
    let keys = [key("Deployment")];
    let k = &keys[0];
    let mine = owner(3, Some("uid-a"));
    let p = |o: &Owner| PositionRecord::new(k, o, Some("10"), &[]).encode();
    let mut l = Loader::new("test", &keys, &mine);
    let e = l.apply(&position_key(&k.id()), Some(&p(&owner(3, Some("uid-b")))), 0).unwrap_err().to_string();
    assert!(e.contains("uid-b") && e.contains("uid-a"), "{e}");
    l.apply(&position_key(&k.id()), Some(&p(&owner(3, Some("uid-a")))), 0).unwrap();
    let e = l.apply(&object_key(&k.id(), "u"), Some(b"{"), 0).unwrap_err().to_string();
    assert!(e.contains(".o.u"), "names the record: {e}");
    let e = l.apply(&position_key(&k.id()), Some(b"{\"format\":9}"), 0).unwrap_err().to_string();
    assert!(e.contains("format 9"), "{e}");
    // Another stream's records are not ours.
    l.apply(&object_key(&key("StatefulSet").id(), "u"), Some(b"{"), 0).unwrap();
    let mut l = Loader::new("test", &keys, &mine);
    l.apply(&object_key(&k.id(), "u"), Some(&encode_object((&entry("1")).into())), 0).unwrap();
    assert!(l.finish().unwrap_err().to_string().contains("no position record"));
}

/// State written under a higher lease epoch belongs to a later holder of the Lease: refused,
/// naming the record, both epochs and the writer; the same or a lower epoch is loaded, and
/// a process without a Lease is not compared.
#[test]
fn a_higher_stored_epoch_is_refused() {
    let keys = [key("Deployment")];
    let k = &keys[0];
    let record = |epoch: i64| {
        let writer = Owner { writer: "kubecast-b".into(), ..owner(epoch, None) };
        PositionRecord::new(k, &writer, Some("10"), &[]).encode()
    };
    let mine = owner(3, None);
    let mut l = Loader::new("NATS bucket s", &keys, &mine);
    let e = l.apply(&position_key(&k.id()), Some(&record(4)), 0).unwrap_err();
    assert!(e.is_fatal(), "{e}");
    let text = e.to_string();
    for part in
        ["NATS bucket s", &position_key(&k.id()), "lease epoch 4", "kubecast-b", "holds epoch 3", "leaseTransitions"]
    {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    for epoch in [3, 2, 0] {
        let mut l = Loader::new("test", &keys, &mine);
        l.apply(&position_key(&k.id()), Some(&record(epoch)), 0).unwrap();
        assert_eq!(l.finish().unwrap()[0].as_ref().unwrap().resource_version.as_deref(), Some("10"));
    }
    let no_lease = Owner { epoch: None, ..mine };
    let mut l = Loader::new("test", &keys, &no_lease);
    l.apply(&position_key(&k.id()), Some(&record(7)), 0).unwrap();
    // What a process without a Lease writes is stored as epoch 0.
    assert_eq!(PositionRecord::new(k, &no_lease, None, &[]).epoch, 0);
}

#[test]
fn fold_all_finds_every_stream_by_its_position_record() {
    let (a, b) = (key("Deployment"), key("StatefulSet"));
    let me = owner(2, Some("uid-a"));
    let mut latest = Latest::new();
    let mut put = |k: String, v: Option<Vec<u8>>, ts: i64| {
        latest.insert(k, (v, Some(ts)));
    };
    put(position_key(&a.id()), Some(PositionRecord::new(&a, &me, Some("10"), &[]).encode()), 5);
    put(object_key(&a.id(), "u1"), Some(encode_object((&entry("3")).into())), 4);
    put(object_key(&a.id(), "u2"), None, 4);
    put(position_key(&b.id()), Some(PositionRecord::new(&b, &me, None, &[]).encode()), 7);
    // A stream whose position record was deleted is no stream; its records are skipped.
    let c = key("DaemonSet");
    put(position_key(&c.id()), None, 8);
    put(object_key(&c.id(), "u9"), Some(encode_object((&entry("9")).into())), 8);
    let mut found = fold_all("test", &latest).unwrap();
    found.sort_by_key(|s| s.record.stream.kind.clone());
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].record.stream, a);
    assert_eq!(found[0].record.epoch, 2);
    assert_eq!(found[0].position.objects.len(), 1);
    assert_eq!(found[0].position.resource_version.as_deref(), Some("10"));
    assert_eq!(found[0].written_ms, Some(5));
    assert_eq!(found[1].record.stream, b);
    assert!(found[1].position.objects.is_empty());
    // An unreadable record of a stream is an error naming it.
    latest.insert(object_key(&b.id(), "u3"), (Some(b"{".to_vec()), None));
    assert!(fold_all("test", &latest).unwrap_err().to_string().contains(".o.u3"));
    latest.insert(position_key(&b.id()), (Some(b"{\"format\":9}".to_vec()), None));
    assert!(fold_all("test", &latest).unwrap_err().to_string().contains("format 9"));
}

/// A sharded stream's state (as `kubecast state list` reads a Kafka or NATS store): every
/// shard is listed with its own objects, none skipped as another process's.
#[test]
fn fold_all_lists_every_shard_of_a_sharded_stream() {
    let whole = key("Deployment");
    let me = owner(3, None);
    let mut latest = Latest::new();
    for i in 0..3 {
        let s = whole.with_shard(Shard::new(i, 3));
        let rv = format!("{}", 10 + i);
        latest.insert(position_key(&s.id()), (Some(PositionRecord::new(&s, &me, Some(&rv), &[]).encode()), Some(1)));
        let uid = format!("u{i}");
        latest.insert(object_key(&s.id(), &uid), (Some(encode_object((&entry(&rv)).into())), Some(1)));
    }
    let mut found = fold_all("test", &latest).unwrap();
    found.sort_by_key(|s| s.record.stream.id());
    assert_eq!(found.len(), 3);
    for (i, s) in found.iter().enumerate() {
        assert_eq!(s.record.stream, whole.with_shard(Shard::new(i as u32, 3)));
        assert_eq!(s.position.resource_version.as_deref(), Some(format!("{}", 10 + i).as_str()));
        assert_eq!(s.position.objects.len(), 1, "shard {i}'s own object");
    }
}

/// A position written with the old shard count's floors (a new count that has not passed them
/// yet) loads with them: a restart then skips what the old shards delivered, as before it.
#[test]
fn the_floors_of_an_adopted_position_are_written_and_loaded_back() {
    let ours = [key("Deployment").with_shard(Shard::new(0, 4))];
    let me = owner(3, None);
    let floors = [(Shard::new(0, 2).unwrap(), 10), (Shard::new(1, 2).unwrap(), 25)];
    let record = PositionRecord::new(&ours[0], &me, Some("12"), &[]).with_floors(&floors);
    let mut l = Loader::new("test", &ours, &me);
    l.apply(&position_key(&ours[0].id()), Some(&record.encode()), 0).unwrap();
    let p = l.finish().unwrap().remove(0).unwrap();
    assert_eq!((p.resource_version.as_deref(), p.floors.as_slice()), (Some("12"), &floors[..]));
    assert!(
        !String::from_utf8(PositionRecord::new(&ours[0], &me, Some("30"), &[]).encode()).unwrap().contains("floors"),
        "no floors, no field (the record read by earlier versions is unchanged)"
    );
}

fn entry(rv: &str) -> IndexEntry {
    IndexEntry { namespace: Some("shop".into()), name: format!("n{rv}"), resource_version: rv.into() }
}

proptest! {
    /// Any sequence of writes, folded back, gives the last value of each object.
    #[test]
    fn folding_the_records_gives_the_last_state(ops in proptest::collection::vec((0u8..20, proptest::option::of(1u32..1000)), 0..200)) {
        let keys = [key("Deployment")];
        let k = &keys[0];
        let me = owner(0, None);
        let mut model = Index::default();
        let mut l = Loader::new("test", &keys, &me);
        for (uid, rv) in &ops {
            let uid = format!("u{uid}");
            match rv {
                Some(rv) => {
                    let e = entry(&rv.to_string());
                    l.apply(&object_key(&k.id(), &uid), Some(&encode_object((&e).into())), 0).unwrap();
                    model.insert(uid, e);
                }
                None => {
                    l.apply(&object_key(&k.id(), &uid), None, 0).unwrap();
                    model.remove(&uid);
                }
            }
        }
        l.apply(&position_key(&k.id()), Some(&PositionRecord::new(k, &me, Some("7"), &[("a".into(), "8".into())]).encode()), 0).unwrap();
        let pos = l.finish().unwrap().remove(0).unwrap();
        prop_assert_eq!(pos.objects.to_index(), model);
        prop_assert_eq!(pos.resource_version.as_deref(), Some("7"));
        prop_assert_eq!(pos.acked_ahead, vec![("a".to_string(), "8".to_string())]);
    }
}
