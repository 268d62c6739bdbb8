//! Reflector benchmark: relist-diff time and memory of kubecast with many watched objects.
//!
//! ```text
//! cargo bench --bench reflector                          # 10000 and 100000 objects
//! cargo bench --bench reflector -- --objects 10000       # a chosen list of sizes
//! ```
//!
//! It runs the real release binary against the *compacting* apiserver of the test environment
//! (`tests/env/compacting up`, which this benchmark runs itself and leaves running: watch cache
//! off, etcd compacted every 5 s, so a resourceVersion expires within seconds). Per size N it
//! creates N ConfigMaps of ~1 KB in a fresh namespace, then:
//!
//! 1. **snapshot**: kubecast on a fresh state dir; wall time until its `list complete` log line
//!    and until all N events are in the file sink; peak RSS (`VmHWM`) and the steady RSS
//!    (`VmRSS` 12 s after the last event: past kubecast's 10 s allocator purge epoch).
//! 2. **RSS per object**: (steady RSS at N - steady RSS on an empty namespace) / N, against the
//!    goal of at most ~1 KB per watched object. The empty-namespace baseline is measured once.
//! 3. **relist-diff**: SIGTERM (final checkpoint), change 2% of the objects (1% modified, 0.5%
//!    deleted, 0.5% created), wait until a watch from the checkpoint's resourceVersion gets 410
//!    Gone, restart on the same state dir; wall time until `list complete` (origin resync), the
//!    events it emitted (should be exactly the changes), peak RSS, checkpoint bytes per object.
//! 4. **resumed**: stop and restart once more: it resumes from the fresh checkpoint without a
//!    list, so its steady RSS is the index plus the watch, with no list having ever been held in
//!    memory (the snapshot's steady RSS can include heap the allocator kept after the list).
//!
//! Figures are printed, never asserted. Progress goes to stderr, results to stdout. The
//! ConfigMaps are deleted (deletecollection) and the namespace deleted afterwards;
//! the test environment has no controller-manager, so a deleted namespace stays `Terminating`
//! forever, but empty. Namespaces left by an interrupted run (label
//! `app.kubernetes.io/managed-by=kubecast-bench`) are emptied at the next start.
//! With `KUBECAST_COMPACTING_ENV_FILE` set, that apiserver is used as it is (not started).
//! The process harness, the client and the namespace come from the test kit (`tests/kit`).
//! See docs/performance.md.

mod watching;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::Api;
use watching::*;

/// Sizes measured when `--objects` is not given.
const DEFAULT_OBJECTS: &[usize] = &[10_000, 100_000];
/// Bytes of `data` per ConfigMap.
const PAYLOAD_BYTES: usize = 1000;

#[tokio::main]
async fn main() -> Result<()> {
    let sizes = parse_args()?;
    eprintln!("starting the compacting apiserver (tests/env/compacting up; left running)");
    let kubeconfig = kubecast_kit::compacting_up();
    let client = kubecast_kit::client_for(&kubeconfig).await;
    kubecast_kit::set_bin(env!("CARGO_BIN_EXE_kubecast"));
    eprintln!("kubecast binary: {}", kubecast_kit::bin().display());

    sweep_leftovers(&client).await?;

    eprintln!("\n== baseline: kubecast watching an empty namespace");
    let baseline = in_namespace(&client, "kubecast-bench-empty", |ns| measure_baseline(&kubeconfig, ns)).await?;
    eprintln!("baseline steady RSS {} (peak {})", mib(baseline.rss_kb), mib(baseline.hwm_kb));

    let (mut rows, mut failed) = (Vec::new(), Vec::new());
    for &n in &sizes {
        eprintln!("\n== {n} objects");
        match in_namespace(&client, &format!("kubecast-bench-{n}"), |ns| measure_size(&client, &kubeconfig, ns, n))
            .await
        {
            Ok(row) => {
                print_details(&row, &baseline);
                rows.push(row);
            }
            // The other sizes still run, and the table shows what was measured.
            Err(e) => {
                eprintln!("{n} objects: FAILED: {e:?}");
                failed.push(n);
            }
        }
    }
    print_table(&rows, &baseline);
    if !failed.is_empty() {
        bail!("no figures for {failed:?} objects (see the errors above)");
    }
    Ok(())
}

/// `--objects 10000,100000` (or `--objects=...`); `cargo bench` also passes `--bench`.
fn parse_args() -> Result<Vec<usize>> {
    let mut sizes = DEFAULT_OBJECTS.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let list = match arg.as_str() {
            "--objects" => args.next().ok_or_else(|| anyhow!("--objects needs a value, e.g. 10000,100000"))?,
            a if a.starts_with("--objects=") => a["--objects=".len()..].to_string(),
            "--bench" => continue,
            other => {
                eprintln!(
                    "ignoring argument {other:?} (usage: cargo bench --bench reflector -- --objects 10000,100000)"
                );
                continue;
            }
        };
        sizes = list
            .split(',')
            .map(|s| s.trim().replace('_', "").parse::<usize>().with_context(|| format!("--objects: bad number {s:?}")))
            .collect::<Result<_>>()?;
        if sizes.contains(&0) {
            bail!("--objects: sizes must be at least 1");
        }
    }
    Ok(sizes)
}

// ------------------------------------------------------------------------------------------
// Measurements

#[derive(Debug, Default)]
struct Row {
    objects: usize,
    create_time: Duration,
    // 1. snapshot
    snapshot: ListDone,
    snapshot_sink: Duration,
    snapshot_mem: Mem,
    // 3. relist-diff
    checkpoint_bytes: u64,
    checkpoint_objects: usize,
    changes: Changes,
    expiry_wait: Duration,
    relist: ListDone,
    relist_mem: Mem,
    relist_events: DiffEvents,
    // 4. resumed from the fresh checkpoint
    resumed_mem: Mem,
    /// The resumed run listed after all (its resourceVersion had expired): its RSS includes a list.
    resumed_relisted: bool,
}

/// Steady RSS of kubecast watching the (empty) namespace `ns`.
async fn measure_baseline(kubeconfig: &str, ns: String) -> Result<Mem> {
    let mut kc = Run::start(&ns, kubeconfig);
    kc.wait_log(LIST_COMPLETE, HANG_GUARD).await?;
    tokio::time::sleep(SETTLE).await;
    let mem = kc.mem()?;
    kc.stop().await?;
    Ok(mem)
}

async fn measure_size(client: &Client, kubeconfig: &str, ns: String, n: usize) -> Result<Row> {
    let ns = ns.as_str();
    let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
    let mut row = Row { objects: n, ..Default::default() };

    let t = Instant::now();
    eprintln!("creating {n} ConfigMaps of ~{PAYLOAD_BYTES} B in {ns} ({IN_FLIGHT} in flight)");
    create_configmaps(&api, (0..n).map(|i| object_name("obj", i)).collect(), PAYLOAD_BYTES).await?;
    row.create_time = t.elapsed();

    // 1. Snapshot on a fresh state dir.
    eprintln!("snapshot: starting kubecast on a fresh state dir");
    let mut kc = Run::start(ns, kubeconfig);
    let mut events = LineCounter::new(kc.events_path());
    row.snapshot = kc.wait_list_complete().await?;
    eprintln!("snapshot: list complete after {:.2} s; waiting for {n} events in the sink", secs(row.snapshot.wall));
    row.snapshot_sink = kc.wait_lines(&mut events, n as u64, HANG_GUARD).await?.context("events in the sink")?;
    tokio::time::sleep(SETTLE).await;
    row.snapshot_mem = kc.mem()?;
    eprintln!("snapshot: all events in the sink after {:.2} s; stopping (SIGTERM)", secs(row.snapshot_sink));
    kc.stop().await?;

    let (cp_bytes, cp) = kc.checkpoint()?;
    row.checkpoint_bytes = cp_bytes;
    row.checkpoint_objects = cp["objects"].as_array().map_or(0, Vec::len);
    let rv = cp["resource_version"].as_str().context("checkpoint without resource_version")?.to_string();
    if row.checkpoint_objects != n {
        eprintln!("WARNING: the checkpoint holds {} objects, expected {n}", row.checkpoint_objects);
    }

    // 3. Relist-diff. The changes come first: they also make the checkpoint's resourceVersion
    // expire, since compaction only removes revisions older than newer writes.
    row.changes = change_configmaps(&api, n, PAYLOAD_BYTES).await?;
    let t = Instant::now();
    eprintln!("relist: waiting until a watch from the checkpoint's resourceVersion {rv} gets 410 Gone");
    wait_until_expired(&api, &rv).await?;
    row.expiry_wait = t.elapsed();

    let before = events.poll()?;
    let diff_from = events.offset;
    eprintln!("relist: restarting kubecast on the same state dir");
    kc.restart();
    row.relist = kc.wait_list_complete().await?;
    let expected = row.changes.total() as u64;
    if kc.wait_lines(&mut events, before + expected, Duration::from_secs(120)).await?.is_none() {
        eprintln!("WARNING: fewer diff events than the {expected} changes within 120 s");
    }
    tokio::time::sleep(Duration::from_secs(1)).await; // room for any event beyond the expected ones
    row.relist_mem = kc.mem()?;
    row.relist_events = diff_events(&kc.events_path(), diff_from)?;
    eprintln!(
        "relist: list complete after {:.2} s, {} events; stopping",
        secs(row.relist.wall),
        row.relist_events.total()
    );
    kc.stop().await?;

    // 4. Resumed: at once, before the new checkpoint's resourceVersion can expire.
    kc.restart();
    kc.wait_log(RESUMING, HANG_GUARD).await?;
    tokio::time::sleep(SETTLE).await;
    row.resumed_mem = kc.mem()?;
    row.resumed_relisted = kc.log().contains(LIST_COMPLETE);
    kc.stop().await?;
    Ok(row)
}

// ------------------------------------------------------------------------------------------
// Report

fn print_details(r: &Row, baseline: &Mem) {
    let ch = &r.changes;
    let ev = &r.relist_events;
    println!("\n{} objects:", r.objects);
    println!("  created in {:.1} s ({:.0}/s)", secs(r.create_time), r.objects as f64 / secs(r.create_time));
    println!(
        "  snapshot: list complete at {:.2} s ({}), all events in the sink at {:.2} s",
        secs(r.snapshot.wall),
        r.snapshot.describe(),
        secs(r.snapshot_sink),
    );
    println!(
        "  snapshot memory: peak {}, steady {} (baseline {}), {} B per object",
        mib(r.snapshot_mem.hwm_kb),
        mib(r.snapshot_mem.rss_kb),
        mib(baseline.rss_kb),
        per_object(r.snapshot_mem.rss_kb, baseline.rss_kb, r.objects)
    );
    println!(
        "  checkpoint: {} bytes for {} objects, {:.0} B per object",
        r.checkpoint_bytes,
        r.checkpoint_objects,
        r.checkpoint_bytes as f64 / r.objects as f64
    );
    println!(
        "  changes: {} modified, {} deleted, {} created; resourceVersion expired {:.1} s after them",
        ch.modified,
        ch.deleted,
        ch.created,
        secs(r.expiry_wait)
    );
    println!("  relist-diff: list complete at {:.2} s after restart ({})", secs(r.relist.wall), r.relist.describe());
    println!("  relist-diff events: {}", ev.against(ch));
    println!("  relist-diff memory: peak {}", mib(r.relist_mem.hwm_kb));
    println!(
        "  resumed from the checkpoint: steady {}, peak {}, {} B per object{}",
        mib(r.resumed_mem.rss_kb),
        mib(r.resumed_mem.hwm_kb),
        per_object(r.resumed_mem.rss_kb, baseline.rss_kb, r.objects),
        if r.resumed_relisted { " (it relisted: the resourceVersion had expired)" } else { "" }
    );
}

fn print_table(rows: &[Row], baseline: &Mem) {
    println!("\nbaseline (empty namespace): steady RSS {}, peak {}", mib(baseline.rss_kb), mib(baseline.hwm_kb));
    println!("goal: at most ~1 KB (1024 B) of RSS per watched object in steady state");
    println!("RSS/object = (steady RSS - baseline) / objects; 'resumed' = restarted from the checkpoint, no list");
    println!("list restart = the list's continue token expired (etcd compaction): kubecast listed again from page 1\n");
    let header = [
        "objects",
        "snapshot s",
        "all in sink s",
        "snapshot peak RSS MiB",
        "steady RSS MiB",
        "RSS/object B",
        "resumed RSS/object B",
        "relist-diff s",
        "relist peak RSS MiB",
        "diff events",
        "checkpoint B/object",
    ];
    let mut lines = vec![header.iter().map(|s| s.to_string()).collect::<Vec<_>>()];
    for r in rows {
        let per = per_object(r.snapshot_mem.rss_kb, baseline.rss_kb, r.objects);
        let resumed = per_object(r.resumed_mem.rss_kb, baseline.rss_kb, r.objects);
        lines.push(vec![
            r.objects.to_string(),
            r.snapshot.wall_cell(),
            format!("{:.2}", secs(r.snapshot_sink)),
            format!("{:.1}", r.snapshot_mem.hwm_kb as f64 / 1024.0),
            format!("{:.1}", r.snapshot_mem.rss_kb as f64 / 1024.0),
            format!("{per} {}", if per <= 1024 { "(ok)" } else { "(> 1 KB)" }),
            format!("{resumed} {}", if resumed <= 1024 { "(ok)" } else { "(> 1 KB)" }),
            r.relist.wall_cell(),
            format!("{:.1}", r.relist_mem.hwm_kb as f64 / 1024.0),
            format!("{}/{}", r.relist_events.total(), r.changes.total()),
            format!("{:.0}", r.checkpoint_bytes as f64 / r.objects as f64),
        ]);
    }
    let widths: Vec<usize> = (0..header.len()).map(|c| lines.iter().map(|l| l[c].len()).max().unwrap_or(0)).collect();
    for (i, line) in lines.iter().enumerate() {
        let cells: Vec<String> = line.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        println!("{}", cells.join(" | "));
        if i == 0 {
            println!("{}", widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("-+-"));
        }
    }
}
