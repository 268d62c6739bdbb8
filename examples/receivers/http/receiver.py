#!/usr/bin/env python3
"""A CloudEvents HTTP receiver for kubecast's HTTP sink, on the official CloudEvents Python SDK.

It does what the docs ask of every receiver: it parses each request with the SDK (binary or
structured mode), answers 2xx only once the event is stored (here: a line in the log), and
drops duplicates by `source` + `id` (kubecast sends an event again after a retry or a
restart; a duplicate is answered 2xx, so that kubecast moves on, and logged as one).

Options for trying kubecast against a receiver on a bad day:
  --faults SHARE        answer that share of requests with a fault chosen at random: 503 with
                        Retry-After, 429 with Retry-After, 500, a hang past kubecast's timeout,
                        or a reset connection (nothing stored for any of them)
  --reject TEXT=STATUS  answer STATUS (e.g. 400, 413) to events whose object name contains TEXT
  --bearer-token-file F accept only `Authorization: Bearer <the file's token>` (read per request)
  --tls-cert/--tls-key  serve HTTPS

Each line of --log is one accepted request: {"mode", "attributes", "data", "traceparent",
"duplicate"}. The first line on stdout is {"port": N} once it listens.
"""

import argparse
import json
import random
import socket
import ssl
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cloudevents.core.bindings.http import HTTPMessage, from_http_event


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--log", required=True, help="file the accepted events are appended to")
    p.add_argument("--faults", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=3.0, help="how long a hang lasts (longer than kubecast's timeout_ms)")
    p.add_argument("--reject", action="append", default=[], metavar="TEXT=STATUS")
    p.add_argument("--bearer-token-file")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    rejects = []
    for r in args.reject:
        text, _, status = r.rpartition("=")
        rejects.append((text, int(status)))
    rng = random.Random(args.seed)
    lock = threading.Lock()
    seen = set()
    log = open(args.log, "a", encoding="utf-8")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet: one line per event would drown the test's log
            pass

        def answer(self, status, body=b"", headers=()):
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if args.bearer_token_file:
                with open(args.bearer_token_file, encoding="utf-8") as f:
                    want = "Bearer " + f.read().strip()
                if self.headers.get("Authorization") != want:
                    return self.answer(401, b"who are you?")
            with lock:
                fault = rng.random() < args.faults and rng.choice(["503", "429", "500", "hang", "reset"])
            if fault == "503":
                return self.answer(503, b"busy", [("Retry-After", "1")])
            if fault == "429":
                return self.answer(429, b"slow down", [("Retry-After", "1")])
            if fault == "500":
                return self.answer(500, b"oops")
            if fault == "hang":
                time.sleep(args.hang_seconds)
                self.close_connection = True
                return
            if fault == "reset":
                # RST instead of an answer.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            try:
                event = from_http_event(HTTPMessage(headers={k.lower(): v for k, v in self.headers.items()}, body=body))
            except Exception as e:  # not a CloudEvent: the sender's mistake, not retried
                return self.answer(400, f"not a CloudEvent: {e}".encode())
            attributes = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in event.get_attributes().items()}
            name = ""
            if isinstance(event.get_data(), dict):
                data = event.get_data()
                name = (data.get("metadata") or {}).get("name") or data.get("name") or ""
            for text, status in rejects:
                if text and text in name:
                    return self.answer(status, f"rejected {name}: status {status} as configured".encode())
            structured = self.headers.get("Content-Type", "").startswith("application/cloudevents+json")
            key = (attributes["source"], attributes["id"])
            with lock:
                duplicate = key in seen
                seen.add(key)
                log.write(json.dumps({
                    "mode": "structured" if structured else "binary",
                    "attributes": attributes,
                    "data": event.get_data(),
                    "traceparent": self.headers.get("traceparent"),
                    "duplicate": duplicate,
                }) + "\n")
                log.flush()
            self.answer(202)

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request, client_address):
            # A sender that went away (killed, timed out) is not the receiver's error.
            if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
                return
            super().handle_error(request, client_address)

    server = Server((args.host, args.port), Handler)
    if args.tls_cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
