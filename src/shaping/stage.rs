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
use super::form::{EventForm, ObjectRef};
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
    form: EventForm,
) {
    // Items are taken in batches (one wake-up of this task per batch, and the permits of a
    // whole batch returned to the reflectors at once).
    let mut items = Vec::with_capacity(SHAPE_BATCH);
    while rx.recv_many(&mut items, SHAPE_BATCH).await > 0 {
        for item in items.drain(..) {
            let job = shape(item, &streams, &mut shapers, &form);
            if tx.send(job).await.is_err() {
                return;
            }
        }
    }
}

/// `form`: what the sink asks of every event (its structured form built here once,
/// [`crate::model::CloudEvent::seal_structured`]; extensions; ApiServerSource's form).
fn shape(item: Item, streams: &[StreamRoute], shapers: &mut [Shaper], form: &EventForm) -> Job {
    let stream = &streams[item.stream];
    let shaper = &mut shapers[stream.shaper];
    let m = &stream.metrics;
    m.read.store(item.seq + 1, std::sync::atomic::Ordering::Relaxed);
    let verb = item.change.as_ref().map_or(Verb::Added, |c| c.verb);
    let delivered_before = item.delivered_before;
    let msg = item.change.and_then(|change| {
        if delivered_before {
            // Sent before the restart, not again; the per-object state (status-only hashes,
            // previous objects) follows it, so the next change is shaped against this one.
            if shaper.keeps_state() {
                let (verb, key) = (change.verb, change.object.metadata.uid.clone().unwrap_or_default());
                if let Ok(mut event) = change.into_cloudevent() {
                    let _ = shaper.apply(verb, &key, false, &mut event);
                }
            }
            return None;
        }
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
        // The root span starts at this instant too: its `shape` child never starts before it.
        let started = std::time::SystemTime::now();
        let mut trace = EventTrace::start(
            &fields.of_type.kind,
            verb.as_str(),
            &fields.namespace,
            change.object.metadata.name.as_deref().unwrap_or_default(),
            started,
        );
        // Only the ApiServerSource form names the object.
        let name = if form.knative.is_some() {
            change.object.metadata.name.clone().unwrap_or_default()
        } else {
            String::new()
        };
        match change.into_cloudevent() {
            Ok(mut event) => {
                // Not sent (filtered out, status only...): acknowledged with the job.
                let shaped = shaper.apply(verb, &key, wanted, &mut event);
                if let Some(t) = &mut trace {
                    t.child("shape", started, vec![]);
                    t.annotate(vec![
                        opentelemetry::KeyValue::new("cloudevents.event_id", event.id().to_string()),
                        opentelemetry::KeyValue::new("cloudevents.event_source", event.attributes.source().to_string()),
                        opentelemetry::KeyValue::new("cloudevents.event_type", event.attributes.ty().to_string()),
                    ]);
                    if shaped.is_ok() {
                        // The send span's context (reserved now, the span starts at the first
                        // attempt): consumers become its children.
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
                if form.seal || form.changes_events() {
                    let api_version = match fields.of_type.group.as_str() {
                        "core" => fields.of_type.version.clone(),
                        group => format!("{group}/{}", fields.of_type.version),
                    };
                    let object = ObjectRef {
                        api_version: &api_version,
                        kind: &fields.of_type.kind,
                        namespace: &fields.namespace,
                        name: &name,
                    };
                    form.apply(verb, &object, &mut event);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kube::api::{ApiResource, GroupVersionKind};

    use super::*;
    use crate::model::{Change, Effect, EventSource, Origin, RawObject};
    use crate::shaping::{PayloadMode, ShapingOptions};

    fn item(seq: u64, data: serde_json::Value, delivered_before: bool) -> Item {
        let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("", "v1", "ConfigMap"), "configmaps");
        let object = RawObject::from_value(&serde_json::json!({
            "metadata": {"name": "a", "namespace": "n", "uid": "u", "resourceVersion": seq.to_string()},
            "data": data
        }))
        .unwrap();
        let source = Arc::new(EventSource::new("c", &ar));
        let verb = if seq == 1 { Verb::Added } else { Verb::Modified };
        Item {
            stream: 0,
            seq,
            effect: Effect::Bookmark(seq.to_string()),
            change: Some(Change { verb, origin: Origin::Watch, object, source }),
            delivered_before,
        }
    }

    /// A change delivered before a restart is not sent again, but the next change is shaped
    /// against it: its patch starts from it, not from the version before.
    #[test]
    fn a_change_delivered_before_a_restart_is_not_sent_but_shapes_the_next() {
        let options = ShapingOptions {
            kind: "ConfigMap".into(),
            events: Verb::ALL.to_vec(),
            keep_previous: true,
            payload: PayloadMode::Patch,
            redact_secrets: true,
            ..Default::default()
        };
        let streams = [StreamRoute {
            shaper: 0,
            metrics: Arc::new(StreamMetrics::new("", "ConfigMap", "stage-test")),
            route: None,
            limiter: None,
        }];
        let mut shapers = [Shaper::new(&options)];
        let first =
            shape(item(1, serde_json::json!({"v": "one"}), false), &streams, &mut shapers, &EventForm::default());
        assert!(first.msg.is_some());
        // Adds a key: a patch from version 1 would add it again.
        let skipped = shape(
            item(2, serde_json::json!({"v": "two", "w": "x"}), true),
            &streams,
            &mut shapers,
            &EventForm::default(),
        );
        assert!(skipped.msg.is_none(), "delivered before: not sent again");
        assert_eq!(skipped.seq, 2, "still acknowledged in its place");
        let next = shape(
            item(3, serde_json::json!({"v": "three", "w": "x"}), false),
            &streams,
            &mut shapers,
            &EventForm::default(),
        )
        .msg
        .expect("sent");
        let patch: serde_json::Value = serde_json::from_str(&next.event.data).unwrap();
        let v = patch.as_array().unwrap().iter().find(|op| op["path"] == "/data/v").expect("a data op");
        assert_eq!(v["value"], "three");
        assert!(
            !patch.as_array().unwrap().iter().any(|op| op["path"] == "/data/w"),
            "the patch starts from the skipped version 2, not from version 1: {patch}"
        );
    }
}
