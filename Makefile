# The two set-up commands of the README.
.PHONY: demo test

# A local demo of the main job on the embedded defaults (starts a local kube-apiserver).
demo:
	scripts/demo

# The whole test suite against real servers (kube-apiserver + etcd, Kafka, NATS).
test:
	tests/run
