//go:build tools

// Package tools pins the commands tests/env/up builds from this module:
//
//	go build -o ... k8s.io/kubernetes/cmd/kube-apiserver
//	go build -o ... k8s.io/kubernetes/cmd/kubectl
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
