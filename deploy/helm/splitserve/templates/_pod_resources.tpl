{{/*
How a pod fits its node and rolls out: the pod-spec fields operators set (runtimeClassName, schedulerName, the
service-account token), accelerator limits and the rollout they call for (no surge), torch's threads from the CPU
limit, a tensor- or pipeline-parallel pod's resources (its ranks'), and the device a GPU limit goes with. _pod.tpl,
deployment-router.yaml and deployment-planner.yaml use them.
*/}}

{{/* Pod-spec fields a component's values may set: runtimeClassName, schedulerName, the service-account token */}}
{{- define "splitserve.podSpecFields" -}}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .schedulerName }}
schedulerName: {{ . }}
{{- end }}
automountServiceAccountToken: {{ .automountServiceAccountToken | default false }}
{{- end }}

{{/* Limits naming an accelerator (a surge pod would wait for a free one): nvidia.com/gpu, amd.com/gpu, ... */}}
{{- define "splitserve.accelerators" -}}
{{- $found := list }}
{{- range $name, $count := (.resources | default dict).limits }}
{{- if and (or (contains "gpu" $name) (has $name (list "habana.ai/gaudi" "aws.amazon.com/neuron" "aws.amazon.com/neuroncore" "google.com/tpu"))) (gt (toString $count | float64) 0.0) }}
{{- $found = append $found $name }}
{{- end }}
{{- end }}
{{- join "," $found }}
{{- end }}

{{/*
The Deployment's rollout: the component's strategy, else no surge where the pods hold an accelerator (a surge pod
would wait for a free GPU, and a full pool never frees one: the rollout hangs); progressDeadlineSeconds.
*/}}
{{- define "splitserve.rollout" -}}
{{- if .strategy }}
strategy:
  {{- toYaml .strategy | nindent 2 }}
{{- else if include "splitserve.accelerators" . }}
strategy:
  type: RollingUpdate
  rollingUpdate:
    maxSurge: 0
    maxUnavailable: 1
{{- end }}
{{- with .progressDeadlineSeconds }}
progressDeadlineSeconds: {{ . }}
{{- end }}
{{- end }}

{{/*
--num-threads from the CPU limit (else the request): whole cores, rounded down, at least 1, so that torch runs one
thread per core it may use (it otherwise starts one per core of the node, and the CFS quota throttles the rest
mid-GEMM). A config.numThreads set by hand may not exceed it. Nothing without either (torch's own choice).
*/}}
{{- define "splitserve.threadArgs" -}}
{{- $cpu := (.resources | default dict).limits | default dict | dig "cpu" "" | default ((.resources | default dict).requests | default dict | dig "cpu" "") | toString }}
{{- if $cpu }}
{{- $cores := 0 }}
{{- if hasSuffix "m" $cpu }}
{{- $cores = div (trimSuffix "m" $cpu | int) 1000 }}
{{- else }}
{{- $cores = $cpu | float64 | floor | int }}
{{- end }}
{{- $cores = max $cores 1 }}
{{- if hasKey .config "numThreads" }}
{{- if gt (int .config.numThreads) (int $cores) }}
{{- fail (printf "%s.config.numThreads %d exceeds the CPU limit (%s: %d whole cores): threads beyond it are throttled" .component (int .config.numThreads) $cpu (int $cores)) }}
{{- end }}
{{- else }}
- "--num-threads"
- {{ $cores | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A pod's resources: values' resources are one rank's, and a pod of tensorParallelSize (or pipelineParallelSize)
ranks (processes pinned to their shares of the container's CPUs, each loading the model's files) asks for that many
times their CPU and memory. Both above 1 is not built in the engine: refused here, before a pod fails to start.
*/}}
{{- define "splitserve.rankResources" -}}
{{- $tp := int (.tensorParallelSize | default 1) }}
{{- $pp := int (.pipelineParallelSize | default 1) }}
{{- if and (gt $tp 1) (gt $pp 1) }}
{{- fail (printf "%s: tensorParallelSize %d and pipelineParallelSize %d both above 1 is not built (one or the other)" .component $tp $pp) }}
{{- end }}
{{- $ranks := mul $tp $pp }}
{{- $pod := dict }}
{{- range $kind, $amounts := (.resources | default dict) }}
{{- $scaled := dict }}
{{- range $name, $amount := $amounts }}
{{- $text := toString $amount }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text }}
{{- if and (gt $ranks 1) (has $name (list "cpu" "memory")) $number }}
{{- $_ := set $scaled $name (printf "%v%s" (mulf (float64 $number) $ranks) (trimPrefix $number $text)) }}
{{- else }}
{{- $_ := set $scaled $name $amount }}
{{- end }}
{{- end }}
{{- $_ := set $pod $kind $scaled }}
{{- end }}
{{- toYaml $pod }}
{{- end }}

{{/* device: cuda needs an nvidia.com/gpu limit, and a GPU limit needs device: cuda (it would sit idle) */}}
{{- define "splitserve.checkDevice" -}}
{{- $gpus := ((.resources | default dict).limits | default dict | dig "nvidia.com/gpu" 0) | toString | float64 }}
{{- $device := .config.device | default "cpu" }}
{{- if and (hasPrefix "cuda" $device) (le $gpus 0.0) }}
{{- fail (printf "%s.config.device is %s but %s.resources.limits has no nvidia.com/gpu: the pod would land on a node without a GPU (add nvidia.com/gpu: 1)" .component $device .component) }}
{{- end }}
{{- if and (gt $gpus 0.0) (not (hasPrefix "cuda" $device)) }}
{{- fail (printf "%s.resources.limits asks for nvidia.com/gpu but %s.config.device is %s: the GPU would sit idle (set config.device: cuda)" .component .component $device) }}
{{- end }}
{{- end }}
