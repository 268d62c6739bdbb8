//! Every destination kubecast can name from the configuration, looked up without creating
//! anything: the events' Kafka topics (each resource's template rendered for sample events)
//! or the JetStream streams that must cover their NATS subjects, the dead-letter destination
//! and the Kafka state topic. What is missing or refused is reported all at once:
//! `kubecast check-config --connect` prints it and exits 2 (the command an installer runs
//! before the install); `run` logs it at start, before the first event (the events to such a
//! destination are then held until it is fixed, see `model::Refusal`).
//!
//! What metadata cannot tell is not claimed: Kafka's Write permission shows only when a
//! record is produced (a topic the principal may not even describe is reported).

use std::time::Duration;

use tracing::{info, warn};

use super::preflight::sample_fields;
use crate::config::Config;
use crate::delivery::DeadLetterType;
use crate::model::Refusal;
use crate::observe::health::Health;
use crate::sink::kafka::lookup::{TopicState, any_broker, broker_auto_creates, lookup_topics};
use crate::sink::template::Template;
use crate::sink::{KafkaSink, NatsSink, Sink, SinkType};
use crate::state::StoreKind;

const TIMEOUT: Duration = Duration::from_secs(10);

/// One thing found: a problem (kubecast would hold events, or not start) or a note.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub problem: bool,
    pub text: String,
    /// About a destination events will surely go to (not one rendered for a sample namespace
    /// of a cluster-wide stream, which may never see an event): what readiness reports.
    pub certain: bool,
}

impl Finding {
    fn problem(text: String) -> Self {
        Self { problem: true, text, certain: true }
    }
    fn note(text: String) -> Self {
        Self { problem: false, text, certain: true }
    }
}

/// `kubecast check-config --connect`: connects to the apiserver and the sink, then looks every
/// destination up.
pub async fn check(config: &Config) -> Result<Vec<Finding>, String> {
    let (client, server) = crate::source::client::client(&config.cluster).await.map_err(|e| e.to_string())?;
    if let Err(e) = client.apiserver_version().await {
        return Ok(vec![Finding::problem(format!(
            "the apiserver {server} did not answer: {} (fix: check [cluster] kubeconfig and the credentials)",
            crate::observe::kube_error::in_words(&e)
        ))]);
    }
    let sink = Sink::open(&config.sink, config.delivery.max_in_flight).await.map_err(|e| e.to_string())?;
    Ok(destinations(config, &client, &sink, false).await)
}

/// Looks up every destination the configuration names; `client` for the resources' kinds.
/// `started`: at the start of `run`, after kubecast created what it creates (its JetStream
/// stream): a subject still not covered is a problem then, not a note.
pub async fn destinations(config: &Config, client: &kube::Client, sink: &Sink, started: bool) -> Vec<Finding> {
    let samples = sample_fields(config, client).await;
    let mut findings = Vec::new();
    if samples.len() < config.resources.iter().map(|r| r.events.len()).sum::<usize>() {
        findings.push(Finding::note(
            "some resources' kinds are not served (yet): their destinations are looked up once they are".into(),
        ));
    }
    let dead_letter = (config.delivery.dead_letter.kind == DeadLetterType::Broker)
        .then(|| config.delivery.dead_letter.destination.clone())
        .flatten();
    if let Some(k) = sink.kafka() {
        let mut topics: Vec<(String, &'static str)> = Vec::new();
        let mut sampled = Vec::new();
        for (i, fields) in &samples {
            let route = config.resources[*i].route(SinkType::Kafka).map(|t| Template::parse(t).expect("validated"));
            let topic = k.topic_for(route.as_ref(), fields);
            if !topics.iter().any(|(t, _)| *t == topic) {
                // A cluster-wide stream's topic that names the namespace: only a sample.
                let other = crate::model::Fields { namespace: "kubecast-sample-namespace".into(), ..fields.clone() };
                sampled
                    .push(config.resources[*i].namespaces.is_empty() && k.topic_for(route.as_ref(), &other) != topic);
                topics.push((topic, "event topic"));
            }
        }
        if let Some(d) = dead_letter {
            topics.push((d, "dead-letter topic ([delivery.dead_letter] destination)"));
            sampled.push(false);
        }
        let state_here = config.checkpoint.store == StoreKind::Kafka && config.checkpoint.kafka.brokers.is_none();
        if state_here {
            topics.push((config.checkpoint.kafka.topic.clone(), "state topic ([checkpoint.kafka] topic)"));
            sampled.push(false);
        }
        findings.extend(kafka_topics(config, k, &topics, &sampled).await);
    } else if let Some(n) = sink.nats() {
        let mut subjects: Vec<(String, &'static str)> = Vec::new();
        let mut sampled = Vec::new();
        if n.jetstream() {
            for (i, fields) in &samples {
                let route = config.resources[*i].route(SinkType::Nats).map(|t| Template::parse(t).expect("validated"));
                let subject = n.subject_for(route.as_ref(), fields);
                if !subjects.iter().any(|(s, _)| *s == subject) {
                    // A cluster-wide stream's subject that names the namespace: only a sample.
                    let other =
                        crate::model::Fields { namespace: "kubecast-sample-namespace".into(), ..fields.clone() };
                    sampled.push(
                        config.resources[*i].namespaces.is_empty() && n.subject_for(route.as_ref(), &other) != subject,
                    );
                    subjects.push((subject, "event subject"));
                }
            }
            if let Some(d) = dead_letter {
                subjects.push((d, "dead-letter subject ([delivery.dead_letter] destination)"));
                sampled.push(false);
            }
        }
        let mut found = nats_subjects(n, &subjects, started).await;
        if found.len() == subjects.len() {
            for (f, sampled) in found.iter_mut().zip(&sampled) {
                f.certain = !sampled;
            }
        }
        findings.extend(found);
    }
    findings
}

async fn kafka_topics(
    config: &Config,
    k: &KafkaSink,
    topics: &[(String, &'static str)],
    sampled: &[bool],
) -> Vec<Finding> {
    let names: Vec<String> = topics.iter().map(|(t, _)| t.clone()).collect();
    let cc = k.client_config().clone();
    let looked = tokio::task::spawn_blocking(move || lookup_topics(&cc, &names, TIMEOUT)).await.expect("lookup task");
    let (states, brokers) = match looked {
        Ok(found) => found,
        Err(e) => {
            return vec![Finding::problem(format!(
                "the Kafka brokers ({}) did not answer: {e} (fix: check sink.kafka.brokers and the connection's TLS and SASL settings)",
                k.client_config().get("bootstrap.servers").unwrap_or_default()
            ))];
        }
    };
    // Whether a missing event topic would be created at the first event.
    let cc = k.client_config().clone();
    let broker = tokio::task::spawn_blocking(move || any_broker(&cc, TIMEOUT)).await.expect("lookup task");
    let auto = match broker {
        Some(id) if k.may_auto_create() => broker_auto_creates(k.client_config(), id).await,
        _ => Some(false),
    };
    let principal = k.principal_words();
    let mut out = Vec::new();
    for (((topic, what), (_, state)), sampled) in topics.iter().zip(states).zip(sampled) {
        let state_topic = what.starts_with("state");
        let before = out.len();
        match state {
            TopicState::Exists { replicas } => {
                out.push(Finding::note(format!("Kafka {what} {topic:?} exists ({replicas} replica(s))")));
                if state_topic && replicas < 2 && brokers > 1 {
                    out.push(Finding::note(format!(
                        "Kafka {what} {topic:?} has one replica on a cluster of {brokers} brokers: losing that broker's disk loses every position (fix: raise its replication factor)"
                    )));
                }
            }
            TopicState::Missing if state_topic && config.checkpoint.kafka.create_topic => out.push(Finding::note(format!(
                "Kafka {what} {topic:?} does not exist: kubecast creates it at start (compacted; [checkpoint.kafka] create_topic)"
            ))),
            TopicState::Missing if !state_topic && auto == Some(true) => out.push(Finding::note(format!(
                "Kafka {what} {topic:?} does not exist: the brokers create it at the first event (auto.create.topics.enable), with their default partitions and replication"
            ))),
            TopicState::Missing => {
                let fix = if state_topic {
                    "create it with cleanup.policy=compact, or set [checkpoint.kafka] create_topic = true"
                } else {
                    Refusal::MissingTopic.fix()
                };
                out.push(Finding::problem(format!("Kafka {what} {topic:?} does not exist (fix: {fix})")));
            }
            TopicState::Refused(r) => out.push(Finding::problem(format!(
                "Kafka {what} {topic:?}{principal}: {r} (fix: {})",
                r.fix()
            ))),
            TopicState::Error(e) => out.push(Finding::problem(format!("Kafka {what} {topic:?}: the broker answered {e}"))),
        }
        for f in &mut out[before..] {
            f.certain = !sampled;
        }
    }
    out
}

async fn nats_subjects(n: &NatsSink, subjects: &[(String, &'static str)], started: bool) -> Vec<Finding> {
    let mut out = Vec::new();
    if !n.is_connected() {
        // The client connects in the background: give it a moment.
        let until = std::time::Instant::now() + TIMEOUT;
        while !n.is_connected() && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !n.is_connected() {
            return vec![Finding::problem(
                "the NATS server did not answer (fix: check sink.nats.url and the credentials)".into(),
            )];
        }
    }
    for (subject, what) in subjects {
        match n.stream_for(subject).await {
            Ok(Some(stream)) => out.push(Finding::note(format!("NATS {what} {subject:?}: stream {stream} covers it"))),
            Ok(None) if n.creates_stream() && !started => out.push(Finding::note(format!(
                "NATS {what} {subject:?}: no stream covers it yet; kubecast creates its stream at start (sink.nats.create_stream)"
            ))),
            Ok(None) => out.push(Finding::problem(format!(
                "NATS {what} {subject:?}: {} (fix: {})",
                Refusal::MissingStream,
                Refusal::MissingStream.fix()
            ))),
            Err(e) => out.push(Finding::problem(format!("NATS {what} {subject:?}: JetStream did not answer: {e}"))),
        }
    }
    out
}

/// How often the look-ups are made again while a destination is not ready.
const AGAIN: Duration = Duration::from_secs(15);

/// At start of `run` (a Kafka or NATS sink): the same look-ups, logged before the first event
/// (problems as warnings). The problems with destinations events
/// will surely go to make `health` not ready; they are looked up again every 15 s until none
/// is left (the operator created the topic or granted the permission).
pub async fn watch_at_start(config: &Config, client: &kube::Client, sink: &Sink, health: &Health) {
    if sink.kafka().is_none() && sink.nats().is_none_or(|n| !n.jetstream()) {
        return;
    }
    let mut said = Vec::new();
    loop {
        let findings = destinations(config, client, sink, true).await;
        for f in &findings {
            if said.contains(&f.text) {
                continue;
            }
            if f.problem {
                warn!(problem = %f.text, "a destination is not ready; its events will be held until it is fixed");
            } else {
                info!("{}", f.text);
            }
            said.push(f.text.clone());
        }
        let problems: Vec<String> = findings
            .into_iter()
            .filter(|f| f.problem && f.certain)
            .map(|f| format!("destination: {} (looked up at start, again every {} s)", f.text, AGAIN.as_secs()))
            .collect();
        let done = problems.is_empty();
        health.set_destination_problems(problems);
        if done {
            return;
        }
        tokio::time::sleep(AGAIN).await;
    }
}
