//! Shutdown has one deadline: `[delivery] shutdown_timeout_seconds` bounds the whole drain
//! (shaping, queue, producer flush), and the final checkpoint is written in every outcome.

use kubecast_kit as common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{Kubecast, TestNamespace, client, cm_config, create_cms, names};

/// A sink slower than the changes (rate limit 20/s) and more changes than the channels and
/// the queue hold: at SIGTERM the shaping stage is blocked on the full queue. kubecast still
/// stops within its shutdown timeout, its admin server answering through the drain ("shutting
/// down"), and the checkpoint it leaves holds exactly delivered objects (none it did not
/// deliver).
#[tokio::test]
async fn a_stop_behind_a_slow_sink_ends_by_the_deadline_with_the_final_checkpoint() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "deadline").await;
    // Far more than the stages before the queue (an eighth of queue_capacity each, at least
    // 16) and the queue (1) hold: without the deadline, they would hand over the rest at 20/s
    // (~100 s) before the shutdown timeout even began. The list cannot complete before the
    // stop (backpressure): the stop comes while the reflector is still listing.
    create_cms(&client, &ns.name, &names("s", 0..2000)).await;
    let timeout = 3u64;
    let config = format!(
        "{}\n[delivery]\nrate_per_second = 20\nqueue_capacity = 1\nshutdown_timeout_seconds = {timeout}\n",
        cm_config(&ns.name, "")
    );
    // No periodic checkpoint write: only the final one.
    let mut kc = Kubecast::start_with_checkpoint(&config, "flush_interval_ms = 3600000", &[]);
    kc.wait_for("some deliveries", Duration::from_secs(60), |e| e.len() >= 20).await;
    assert!(kc.checkpoints().is_empty(), "nothing written before the stop");

    let stopped_at = Instant::now();
    kc.signal("TERM");
    // Through the drain the admin server answers: not ready, shutting down; metrics served.
    kc.wait_ready_reason("shutting down").await;
    let (code, metrics) = kc.admin_get("/metrics").await;
    assert!(code == 200 && metrics.contains("kubecast_queue_depth"), "{code}: {metrics}");
    let status = kc.wait_exit(Duration::from_secs(timeout + 30)).await;
    let took = stopped_at.elapsed();
    assert!(status.success(), "{}", kc.log());
    // The deadline plus the start-up of the drain and the final write.
    assert!(took < Duration::from_secs(timeout + 7), "stopped after {took:?}\n{}", kc.log());
    let log = kc.log();
    assert!(log.contains("final checkpoints written"), "{log}");

    let delivered: HashSet<String> =
        kc.events().iter().map(|e| e["partitionkey"].as_str().unwrap().to_string()).collect();
    assert!(delivered.len() < 2000, "the rate limit left most undelivered: {}", delivered.len());
    let checkpoints = kc.checkpoints();
    assert_eq!(checkpoints.len(), 1, "the final checkpoint was written");
    let indexed: Vec<&str> =
        checkpoints[0]["objects"].as_array().unwrap().iter().map(|o| o[0].as_str().unwrap()).collect();
    assert!(!indexed.is_empty(), "the delivered prefix is in it");
    for uid in &indexed {
        assert!(delivered.contains(*uid), "the checkpoint holds {uid}, which was never delivered");
    }
    assert!(checkpoints[0]["resource_version"].is_null(), "the list's end was not delivered: no resume point yet");
}
