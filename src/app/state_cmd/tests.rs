use super::*;

fn doc() -> Export {
    let key = StreamKey {
        cluster: "e2e".into(),
        group: String::new(),
        version: "v1".into(),
        kind: "ConfigMap".into(),
        namespace: Some("shop".into()),
        label_selector: "app=x".into(),
        field_selector: String::new(),
        shard: None,
    };
    Export {
        format: EXPORT_FORMAT,
        cluster_name: "e2e".into(),
        cluster_uid: Some("uid-a".into()),
        source: "directory /tmp/state".into(),
        exported_at: "2026-11-24T06:00:00Z".into(),
        streams: vec![ExportedStream {
            id: key.id(),
            key,
            cluster_uid: Some("uid-a".into()),
            resource_version: Some("1234".into()),
            acked_ahead: vec![("6f1c1a9e-2b7d-4c1e-9f00-0123456789ab".into(), "1240".into())],
            objects: vec![
                ("6f1c1a9e-2b7d-4c1e-9f00-0123456789ab".into(), "shop".into(), "a".into(), "1200".into()),
                ("not-a-uuid".into(), String::new(), "b".into(), "x17".into()),
            ],
            snapshot: false,
        }],
    }
}

#[test]
fn export_round_trips() {
    let d = doc();
    let bytes = serde_json::to_vec_pretty(&d).unwrap();
    assert_eq!(Export::parse(&bytes).unwrap(), d);
    // And through the index a write would carry: the same rows.
    let p = d.streams[0].position();
    let mut rows: Vec<_> = p
        .objects
        .iter()
        .map(|(u, e)| {
            (u.to_string(), e.namespace.unwrap_or("").to_string(), e.name.to_string(), e.resource_version.to_string())
        })
        .collect();
    rows.sort();
    let mut want = d.streams[0].objects.clone();
    want.sort();
    assert_eq!(rows, want);
    assert_eq!(p.resource_version.as_deref(), Some("1234"));
    assert_eq!(p.acked_ahead, d.streams[0].acked_ahead);
}

#[test]
fn other_formats_and_edited_ids_are_refused() {
    let mut v = serde_json::to_value(doc()).unwrap();
    v["format"] = 2.into();
    let e = Export::parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(e.contains("format 2"), "{e}");
    let mut v = serde_json::to_value(doc()).unwrap();
    v["streams"][0]["key"]["namespace"] = "other".into();
    let e = Export::parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(e.contains("does not match"), "{e}");
    let e = Export::parse(b"[]").unwrap_err();
    assert!(e.contains("not a kubecast state export") && e.contains("fix:"), "{e}");
    assert!(!e.contains("Versioned"), "no internal name: {e}");
}

#[test]
fn resume_points_that_are_no_resource_versions_and_streams_twice_are_refused() {
    for bad in ["abc", "", "12a"] {
        let mut v = serde_json::to_value(doc()).unwrap();
        v["streams"][0]["resource_version"] = bad.into();
        let e = Export::parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(e.contains("is not a resourceVersion") && e.contains("fix:"), "{bad:?}: {e}");
    }
    let mut v = serde_json::to_value(doc()).unwrap();
    v["streams"][0]["resource_version"] = serde_json::Value::Null;
    Export::parse(&serde_json::to_vec(&v).unwrap()).expect("null: list again");
    let mut v = serde_json::to_value(doc()).unwrap();
    let first = v["streams"][0].clone();
    v["streams"].as_array_mut().unwrap().push(first);
    let e = Export::parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
    assert!(e.contains("in the file twice"), "{e}");
}

#[test]
fn streams_are_picked_by_id_or_unique_prefix() {
    let ids = vec!["configmap.core.v1.ns-a.1111".to_string(), "configmap.core.v1.ns-ab.2222".to_string()];
    assert_eq!(pick("configmap.core.v1.ns-a.1111", &ids, "x").unwrap(), 0);
    assert_eq!(pick("configmap.core.v1.ns-ab", &ids, "x").unwrap(), 1);
    assert!(matches!(pick("configmap.core.v1.ns-a", &ids, "x"), Err(StateError::Ambiguous { .. })));
    assert!(matches!(pick("secret", &ids, "x"), Err(StateError::NoSuchStream { .. })));
    assert!(matches!(pick("", &ids[..1], "x"), Err(StateError::NoSuchStream { .. })), "an empty id picks nothing");
}
