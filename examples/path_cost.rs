//! The per-event CPU cost of kubecast's delivery path without a broker, for deterministic
//! instruction counts (see docs/performance.md, "Reproducing"):
//!
//!     cargo build --release --example path_cost
//!     valgrind --tool=callgrind target/release/examples/path_cost 2000 none
//!     valgrind --tool=callgrind target/release/examples/path_cost 2000 nats
//!
//! (instructions of a step - instructions of `none`) / events = instructions per event.
//! Steps, each including the ones before it: `none` (only recording the stream), `decode`
//! (the object's identity, as the reflector does), `job` (+ the reflector's item and the
//! CloudEvent of its change; no shaping, no queue), `kafka`, `nats`, `structured` (+ encoding
//! the record or message: Kafka binary, NATS binary, NATS structured), `ack` (+ the item's
//! effect on the watermark).

#[path = "../benches/common/mod.rs"]
mod common;

use std::sync::Arc;

use kubecast::model::EventSource;
use kubecast::model::Position;
use kubecast::model::RawObject;
use kubecast::sink::{kafka, nats};
use kubecast::state::watermark::Watermark;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(2000, |s| s.parse().expect("events"));
    let step = args.next().unwrap_or_else(|| "ack".into());
    let recording = common::record(n);
    let source = Arc::new(EventSource::new("bench", &common::pods()));
    let mut watermark = Watermark::new(Position::default());
    let mut sum = 0usize;
    // `PATH_COST_PASSES=k`: go over the recording k times and print the time per event (for
    // wall-time comparisons; the recording is made once, outside the timing).
    let passes: usize = std::env::var("PATH_COST_PASSES").map_or(1, |p| p.parse().expect("PATH_COST_PASSES"));
    let started = std::time::Instant::now();
    for (seq, bytes) in std::iter::repeat_n(recording.iter(), passes).flatten().enumerate() {
        match step.as_str() {
            "none" => sum += bytes.len(),
            "decode" => sum += common::object(bytes).text().len(),
            "serde" => sum += serde_json::from_slice::<kube::api::WatchEvent<RawObject>>(bytes).is_ok() as usize,
            _ => {
                let item = common::item(seq as u64, &common::read(bytes), &source);
                let event = &item.change.unwrap().into_cloudevent().unwrap();
                sum += match step.as_str() {
                    "kafka" => kafka::encode(event, kafka::Mode::Binary).0.len(),
                    "nats" => nats::encode(event, nats::Mode::Binary).0.len(),
                    "structured" => nats::encode(event, nats::Mode::Structured).0.len(),
                    _ => event.data.len(),
                };
                if step == "ack" {
                    watermark.ack(item.seq, item.effect);
                }
            }
        }
    }
    let per_event = started.elapsed().as_secs_f64() / (n * passes) as f64 * 1e9;
    eprintln!("{step}: {n} events x {passes}, {sum} bytes, {per_event:.0} ns per event");
}
