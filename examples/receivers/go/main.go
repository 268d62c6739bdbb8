// A CloudEvents HTTP receiver for kubecast's HTTP sink, on the official CloudEvents Go SDK,
// that speaks HTTP/2: over TLS (offered by ALPN "h2" next to HTTP/1.1) and, with --h2c, in
// cleartext with prior knowledge (next to HTTP/1.1; an HTTP/1.1 "Upgrade: h2c" request is
// answered in HTTP/1.1). It lets the tests send kubecast's events over HTTP/2; the Python
// receiver of examples/receivers/http speaks HTTP/1.1 only.
//
// Like every receiver should, it parses each request with the SDK (binary or structured
// mode), answers 202 only once the event is stored (here: a line in the log), and marks
// duplicates by source + id (kubecast sends an event again after a retry or a restart; a
// duplicate is answered 2xx as well, so that kubecast moves on).
//
// Each line of --log is one accepted request, in the Python receiver's format plus "proto":
//
//	{"mode": "binary"|"structured", "attributes": {...}, "data": ..., "traceparent": ...,
//	 "duplicate": false, "proto": "HTTP/2.0"}
//
// The first line on stdout is {"port": N} once it listens.
//
//	receiver --log events.jsonl --h2c --port 0
//	receiver --log events.jsonl --tls-cert server.crt --tls-key server.key
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"
	"github.com/cloudevents/sdk-go/v2/types"
)

// entry is one line of the log.
type entry struct {
	Mode        string            `json:"mode"`
	Attributes  map[string]string `json:"attributes"`
	Data        json.RawMessage   `json:"data"`
	Traceparent *string           `json:"traceparent"`
	Duplicate   bool              `json:"duplicate"`
	Proto       string            `json:"proto"`
}

// receiver stores the accepted events: one log line each, duplicates marked.
type receiver struct {
	mu   sync.Mutex
	log  *os.File
	seen map[string]bool // source + " " + id
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// Every answer comes after the whole body is read: over HTTP/2 an answer before the body
	// is read resets the stream, and the sender sees a broken stream instead of the status.
	if r.Method != http.MethodPost {
		io.Copy(io.Discard, r.Body)
		http.Error(w, "POST a CloudEvent", http.StatusMethodNotAllowed)
		return
	}
	// Parse with the SDK: it reads both binary (ce-* headers) and structured mode.
	msg := cehttp.NewMessageFromHttpRequest(r)
	defer msg.Finish(nil)
	e, err := binding.ToEvent(r.Context(), msg)
	if err == nil {
		err = e.Validate()
	}
	// What the SDK did not read (of a request it could not parse).
	io.Copy(io.Discard, r.Body)
	if err != nil { // not a CloudEvent: the sender's mistake, not retried
		http.Error(w, "not a CloudEvent: "+err.Error(), http.StatusBadRequest)
		return
	}
	line := entry{
		Mode:       "binary",
		Attributes: attributes(e),
		Data:       data(e),
		Proto:      r.Proto,
	}
	if strings.HasPrefix(r.Header.Get("Content-Type"), "application/cloudevents+json") {
		line.Mode = "structured"
	}
	if tp := r.Header.Get("traceparent"); tp != "" {
		line.Traceparent = &tp
	}
	rc.mu.Lock()
	key := e.Source() + " " + e.ID()
	line.Duplicate = rc.seen[key]
	rc.seen[key] = true
	b, _ := json.Marshal(line)
	_, err = rc.log.Write(append(b, '\n'))
	rc.mu.Unlock()
	if err != nil { // not stored: not accepted either
		http.Error(w, "cannot store the event: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.WriteHeader(http.StatusAccepted)
}

// attributes returns the event's context attributes that are set and its extensions, as
// strings (time in RFC 3339).
func attributes(e *event.Event) map[string]string {
	a := map[string]string{
		"specversion": e.SpecVersion(),
		"id":          e.ID(),
		"source":      e.Source(),
		"type":        e.Type(),
	}
	if !e.Time().IsZero() {
		a["time"] = types.FormatTime(e.Time())
	}
	for k, v := range map[string]string{"subject": e.Subject(), "datacontenttype": e.DataContentType(), "dataschema": e.DataSchema()} {
		if v != "" {
			a[k] = v
		}
	}
	for k, v := range e.Extensions() {
		if s, err := types.Format(v); err == nil {
			a[k] = s
		} else {
			a[k] = fmt.Sprint(v)
		}
	}
	return a
}

// data returns the event's data as JSON when it is JSON, else as a JSON string (null when
// there is none).
func data(e *event.Event) json.RawMessage {
	d := e.Data()
	if len(d) == 0 {
		return json.RawMessage("null")
	}
	ct := e.DataContentType()
	if (ct == "" || strings.Contains(ct, "json")) && json.Valid(d) {
		return json.RawMessage(d)
	}
	b, _ := json.Marshal(string(d))
	return b
}

func main() {
	host := flag.String("host", "127.0.0.1", "address to listen on")
	port := flag.Int("port", 8080, "port to listen on (0: any free port)")
	logPath := flag.String("log", "", "file the accepted events are appended to (required)")
	cert := flag.String("tls-cert", "", "serve HTTPS with this certificate (PEM); HTTP/2 is offered by ALPN")
	key := flag.String("tls-key", "", "the certificate's private key (PEM)")
	h2c := flag.Bool("h2c", false, "cleartext: serve HTTP/2 with prior knowledge as well as HTTP/1.1")
	flag.Parse()
	if *logPath == "" || (*cert == "") != (*key == "") || (*h2c && *cert != "") {
		fmt.Fprintln(os.Stderr, "usage: receiver --log FILE [--host H] [--port N] [--tls-cert F --tls-key F | --h2c]")
		os.Exit(2)
	}
	f, err := os.OpenFile(*logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Handler: &receiver{log: f, seen: map[string]bool{}}}
	// Over TLS net/http offers h2 and http/1.1 by ALPN by itself. In cleartext, HTTP/2 with
	// prior knowledge is net/http's own too (Go >= 1.24; golang.org/x/net/http2/h2c is
	// deprecated in its favour).
	if *h2c {
		srv.Protocols = new(http.Protocols)
		srv.Protocols.SetHTTP1(true)
		srv.Protocols.SetUnencryptedHTTP2(true)
	}
	fmt.Printf("{\"port\": %d}\n", ln.Addr().(*net.TCPAddr).Port)
	if *cert != "" {
		err = srv.ServeTLS(ln, *cert, *key)
	} else {
		err = srv.Serve(ln)
	}
	log.Fatal(err)
}
