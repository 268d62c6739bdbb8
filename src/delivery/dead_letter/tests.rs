//! The dead letter with a stub sink (its destination: `stub`): the file's lines, and `stop`.

use crate::delivery::dead_letter::DeadLetter;
use crate::delivery::retry::RetryPolicy;
use crate::delivery::testkit::{config, dead_letter_config, outbound, read_json_lines};
use crate::delivery::{DeadLetterType, DeliveryError};
use crate::sink::Sink;
use crate::sink::stub::StubSink;

fn retry() -> RetryPolicy {
    RetryPolicy::new(&config(100, 10))
}

/// `type = "file"`: one JSON line per event (reason, destination, failed_at, the structured
/// event), appended: a second dead letter on the same file (kubecast restarted) adds to it.
#[tokio::test]
async fn the_file_dead_letter_appends_one_json_line_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dl.jsonl");
    let sink = Sink::Stub(StubSink::new());
    let cfg = dead_letter_config(DeadLetterType::File, Some(path.clone()));
    let (a, b, c) = (outbound("a", 1), outbound("b", 2), outbound("c", 3));
    let dead_letter = DeadLetter::new(&cfg, dir.path(), retry());
    dead_letter.put(&sink, &a, "message too large").await.unwrap();
    // A reason with a line break and quotes still makes one line.
    dead_letter.put(&sink, &b, "gave up after 3 attempts:\n\"broker down\"").await.unwrap();
    assert_eq!(dead_letter.count(), 2);
    let again = DeadLetter::new(&cfg, dir.path(), retry());
    again.put(&sink, &c, "not authorized").await.unwrap();
    assert_eq!(again.count(), 1);

    let lines = read_json_lines(&path);
    assert_eq!(lines.len(), 3, "one line per event, appended");
    let reasons = ["message too large", "gave up after 3 attempts:\n\"broker down\"", "not authorized"];
    for ((line, msg), reason) in lines.iter().zip([&a, &b, &c]).zip(reasons) {
        assert_eq!(line["reason"], reason);
        assert_eq!(line["destination"], "stub");
        let failed_at = line["failed_at"].as_str().expect("failed_at");
        chrono::DateTime::parse_from_rfc3339(failed_at).expect("an RFC 3339 time");
        let event: serde_json::Value = serde_json::from_slice(&msg.event.to_structured()).unwrap();
        assert_eq!(line["event"], event, "the whole structured event");
        assert_eq!(line["event"]["id"], msg.event.id());
        assert_eq!(line["event"]["data"]["metadata"]["uid"], msg.key());
        let keys: Vec<&String> = line.as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 4, "{keys:?}");
    }
}

/// Without a `path`, the file is `dead-letter.jsonl` in the checkpoint directory.
#[tokio::test]
async fn the_file_dead_letter_defaults_to_the_checkpoint_directory() {
    let dir = tempfile::tempdir().unwrap();
    let sink = Sink::Stub(StubSink::new());
    let dead_letter = DeadLetter::new(&dead_letter_config(DeadLetterType::File, None), dir.path(), retry());
    dead_letter.put(&sink, &outbound("a", 1), "message too large").await.unwrap();
    let lines = read_json_lines(&dir.path().join("dead-letter.jsonl"));
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["reason"], "message too large");
}

/// `type = "stop"`: nothing is written; the event is `Undeliverable` (kubecast stops).
#[tokio::test]
async fn the_stop_dead_letter_returns_undeliverable() {
    let dir = tempfile::tempdir().unwrap();
    let sink = Sink::Stub(StubSink::new());
    let dead_letter = DeadLetter::new(&dead_letter_config(DeadLetterType::Stop, None), dir.path(), retry());
    let msg = outbound("a", 1);
    let Err(DeliveryError::Undeliverable(e)) = dead_letter.put(&sink, &msg, "not authorized").await else {
        panic!("type = \"stop\" must refuse the event")
    };
    assert_eq!(e.id, msg.event.id());
    assert_eq!(e.destination, "stub");
    assert_eq!(e.reason, "not authorized");
    assert!(e.to_string().contains("type = \"stop\""), "{e}");
    assert_eq!(dead_letter.count(), 0);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "no file written");
}

/// The pipelines of a sharded process each have a dead letter, all on one file: they share one
/// writer (two would each cut the file back to their own idea of its end after a failed
/// write), and every line of both is kept.
#[tokio::test]
async fn dead_letters_on_one_file_share_its_writer() {
    use crate::delivery::dead_letter::Target;
    let dir = tempfile::tempdir().unwrap();
    let sink = Sink::Stub(StubSink::new());
    let cfg = dead_letter_config(DeadLetterType::File, None);
    let (shard0, shard1) = (DeadLetter::new(&cfg, dir.path(), retry()), DeadLetter::new(&cfg, dir.path(), retry()));
    let other = tempfile::tempdir().unwrap();
    let elsewhere = DeadLetter::new(&cfg, other.path(), retry());
    match (&shard0.target, &shard1.target, &elsewhere.target) {
        (Target::File { file: a, .. }, Target::File { file: b, .. }, Target::File { file: c, .. }) => {
            assert!(std::sync::Arc::ptr_eq(a, b), "one writer per file");
            assert!(!std::sync::Arc::ptr_eq(a, c), "another file, another writer");
        }
        _ => panic!("file dead letters"),
    }
    shard0.put(&sink, &outbound("a", 1), "no permission").await.unwrap();
    shard1.put(&sink, &outbound("b", 2), "no permission").await.unwrap();
    shard0.put(&sink, &outbound("c", 3), "no permission").await.unwrap();
    let lines = read_json_lines(&dir.path().join("dead-letter.jsonl"));
    assert_eq!(lines.len(), 3, "{lines:?}");
}
