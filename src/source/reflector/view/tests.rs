use super::testkit::Stream;
use crate::model::{Effect, Index, IndexEntry, IndexOp, UidList};

fn entry(rv: u64) -> IndexEntry {
    IndexEntry { namespace: Some("ns".into()), name: "n".into(), resource_version: rv.to_string() }
}

fn upsert(uid: &str, rv: u64) -> Effect {
    Effect::Watched { op: IndexOp::Upsert(uid.into(), entry(rv)), rv: rv.to_string() }
}

fn remove(uid: &str, rv: u64) -> Effect {
    Effect::Watched { op: IndexOp::Remove(uid.into()), rv: rv.to_string() }
}

#[test]
fn the_view_reads_the_last_emitted_change_before_the_acknowledged_index() {
    let start: Index = [("a".to_string(), entry(1)), ("b".to_string(), entry(2))].into_iter().collect();
    let mut s = Stream::new(start);
    s.emit(upsert("a", 3));
    s.emit(remove("b", 4));
    s.emit(upsert("c", 5));
    s.emit(upsert("a", 6));
    assert_eq!((s.view.get("a"), s.view.get("b"), s.view.get("c")), (Some(entry(6)), None, Some(entry(5))));
    assert_eq!(s.view.len(), 2);
    // The first change of `a` acknowledged: the view still reads its last one.
    s.ack(1);
    s.emit(Effect::Bookmark("7".into()));
    s.emit(upsert("d", 8));
    assert_eq!(s.view.get("a"), Some(entry(6)));
    s.ack(3);
    s.emit(upsert("e", 9));
    assert_eq!(s.view.get("a"), Some(entry(6)));
    assert_eq!(s.view.get("b"), None);
    assert_eq!(s.view.len(), 4);
    s.ack_all();
    s.emit(upsert("f", 10));
    s.emit(upsert("g", 11));
    s.emit(remove("g", 12));
    s.emit(upsert("h", 13));
    // Everything before f was acknowledged: f, g and h are left.
    assert_eq!(s.view.pending(), 3, "acknowledged changes left the overlay");
    assert_eq!(s.view.get("a"), Some(entry(6)), "now from the acknowledged index");
    assert_eq!((s.view.get("g"), s.view.len()), (None, 6));
    let mut seen = UidList::new();
    for uid in ["a", "c", "d"] {
        seen.insert(uid);
    }
    let mut absent = s.view.absent_from(&seen.into_set());
    absent.sort_by(|x, y| x.0.cmp(&y.0));
    let want = [("e", 9), ("f", 10), ("h", 13)].map(|(u, rv)| (u.to_string(), entry(rv)));
    assert_eq!(absent, want);
}

#[test]
fn the_overlay_holds_no_more_than_what_is_in_flight() {
    let mut s = Stream::new(Index::default());
    for i in 0..100_000u64 {
        s.emit(upsert(&format!("u{i}"), i));
        // 500 items in flight at most, as a queue would keep them.
        if s.in_flight() > 500 {
            s.ack(s.in_flight() - 500);
        }
        assert!(s.view.pending() <= s.in_flight());
    }
    assert_eq!(s.most_in_flight(), 501);
    assert_eq!(s.view.len(), 100_000);
    s.ack_all();
    assert_eq!(s.acked().len(), 100_000);
    assert_eq!(s.view.pending(), 0, "all acknowledged: the overlay is empty");
}
