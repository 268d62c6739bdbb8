//! Checks made at start, before any stream runs, that need both the apiserver and the sink.

use std::sync::Arc;
use std::time::Duration;

use kube::api::GroupVersionKind;
use tracing::{error, warn};

use crate::config::Config;
use crate::delivery::DeliveryError;
use crate::delivery::dead_letter::DeadLetter;
use crate::delivery::retry::RetryPolicy;
use crate::model::{Fields, TypeFields};
use crate::sink::template::Template;
use crate::sink::{NatsSink, Sink, SinkError};

/// The dead-letter destination takes dead letters (see [`DeadLetter::check`]).
pub async fn check_dead_letter(config: &Config, sink: &Sink) -> Result<(), DeliveryError> {
    let d = &config.delivery;
    if d.dead_letter.path.is_none() {
        // Its default place is the checkpoint directory, which a broker store never creates.
        let _ = std::fs::create_dir_all(&config.checkpoint.dir);
    }
    DeadLetter::new(&d.dead_letter, &config.checkpoint.dir, RetryPolicy::new(d)).check(sink).await
}

/// JetStream: a stream must cover the subjects events go to. Looked up at start for each
/// resource's subjects (its kind found by discovery; a namespace of the configured ones, or
/// `default`), and created when `[sink.nats] create_stream` says so. A subject no stream
/// covers is a set-up mistake, not a reason to stop: it is logged here, named on `/readyz` by
/// the start-up look-up (`connect_check::watch_at_start`) until a stream covers it, and its
/// events are held in order meanwhile. When NATS is not reachable yet, the look-up is made
/// once it is.
pub async fn check_nats_streams(config: &Config, client: &kube::Client, sink: &Arc<Sink>) -> Result<(), SinkError> {
    let Some(n) = sink.nats() else { return Ok(()) };
    if !n.jetstream() {
        warn!("sink.nats.jetstream = false: core NATS is at-most-once; events can be lost when the connection drops");
        return Ok(());
    }
    let subjects = nats_sample_subjects(config, client, n).await;
    if n.is_connected() {
        if let Err(e) = n.ensure_streams(&subjects).await {
            error!(error = %e, "events to these subjects are held until a stream covers them");
        }
        return Ok(());
    }
    warn!("NATS is not reachable yet; the JetStream streams are checked once it is, and events wait until then");
    let sink = sink.clone();
    tokio::spawn(async move {
        let Some(n) = sink.nats() else { return };
        while !n.is_connected() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if let Err(e) = n.ensure_streams(&subjects).await {
            error!(error = %e, "events to these subjects are held until a stream covers them");
        }
    });
    Ok(())
}

async fn nats_sample_subjects(config: &Config, client: &kube::Client, n: &NatsSink) -> Vec<String> {
    let mut out = Vec::new();
    for (i, fields) in sample_fields(config, client).await {
        let rc = &config.resources[i];
        let route = rc.subject.as_deref().map(|t| Template::parse(t).expect("validated"));
        let subject = n.subject_for(route.as_ref(), &fields);
        if !out.contains(&subject) {
            out.push(subject);
        }
    }
    out
}

/// For each `[[resources]]` entry (its index) whose kind the apiserver serves, the fields of
/// sample events: each configured namespace (or `default` for a cluster-wide stream of a
/// namespaced kind, none for a cluster-scoped kind), each verb. What destination templates
/// are rendered with to name destinations before the first event.
pub async fn sample_fields(config: &Config, client: &kube::Client) -> Vec<(usize, Fields)> {
    let mut out = Vec::new();
    for (i, rc) in config.resources.iter().enumerate() {
        let (group, version) = rc.group_version();
        let gvk = GroupVersionKind::gvk(group, version, &rc.kind);
        let Ok((ar, caps)) = kube::discovery::pinned_kind(client, &gvk).await else {
            continue; // not served (yet): the reflector waits for it or fails
        };
        let namespaces: Vec<String> = if !rc.namespaces.is_empty() {
            rc.namespaces.clone()
        } else if caps.scope == kube::discovery::Scope::Namespaced {
            vec!["default".into()]
        } else {
            vec![String::new()]
        };
        let of_type = TypeFields::new(&config.cluster.name, &ar).intern();
        for namespace in namespaces {
            for verb in &rc.events {
                out.push((i, Fields { of_type, namespace: namespace.clone(), verb: verb.as_str() }));
            }
        }
    }
    out
}
