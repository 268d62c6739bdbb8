package io.kubecast.example;

import com.fasterxml.jackson.databind.ObjectMapper;
import io.cloudevents.CloudEvent;
import io.cloudevents.kafka.CloudEventDeserializer;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.StringDeserializer;

/**
 * A kubecast consumer in Java: rebuilds the current set of objects (a materialized view) from
 * a Kafka topic that kubecast publishes to.
 *
 * <p>What a service needs:
 *
 * <ul>
 *   <li>parse each CloudEvent with the official SDK (cloudevents-kafka's {@link
 *       CloudEventDeserializer} reads binary and structured mode);
 *   <li>drop duplicates by source + id (kubecast re-sends after a crash with the same ids);
 *   <li>keep per-object order: apply records one by one in the order of their partition (the
 *       key is the object's uid, so an object's events share a partition), never reordered;
 *   <li>key the view by the object's uid (partitionkey), not by its name: a deleted and
 *       re-created object has a new uid, and its events may sit in another partition.
 * </ul>
 *
 * <p>It reads from the beginning until nothing arrived for -idle-seconds, then prints one JSON
 * object: {"view": {"&lt;ns&gt;/&lt;name&gt;": "&lt;resourceVersion&gt;"}, "events": N,
 * "duplicates": N, ...}.
 *
 * <pre>
 *   java -cp 'kubecast-consumer.jar:lib/*' io.kubecast.example.Consumer \
 *       -kafka 127.0.0.1:9092 -topic kubecast.prod.core.configmaps
 * </pre>
 */
public final class Consumer {
  /** One entry of the view: the object as its last event says it is. */
  record KubeObject(String subject, String resourceVersion, byte[] data) {}

  private final Set<String> seen = new HashSet<>(); // source + " " + id: the dedupe key
  private final Map<String, KubeObject> objects = new HashMap<>(); // uid -> object
  private final Map<String, Integer> stats = new LinkedHashMap<>();

  private void count(String stat) {
    stats.merge(stat, 1, Integer::sum);
  }

  void apply(CloudEvent e, boolean binary) {
    count("events");
    count(binary ? "binary" : "structured");
    if (!seen.add(e.getSource() + " " + e.getId())) { // a re-send: already applied
      count("duplicates");
      return;
    }
    count("applied");
    String uid = String.valueOf(e.getExtension("partitionkey"));
    String type = e.getType();
    String verb = type.substring(type.lastIndexOf('.') + 1); // added | modified | deleted
    if (verb.equals("deleted")) {
      objects.remove(uid);
    } else {
      byte[] data = e.getData() == null ? null : e.getData().toBytes(); // the object
      objects.put(
          uid, new KubeObject(e.getSubject(), String.valueOf(e.getExtension("resourceversion")), data));
    }
  }

  void consumeKafka(String brokers, String topic, String isolation, Duration idle) {
    Properties props = new Properties();
    props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, brokers);
    // read_committed (the default here; the Java client's own is read_uncommitted): with
    // kubecast's exactly_once only committed transactions, each change once; without
    // transactions it reads every record either way. read_uncommitted also sees aborted
    // transactions' records, which the dedupe then drops.
    props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, isolation);
    props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
    props.put(ConsumerConfig.ALLOW_AUTO_CREATE_TOPICS_CONFIG, "false");
    // Values as bytes: a tombstone (null value, [sink.kafka] tombstones = true) is no event.
    CloudEventDeserializer events = new CloudEventDeserializer();
    events.configure(Map.of(), false);
    try (KafkaConsumer<String, byte[]> consumer =
        new KafkaConsumer<>(props, new StringDeserializer(), new ByteArrayDeserializer())) {
      // Every partition from its beginning, no group: the whole topic, each partition in its
      // own order (an object's events are all in one partition).
      List<TopicPartition> partitions = new ArrayList<>();
      for (PartitionInfo p : consumer.partitionsFor(topic, Duration.ofSeconds(30))) {
        partitions.add(new TopicPartition(topic, p.partition()));
      }
      if (partitions.isEmpty()) {
        throw new IllegalStateException("kafka topic " + topic + ": no partitions (does it exist?)");
      }
      consumer.assign(partitions);
      consumer.seekToBeginning(partitions);
      long last = System.nanoTime();
      while (System.nanoTime() - last < idle.toNanos()) {
        for (ConsumerRecord<String, byte[]> r : consumer.poll(Duration.ofMillis(200))) {
          last = System.nanoTime();
          if (r.value() == null) {
            continue;
          }
          boolean binary = false; // binary mode: ce_* headers; structured: the event as JSON
          for (Header h : r.headers()) {
            binary |= h.key().startsWith("ce_");
          }
          apply(events.deserialize(r.topic(), r.headers(), r.value()), binary);
        }
      }
    }
  }

  String result() throws Exception {
    Map<String, String> view = new TreeMap<>();
    for (KubeObject o : objects.values()) {
      view.put(o.subject(), o.resourceVersion());
    }
    Map<String, Object> out = new TreeMap<>();
    for (String s : List.of("events", "applied", "duplicates", "binary", "structured")) {
      out.put(s, stats.getOrDefault(s, 0));
    }
    out.put("view", view);
    return new ObjectMapper().writeValueAsString(out);
  }

  public static void main(String[] args) throws Exception {
    Map<String, String> opts =
        new HashMap<>(Map.of("-idle-seconds", "5", "-isolation", "read_committed"));
    for (int i = 0; i + 1 < args.length; i += 2) {
      opts.put(args[i].replaceFirst("^--", "-"), args[i + 1]);
    }
    String isolation = opts.get("-isolation");
    if (!opts.containsKey("-kafka")
        || !opts.containsKey("-topic")
        || !List.of("read_committed", "read_uncommitted").contains(isolation)) {
      System.err.println(
          "usage: Consumer -kafka BROKERS -topic TOPIC [-isolation read_committed|read_uncommitted] [-idle-seconds N]");
      System.exit(2);
    }
    Consumer c = new Consumer();
    Duration idle = Duration.ofMillis((long) (Double.parseDouble(opts.get("-idle-seconds")) * 1000));
    c.consumeKafka(opts.get("-kafka"), opts.get("-topic"), isolation, idle);
    System.out.println(c.result());
  }
}
