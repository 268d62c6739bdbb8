#!/usr/bin/env python3
"""A kubecast consumer in Python: rebuilds the current set of objects (a materialized view)
from a Kafka topic or a NATS JetStream stream that kubecast publishes to.

What a service needs:
  * parse each CloudEvent with the official SDK (`cloudevents`), binary or structured mode;
  * drop duplicates by `source` + `id` (kubecast re-sends after a crash with the same ids);
  * keep per-object order: apply events one by one in the order of their partition (Kafka,
    keyed by the object's uid) or of the stream (JetStream), never reordered;
  * key the view by the object's uid (`partitionkey`), not by its name: a deleted and
    re-created object has a new uid, and its events may sit in another partition.

It reads from the beginning until nothing arrived for --idle-seconds, then prints one JSON
object: {"view": {"<ns>/<name>": "<resourceVersion>"}, "events": N, "duplicates": N, ...}.

  consumer.py --kafka 127.0.0.1:9092 --topic kubecast.prod.core.configmaps
  consumer.py --nats nats://127.0.0.1:4222 --subject 'kubecast.prod.core.configmaps.>'
"""

import argparse
import asyncio
import json
import sys
import time

from cloudevents.core.bindings import http as ce_http  # NATS headers are HTTP-like: ce-*
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat

JSON = JSONFormat()


class View:
    """The objects as the events say they are now, and what it took to get there."""

    def __init__(self):
        self.seen = set()  # (source, id) of every event applied: the dedupe key
        self.objects = {}  # uid -> {"subject", "resourceversion", "data"}
        self.stats = {"events": 0, "applied": 0, "duplicates": 0, "binary": 0, "structured": 0}

    def apply(self, event, binary):
        self.stats["events"] += 1
        self.stats["binary" if binary else "structured"] += 1
        key = (event.get_source(), event.get_id())
        if key in self.seen:  # a re-send (same change, same id): already applied
            self.stats["duplicates"] += 1
            return
        self.seen.add(key)
        self.stats["applied"] += 1
        verb = event.get_type().rsplit(".", 1)[-1]  # added | modified | deleted
        uid = event.get_extension("partitionkey")
        if verb == "deleted":
            self.objects.pop(uid, None)
        else:
            self.objects[uid] = {
                "subject": event.get_subject(),  # "namespace/name" (or "name")
                "resourceversion": event.get_extension("resourceversion"),
                "data": event.get_data(),  # the object (payload = "full")
            }

    def result(self):
        view = {o["subject"]: o["resourceversion"] for o in self.objects.values()}
        return {"view": view, **self.stats}


def consume_kafka(args, view):
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": args.kafka,
        "group.id": args.group,  # offsets are never committed: the view is rebuilt each run
        "enable.auto.commit": False,
        # read_committed (librdkafka's default too): with kubecast's exactly_once only committed
        # transactions, each change once; without transactions it reads every record either
        # way. read_uncommitted also sees aborted transactions' records, which the dedupe drops.
        "isolation.level": args.isolation,
    })
    # Every partition from its beginning, no group rebalancing: the whole topic, each
    # partition in its own order (an object's events are all in one partition).
    topic = consumer.list_topics(args.topic, timeout=30).topics[args.topic]
    if topic.error or not topic.partitions:
        sys.exit(f"kafka topic {args.topic}: {topic.error or 'no partitions'}")
    parts = topic.partitions
    consumer.assign([TopicPartition(args.topic, p, OFFSET_BEGINNING) for p in parts])
    last = time.monotonic()
    while time.monotonic() - last < args.idle_seconds:
        msg = consumer.poll(0.2)
        if msg is None:
            continue
        if msg.error():
            print(f"kafka: {msg.error()}", file=sys.stderr)
            continue
        last = time.monotonic()
        if msg.value() is None:  # a tombstone ([sink.kafka] tombstones = true): not an event
            continue
        headers = {k: v for k, v in (msg.headers() or [])}
        record = ce_kafka.KafkaMessage(headers=headers, key=msg.key(), value=msg.value())
        binary = any(k.lower().startswith("ce_") for k in headers)
        view.apply(ce_kafka.from_kafka(record, JSON), binary)  # binary or structured
    consumer.close()


async def consume_nats(args, view):
    import nats
    from nats.js.api import DeliverPolicy

    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    # An ordered consumer: the stream's messages in stream order, from the first one.
    sub = await js.subscribe(args.subject, stream=args.stream, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL)
    while True:
        try:
            msg = await sub.next_msg(timeout=args.idle_seconds)
        except nats.errors.TimeoutError:
            break
        headers = dict(msg.headers or {})
        message = ce_http.HTTPMessage(headers=headers, body=msg.data)
        binary = "ce-specversion" in headers  # binary: ce-* headers (percent-encoded)
        view.apply(ce_http.from_http(message, JSON), binary)
    await nc.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kafka", help="Kafka bootstrap servers")
    p.add_argument("--topic", help="Kafka topic")
    p.add_argument("--group", default="kubecast-consumer-example", help="Kafka group.id")
    p.add_argument("--nats", help="NATS server URL")
    p.add_argument("--subject", help="NATS subject filter, e.g. 'kubecast.prod.core.configmaps.>'")
    p.add_argument("--stream", help="JetStream stream name (default: the one covering --subject)")
    p.add_argument("--idle-seconds", type=float, default=5.0, help="stop after this long without a message")
    p.add_argument("--isolation", choices=["read_committed", "read_uncommitted"], default="read_committed",
                   help="Kafka: read_committed with kubecast's exactly_once")
    args = p.parse_args()
    view = View()
    if args.kafka and args.topic:
        consume_kafka(args, view)
    elif args.nats and args.subject:
        asyncio.run(consume_nats(args, view))
    else:
        p.error("give --kafka and --topic, or --nats and --subject")
    json.dump(view.result(), sys.stdout, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
