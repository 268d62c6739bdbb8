{{/*
Names and labels.
*/}}
{{- define "kubecast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubecast.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kubecast.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubecast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubecast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kubecast.labels" -}}
helm.sh/chart: {{ include "kubecast.chart" . }}
{{ include "kubecast.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: event-publisher
app.kubernetes.io/part-of: kubecast
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kubecast.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubecast.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set the existing ServiceAccount kubecast runs as (serviceAccount.create is false)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kubecast.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Where the chart mounts things in the kubecast container. */}}
{{- define "kubecast.configDir" -}}/etc/kubecast/config{{- end }}
{{- define "kubecast.checkpointDir" -}}/var/lib/kubecast{{- end }}

{{/*
"kubecast.intify" DICT: turns whole-number floats in DICT (in place, recursively) into
integers. Helm reads numbers of values files as floats, and toToml would write 20 as 20.0,
which kubecast's integer keys refuse.
*/}}
{{- define "kubecast.intify" -}}
{{- $m := . }}
{{- range $k, $v := $m }}
{{- if kindIs "float64" $v }}
{{- if eq $v (float64 (int64 $v)) }}{{ $_ := set $m $k (int64 $v) }}{{ end }}
{{- else if kindIs "map" $v }}
{{- include "kubecast.intify" $v }}
{{- else if kindIs "slice" $v }}
{{- $out := list }}
{{- range $e := $v }}
{{- if and (kindIs "float64" $e) (eq $e (float64 (int64 $e))) }}
{{- $out = append $out (int64 $e) }}
{{- else }}
{{- if kindIs "map" $e }}{{ include "kubecast.intify" $e }}{{ end }}
{{- $out = append $out $e }}
{{- end }}
{{- end }}
{{- $_ := set $m $k $out }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"kubecast.stringifyProperties" KAFKA: the librdkafka properties of a [*.kafka] table (in place)
as strings, as kubecast takes them: `linger.ms: 20` or `enable.ssl.certificate.verification:
false` in YAML are a number and a boolean, which would render as TOML values kubecast refuses.
*/}}
{{- define "kubecast.stringifyProperties" -}}
{{- $kafka := . }}
{{- if and (kindIs "map" $kafka) (kindIs "map" $kafka.properties) }}
{{- $props := dict }}
{{- range $k, $v := $kafka.properties }}
{{- if kindIs "float64" $v }}
{{- if eq $v (float64 (int64 $v)) }}{{ $_ := set $props $k (toString (int64 $v)) }}{{ else }}{{ $_ := set $props $k (toString $v) }}{{ end }}
{{- else }}
{{- $_ := set $props $k (toString $v) }}
{{- end }}
{{- end }}
{{- $_ := set $kafka "properties" $props }}
{{- end }}
{{- end }}

{{/*
"kubecast.checkSecrets" (list SINK WHERE [CHECKPOINT]): fails when a secret-looking key of the
sink (or of the Kafka state store's own connection) holds a value inline instead of
"${env:NAME}" / "${file:/path}".
*/}}
{{- define "kubecast.checkSecrets" -}}
{{- $sink := index . 0 }}
{{- $where := index . 1 }}
{{- $checkpoint := dict }}
{{- if gt (len .) 2 }}{{ $checkpoint = index . 2 | default dict }}{{ end }}
{{- $ref := "^\\$\\{(env|file):[^}]+\\}$" }}
{{- $fix := "holds a secret inline; reference an existing Secret instead: \"${env:NAME}\" with secretEnv, or \"${file:/path}\" with secretMounts" }}
{{- if kindIs "map" $sink }}
{{- with $sink.kafka }}
{{- range $k, $v := (.properties | default dict) }}
{{- if and (regexMatch "(password|secret|jaas\\.config|key\\.pem|token)" (lower $k)) (not (regexMatch $ref (toString $v))) }}
{{- fail (printf "%s: sink.kafka.properties.%q %s" $where $k $fix) }}
{{- end }}
{{- end }}
{{- end }}
{{- if kindIs "map" $checkpoint }}
{{- with $checkpoint.kafka }}
{{- range $k, $v := (.properties | default dict) }}
{{- if and (regexMatch "(password|secret|jaas\\.config|key\\.pem|token)" (lower $k)) (not (regexMatch $ref (toString $v))) }}
{{- fail (printf "%s: checkpoint.kafka.properties.%q %s" $where $k $fix) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- $http := $sink.http }}
{{- if kindIs "map" $http }}
{{- if and (hasKey $http "password") (not (regexMatch $ref (toString $http.password))) }}
{{- fail (printf "%s: sink.http.password %s (or a token file: bearer_token_file)" $where $fix) }}
{{- end }}
{{- range $k, $v := ($http.headers | default dict) }}
{{- if and (regexMatch "(authorization|token|secret|key)" (lower $k)) (not (regexMatch $ref (toString $v))) }}
{{- fail (printf "%s: sink.http.headers.%q %s" $where $k $fix) }}
{{- end }}
{{- end }}
{{- end }}
{{- $nats := $sink.nats }}
{{- if kindIs "map" $nats }}
{{- range $k := list "password" "token" "nkey_seed" }}
{{- if and (hasKey $nats $k) (not (regexMatch $ref (toString (index $nats $k)))) }}
{{- fail (printf "%s: sink.nats.%s %s (or a file: credentials_file)" $where $k $fix) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* "kubecast.group" API_VERSION: the API group ("" for the core group "v1"). */}}
{{- define "kubecast.group" -}}
{{- if contains "/" . }}{{ first (splitList "/" .) }}{{ end }}
{{- end }}

{{/* "kubecast.streamKey" RESOURCE: api_version|kind|sorted,namespaces (to compare configs). */}}
{{- define "kubecast.streamKey" -}}
{{- printf "%s|%s|%s" .api_version .kind (join "," (sortAlpha (.namespaces | default list))) }}
{{- end }}

{{/*
The kubecast.toml of the ConfigMap: config.raw verbatim, or rendered from config.* with
toToml. Also runs the checks (secrets inline, raw resources = config.resources).
*/}}
{{/*
"kubecast.gracePeriod": terminationGracePeriodSeconds. Empty: [delivery]
shutdown_timeout_seconds (default 30) + 15. Set: at least shutdown_timeout_seconds + 5, or the
chart refuses it (the kubelet would SIGKILL kubecast before its final checkpoint).
*/}}
{{- define "kubecast.gracePeriod" -}}
{{- $timeout := 30 }}
{{- $delivery := .Values.config.delivery | default dict }}
{{- if .Values.config.raw }}
{{- $delivery = (fromToml .Values.config.raw).delivery | default dict }}
{{- end }}
{{- if hasKey $delivery "shutdown_timeout_seconds" }}{{ $timeout = int $delivery.shutdown_timeout_seconds }}{{ end }}
{{- $min := add $timeout 5 | int }}
{{- $grace := .Values.terminationGracePeriodSeconds }}
{{- if kindIs "invalid" $grace }}
{{- add $timeout 15 }}
{{- else if lt (int $grace) $min }}
{{- fail (printf "terminationGracePeriodSeconds = %d is shorter than config.delivery.shutdown_timeout_seconds (%d) + 5: the kubelet would SIGKILL kubecast before it writes its final checkpoints (fix: leave terminationGracePeriodSeconds empty to derive it, or set at least %d)" (int $grace) $timeout $min) }}
{{- else }}
{{- int $grace }}
{{- end }}
{{- end }}

{{- define "kubecast.leaseName" -}}
{{- .Values.coordination.leaseName | default (include "kubecast.fullname" .) }}
{{- end }}

{{- define "kubecast.configToml" -}}
{{- $listen := printf "0.0.0.0:%d" (int .Values.admin.port) }}
{{- if .Values.config.raw }}
{{- $raw := fromToml .Values.config.raw }}
{{- if hasKey $raw "Error" }}
{{- fail (printf "config.raw is not valid TOML: %s" $raw.Error) }}
{{- end }}
{{- include "kubecast.checkSecrets" (list ($raw.sink | default dict) "config.raw" ($raw.checkpoint | default dict)) }}
{{- $rawKeys := list }}
{{- range ($raw.resources | default list) }}{{ $rawKeys = append $rawKeys (include "kubecast.streamKey" .) }}{{ end }}
{{- $keys := list }}
{{- range .Values.config.resources }}{{ $keys = append $keys (include "kubecast.streamKey" .) }}{{ end }}
{{- if ne (sortAlpha $rawKeys | uniq | join ";") (sortAlpha $keys | uniq | join ";") }}
{{- fail (printf "config.raw watches [%s] but config.resources lists [%s]; RBAC is rendered from config.resources, so list every [[resources]] entry of config.raw there too (api_version, kind, resource = the plural, namespaces)" (sortAlpha $rawKeys | join "; ") (sortAlpha $keys | join "; ")) }}
{{- end }}
{{- if and (not .Values.coordination.enabled) ($raw.coordination | default dict).enabled }}
{{- fail "config.raw enables [coordination], but coordination.enabled is false: the chart renders no Role for the Lease (fix: set coordination.enabled = true)" }}
{{- end }}
{{- $rawShards := int (($raw.coordination | default dict).shards | default 1) }}
{{- $shards := int (.Values.coordination.shards | default 1) }}
{{- if ne $rawShards $shards }}
{{- fail (printf "config.raw has [coordination] shards = %d but coordination.shards is %d: the chart's Role names the shard Leases from coordination.shards, so the replicas could take none (fix: set coordination.shards = %d)" $rawShards $shards $rawShards) }}
{{- end }}
{{- .Values.config.raw }}
{{- else }}
{{- include "kubecast.checkSecrets" (list .Values.config.sink "config" .Values.config.checkpoint) }}
{{- if gt (int (.Values.coordination.shards | default 1)) 1 }}
{{- if not .Values.coordination.enabled }}
{{- fail (printf "coordination.shards = %d needs coordination.enabled = true: the replicas share the shards through Leases" (int .Values.coordination.shards)) }}
{{- end }}
{{- if eq (include "kubecast.store" .) "file" }}
{{- fail (printf "coordination.shards = %d needs the state in Kafka or NATS (config.checkpoint.store, or a Kafka or NATS JetStream sink): a shard moves between replicas, a volume is one replica's" (int .Values.coordination.shards)) }}
{{- end }}
{{- end }}
{{- $cfg := dict }}
{{- $_ := set $cfg "cluster" (deepCopy .Values.config.cluster) }}
{{- $checkpoint := merge (dict "dir" (include "kubecast.checkpointDir" .)) (deepCopy .Values.config.checkpoint) }}
{{- $_ := set $checkpoint "store" (include "kubecast.store" .) }}
{{- $_ := set $cfg "checkpoint" $checkpoint }}
{{- $_ := set $cfg "sink" (deepCopy .Values.config.sink) }}
{{- $delivery := deepCopy (.Values.config.delivery | default dict) }}
{{- if include "kubecast.brokerDeadLetter" . }}
{{- $_ := set $delivery "dead_letter" (dict "type" "broker" "destination" (include "kubecast.deadLetterDestination" .)) }}
{{- end }}
{{- if $delivery }}
{{- $_ := set $cfg "delivery" $delivery }}
{{- end }}
{{- if .Values.config.telemetry }}
{{- $_ := set $cfg "telemetry" (deepCopy .Values.config.telemetry) }}
{{- end }}
{{- $_ := set $cfg "admin" (dict "listen" $listen) }}
{{- if .Values.coordination.enabled }}
{{- $coordination := dict "enabled" true "lease_name" (include "kubecast.leaseName" .) "lease_namespace" .Release.Namespace }}
{{- if gt (int (.Values.coordination.shards | default 1)) 1 }}
{{- $_ := set $coordination "shards" (int .Values.coordination.shards) }}
{{- end }}
{{- $_ := set $cfg "coordination" $coordination }}
{{- end }}
{{- $res := list }}
{{- range .Values.config.resources }}
{{- $res = append $res (omit (deepCopy .) "resource") }}
{{- end }}
{{- $_ := set $cfg "resources" $res }}
{{- include "kubecast.intify" $cfg }}
{{- include "kubecast.stringifyProperties" ($cfg.sink.kafka | default dict) }}
{{- include "kubecast.stringifyProperties" ($cfg.checkpoint.kafka | default dict) }}
{{- printf "# Rendered by the kubecast Helm chart from its values; every key: config/kubecast.toml.\n" }}
{{- toToml $cfg }}
{{- end }}
{{- end }}

{{/*
"kubecast.rbac" ROOT: the RBAC plan as JSON: {"cluster": [[group, resource], ...],
"namespaces": {ns: [[group, resource], ...]}}, deduplicated, in config order.
*/}}
{{- define "kubecast.rbac" -}}
{{- $cluster := list }}
{{- $ns := dict }}
{{- range .Values.config.resources }}
{{- $gr := list (include "kubecast.group" .api_version) .resource }}
{{- if .namespaces }}
{{- range .namespaces }}
{{- $cur := get $ns . | default list }}
{{- if not (has $gr $cur) }}{{ $_ := set $ns . (append $cur $gr) }}{{ end }}
{{- end }}
{{- else if not (has $gr $cluster) }}
{{- $cluster = append $cluster $gr }}
{{- end }}
{{- end }}
{{- dict "cluster" $cluster "namespaces" $ns | toJson }}
{{- end }}

{{/* "kubecast.rules" LIST-OF-[group, resource]: one read-only rule per resource. */}}
{{- define "kubecast.rules" -}}
rules:
{{- range . }}
  - apiGroups: [{{ index . 0 | quote }}]
    resources: [{{ index . 1 | quote }}]
    verbs: ["get", "list", "watch"]
{{- end }}
{{- end }}

{{/*
The kubecast container (a list item), for this chart's Deployment and for sidecar use:
  containers:
    {{- include "kubecast.container" .Subcharts.kubecast | nindent 4 }}
*/}}
{{- define "kubecast.container" -}}
- name: kubecast
  image: {{ include "kubecast.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: ["run", "--config", "{{ include "kubecast.configDir" . }}/kubecast.toml"]
  env:
    # The same file for `kubectl exec ... -- kubecast state list` (and check-config).
    - name: KUBECAST_CONFIG
      value: "{{ include "kubecast.configDir" . }}/kubecast.toml"
    - name: KUBECAST_LOG_FORMAT
      value: {{ .Values.logFormat | quote }}
    - name: RUST_LOG
      value: {{ .Values.logLevel | quote }}
    # Pinned by the chart (also over config.raw): the checkpoint volume and the probes' port.
    - name: KUBECAST_CHECKPOINT__DIR
      value: {{ include "kubecast.checkpointDir" . | quote }}
    - name: KUBECAST_ADMIN__LISTEN
      value: {{ printf "0.0.0.0:%d" (int .Values.admin.port) | quote }}
    {{- if .Values.coordination.enabled }}
    # Pinned by the chart (also over config.raw): the Lease its Role grants.
    - name: KUBECAST_COORDINATION__ENABLED
      value: "true"
    - name: KUBECAST_COORDINATION__LEASE_NAME
      value: {{ include "kubecast.leaseName" . | quote }}
    - name: KUBECAST_COORDINATION__LEASE_NAMESPACE
      value: {{ .Release.Namespace | quote }}
    # The identity in the Lease, and its namespace.
    - name: POD_NAME
      valueFrom:
        fieldRef:
          apiVersion: v1
          fieldPath: metadata.name
    - name: POD_NAMESPACE
      valueFrom:
        fieldRef:
          apiVersion: v1
          fieldPath: metadata.namespace
    # Tells this pod from one replaced under the same name, and from replicas given one
    # identity by a shared config.
    - name: POD_UID
      valueFrom:
        fieldRef:
          apiVersion: v1
          fieldPath: metadata.uid
    {{- end }}
    {{- range .Values.secretEnv }}
    - name: {{ .name }}
      valueFrom:
        secretKeyRef:
          name: {{ .secretName }}
          key: {{ .key }}
          {{- if hasKey . "optional" }}
          optional: {{ .optional }}
          {{- end }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: admin
      containerPort: {{ .Values.admin.port }}
      protocol: TCP
  {{- with .Values.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: kubecast-config
      mountPath: {{ include "kubecast.configDir" . }}
      readOnly: true
    - name: kubecast-state
      mountPath: {{ include "kubecast.checkpointDir" . }}
    - name: kubecast-tmp
      mountPath: /tmp
    {{- range .Values.secretMounts }}
    - name: {{ .name }}
      mountPath: {{ .mountPath }}
      readOnly: true
    {{- end }}
    {{- with .Values.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
"kubecast.configName": the config ConfigMap's name, "<fullname>-config-" and the first 10 hex
digits of the sha256 of its kubecast.toml as stored (the YAML block keeps one final newline).
The ConfigMap is immutable: a changed config is a new ConfigMap, and a pod template names the
one config it was rendered with (a pod of an older ReplicaSet never reads a newer config;
when its ConfigMap is gone, it does not start).
*/}}
{{- define "kubecast.configName" -}}
{{- $stored := printf "%s\n" (regexReplaceAll "\n+$" (include "kubecast.configToml" .) "") }}
{{- printf "%s-config-%s" (include "kubecast.fullname" .) ($stored | sha256sum | trunc 10) }}
{{- end }}

{{/* The volumes of the kubecast container (list items), for the Deployment and sidecar use. */}}
{{- define "kubecast.volumes" -}}
- name: kubecast-config
  configMap:
    name: {{ include "kubecast.configName" . }}
- name: kubecast-state
  {{- if .Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ .Values.persistence.existingClaim | default (include "kubecast.fullname" .) }}
  {{- else if .Values.persistence.emptyDirSizeLimit }}
  emptyDir:
    sizeLimit: {{ .Values.persistence.emptyDirSizeLimit }}
  {{- else }}
  emptyDir: {}
  {{- end }}
- name: kubecast-tmp
  emptyDir:
    sizeLimit: 16Mi
{{- range .Values.secretMounts }}
- name: {{ .name }}
  secret:
    secretName: {{ .secretName }}
    defaultMode: {{ .defaultMode | default 0444 }}
    {{- with .items }}
    items:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The state store: config.checkpoint.store, "auto" = the sink's broker (Kafka; NATS with
JetStream), else the file store. With config.raw: its [checkpoint] store (kubecast's
default: "file").
*/}}
{{- define "kubecast.store" -}}
{{- if .Values.config.raw }}
{{- ((fromToml .Values.config.raw).checkpoint | default dict).store | default "file" }}
{{- else }}
{{- $sink := .Values.config.sink | default dict }}
{{- $store := .Values.config.checkpoint.store | default "auto" }}
{{- if eq $store "auto" }}
{{- $nats := $sink.nats | default dict }}
{{- if eq ($sink.type | default "stdout") "kafka" }}kafka
{{- else if and (eq ($sink.type | default "stdout") "nats") (ne (toString $nats.jetstream) "false") }}nats
{{- else }}file
{{- end }}
{{- else }}{{ $store }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"kubecast.brokerDeadLetter": "true" when the chart sets the dead letter: a Kafka or NATS sink,
config.brokerDeadLetter not empty, and no config.delivery.dead_letter (nor config.raw).
*/}}
{{- define "kubecast.brokerDeadLetter" -}}
{{- $sink := .Values.config.sink | default dict }}
{{- if and (not .Values.config.raw) .Values.config.brokerDeadLetter (has ($sink.type | default "stdout") (list "kafka" "nats")) (not (hasKey (.Values.config.delivery | default dict) "dead_letter")) }}true{{ end }}
{{- end }}

{{/*
"kubecast.deadLetterDestination": config.brokerDeadLetter; with a NATS sink whose subject
template does not start with "kubecast.", the default "kubecast.dead-letter" becomes
"<the template's literal prefix>dead-letter", so that the stream covering the events' subjects
(kubecast creates it over "<prefix>>") covers the dead letter too.
*/}}
{{- define "kubecast.deadLetterDestination" -}}
{{- $dl := .Values.config.brokerDeadLetter }}
{{- $sink := .Values.config.sink | default dict }}
{{- if and (eq ($sink.type | default "") "nats") (eq $dl "kubecast.dead-letter") }}
{{- $subject := (($sink.nats | default dict).subject | default "kubecast.{cluster}.{group}.{resource}.{namespace}") }}
{{- $prefix := regexFind "^[^{]*" $subject }}
{{- if and $prefix (hasSuffix "." $prefix) (ne $prefix "kubecast.") }}
{{- $dl = printf "%sdead-letter" $prefix }}
{{- end }}
{{- end }}
{{- $dl }}
{{- end }}
