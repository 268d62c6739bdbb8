//! The brokers of tests/env are real and reachable: one message through Kafka and one through
//! NATS JetStream, each produced and consumed back.

use kubecast_kit as common;

use std::time::Duration;

use futures::StreamExt;
use rdkafka::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};

#[tokio::test]
async fn kafka_round_trip() {
    let brokers = common::env_var("KAFKA_BROKERS");
    let topic = common::unique("kubecast-e2e");
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", "30000")
        .create()
        .expect("producer");
    let delivery = producer
        .send(FutureRecord::to(&topic).key("k").payload("hello kafka"), Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .expect("delivered with acks=all");
    assert_eq!(delivery.offset, 0, "first record of a new topic");

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", common::unique("g"))
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("consumer");
    consumer.subscribe(&[&topic]).unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
        .await
        .expect("a message within 60 s")
        .expect("consume");
    assert_eq!(msg.payload(), Some(&b"hello kafka"[..]));
    assert_eq!(msg.key(), Some(&b"k"[..]));
}

#[tokio::test]
async fn nats_jetstream_round_trip() {
    let url = common::env_var("NATS_URL");
    let client = async_nats::connect(&url).await.expect("connect to nats");
    let js = async_nats::jetstream::new(client);
    let name = common::unique("E2E").replace('-', "_");
    let subject = format!("e2e.{name}");
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
        })
        .await
        .expect("create stream (JetStream enabled)");
    let ack = js.publish(subject.clone(), "hello nats".into()).await.expect("publish").await.expect("PubAck");
    assert_eq!(ack.stream, name);
    assert_eq!(ack.sequence, 1);

    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config { durable_name: None, ..Default::default() })
        .await
        .expect("consumer");
    let mut msgs = consumer.fetch().max_messages(1).expires(Duration::from_secs(10)).messages().await.unwrap();
    let msg = msgs.next().await.expect("one message").expect("message");
    assert_eq!(&msg.payload[..], b"hello nats");
    msg.ack().await.unwrap();
    js.delete_stream(&name).await.unwrap();
}
