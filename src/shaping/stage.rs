//! The shaping stage: takes the reflectors' items, shapes each change with its resource's
//! [`Shaper`], makes its CloudEvent (and, for structured-mode sinks, its structured form once)
//! and hands the queue a [`Job`] per item: with an event to send, or without one (filtered
//! out, bookmark, end of a list), to be acknowledged at once.
//!
//! Invariant: every item becomes exactly one job, in the order the items came.

use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::warn;

use super::Shaper;
use crate::delivery::queue::{Job, Limiter};
use crate::model::{Fields, Verb};
use crate::observe::metrics::StreamMetrics;
use crate::observe::trace::EventTrace;
use crate::sink::Outbound;
use crate::sink::template::Template;
use crate::source::reflector::Item;

/// Items the shaping stage takes from its channel at once.
const SHAPE_BATCH: usize = 128;

/// What the shaping stage knows of a stream.
pub struct StreamRoute {
    /// Index of its `[[resources]]` entry's shaper.
    pub shaper: usize,
    pub metrics: Arc<StreamMetrics>,
    /// The resource's own destination template.
    pub route: Option<Arc<Template>>,
    /// The resource's own rate limit.
    pub limiter: Option<Limiter>,
}

/// The filter/transform stage: shaping (`src/shaping`: safe payload, change detection,
/// redaction, `events` and CEL filters, payload mode), then the CloudEvent's destination fields.
pub async fn run(
    mut rx: mpsc::Receiver<Item>,
    tx: mpsc::Sender<Job>,
    streams: Vec<StreamRoute>,
    mut shapers: Vec<Shaper>,
    seal: bool,
) {
    // Items are taken in batches (one wake-up of this task per batch, and the permits of a
    // whole batch returned to the reflectors at once).
    let mut items = Vec::with_capacity(SHAPE_BATCH);
    while rx.recv_many(&mut items, SHAPE_BATCH).await > 0 {
        for item in items.drain(..) {
            let job = shape(item, &streams, &mut shapers, seal);
            if tx.send(job).await.is_err() {
                return;
            }
        }
    }
}

/// `seal`: the sink sends structured events, built here once
/// ([`crate::model::CloudEvent::seal_structured`]).
fn shape(item: Item, streams: &[StreamRoute], shapers: &mut [Shaper], seal: bool) -> Job {
    let stream = &streams[item.stream];
    let shaper = &mut shapers[stream.shaper];
    let m = &stream.metrics;
    m.read.store(item.seq + 1, std::sync::atomic::Ordering::Relaxed);
    let verb = item.change.as_ref().map_or(Verb::Added, |c| c.verb);
    let msg = item.change.and_then(|change| {
        m.observed[change.verb.index()].inc();
        let wanted = shaper.wants(change.verb);
        if !wanted && !shaper.keeps_state() {
            m.filtered(change.verb, "verb");
            return None;
        }
        let verb = change.verb;
        let fields = Fields {
            of_type: change.source.type_fields(),
            namespace: change.object.metadata.namespace.clone().unwrap_or_default(),
            verb: verb.as_str(),
        };
        let key = change.object.metadata.uid.clone().unwrap_or_default();
        let started = std::time::SystemTime::now();
        let mut trace = EventTrace::start(
            &fields.of_type.kind,
            verb.as_str(),
            &fields.namespace,
            change.object.metadata.name.as_deref().unwrap_or_default(),
        );
        match change.into_cloudevent() {
            Ok(mut event) => {
                // Not sent (filtered out, status only...): acknowledged with the job.
                let shaped = shaper.apply(verb, &key, wanted, &mut event);
                if let Some(t) = &mut trace {
                    t.child("shape", started, vec![]);
                    t.annotate(vec![
                        opentelemetry::KeyValue::new("cloudevents.event_id", event.id().to_string()),
                        opentelemetry::KeyValue::new("cloudevents.event_type", event.attributes.ty().to_string()),
                    ]);
                    if shaped.is_ok() {
                        let (parent, state) = t.w3c();
                        event.attributes.set_extension("traceparent", parent);
                        if let Some(state) = state {
                            event.attributes.set_extension("tracestate", state);
                        }
                        t.mark_queued();
                    }
                }
                if let Err(why) = shaped {
                    m.filtered(verb, why.as_str());
                    if let Some(t) = trace {
                        t.end(format!("filtered ({})", why.as_str()).into(), None);
                    }
                    return None;
                }
                if seal {
                    event.seal_structured();
                }
                Some(Box::new(Outbound { event, fields, route: stream.route.clone(), trace }))
            }
            // Cannot happen with objects from a real apiserver (they all have uid and
            // resourceVersion); acknowledged so the stream does not stall on it.
            Err(e) => {
                warn!(error = %e, "object cannot become an event; skipped");
                None
            }
        }
    });
    Job { stream: item.stream, seq: item.seq, effect: item.effect, msg, limiter: stream.limiter.clone(), verb }
}
