use super::*;

fn key(ns: Option<&str>, labels: &str) -> StreamKey {
    StreamKey {
        cluster: "c".into(),
        group: "".into(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        namespace: ns.map(Into::into),
        label_selector: labels.into(),
        field_selector: "".into(),
        shard: None,
    }
}

fn e(name: &str, rv: &str) -> IndexEntry {
    IndexEntry { namespace: Some("shop".into()), name: name.into(), resource_version: rv.into() }
}

fn me() -> Owner {
    Owner { cluster_uid: Some("cluster-a".into()), epoch: None, writer: "t".into() }
}

fn full(rv: &str, objects: &[(&str, IndexEntry)]) -> Delta {
    Delta {
        upserts: objects.iter().map(|(u, e)| (u.to_string(), e.clone())).collect(),
        full: true,
        resource_version: Some(rv.into()),
        ..Default::default()
    }
}

fn change(rv: &str, up: &[(&str, IndexEntry)], rm: &[&str]) -> Delta {
    Delta {
        upserts: up.iter().map(|(u, e)| (u.to_string(), e.clone())).collect(),
        removes: rm.iter().map(|u| u.to_string()).collect(),
        resource_version: Some(rv.into()),
        ..Default::default()
    }
}

#[test]
fn snapshot_then_journal_round_trip_and_identity() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let k = key(Some("shop"), "app=x");
    assert_eq!(store.load(&k).unwrap(), None);
    assert!(store.wants_full(&k), "the first write is a snapshot");
    store.write(&k, &full("10", &[("u1", e("a", "9")), ("u2", e("b", "10"))])).unwrap();
    assert!(!store.wants_full(&k));
    store.write(&k, &change("12", &[("u3", e("c", "12"))], &["u1"])).unwrap();
    store.write(&k, &change("13", &[("u2", e("b", "13"))], &[])).unwrap();
    let snapshot_len = fs::metadata(store.path(&k)).unwrap().len();
    let journal_len = fs::metadata(store.journal_path(&k)).unwrap().len();
    assert!(journal_len > 0 && journal_len < 400, "a change writes one short line: {journal_len}");

    drop(store);
    let store = FileStore::open(dir.path(), me()).unwrap();
    let p = store.load(&k).unwrap().unwrap();
    assert_eq!(p.resource_version.as_deref(), Some("13"));
    let mut want = crate::model::Index::default();
    want.insert("u2".into(), e("b", "13"));
    want.insert("u3".into(), e("c", "12"));
    assert_eq!(p.objects.to_index(), want);
    assert_eq!(fs::metadata(store.path(&k)).unwrap().len(), snapshot_len, "loading writes nothing");
    // Another selector is another stream: no checkpoint.
    assert_eq!(store.load(&key(Some("shop"), "app=y")).unwrap(), None);
    assert_ne!(k.file_name(), key(None, "app=x").file_name());
}

#[test]
fn a_torn_last_line_is_cut_off_and_a_bad_line_inside_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let k = key(None, "");
    store.write(&k, &full("10", &[("u1", e("a", "9"))])).unwrap();
    store.write(&k, &change("11", &[("u2", e("b", "11"))], &[])).unwrap();
    let good = fs::metadata(store.journal_path(&k)).unwrap().len();
    let mut j = fs::OpenOptions::new().append(true).open(store.journal_path(&k)).unwrap();
    j.write_all(b"{\"seq\":3,\"resource_version\":\"1").unwrap();
    drop(j);
    let p = store.load(&k).unwrap().unwrap();
    assert_eq!(p.resource_version.as_deref(), Some("11"), "the torn write was never done");
    assert_eq!(fs::metadata(store.journal_path(&k)).unwrap().len(), good, "cut back to the last whole line");
    // The next write continues after the good lines.
    store.write(&k, &change("12", &[], &["u1"])).unwrap();
    assert_eq!(store.load(&k).unwrap().unwrap().objects.len(), 1);

    let mut lines = fs::read_to_string(store.journal_path(&k)).unwrap();
    lines.insert_str(0, "not json\n");
    fs::write(store.journal_path(&k), lines).unwrap();
    let err = store.load(&k).unwrap_err().to_string();
    assert!(err.contains(".journal") && err.contains("line 1") && err.contains("corrupt"), "{err}");
    // The fix names the stream's two files.
    let json = store.journal_path(&k).with_extension("json");
    assert!(err.contains(&format!("{} and {}", json.display(), store.journal_path(&k).display())), "{err}");
}

#[test]
fn compaction_writes_a_snapshot_and_older_journal_lines_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let k = key(None, "");
    store.write(&k, &full("1", &[("u1", e("a", "1"))])).unwrap();
    let mut rv = 1;
    while !store.wants_full(&k) {
        rv += 1;
        store.write(&k, &change(&rv.to_string(), &[("u1", e("a", &rv.to_string()))], &[])).unwrap();
    }
    assert!(fs::metadata(store.journal_path(&k)).unwrap().len() > MIN_COMPACTION_BYTES);
    // Keep the old journal: as if kubecast crashed between the snapshot and the truncation.
    let old_journal = fs::read(store.journal_path(&k)).unwrap();
    store.write(&k, &full(&rv.to_string(), &[("u1", e("a", &rv.to_string()))])).unwrap();
    assert_eq!(fs::metadata(store.journal_path(&k)).unwrap().len(), 0, "emptied after the snapshot");
    fs::write(store.journal_path(&k), old_journal).unwrap();
    let p = store.load(&k).unwrap().unwrap();
    assert_eq!(p.objects.to_index()["u1"].resource_version, rv.to_string(), "older lines do not go back in time");
}

#[test]
fn a_second_store_on_one_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let first = FileStore::open(dir.path(), me()).unwrap();
    let err = FileStore::open(dir.path(), me()).unwrap_err().to_string();
    assert!(err.contains("in use by another kubecast process"), "{err}");
    assert!(err.contains(&format!("pid {}", std::process::id())), "{err}");
    drop(first);
    FileStore::open(dir.path(), me()).expect("free again once the holder is gone");
}

#[test]
fn corrupt_future_and_foreign_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let k = key(None, "");
    fs::write(store.path(&k), b"{\"version\":1,\"stream\":").unwrap();
    assert!(matches!(store.load(&k), Err(CheckpointError::Corrupt { .. })));
    fs::write(store.path(&k), b"{\"version\":7}").unwrap();
    assert!(matches!(store.load(&k), Err(CheckpointError::UnknownVersion { found: 7, .. })));
    store.write(&k, &full("1", &[])).unwrap();
    drop(store);
    let other = Owner { cluster_uid: Some("cluster-b".into()), ..me() };
    let err = FileStore::open(dir.path(), other).unwrap().load(&k).unwrap_err().to_string();
    assert!(err.contains("another cluster") && err.contains("cluster-a") && err.contains("cluster-b"), "{err}");
}

#[test]
fn version_1_files_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let k = key(None, "");
    let v1 = serde_json::json!({
        "version": 1, "stream": k, "resource_version": "5",
        "objects": [["u1", "shop", "a", "4"]]
    });
    fs::write(store.path(&k), serde_json::to_vec(&v1).unwrap()).unwrap();
    let p = store.load(&k).unwrap().unwrap();
    assert_eq!(p.resource_version.as_deref(), Some("5"));
    store.write(&k, &change("6", &[], &["u1"])).unwrap();
    assert!(store.load(&k).unwrap().unwrap().objects.is_empty());
}

#[test]
fn the_unknown_version_message_names_the_versions_read() {
    assert_eq!(FORMAT_VERSION, 2, "CheckpointError::UnknownVersion says \"versions 1 and 2\": update it too");
}

#[test]
fn scan_reads_every_stream_without_the_lock_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let (a, b) = (key(Some("shop"), ""), key(None, "app=x"));
    store.write(&a, &full("10", &[("u1", e("a", "9")), ("u2", e("b", "10"))])).unwrap();
    store.write(&a, &change("12", &[], &["u1"])).unwrap();
    store.write(&b, &full("20", &[])).unwrap();
    // The owner is appending a line right now: the scan skips it, never cuts it off.
    let mut j = fs::OpenOptions::new().append(true).open(store.journal_path(&a)).unwrap();
    j.write_all(b"{\"seq\":3,\"resource_version\":\"1").unwrap();
    drop(j);
    let journal = fs::read(store.journal_path(&a)).unwrap();
    // While the store (and its lock) is held.
    let mut found = scan(dir.path()).unwrap();
    found.sort_by_key(|s| s.key.id());
    let found_a = found.iter().find(|s| s.key == a).unwrap();
    assert_eq!(found_a.position.resource_version.as_deref(), Some("12"));
    assert_eq!(found_a.position.objects.len(), 1);
    assert_eq!(found_a.cluster_uid.as_deref(), Some("cluster-a"));
    assert!(found_a.modified.is_some());
    assert!(found.iter().any(|s| s.key == b && s.position.objects.is_empty()));
    assert_eq!(found.len(), 2);
    assert_eq!(fs::read(store.journal_path(&a)).unwrap(), journal, "the scan changed nothing");
    assert!(scan(&dir.path().join("missing")).unwrap().is_empty());
}

#[test]
fn scan_skips_other_programs_files_but_not_a_corrupt_stream_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileStore::open(dir.path(), me()).unwrap();
    let a = key(Some("shop"), "");
    store.write(&a, &full("10", &[("u1", e("a", "9"))])).unwrap();
    fs::write(dir.path().join("foo.json"), b"not json at all").unwrap();
    fs::write(dir.path().join("notes.json"), b"{\"x\": 1}").unwrap();
    let found = scan(dir.path()).unwrap();
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].key, a);
    // A file named like a stream that does not read is still an error: never hidden.
    fs::write(dir.path().join("configmap.core.v1.all.0123456789abcdef.json"), b"{").unwrap();
    assert!(matches!(scan(dir.path()), Err(CheckpointError::Corrupt { .. })));
}
