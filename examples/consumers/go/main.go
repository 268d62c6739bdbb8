// A kubecast consumer in Go: rebuilds the current set of objects (a materialized view) from a
// Kafka topic or a NATS JetStream stream that kubecast publishes to.
//
// What a service needs:
//   - parse each CloudEvent with the official SDK (sdk-go's Kafka (sarama) and NATS JetStream
//     protocol bindings read both binary and structured mode);
//   - drop duplicates by source + id (kubecast re-sends after a crash with the same ids);
//   - keep per-object order: apply events one by one in the order of their partition (Kafka,
//     keyed by the object's uid) or of the stream (JetStream), never reordered;
//   - key the view by the object's uid (partitionkey), not by its name: a deleted and
//     re-created object has a new uid, and its events may sit in another partition.
//
// It reads from the beginning until nothing arrived for -idle-seconds, then prints one JSON
// object: {"view": {"<ns>/<name>": "<resourceVersion>"}, "events": N, "duplicates": N, ...}.
//
//	consumer -kafka 127.0.0.1:9092 -topic kubecast.prod.core.configmaps
//	consumer -nats nats://127.0.0.1:4222 -subject 'kubecast.prod.core.configmaps.>'
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/cloudevents/sdk-go/protocol/kafka_sarama/v2"
	"github.com/cloudevents/sdk-go/protocol/nats_jetstream/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"
	"github.com/nats-io/nats.go"
)

// object is one entry of the view: the object as its last event says it is.
type object struct {
	Subject         string // "namespace/name" (or "name")
	ResourceVersion string
	Data            []byte // the object (payload = "full")
}

// View is the current set of objects and what it took to get there.
type View struct {
	seen    map[string]bool    // source + " " + id of every event applied: the dedupe key
	objects map[string]*object // uid -> object
	Stats   struct{ Events, Applied, Duplicates, Binary, Structured int }
}

func (v *View) apply(e *event.Event, binary bool) {
	v.Stats.Events++
	if binary {
		v.Stats.Binary++
	} else {
		v.Stats.Structured++
	}
	key := e.Source() + " " + e.ID()
	if v.seen[key] { // a re-send (same change, same id): already applied
		v.Stats.Duplicates++
		return
	}
	v.seen[key] = true
	v.Stats.Applied++
	uid, _ := types.ToString(e.Extensions()["partitionkey"])
	rv, _ := types.ToString(e.Extensions()["resourceversion"])
	verb := e.Type()[strings.LastIndexByte(e.Type(), '.')+1:] // added | modified | deleted
	if verb == "deleted" {
		delete(v.objects, uid)
	} else {
		v.objects[uid] = &object{Subject: e.Subject(), ResourceVersion: rv, Data: e.Data()}
	}
}

func (v *View) print() {
	view := map[string]string{}
	for _, o := range v.objects {
		view[o.Subject] = o.ResourceVersion
	}
	out, _ := json.Marshal(map[string]any{
		"view": view, "events": v.Stats.Events, "applied": v.Stats.Applied,
		"duplicates": v.Stats.Duplicates, "binary": v.Stats.Binary, "structured": v.Stats.Structured,
	})
	fmt.Println(string(out))
}

// toEvent parses one message with its protocol binding: binary (ce_ / ce- headers) or
// structured (the whole event as JSON), whichever the message is.
func toEvent(m binding.Message) (*event.Event, bool) {
	e, err := binding.ToEvent(context.Background(), m)
	if err != nil {
		log.Fatalf("not a CloudEvent: %v", err)
	}
	return e, m.ReadEncoding() == binding.EncodingBinary
}

func consumeKafka(brokers, topic, isolation string, idle time.Duration, v *View) {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_1_0_0 // the oldest protocol Kafka 4 speaks
	cfg.Metadata.AllowAutoTopicCreation = false
	// read_committed (the default here; sarama's own is read_uncommitted): with kubecast's
	// exactly_once only committed transactions, each change once; without transactions it
	// reads every record either way. read_uncommitted also sees aborted transactions' records,
	// which the dedupe then drops.
	if isolation == "read_committed" {
		cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	}
	consumer, err := sarama.NewConsumer(strings.Split(brokers, ","), cfg)
	if err != nil {
		log.Fatalf("kafka: %v", err)
	}
	defer consumer.Close()
	partitions, err := consumer.Partitions(topic)
	if err == nil && len(partitions) == 0 {
		err = fmt.Errorf("no partitions")
	}
	if err != nil {
		log.Fatalf("kafka topic %s: %v", topic, err)
	}
	// Every partition from its beginning, no group: the whole topic, each partition in its
	// own order (an object's events are all in one partition). One loop applies them all.
	msgs, done := make(chan *sarama.ConsumerMessage), make(chan struct{})
	for _, p := range partitions {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			log.Fatalf("kafka partition %d: %v", p, err)
		}
		defer pc.Close()
		go func() {
			for m := range pc.Messages() {
				select {
				case msgs <- m:
				case <-done: // stopping: drain, so that pc.Close can finish
				}
			}
		}()
	}
	defer close(done) // runs before the pc.Close calls above
	for {
		select {
		case m := <-msgs:
			if m.Value == nil { // a tombstone ([sink.kafka] tombstones = true): not an event
				continue
			}
			v.apply(toEvent(kafka_sarama.NewMessageFromConsumerMessage(m)))
		case <-time.After(idle):
			return
		}
	}
}

func consumeNATS(url, subject, stream string, idle time.Duration, v *View) {
	nc, err := nats.Connect(url)
	if err != nil {
		log.Fatalf("nats: %v", err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		log.Fatalf("jetstream: %v", err)
	}
	// An ordered consumer: the stream's messages in stream order, from the first one.
	opts := []nats.SubOpt{nats.OrderedConsumer(), nats.DeliverAll()}
	if stream != "" {
		opts = append(opts, nats.BindStream(stream))
	}
	sub, err := js.SubscribeSync(subject, opts...)
	if err != nil {
		log.Fatalf("subscribe %s: %v", subject, err)
	}
	for {
		m, err := sub.NextMsg(idle)
		if err == nats.ErrTimeout {
			return
		} else if err != nil {
			log.Fatalf("nats: %v", err)
		}
		v.apply(toEvent(nats_jetstream.NewMessage(m)))
	}
}

func main() {
	brokers := flag.String("kafka", "", "Kafka bootstrap servers")
	topic := flag.String("topic", "", "Kafka topic")
	url := flag.String("nats", "", "NATS server URL")
	subject := flag.String("subject", "", "NATS subject filter, e.g. 'kubecast.prod.core.configmaps.>'")
	stream := flag.String("stream", "", "JetStream stream name (default: the one covering -subject)")
	idleSeconds := flag.Float64("idle-seconds", 5, "stop after this long without a message")
	isolation := flag.String("isolation", "read_committed", "Kafka: read_committed (with kubecast's exactly_once) or read_uncommitted")
	flag.Parse()
	if *isolation != "read_committed" && *isolation != "read_uncommitted" {
		fmt.Fprintln(os.Stderr, "-isolation: read_committed or read_uncommitted")
		os.Exit(2)
	}
	idle := time.Duration(*idleSeconds * float64(time.Second))
	v := &View{seen: map[string]bool{}, objects: map[string]*object{}}
	switch {
	case *brokers != "" && *topic != "":
		consumeKafka(*brokers, *topic, *isolation, idle, v)
	case *url != "" && *subject != "":
		consumeNATS(*url, *subject, *stream, idle, v)
	default:
		fmt.Fprintln(os.Stderr, "give -kafka and -topic, or -nats and -subject")
		os.Exit(2)
	}
	v.print()
}
