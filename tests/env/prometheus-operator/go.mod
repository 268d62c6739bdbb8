// Fetch-only module: tests/env/tools takes prometheus-operator's CRDs (example/
// prometheus-operator-crd/*.yaml, part of the module's zip) from the Go module proxy for the
// chart tests (the PrometheusRule the chart renders is validated against the real CRD).
// Nothing is built from it.
module kubecast.test/env/prometheus-operator

go 1.26.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
