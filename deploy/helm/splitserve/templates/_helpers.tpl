{{/*
Names, labels, and the one place that turns values into flags (splitserve.configArgs). Every component's
Deployment, Service, PodDisruptionBudget, HorizontalPodAutoscaler and ServiceMonitor is rendered by the
definitions here; the per-component template files only say which component.
*/}}

{{- define "splitserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.fullname" -}}
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

{{/* <fullname>-<component>, e.g. demo-splitserve-prefill */}}
{{- define "splitserve.componentName" -}}
{{- printf "%s-%s" (include "splitserve.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "splitserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "splitserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "splitserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "splitserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: splitserve
{{- end }}

{{/* On every prefill, decode and mixed pod: the pods' headless Service (service-pods.yaml) selects it */}}
{{- define "splitserve.servingPodLabel" -}}
splitserve.io/serving-pod: {{ .Release.Name | quote }}
{{- end }}

{{/*
repository@digest when a digest is set (what runs is then exactly that image), else repository:tag. The repository
is required: no public image exists, and a default name would pull docker.io/library/<name>.
*/}}
{{- define "splitserve.image" -}}
{{- $repository := required "image.repository is required: the registry you pushed the image built from deploy/Dockerfile to (e.g. --set image.repository=registry.example.com/splitserve)" .Values.image.repository }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
A config block as flags: camelCase key -> --kebab-case flag; booleans --flag / --no-flag; lists comma-joined;
whole numbers printed as integers (values arrive as float64); null keys are skipped (the dataclass default).
*/}}
{{- define "splitserve.configArgs" -}}
{{- range $key, $value := . }}
{{- $flag := printf "--%s" (kebabcase $key) }}
{{- if kindIs "bool" $value }}
- {{ ternary $flag (printf "--no-%s" (kebabcase $key)) $value | quote }}
{{- else if kindIs "slice" $value }}
- {{ $flag | quote }}
- {{ join "," $value | quote }}
{{- else if or (kindIs "float64" $value) (kindIs "int" $value) (kindIs "int64" $value) }}
- {{ $flag | quote }}
- {{ ternary (int64 $value | toString) (toString $value) (eq (float64 $value) (floor $value)) | quote }}
{{- else if not (kindIs "invalid" $value) }}
- {{ $flag | quote }}
- {{ toString $value | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* --model: a name or path in the image, or the file in the mounted volume */}}
{{- define "splitserve.modelArgs" -}}
- "--model"
{{- if eq .Values.model.source "image" }}
- {{ required "model.name is required with model.source image" .Values.model.name | quote }}
{{- else }}
- {{ printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (required "model.path is required with model.source pvc or hostPath" .Values.model.path) | quote }}
{{- end }}
{{- end }}

{{- define "splitserve.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- $password := ternary ":$(REDIS_PASSWORD)@" "" .Values.redis.auth.enabled }}
{{- printf "redis://%s%s:%d/0" $password (include "splitserve.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- else }}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/*
The Secret holding the bundled Redis' password: redis.auth.existingSecret, or the chart's own from redis.auth.password.
Never generated: a random password would change at every `helm template` (Argo CD, Flux), and `lookup` sees no
cluster there.
*/}}
{{- define "splitserve.redisSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if .Values.redis.auth.password }}
{{- include "splitserve.componentName" (dict "root" . "component" "redis") }}
{{- else }}
{{- fail "redis.auth.existingSecret (a Secret you create with the Redis password under redis.auth.secretKey) or redis.auth.password is required with redis.auth.enabled: the chart generates no password (deploy/README.md)" }}
{{- end }}
{{- end }}

{{/* The URL comes through SPLITSERVE_REDIS_URL (it holds a password), not a flag (ps shows flags) */}}
{{- define "splitserve.redisUrlInEnv" -}}
{{- if .Values.redis.enabled }}{{ if .Values.redis.auth.enabled }}true{{ end }}
{{- else if .Values.redis.externalUrlSecret.name }}true{{ end }}
{{- end }}

{{/* The registry: Redis, by URL or (a URL with a password) through SPLITSERVE_REDIS_URL */}}
{{- define "splitserve.registryArgs" -}}
- "--registry"
- "redis"
{{- if not (include "splitserve.redisUrlInEnv" .) }}
- "--redis-url"
- {{ required "redis.externalUrl (or redis.externalUrlSecret.name) is required with redis.enabled false" (include "splitserve.redisUrl" .) | quote }}
{{- end }}
{{- end }}

{{/* The bundled Redis' password from its Secret, composed into the URL by the kubelet ($(REDIS_PASSWORD)) */}}
{{- define "splitserve.registryEnv" -}}
{{- if and .Values.redis.enabled .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "splitserve.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
- name: SPLITSERVE_REDIS_URL
  value: {{ include "splitserve.redisUrl" . | quote }}
{{- else if and (not .Values.redis.enabled) .Values.redis.externalUrlSecret.name }}
- name: SPLITSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret.name }}
      key: {{ .Values.redis.externalUrlSecret.key }}
{{- end }}
{{- end }}

{{/* The router's environment: the registry's URL from a Secret, the API keys from a Secret */}}
{{- define "splitserve.routerEnv" -}}
{{- include "splitserve.registryEnv" . }}
{{- with .Values.router.apiKeysSecret.name }}
- name: SPLITSERVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.router.apiKeysSecret.key }}
{{- end }}
{{- end }}

{{- define "splitserve.tlsDir" -}}/etc/splitserve/tls{{- end }}

{{- define "splitserve.tlsArgs" -}}
{{- if .Values.tls.enabled }}
{{- $dir := include "splitserve.tlsDir" . }}
- "--tls-cert-file"
- "{{ $dir }}/tls.crt"
- "--tls-key-file"
- "{{ $dir }}/tls.key"
- "--tls-ca-file"
- "{{ $dir }}/ca.crt"
- {{ ternary "--tls-require-client-cert" "--no-tls-require-client-cert" .Values.tls.requireClientCert | quote }}
- "--tls-server-name"
- {{ include "splitserve.tlsServerName" . | quote }}
{{- end }}
{{- end }}

{{/* Pods are dialled by pod IP and checked against this name, which every pod's certificate lists */}}
{{- define "splitserve.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "splitserve.componentName" (dict "root" . "component" "pods")) .Release.Namespace) }}
{{- end }}

{{/* Volumes every splitserve container gets: /tmp (the root filesystem is read-only), TLS, the model */}}
{{- define "splitserve.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required with tls.enabled" .Values.tls.secretName }}
{{- end }}
{{- if eq .Values.model.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source pvc" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source hostPath" .Values.model.hostPath.path }}
    {{- with .Values.model.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{- define "splitserve.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: {{ include "splitserve.tlsDir" . }}
  readOnly: true
{{- end }}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
A probe on grpc.health.v1.Health: kubelet's native gRPC probe, on the process' probe port (--probe-port), where
the same health service answers in plain text, TLS or not (kubelet's probe speaks no TLS; an exec probe would need
a client binary per architecture and a process per probe).
*/}}
{{- define "splitserve.grpcProbe" -}}
grpc:
  port: {{ .port }}
timeoutSeconds: {{ .probe.timeoutSeconds | default 2 }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{- define "splitserve.scrapeAnnotations" -}}
{{- if .root.Values.metrics.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds: the process' own drain (shutdownGraceS) plus what comes before and after it */}}
{{- define "splitserve.terminationGrace" -}}
{{- $drain := .drain | default 30 | float64 | ceil | int }}
{{- add $drain (.before | default 0 | int) (.values.terminationGraceExtraSeconds | default 0 | int) }}
{{- end }}

{{/*
Where a component's pods run: nodeSelector, affinity, tolerations, priorityClassName, and topologySpreadConstraints
(by default: spread over nodes, softly, so that one node's loss takes few pods of a role).
*/}}
{{- define "splitserve.scheduling" -}}
{{- $values := .values }}
{{- with $values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
topologySpreadConstraints:
{{- if $values.topologySpreadConstraints }}
  {{- toYaml $values.topologySpreadConstraints | nindent 2 }}
{{- else }}
  - maxSkew: 1
    topologyKey: kubernetes.io/hostname
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "splitserve.selectorLabels" . | nindent 8 }}
{{- end }}
{{- with $values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "splitserve.podSecurity" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/*
Replicas, unless something else (the planner, an HPA) owns the count: then the live Deployment's count, read with
`lookup`, so that the upgrade which turns the planner or the HPA on does not drop the field (Helm's three-way merge
would then reset the live count to 1) and later upgrades keep what the owner chose. Offline (`helm template`, a
first install) lookup finds nothing and the field is left out (GitOps: deploy/README.md, ignoreDifferences).
*/}}
{{- define "splitserve.replicas" -}}
{{- $planned := and .root.Values.planner.enabled (has .component (list "prefill" "decode")) }}
{{- $hpa := and .values.autoscaling .values.autoscaling.enabled }}
{{- if not (or $planned $hpa) }}
replicas: {{ .values.replicas }}
{{- else }}
{{- $live := lookup "apps/v1" "Deployment" .root.Release.Namespace (include "splitserve.componentName" .) }}
{{- if and $live $live.spec.replicas }}
replicas: {{ $live.spec.replicas }}
{{- end }}
{{- end }}
{{- end }}

{{/* The operator's own environment, volumes and mounts (extraEnv, extraVolumes, extraVolumeMounts) */}}
{{- define "splitserve.extraEnv" -}}
{{- with .extraEnv }}
{{- toYaml . }}
{{- end }}
{{- end }}
