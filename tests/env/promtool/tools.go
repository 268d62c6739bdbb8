//go:build tools

// Package tools pins the promtool command tests/env/tools builds with
//
//	go build -o ... github.com/prometheus/prometheus/cmd/promtool
package tools

import _ "github.com/prometheus/prometheus/cmd/promtool"
