//! Shaping cost per event vs the delivery path's, same run. Prints figures; asserts nothing
//! about time.
//!
//!     cargo bench --bench shaping                  # 20000 events over 5000 Pods
//!     cargo bench --bench shaping -- --events 50000
//!
//! The recorded stream of the delivery benchmarks (~10 KB Pods with managedFields). For each
//! shaping configuration it measures the CPU time of `Shaper::apply` over the CloudEvents of
//! the stream; the delivery cost is kubecast's Kafka delivery path on the same stream (as in
//! `cargo bench --bench kafka`). Goal (issue 6): shaping with a CEL filter adds less than 20%
//! to the per-event delivery cost. Needs the test Kafka (`tests/env/up kafka`, run by it).

mod common;

use common::{cpu_seconds, record};
use kubecast::config::ResourceConfig;
use kubecast::model::Verb;
use kubecast::model::{Change, CloudEvent, EventSource, Origin};
use kubecast::shaping::Shaper;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CONFIGS: &[(&str, &str)] = &[
    ("defaults (managedFields removal)", ""),
    ("CEL filter on verb only", "filter = \"verb != 'deleted'\""),
    ("CEL label filter", "filter = \"has(object.metadata.labels) && object.metadata.labels.app == 'web'\""),
    ("CEL filter on spec", "filter = \"object.spec.containers.exists(c, c.image.contains(':1.'))\""),
    ("ignore_status_only", "ignore_status_only = true"),
    (
        "keep_previous + oldObject filter",
        "keep_previous = true\nfilter = \"oldObject == null || oldObject.status.phase != object.status.phase\"",
    ),
    ("payload = metadata", "payload = \"metadata\""),
];

fn main() {
    common::run_like_the_binary(run());
}

async fn run() {
    let events = common::events_arg(20_000);
    let env = common::env_up("kafka");
    let brokers = common::env_value(&env, "KAFKA_BROKERS");
    let recording = record(events);
    let ar = common::pods();
    let source = std::sync::Arc::new(EventSource::new("bench", &ar));
    let to_events = || -> Vec<(String, CloudEvent)> {
        recording
            .iter()
            .map(|b| {
                let object = common::object(&common::read(b));
                let uid = object.metadata.uid.clone().unwrap();
                let change = Change { verb: Verb::Modified, origin: Origin::Watch, object, source: source.clone() };
                (uid, change.into_cloudevent().unwrap())
            })
            .collect()
    };
    println!("recorded stream: {events} events over {} Pods", common::OBJECTS);

    let sink = format!(
        "[sink]\ntype = \"kafka\"\n\n[sink.kafka]\nbrokers = \"{brokers}\"\ntopic = \"bench.shaping.{}\"\n",
        std::process::id()
    );
    let (_, delivery_cpu) = common::kubecast(&sink, &recording).await;
    let delivery_us = delivery_cpu / events as f64 * 1e6;
    println!("\ndelivery path (Kafka, binary mode): {delivery_us:.1} µs CPU per event\n");
    println!("{:<36} {:>14} {:>12} {:>10}", "shaping", "µs per event", "vs delivery", "sent");
    for (name, extra) in CONFIGS {
        let rc: ResourceConfig = toml_resource(extra);
        let mut shaper = Shaper::new(&rc.shaping());
        let mut evs = to_events();
        let cpu0 = cpu_seconds();
        let mut sent = 0usize;
        for (uid, ev) in evs.iter_mut() {
            if shaper.apply(Verb::Modified, uid, true, ev).is_ok() {
                sent += 1;
            }
        }
        let us = (cpu_seconds() - cpu0) / events as f64 * 1e6;
        println!("{name:<36} {us:>14.1} {:>11.0}% {sent:>10}", us / delivery_us * 100.0);
    }
    println!("\ngoal: shaping with a CEL filter adds < 20% to the delivery cost per event");
}

fn toml_resource(extra: &str) -> ResourceConfig {
    use figment::providers::Format;
    figment::Figment::from(figment::providers::Toml::string(&format!("api_version = \"v1\"\nkind = \"Pod\"\n{extra}")))
        .extract()
        .unwrap()
}
