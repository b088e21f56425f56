{{/*
The prefill, decode and mixed pods: one Deployment shape, three roles (deployment-prefill.yaml and its siblings
only name the component). A pod listens on its gRPC port, advertises <pod IP>:<port> in Redis, and serves
/metrics on its metrics port. On SIGTERM it turns NOT_SERVING, leaves the registry and drains for
config.shutdownGraceS; terminationGracePeriodSeconds covers that plus terminationGraceExtraSeconds.
*/}}
{{- define "splitserve.podDeployment" -}}
{{- $root := .root }}
{{- $values := index $root.Values .component }}
{{- $ctx := dict "root" $root "component" .component }}
{{- if $values.enabled }}
{{- $resources := include "splitserve.rankResources" (merge (dict "component" .component) $values) | fromYaml }}
{{- $named := merge (dict "component" .component "resources" $resources) $values }}
{{- include "splitserve.checkDevice" $named }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  {{- include "splitserve.replicas" (dict "root" $root "component" .component "values" $values) | nindent 2 }}
  {{- include "splitserve.rollout" $values | nindent 2 }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "splitserve.selectorLabels" $ctx | nindent 8 }}
        {{- include "splitserve.servingPodLabel" $root | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- include "splitserve.scrapeAnnotations" (dict "root" $root "port" $values.ports.metrics) | nindent 8 }}
        {{- with $values.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      {{- include "splitserve.podSecurity" $root | nindent 6 }}
      {{- include "splitserve.podSpecFields" $values | nindent 6 }}
      terminationGracePeriodSeconds: {{ include "splitserve.terminationGrace" (dict "drain" $values.config.shutdownGraceS "values" $values) }}
      {{- include "splitserve.scheduling" (dict "root" $root "component" .component "values" $values) | nindent 6 }}
      containers:
        - name: {{ .component }}
          image: {{ include "splitserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          command: ["python", "-m", "splitserve.{{ ternary "prefill_service" "decode_service" (eq .component "prefill") }}"]
          args:
            - "--host"
            - "0.0.0.0"
            - "--port"
            - {{ $values.ports.grpc | quote }}
            - "--metrics-port"
            - {{ $values.ports.metrics | quote }}
            - "--probe-port"
            - {{ $values.ports.probe | quote }}
            - "--advertise-address"
            - "$(POD_IP):{{ $values.ports.grpc }}"
            {{- if ne .component "prefill" }}
            - "--role"
            - {{ .component | quote }}
            {{- end }}
            {{- include "splitserve.modelArgs" $root | nindent 12 }}
            {{- include "splitserve.registryArgs" $root | nindent 12 }}
            {{- include "splitserve.tlsArgs" $root | nindent 12 }}
            {{- include "splitserve.threadArgs" $named | nindent 12 }}
            {{- if ne .component "prefill" }}
            {{- /* Where prefill pods of this node put KV for this pod: the node's shared directory, or none (gRPC). */}}
            - "--kv-shm-dir"
            - {{ ternary (include "splitserve.kvShmDir" .) "" $root.Values.kvTransfer.sharedMemory.enabled | quote }}
            {{- end }}
            - "--tensor-parallel-size"
            - {{ $values.tensorParallelSize | default 1 | quote }}
            - "--pipeline-parallel-size"
            - {{ $values.pipelineParallelSize | default 1 | quote }}
            {{- if and (eq .component "decode") (eq (toString $root.Values.router.config.scheduling) "hybrid") }}
            {{- /* Hybrid scheduling lends prompts to decode pods: they prefill them in chunks that keep the TPOT. */}}
            - "--tpot-slack-chunking"
            - "--tpot-target-s"
            - {{ $root.Values.serviceLevel.tpotSeconds | toString | quote }}
            {{- end }}
            {{- include "splitserve.configArgs" $values.config | nindent 12 }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            {{- include "splitserve.registryEnv" $root | nindent 12 }}
            - name: SPLITSERVE_KERNEL_TARGET
              value: {{ $root.Values.kernels.target | quote }}
            {{- include "splitserve.extraEnv" $values | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $values.ports.grpc }}
            - name: metrics
              containerPort: {{ $values.ports.metrics }}
            - name: probe
              containerPort: {{ $values.ports.probe }}
          startupProbe:
            {{- include "splitserve.grpcProbe" (dict "root" $root "port" $values.ports.probe "probe" $values.probes.startup) | nindent 12 }}
          readinessProbe:
            {{- include "splitserve.grpcProbe" (dict "root" $root "port" $values.ports.probe "probe" $values.probes.readiness) | nindent 12 }}
          livenessProbe:
            {{- include "splitserve.grpcProbe" (dict "root" $root "port" $values.ports.probe "probe" $values.probes.liveness) | nindent 12 }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            {{- include "splitserve.volumeMounts" $root | nindent 12 }}
            # ~/.cache/splitserve (HOME=/tmp in the image): kernels compiled for this node's CPU (kernels.target
            # native, or a CPU that runs none of the image's baselines in SPLITSERVE_CACHE_DIR, read-only)
            - name: kernel-cache
              mountPath: /tmp/.cache/splitserve
            {{- if $root.Values.kvTransfer.sharedMemory.enabled }}
            - name: kv-shm
              mountPath: {{ include "splitserve.kvShmDir" . }}
            {{- end }}
            {{- if $values.shm.enabled }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- with $values.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- with $values.extraContainers }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      volumes:
        {{- include "splitserve.volumes" $root | nindent 8 }}
        - name: kernel-cache
          emptyDir:
            sizeLimit: {{ $root.Values.scratch.kernelCacheSizeLimit }}
        {{- if $root.Values.kvTransfer.sharedMemory.enabled }}
        # a node directory every serving pod of the node mounts at one path: KV arenas between them (kvtransfer/shm.py)
        - name: kv-shm
          hostPath:
            path: {{ $root.Values.kvTransfer.sharedMemory.hostPath }}
            type: Directory
        {{- end }}
        {{- if $values.shm.enabled }}
        # CUDA and NCCL share memory through /dev/shm; the container runtime's default is 64 MiB
        - name: shm
          emptyDir:
            medium: Memory
            {{- with $values.shm.sizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- end }}
        {{- with $values.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}
{{- end }}

{{/*
The path at which every serving pod mounts kvTransfer.sharedMemory's node directory: one path in all of them, since a
decode pod names it in its handshake and a prefill pod opens it there (and compares its device:inode).
*/}}
{{- define "splitserve.kvShmDir" -}}
/run/splitserve/kv-shm
{{- end }}

{{/* Headless: the router picks pods itself (from Redis); the Service names them for monitoring and debugging */}}
{{- define "splitserve.podService" -}}
{{- $values := index .root.Values .component }}
{{- $ctx := dict "root" .root "component" .component }}
{{- if $values.enabled }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "splitserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $values.ports.grpc }}
      targetPort: grpc
      appProtocol: grpc
    - name: metrics
      port: {{ $values.ports.metrics }}
      targetPort: metrics
{{- end }}
{{- end }}

{{/* The fewest pods a component runs: its replicas, or the planner's or the HPA's minimum when one owns the count */}}
{{- define "splitserve.minReplicas" -}}
{{- $values := index .root.Values .component }}
{{- if and .root.Values.planner.enabled (has .component (list "prefill" "decode")) }}
{{- $key := printf "min%sReplicas" (title .component) }}
{{- index .root.Values.planner.config $key | default 1 | int }}
{{- else if and $values.autoscaling $values.autoscaling.enabled }}
{{- $values.autoscaling.minReplicas | int }}
{{- else }}
{{- $values.replicas | int }}
{{- end }}
{{- end }}

{{/*
minAvailable (1) where a role runs two pods or more: a node drain then never takes the role's last pod. At one pod
no budget: one that protects it would block every drain (NOTES.txt says so).
*/}}
{{- define "splitserve.podDisruptionBudget" -}}
{{- $values := index .root.Values .component }}
{{- $ctx := dict "root" .root "component" .component }}
{{- if and (ne (toString $values.enabled) "false") $values.podDisruptionBudget.enabled (ge (include "splitserve.minReplicas" $ctx | int) 2) }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  minAvailable: {{ $values.podDisruptionBudget.minAvailable }}
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}

{{- define "splitserve.horizontalPodAutoscaler" -}}
{{- $values := index .root.Values .component }}
{{- $ctx := dict "root" .root "component" .component }}
{{- if and (ne (toString $values.enabled) "false") $values.autoscaling.enabled }}
{{- if and .root.Values.planner.enabled (has .component (list "prefill" "decode")) }}
{{- fail (printf "%s.autoscaling and the planner would both scale %s: enable one" .component .component) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "splitserve.componentName" $ctx }}
  minReplicas: {{ $values.autoscaling.minReplicas }}
  maxReplicas: {{ $values.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $values.autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
{{- end }}

{{/*
port: the Service port's name that serves /metrics (always plain HTTP: scrapers need no certificate); selector: more
labels the Service must carry (the router's metrics Service's).
*/}}
{{- define "splitserve.serviceMonitor" -}}
{{- $values := index .root.Values .component }}
{{- $ctx := dict "root" .root "component" .component }}
{{- if and (ne (toString $values.enabled) "false") $values.serviceMonitor.enabled }}
apiVersion: monitoring.coreos.com/v1
kind: ServiceMonitor
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
    {{- with $values.serviceMonitor.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
      {{- with .selector }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  endpoints:
    - port: {{ .port }}
      path: /metrics
      interval: {{ $values.serviceMonitor.interval }}
      {{- with $values.serviceMonitor.scrapeTimeout }}
      scrapeTimeout: {{ . }}
      {{- end }}
{{- end }}
{{- end }}
