//go:build tools

// Package tools pins the commands tests/env builds from this module:
//
//	tests/env/up:   k8s.io/kubernetes/cmd/kube-apiserver, k8s.io/kubernetes/cmd/kubectl
//	tests/env/node: k8s.io/kubernetes/cmd/kubelet, kube-controller-manager, kube-scheduler,
//	                kube-proxy (a single-node cluster on the same apiserver version)
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
