//go:build tools

// Package tools pins the nats-server command tests/env/up builds with
//
//	go build -o ... github.com/nats-io/nats-server/v2
package tools

import _ "github.com/nats-io/nats-server/v2"
