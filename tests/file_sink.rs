//! The file sink never leaves a torn line before a retried one: a write cut short (here: the
//! file size limit of the process, `ulimit -f`) is cut back, and after a crash the restart
//! goes on from whole lines.

use kubecast_kit as common;

use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{TestNamespace, client, names};

const WAIT: Duration = Duration::from_secs(120);

/// `kubecast run` on `dir/kubecast.toml`; with `limit_kb`, under a file size limit (and
/// SIGXFSZ ignored, so a write past it fails with EFBIG instead of killing the process).
fn spawn(dir: &Path, limit_kb: Option<u64>) -> Child {
    let mut cmd = Command::new("sh");
    let script = match limit_kb {
        // dash counts -f in 512-byte blocks, bash in 1024: either way a small limit.
        Some(kb) => format!("trap '' XFSZ; ulimit -f {kb}; exec \"$0\" run --config \"$1\""),
        None => "exec \"$0\" run --config \"$1\"".to_string(),
    };
    cmd.arg("-c").arg(&script).arg(common::bin()).arg(dir.join("kubecast.toml"));
    cmd.env("KUBECONFIG", common::kubeconfig())
        .env("RUST_LOG", "warn")
        .env("KUBECAST_ADMIN__LISTEN", "127.0.0.1:0")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("log-{}", limit_kb.is_some()))).unwrap());
    cmd.spawn().unwrap()
}

/// Kills the process when dropped (also when the test fails).
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(String::from).collect()
}

#[tokio::test]
async fn a_write_cut_short_leaves_no_torn_line_before_the_retried_one() {
    let client = client().await;
    let ns = TestNamespace::new(&client, "torn").await;
    // ~300 events of ~1.4 KB: far past the limit.
    let big = "x".repeat(1000);
    let created: Vec<String> = names("t", 0..300);
    {
        use futures::StreamExt;
        futures::stream::iter(created.iter().cloned())
            .for_each_concurrent(8, |name| {
                let (client, ns, big) = (client.clone(), ns.name.clone(), big.clone());
                async move {
                    common::create_cm(&client, &ns, &name, serde_json::json!({}), serde_json::json!({"v": big})).await;
                }
            })
            .await;
    }
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    std::fs::write(
        dir.path().join("kubecast.toml"),
        format!(
            "[sink]\ntype = \"file\"\npath = \"{}\"\n[checkpoint]\ndir = \"{}\"\n[[resources]]\napi_version = \"v1\"\nkind = \"ConfigMap\"\nnamespaces = [\"{}\"]\n",
            events.display(),
            dir.path().join("state").display(),
            ns.name
        ),
    )
    .unwrap();

    let mut limited = Running(spawn(dir.path(), Some(200)));
    // Until the file stops growing: the limit was reached and the sends are being retried.
    let deadline = Instant::now() + WAIT;
    let (mut last, mut since) = (0u64, Instant::now());
    loop {
        let len = std::fs::metadata(&events).map(|m| m.len()).unwrap_or(0);
        if len != last {
            (last, since) = (len, Instant::now());
        } else if len > 0 && since.elapsed() > Duration::from_secs(3) {
            break;
        }
        assert!(limited.0.try_wait().unwrap().is_none(), "kubecast exited under the limit");
        assert!(Instant::now() < deadline, "the events file never stopped growing ({len} bytes)");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let before = lines(&events);
    assert!(before.len() < 300, "the limit stopped the sink: {} lines", before.len());
    drop(limited);

    let mut child = Running(spawn(dir.path(), None));
    let deadline = Instant::now() + WAIT;
    let subjects = loop {
        let all = lines(&events);
        let parsed: Vec<serde_json::Value> = all
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("a torn line in the sink ({e}): {l:.200}")))
            .collect();
        let subjects: HashSet<String> = parsed.iter().map(|e| e["subject"].as_str().unwrap().to_string()).collect();
        if subjects.len() == 300 {
            break subjects;
        }
        assert!(child.0.try_wait().unwrap().is_none(), "kubecast exited");
        assert!(Instant::now() < deadline, "{} of 300 objects delivered", subjects.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for name in &created {
        assert!(subjects.contains(&format!("{}/{name}", ns.name)));
    }
    drop(child);
}
