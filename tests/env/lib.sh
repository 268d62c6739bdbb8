# shellcheck shell=bash disable=SC2034 # globals are used by the sourcing scripts
# Shared code of tests/env/{up,down,restart-apiserver,kafka-*}. Sourced, not run.
#
# Layout
#   cache  ${KUBECAST_ENV_CACHE:-$HOME/.cache/kubecast-env}  (shared by checkouts)
#     bin/<tool>-<version>-<hash>   built binaries, keyed by version + build inputs
#     kafka-<version>-<hash>/libs   Kafka jars
#     locks/                        flock files serialising builds
#   state  ${KUBECAST_ENV_STATE:-<repo>/target/kubecast-env}  (per checkout)
#     env                           KEY=value file for the services that run
#     kubeconfig                    admin kubeconfig (static token)
#     bin/                          symlinks: etcd kube-apiserver kubectl nats-server
#     <service>/pid <service>/<service>.log <service>/env (env fragment)
#     <service>/...                 data dirs, certs, configs

ENV_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO_DIR=$(cd "$ENV_DIR/../.." && pwd -P)

ALL_SERVICES=(etcd apiserver kafka nats)

ETCD_PORT=${KUBECAST_ENV_ETCD_PORT:-23790}
ETCD_PEER_PORT=${KUBECAST_ENV_ETCD_PEER_PORT:-23800}
APISERVER_PORT=${KUBECAST_ENV_APISERVER_PORT:-16443}
KAFKA_PORT=${KUBECAST_ENV_KAFKA_PORT:-19092}
KAFKA_CONTROLLER_PORT=${KUBECAST_ENV_KAFKA_CONTROLLER_PORT:-19093}
# A second listener that requires SASL/PLAIN (user kubecast, password kubecast-secret), for
# authentication tests.
KAFKA_SASL_PORT=${KUBECAST_ENV_KAFKA_SASL_PORT:-19094}
# A listener for pods on the node (tests/env/node): bound on 127.0.0.1, advertised as
# $NODE_HOST_IP:<port>, which the node's network namespace reaches (see tests/env/node).
KAFKA_NODE_PORT=${KUBECAST_ENV_KAFKA_NODE_PORT:-19096}
# TLS listeners, with the test CA of $STATE_DIR/kafka/pki (see kafka_pki in tests/env/up):
# server-authenticated TLS, SASL over TLS (PLAIN and SCRAM-SHA-512), and TLS that requires a
# client certificate signed by that CA (mutual TLS).
KAFKA_SSL_PORT=${KUBECAST_ENV_KAFKA_SSL_PORT:-19097}
KAFKA_SASL_SSL_PORT=${KUBECAST_ENV_KAFKA_SASL_SSL_PORT:-19098}
KAFKA_MTLS_PORT=${KUBECAST_ENV_KAFKA_MTLS_PORT:-19099}
# SASL over TLS (PLAIN and SCRAM-SHA-512) for pods on the node: bound on 127.0.0.1, advertised
# as $NODE_HOST_IP:<port> (the broker certificate names that address too).
KAFKA_NODE_SASL_SSL_PORT=${KUBECAST_ENV_KAFKA_NODE_SASL_SSL_PORT:-19100}
NATS_PORT=${KUBECAST_ENV_NATS_PORT:-14222}
NATS_MONITOR_PORT=${KUBECAST_ENV_NATS_MONITOR_PORT:-18222}

# The node (tests/env/node): its network namespace reaches this machine at NODE_HOST_IP (the
# host end of a veth pair), and this machine reaches the node at NODE_IP.
NODE_HOST_IP=${KUBECAST_ENV_NODE_HOST_IP:-10.201.0.1}
NODE_IP=${KUBECAST_ENV_NODE_IP:-10.201.0.2}

log() { printf '[tests/env] %s\n' "$*" >&2; }
die() {
	printf '[tests/env] ERROR: %s\n' "$*" >&2
	exit 1
}

if [[ -z ${KUBECAST_ENV_CACHE:-} && -z ${HOME:-} ]]; then
	die "HOME is not set; set KUBECAST_ENV_CACHE to a cache directory"
fi
CACHE_DIR=${KUBECAST_ENV_CACHE:-$HOME/.cache/kubecast-env}
STATE_DIR=${KUBECAST_ENV_STATE:-$REPO_DIR/target/kubecast-env}
mkdir -p "$CACHE_DIR/bin" "$CACHE_DIR/locks" "$STATE_DIR"
CACHE_DIR=$(cd "$CACHE_DIR" && pwd -P)
STATE_DIR=$(cd "$STATE_DIR" && pwd -P)
BIN_DIR=$STATE_DIR/bin

# ---------------------------------------------------------------- locking
# fd 9: whole-state lock (one up/down at a time per state dir)
# fd 8: build lock in the main shell; fd 7: build lock in a background job.
# Daemons are started with 7>&- 8>&- 9>&- so they never inherit a lock.

lock_state() {
	exec 9>"$STATE_DIR/.lock"
	if ! flock -n 9; then
		log "waiting for another tests/env command on $STATE_DIR ..."
		flock -w 1800 9 || die "timed out waiting for lock $STATE_DIR/.lock"
	fi
}

# lock_build FD NAME: take the cache build lock NAME on fd FD (7 or 8).
lock_build() {
	local fd=$1 name=$2 file="$CACHE_DIR/locks/$2.lock"
	case $fd in
	7) exec 7>"$file" ;;
	8) exec 8>"$file" ;;
	*) die "lock_build: bad fd $fd" ;;
	esac
	if ! flock -n "$fd"; then
		log "waiting for another build of $name (lock $file) ..."
		flock -w 3600 "$fd" || die "timed out waiting for lock $file"
	fi
}

unlock_build() {
	case $1 in
	7) exec 7>&- ;;
	8) exec 8>&- ;;
	esac
}

# node_mode: the apiserver serves a node (tests/env/node): the ServiceAccount admission plugin
# on (the node's controller-manager makes every namespace's "default" ServiceAccount). Set by
# KUBECAST_ENV_NODE=1 (tests/run), or remembered from `tests/env/node up` ($STATE_DIR/node-mode).
node_mode() {
	case ${KUBECAST_ENV_NODE:-} in
	1) return 0 ;;
	0) return 1 ;;
	esac
	[[ -f $STATE_DIR/node-mode ]]
}

# ---------------------------------------------------------------- toolchains

find_go() {
	if [[ -z ${GO:-} ]]; then
		if command -v go >/dev/null 2>&1; then
			GO=$(command -v go)
		elif [[ -x /usr/local/go/bin/go ]]; then
			GO=/usr/local/go/bin/go
		else
			die "go not found in PATH (nor /usr/local/go/bin/go); Go >= 1.26 is needed to build etcd, kube-apiserver, kubectl and nats-server"
		fi
	fi
	local v
	v=$("$GO" env GOVERSION 2>/dev/null) || die "the Go toolchain '$GO' does not work ('$GO env GOVERSION' failed)"
	GO_MINOR=$(sed -E 's/^go1\.([0-9]+).*/\1/' <<<"$v")
	[[ $GO_MINOR =~ ^[0-9]+$ ]] || GO_MINOR=0
	if ((GO_MINOR < 26)); then
		log "warning: $GO is $v; the pinned modules need Go >= 1.26 (GOTOOLCHAIN may fetch one through the module proxy)"
	fi
}

find_java() {
	command -v java >/dev/null 2>&1 || die "java not found in PATH; Kafka needs Java >= 17 (Debian: apt-get install openjdk-17-jre-headless)"
	local v
	v=$(java -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java.specification.version = //p')
	v=${v%%.*}
	if ! [[ $v =~ ^[0-9]+$ ]] || ((v < 17)); then
		die "java ${v:-(unknown version)} found; Kafka 4 needs Java >= 17"
	fi
}

find_mvn() {
	command -v mvn >/dev/null 2>&1 || die "mvn not found in PATH; it fetches the Kafka jars (Debian: apt-get install maven)"
}

# inputs_hash FILE...: short hash of the contents of the files (build inputs).
inputs_hash() {
	cat "$@" | sha256sum | cut -c1-10
}

# go_mod_version DIR MODULE: the version DIR/go.mod requires for MODULE.
go_mod_version() {
	local v
	v=$(awk -v m="$2" '($1 == m && $2 ~ /^v/) { print $2 } ($1 == "require" && $2 == m) { print $3 }' "$1/go.mod" | head -n1)
	[[ -n $v ]] || die "cannot find the version of $2 in $1/go.mod"
	printf '%s\n' "$v"
}

# go_build NAME MODDIR LOG -- go build args...: run go build in MODDIR, output to LOG.
go_build() {
	local name=$1 moddir=$2 logf=$3
	shift 4
	local -a envs=(CGO_ENABLED=0)
	if ((GO_MINOR >= 27)); then envs+=(GOEXPERIMENT=nojsonv2); fi
	if ! (cd "$moddir" && env "${envs[@]}" "$GO" build -buildvcs=false -trimpath "$@") >"$logf" 2>&1; then
		log "building $name failed; last lines of $logf:"
		tail -n 30 "$logf" | sed 's/^/    /' >&2
		exit 1
	fi
	rm -f "$logf"
}

# link_bin TARGET NAME: $BIN_DIR/NAME -> TARGET
link_bin() {
	mkdir -p "$BIN_DIR"
	ln -sfn "$1" "$BIN_DIR/$2"
}

ensure_etcd() {
	local dir=$ENV_DIR/etcd ver key out
	ver=$(go_mod_version "$dir" go.etcd.io/etcd/server/v3)
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/main.go")
	out=$CACHE_DIR/bin/etcd-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 etcd
		if [[ ! -x $out ]]; then
			log "building etcd $ver (first run, ~1 min) ..."
			local t0=$SECONDS
			go_build "etcd $ver" "$dir" "$STATE_DIR/build-etcd.log" -- -ldflags '-s -w' -o "$out.tmp" .
			mv -f "$out.tmp" "$out"
			log "built etcd $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" etcd
}

ensure_kube() {
	local dir=$ENV_DIR/kube ver key apiserver kubectl
	ver=$(go_mod_version "$dir" k8s.io/kubernetes)
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/tools.go")
	apiserver=$CACHE_DIR/bin/kube-apiserver-$key
	kubectl=$CACHE_DIR/bin/kubectl-$key
	if [[ ! -x $apiserver || ! -x $kubectl ]]; then
		find_go
		lock_build 8 kube
		if [[ ! -x $apiserver || ! -x $kubectl ]]; then
			log "building kube-apiserver + kubectl $ver (first run, ~4-8 min on 2 cores) ..."
			local t0=$SECONDS tmp=$CACHE_DIR/bin/.kube-$key.tmp minor=${ver#v1.} x ld
			minor=${minor%%.*}
			ld='-s -w'
			for x in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
				ld+=" -X $x.gitVersion=$ver -X $x.gitMajor=1 -X $x.gitMinor=$minor -X $x.gitTreeState=clean"
			done
			rm -rf "$tmp"
			mkdir -p "$tmp"
			go_build "kube-apiserver/kubectl $ver" "$dir" "$STATE_DIR/build-kube.log" -- \
				-ldflags "$ld" -o "$tmp/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubectl
			mv -f "$tmp/kube-apiserver" "$apiserver"
			mv -f "$tmp/kubectl" "$kubectl"
			rm -rf "$tmp"
			log "built kube-apiserver + kubectl $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$apiserver" kube-apiserver
	link_bin "$kubectl" kubectl
}

# ensure_node_bins: build (first time only) the node's kubelet, kube-controller-manager,
# kube-scheduler and kube-proxy from the module of kube-apiserver (tests/env/kube: the same
# version) and link them into $BIN_DIR. Sets KUBE_VERSION.
ensure_node_bins() {
	local dir=$ENV_DIR/kube key c missing=""
	KUBE_VERSION=$(go_mod_version "$dir" k8s.io/kubernetes)
	key=$KUBE_VERSION-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/tools.go")
	for c in "${NODE_COMMANDS[@]}"; do [[ -x $CACHE_DIR/bin/$c-$key ]] || missing=1; done
	if [[ -n $missing ]]; then
		find_go
		lock_build 8 kube-node
		missing=""
		for c in "${NODE_COMMANDS[@]}"; do [[ -x $CACHE_DIR/bin/$c-$key ]] || missing=1; done
		if [[ -n $missing ]]; then
			log "building ${NODE_COMMANDS[*]} $KUBE_VERSION (first run, ~5-8 min on 2 cores) ..."
			local t0=$SECONDS tmp=$CACHE_DIR/bin/.kube-node-$key.tmp minor=${KUBE_VERSION#v1.} x ld pkgs=()
			minor=${minor%%.*}
			ld='-s -w'
			for x in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
				ld+=" -X $x.gitVersion=$KUBE_VERSION -X $x.gitMajor=1 -X $x.gitMinor=$minor -X $x.gitTreeState=clean"
			done
			for c in "${NODE_COMMANDS[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
			rm -rf "$tmp"
			mkdir -p "$tmp"
			go_build "${NODE_COMMANDS[*]} $KUBE_VERSION" "$dir" "$STATE_DIR/build-kube-node.log" -- \
				-ldflags "$ld" -o "$tmp/" "${pkgs[@]}"
			for c in "${NODE_COMMANDS[@]}"; do mv -f "$tmp/$c" "$CACHE_DIR/bin/$c-$key"; done
			rm -rf "$tmp"
			log "built ${NODE_COMMANDS[*]} $KUBE_VERSION in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	for c in "${NODE_COMMANDS[@]}"; do link_bin "$CACHE_DIR/bin/$c-$key" "$c"; done
}
NODE_COMMANDS=(kubelet kube-controller-manager kube-scheduler kube-proxy)

ensure_nats() {
	local dir=$ENV_DIR/nats ver key out
	ver=$(go_mod_version "$dir" github.com/nats-io/nats-server/v2)
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/tools.go")
	out=$CACHE_DIR/bin/nats-server-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 nats
		if [[ ! -x $out ]]; then
			log "building nats-server $ver (first run, ~1 min) ..."
			local t0=$SECONDS
			go_build "nats-server $ver" "$dir" "$STATE_DIR/build-nats.log" -- -ldflags '-s -w' -o "$out.tmp" github.com/nats-io/nats-server/v2
			mv -f "$out.tmp" "$out"
			log "built nats-server $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" nats-server
	# nats-creds (tests/env/nats/creds): operator, account and user JWTs and .creds files for
	# the credentials-file test, from the nats-server's own jwt and nkeys modules (seconds).
	key=$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/creds/main.go")
	out=$CACHE_DIR/bin/nats-creds-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 nats-creds
		if [[ ! -x $out ]]; then
			go_build "nats-creds" "$dir" "$STATE_DIR/build-nats-creds.log" -- -ldflags '-s -w' -o "$out.tmp" ./creds
			mv -f "$out.tmp" "$out"
		fi
		unlock_build 8
	fi
	link_bin "$out" nats-creds
}

# ensure_helm: build (first time only) helm from helm/go.mod and link it as $BIN_DIR/helm.
# Not a service: the chart tests run it (tests/env/tools helm).
ensure_helm() {
	local dir=$ENV_DIR/helm ver key out
	ver=$(go_mod_version "$dir" helm.sh/helm/v4)
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/tools.go")
	out=$CACHE_DIR/bin/helm-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 helm
		if [[ ! -x $out ]]; then
			log "building helm $ver (first run, ~3-8 min on 2 cores) ..."
			local t0=$SECONDS x=helm.sh/helm/v4/internal/version
			go_build "helm $ver" "$dir" "$STATE_DIR/build-helm.log" -- \
				-ldflags "-s -w -X $x.version=$ver -X $x.gitTreeState=clean" -o "$out.tmp" helm.sh/helm/v4/cmd/helm
			mv -f "$out.tmp" "$out"
			log "built helm $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" helm
}

# ensure_otelcol: build (first time only) the OpenTelemetry Collector of otelcol/ (the core
# OTLP receiver and the contrib file exporter) and link it as $BIN_DIR/otelcol. Not a service:
# the trace tests (tests/telemetry.rs) start one each, with their own config.
ensure_otelcol() {
	local dir=$ENV_DIR/otelcol ver key out
	ver=$(go_mod_version "$dir" go.opentelemetry.io/collector/otelcol)
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/main.go")
	out=$CACHE_DIR/bin/otelcol-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 otelcol
		if [[ ! -x $out ]]; then
			log "building otelcol $ver (first run, ~3-9 min on 2 cores) ..."
			local t0=$SECONDS
			go_build "otelcol $ver" "$dir" "$STATE_DIR/build-otelcol.log" -- \
				-ldflags "-s -w -X main.version=$ver" -o "$out.tmp" .
			mv -f "$out.tmp" "$out"
			log "built otelcol $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" otelcol
}

# ensure_promtool: build (first time only) promtool from promtool/go.mod and link it as
# $BIN_DIR/promtool. Not a service: the alert rule tests run it (tests/env/tools promtool).
ensure_promtool() {
	local dir=$ENV_DIR/promtool ver key out
	ver=$(go_mod_version "$dir" github.com/prometheus/prometheus)
	# The build tags are an input too (see go_build below).
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/tools.go" <(echo "-tags remove_all_sd"))
	out=$CACHE_DIR/bin/promtool-$key
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 promtool
		if [[ ! -x $out ]]; then
			log "building promtool $ver (first run, ~5 min of CPU: 3-10 min on 2 cores) ..."
			# The module v0.3XX.Y is Prometheus 3.XX.Y (what `promtool --version` says).
			local t0=$SECONDS x=github.com/prometheus/common/version rel=${ver#v0.}
			rel=3.$((10#${rel%%.*} - 300)).${rel#*.}
			# remove_all_sd: without the optional service discoveries (the cloud SDKs: AWS,
			# Azure, GCE, ...), which the rule checks and unit tests do not use.
			go_build "promtool $ver" "$dir" "$STATE_DIR/build-promtool.log" -- -tags remove_all_sd \
				-ldflags "-s -w -X $x.Version=$rel -X $x.Branch=HEAD -X $x.BuildUser=kubecast-tests" \
				-o "$out.tmp" github.com/prometheus/prometheus/cmd/promtool
			mv -f "$out.tmp" "$out"
			log "built promtool $ver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" promtool
}

# ensure_prometheus_crds: fetch (first time only) prometheus-operator's CRDs from the Go module
# pinned in prometheus-operator/go.mod (its zip holds example/prometheus-operator-crd/) into
# the cache and link the directory as $BIN_DIR/prometheus-operator-crds. The chart tests
# install the PrometheusRule CRD from there (tests/env/tools prometheus-crds).
ensure_prometheus_crds() {
	local dir=$ENV_DIR/prometheus-operator mod=github.com/prometheus-operator/prometheus-operator ver key out src
	ver=$(go_mod_version "$dir" "$mod")
	key=$ver-$(inputs_hash "$dir/go.mod" "$dir/go.sum")
	out=$CACHE_DIR/prometheus-operator-crds-$key
	if [[ ! -f $out/.complete ]]; then
		find_go
		lock_build 8 prometheus-crds
		if [[ ! -f $out/.complete ]]; then
			log "fetching prometheus-operator $ver CRDs from the Go module proxy ..."
			# Checked against go.sum; the module's files land in Go's module cache.
			src=$(cd "$dir" && "$GO" mod download -json "$mod" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
			[[ -n $src && -d $src/example/prometheus-operator-crd ]] || die "go mod download $mod@$ver gave no example/prometheus-operator-crd"
			rm -rf "$out.tmp"
			mkdir -p "$out.tmp"
			cp "$src"/example/prometheus-operator-crd/*.yaml "$out.tmp/"
			chmod -R u+w "$out.tmp"
			touch "$out.tmp/.complete"
			rm -rf "$out"
			mv -f "$out.tmp" "$out"
		fi
		unlock_build 8
	fi
	link_bin "$out" prometheus-operator-crds
}

# ensure_consumers: the consumer examples of examples/consumers (tests/consumers.rs), each
# built once per version of its inputs and cached: a Python venv from requirements.txt, the Go
# binary, the Java jar with its lib/. Linked as $BIN_DIR/consumer-{python,go,java} (keys
# CONSUMER_PYTHON, CONSUMER_GO, CONSUMER_JAVA: commands taking the consumers' options), the
# HTTP receiver example of examples/receivers/http in the Python venv (RECEIVER_HTTP), and the
# HTTP/2 receiver of examples/receivers/go (RECEIVER_HTTP2).
ensure_consumers() {
	local src=$REPO_DIR/examples/consumers
	ensure_consumer_python "$src/python"
	ensure_consumer_go "$src/go"
	ensure_consumer_java "$src/java"
	ensure_receiver_go "$REPO_DIR/examples/receivers/go"
}

ensure_consumer_python() {
	local dir=$1 py=${PYTHON:-python3} pyver venv
	command -v "$py" >/dev/null 2>&1 || die "$py not found in PATH; the Python consumer example needs Python >= 3.10 with venv (Debian: apt-get install python3-venv)"
	pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || die "$py does not run"
	"$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$py is Python $pyver; the consumer example needs >= 3.10"
	venv=$CACHE_DIR/consumer-python-$pyver-$(inputs_hash "$dir/requirements.txt")
	if [[ ! -f $venv/.complete ]]; then
		lock_build 8 consumer-python
		if [[ ! -f $venv/.complete ]]; then
			log "building the Python consumer's venv (first run, ~20-30 s) ..."
			local t0=$SECONDS logf=$STATE_DIR/build-consumer-python.log
			rm -rf "$venv"
			# Every package is pinned in requirements.txt (--no-deps; pip check proves none is missing).
			if ! { "$py" -m venv "$venv" && "$venv/bin/pip" install -q --disable-pip-version-check --no-deps \
				-r "$dir/requirements.txt" && "$venv/bin/pip" check; } >"$logf" 2>&1; then
				log "building the Python consumer's venv failed; last lines of $logf:"
				tail -n 30 "$logf" | sed 's/^/    /' >&2
				exit 1
			fi
			rm -f "$logf"
			touch "$venv/.complete"
			log "built the Python consumer's venv in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	# The script runs from this checkout; only the venv is shared.
	mkdir -p "$BIN_DIR"
	rm -f "$BIN_DIR/consumer-python"
	printf '#!/bin/sh\nexec %q %q "$@"\n' "$venv/bin/python" "$dir/consumer.py" >"$BIN_DIR/consumer-python"
	chmod +x "$BIN_DIR/consumer-python"
	# The HTTP receiver example needs the CloudEvents SDK only, which this venv has.
	rm -f "$BIN_DIR/receiver-http"
	printf '#!/bin/sh\nexec %q %q "$@"\n' "$venv/bin/python" "$REPO_DIR/examples/receivers/http/receiver.py" >"$BIN_DIR/receiver-http"
	chmod +x "$BIN_DIR/receiver-http"
}

ensure_consumer_go() {
	local dir=$1 out
	out=$CACHE_DIR/bin/consumer-go-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/main.go")
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 consumer-go
		if [[ ! -x $out ]]; then
			log "building the Go consumer (first run, ~1-3 min) ..."
			local t0=$SECONDS
			go_build "the Go consumer" "$dir" "$STATE_DIR/build-consumer-go.log" -- -ldflags '-s -w' -o "$out.tmp" .
			mv -f "$out.tmp" "$out"
			log "built the Go consumer in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" consumer-go
}

# The CloudEvents HTTP receiver in Go (HTTP/2 over TLS and h2c), cached like the Go consumer.
ensure_receiver_go() {
	local dir=$1 out
	out=$CACHE_DIR/bin/receiver-http2-$(inputs_hash "$dir/go.mod" "$dir/go.sum" "$dir/main.go")
	if [[ ! -x $out ]]; then
		find_go
		lock_build 8 receiver-http2
		if [[ ! -x $out ]]; then
			log "building the Go HTTP/2 receiver (first run, ~30 s) ..."
			local t0=$SECONDS
			go_build "the Go HTTP/2 receiver" "$dir" "$STATE_DIR/build-receiver-http2.log" -- -ldflags '-s -w' -o "$out.tmp" .
			mv -f "$out.tmp" "$out"
			log "built the Go HTTP/2 receiver in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out" receiver-http2
}

ensure_consumer_java() {
	local dir=$1 out
	out=$CACHE_DIR/consumer-java-$(inputs_hash "$dir/pom.xml" $(find "$dir/src" -type f | LC_ALL=C sort))
	if [[ ! -f $out/.complete ]]; then
		find_java
		find_mvn
		lock_build 8 consumer-java
		if [[ ! -f $out/.complete ]]; then
			log "building the Java consumer with Maven (first run, ~20-60 s) ..."
			local t0=$SECONDS tmp=$out.tmp logf=$STATE_DIR/build-consumer-java.log
			rm -rf "$tmp"
			mkdir -p "$tmp"
			cp -r "$dir/pom.xml" "$dir/src" "$tmp/"
			# Not beside the Kafka jar fetch of a concurrent `up` (both fill ~/.m2, which Maven
			# does not lock; kafka-clients is in both).
			lock_build 7 kafka
			# Offline first (everything pinned is in ~/.m2 after one online build), else online.
			if ! (cd "$tmp" && { mvn -B -q -o package || mvn -B -q package; }) >"$logf" 2>&1; then
				log "building the Java consumer failed; last lines of $logf:"
				tail -n 30 "$logf" | sed 's/^/    /' >&2
				exit 1
			fi
			unlock_build 7
			rm -f "$logf"
			mkdir -p "$tmp/out"
			mv "$tmp/target/kubecast-consumer.jar" "$tmp/target/lib" "$tmp/out/"
			printf '#!/bin/sh\nexec java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -cp %q io.kubecast.example.Consumer "$@"\n' \
				"$out/kubecast-consumer.jar:$out/lib/*" >"$tmp/out/consumer-java"
			chmod +x "$tmp/out/consumer-java"
			touch "$tmp/out/.complete"
			rm -rf "$out"
			mv "$tmp/out" "$out"
			rm -rf "$tmp"
			log "built the Java consumer in $((SECONDS - t0))s"
		fi
		unlock_build 8
	fi
	link_bin "$out/consumer-java" consumer-java
}

kafka_version() {
	sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ENV_DIR/kafka/pom.xml" | head -n1
}

# kafka_libs_dir: the cache dir holding the Kafka jars for the pinned pom.
kafka_libs_dir() {
	local ver
	ver=$(kafka_version)
	[[ -n $ver ]] || die "cannot read <kafka.version> from $ENV_DIR/kafka/pom.xml"
	printf '%s\n' "$CACHE_DIR/kafka-$ver-$(inputs_hash "$ENV_DIR/kafka/pom.xml")/libs"
}

# ensure_kafka [FD]: fetch the jars with Maven (lock fd 8, or 7 in a background job).
ensure_kafka() {
	local fd=${1:-8} libs ver
	libs=$(kafka_libs_dir)
	ver=$(kafka_version)
	if [[ ! -f $libs/.complete ]]; then
		find_java
		find_mvn
		lock_build "$fd" kafka
		if [[ ! -f $libs/.complete ]]; then
			log "fetching Kafka $ver jars with Maven (first run, ~1 min) ..."
			local t0=$SECONDS tmp=${libs%/libs}.tmp logf=$STATE_DIR/build-kafka.log
			rm -rf "$tmp"
			mkdir -p "$tmp"
			cp "$ENV_DIR/kafka/pom.xml" "$tmp/pom.xml"
			if ! (cd "$tmp" && mvn -B -q -f pom.xml dependency:copy-dependencies \
				-DincludeScope=runtime -DoutputDirectory="$tmp/libs") >"$logf" 2>&1; then
				log "fetching Kafka jars failed; last lines of $logf:"
				tail -n 30 "$logf" | sed 's/^/    /' >&2
				exit 1
			fi
			rm -f "$logf"
			touch "$tmp/libs/.complete"
			rm -rf "${libs%/libs}"
			mv "$tmp" "${libs%/libs}"
			log "fetched Kafka $ver jars in $((SECONDS - t0))s"
		fi
		unlock_build "$fd"
	fi
}

# ---------------------------------------------------------------- processes

svc_dir() { printf '%s\n' "$STATE_DIR/$1"; }
svc_log() { printf '%s\n' "$STATE_DIR/$1/$1.log"; }

# svc_pid SERVICE: print the recorded pid if the process is alive and ours.
# "Ours" = its command line mentions this state dir (guards against pid reuse).
svc_pid() {
	local f pid
	f="$STATE_DIR/$1/pid"
	[[ -f $f ]] || return 1
	pid=$(<"$f")
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	[[ -r /proc/$pid/cmdline ]] || return 1
	tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$STATE_DIR" || return 1
	printf '%s\n' "$pid"
}

svc_alive() { svc_pid "$1" >/dev/null; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# require_free_port PORT WHAT VAR: die if something else listens there.
require_free_port() {
	if port_open "$1"; then
		log "port 127.0.0.1:$1 ($2) is already in use by a process that tests/env/up did not start:"
		if command -v ss >/dev/null 2>&1; then
			ss -Hltnp "sport = :$1" 2>/dev/null | sed 's/^/    /' >&2 || true
		fi
		die "stop that process, or choose another port with $3=<port>"
	fi
}

show_log_tail() {
	local logf
	logf=$(svc_log "$1")
	if [[ -f $logf ]]; then
		log "last lines of $logf:"
		tail -n "${2:-40}" "$logf" | sed 's/^/    /' >&2
	fi
}

# start_daemon SERVICE CMD...: start CMD detached (own session), stdout+stderr
# to the service log, pid in the service pid file.
start_daemon() {
	local svc=$1 dir logf pidf i
	shift
	dir=$(svc_dir "$svc")
	logf=$(svc_log "$svc")
	pidf=$dir/pid
	mkdir -p "$dir"
	[[ -f $logf ]] && mv -f "$logf" "$logf.1"
	rm -f "$pidf"
	# The child writes its own pid, closes every descriptor it inherited beyond stdio (a
	# caller's lock, e.g. `flock`, or a CI runner's pipe must not live on in a server), then
	# execs the daemon (no pid race).
	# shellcheck disable=SC2016
	setsid bash -c 'echo $$ >"$0"; for fd in $(ls /proc/$$/fd); do [ "$fd" -gt 2 ] && eval "exec $fd>&-"; done 2>/dev/null; exec "$@"' "$pidf" "$@" </dev/null >"$logf" 2>&1 7>&- 8>&- 9>&- &
	for ((i = 0; i < 50; i++)); do
		[[ -s $pidf ]] && return 0
		sleep 0.1
	done
	die "$svc did not start (no pid file $pidf)"
}

# wait_ready SERVICE TIMEOUT CHECK-CMD...: poll CHECK until it succeeds.
wait_ready() {
	local svc=$1 timeout=$2 t0=$SECONDS
	shift 2
	while true; do
		if ! svc_alive "$svc"; then
			log "$svc exited during startup"
			show_log_tail "$svc"
			exit 1
		fi
		if "$@" >/dev/null 2>&1; then
			return 0
		fi
		if ((SECONDS - t0 >= timeout)); then
			log "$svc not ready after ${timeout}s (check: $*); stopping it"
			show_log_tail "$svc"
			stop_service "$svc" >/dev/null 2>&1 || true
			exit 1
		fi
		sleep 0.5
	done
}

# stop_service SERVICE: SIGTERM, wait, SIGKILL. Only the recorded pid.
stop_service() {
	local svc=$1 pid i dir
	dir=$(svc_dir "$svc")
	if pid=$(svc_pid "$svc"); then
		log "stopping $svc (pid $pid) ..."
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < ${KUBECAST_ENV_STOP_TIMEOUT:-30} * 10; i++)); do
			svc_alive "$svc" || break
			sleep 0.1
		done
		if svc_alive "$svc"; then
			log "$svc (pid $pid) still running after SIGTERM; sending SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
			for ((i = 0; i < 50; i++)); do
				svc_alive "$svc" || break
				sleep 0.1
			done
		fi
	fi
	rm -f "$dir/pid" "$dir/env"
}

# ---------------------------------------------------------------- env file

# kv KEY VALUE: a KEY=value line valid for `source` (quoted only if needed).
kv() {
	if [[ $2 =~ ^[A-Za-z0-9_./:@,+=%-]*$ ]]; then
		printf '%s=%s\n' "$1" "$2"
	else
		printf "%s='%s'\n" "$1" "${2//\'/\'\\\'\'}"
	fi
}

# write_env: (re)write $STATE_DIR/env from the fragments of running services.
write_env() {
	[[ -d $STATE_DIR ]] || return 0
	local svc running=() tmp=$STATE_DIR/env.tmp
	for svc in "${ALL_SERVICES[@]}"; do
		if svc_alive "$svc" && [[ -f $STATE_DIR/$svc/env ]]; then
			running+=("$svc")
		fi
	done
	{
		echo "# Written by tests/env/up and tests/env/down; only running services have keys."
		echo "# Use: set -a; . $STATE_DIR/env; set +a"
		kv KUBECAST_ENV_STATE "$STATE_DIR"
		kv KUBECAST_ENV_BIN "$BIN_DIR"
		kv KUBECAST_ENV_SERVICES "$(
			IFS=,
			echo "${running[*]}"
		)"
		for svc in "${running[@]}"; do
			cat "$STATE_DIR/$svc/env"
		done
		# The node (tests/env/node), while its kubelet runs.
		if svc_alive node-kubelet && [[ -f $STATE_DIR/node/env ]]; then cat "$STATE_DIR/node/env"; fi
		# Tools built by tests/env/tools (not services: present once built).
		if [[ -x $BIN_DIR/helm ]]; then kv HELM "$BIN_DIR/helm"; fi
		if [[ -x $BIN_DIR/otelcol ]]; then kv OTELCOL "$BIN_DIR/otelcol"; fi
		if [[ -x $BIN_DIR/promtool ]]; then kv PROMTOOL "$BIN_DIR/promtool"; fi
		if [[ -f $BIN_DIR/prometheus-operator-crds/.complete ]]; then
			kv PROMETHEUS_OPERATOR_CRDS "$BIN_DIR/prometheus-operator-crds"
		fi
		if [[ -x $BIN_DIR/consumer-python ]]; then kv CONSUMER_PYTHON "$BIN_DIR/consumer-python"; fi
		if [[ -x $BIN_DIR/receiver-http ]]; then kv RECEIVER_HTTP "$BIN_DIR/receiver-http"; fi
		if [[ -x $BIN_DIR/receiver-http2 ]]; then kv RECEIVER_HTTP2 "$BIN_DIR/receiver-http2"; fi
		if [[ -x $BIN_DIR/consumer-go ]]; then kv CONSUMER_GO "$BIN_DIR/consumer-go"; fi
		if [[ -x $BIN_DIR/consumer-java ]]; then kv CONSUMER_JAVA "$BIN_DIR/consumer-java"; fi
	} >"$tmp"
	mv -f "$tmp" "$STATE_DIR/env"
}

# ---------------------------------------------------------------- kafka

kafka_java() {
	local libs
	libs=$(kafka_libs_dir)
	[[ -f $libs/.complete ]] || die "Kafka jars are not fetched yet; run tests/env/up kafka first"
	find_java
	exec java -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
		-Dlog4j2.configurationFile="$ENV_DIR/kafka/log4j2-tools.properties" \
		-cp "$libs/*" "$@"
}

# kafka_api_versions_ok PORT: send a Kafka ApiVersions (v0) request and
# check for a well-formed response with our correlation id.
kafka_api_versions_ok() {
	local out
	out=$(
		exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
		# size=12 | api_key=18 api_version=0 correlation_id=42 client_id="up"
		printf '\x00\x00\x00\x0c\x00\x12\x00\x00\x00\x00\x00\x2a\x00\x02up' >&3
		timeout 5 head -c 10 <&3 | od -An -tx1 | tr -d ' \n'
	) || return 1
	# bytes 4-7: correlation id 42; bytes 8-9: error code (0, or 35 =
	# UNSUPPORTED_VERSION, which still proves the broker serves requests)
	[[ ${out:8:8} == 0000002a && (${out:16:4} == 0000 || ${out:16:4} == 0023) ]]
}
