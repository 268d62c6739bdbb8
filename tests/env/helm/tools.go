//go:build tools

// Package tools pins the helm command tests/env/tools builds with
//
//	go build -o ... helm.sh/helm/v4/cmd/helm
package tools

import _ "helm.sh/helm/v4/cmd/helm"
