{{/*
NetworkPolicies (networkPolicy.enabled, on by default): one per component, allowing only the links splitserve uses.

    clients (networkPolicy.clientsFrom)   -> router                   grpc, http
    router                                -> prefill, decode, mixed   grpc
    prefill                               -> decode, mixed            grpc (KV pushes)
    router, prefill, decode, mixed        -> redis                    redis (external: networkPolicy.externalRedisPorts)
    scrapers (networkPolicy.metricsFrom)  -> every metrics port
    planner                               -> Kubernetes API, Prometheus (networkPolicy.plannerEgressPorts)
    every component                       -> DNS (networkPolicy.dns: kube-dns, NodeLocal DNSCache, OpenShift)

Anything else, in or out, is refused: a pod of another release cannot register as a decode pod nor receive
prompts. The rules are built as lists of dicts and written with toYaml; each file networkpolicy-<component>.yaml
only says which links its component has.
*/}}

{{/* A peer (JSON): the pods of one component of this release */}}
{{- define "splitserve.npPeer" -}}
{{- toJson (dict "podSelector" (dict "matchLabels" (include "splitserve.selectorLabels" . | fromYaml))) }}
{{- end }}

{{/* TCP ports (JSON list) */}}
{{- define "splitserve.npPorts" -}}
{{- $ports := list }}
{{- range . }}
{{- $ports = append $ports (dict "port" (int .) "protocol" "TCP") }}
{{- end }}
{{- toJson ($ports | uniq) }}
{{- end }}

{{/* A rule (JSON) between this component and the pods of `components` on `ports`; `direction`: from or to */}}
{{- define "splitserve.npComponentsRule" -}}
{{- $peers := list }}
{{- range .components }}
{{- $peers = append $peers (include "splitserve.npPeer" (dict "root" $.root "component" .) | fromJson) }}
{{- end }}
{{- toJson (dict .direction $peers "ports" (include "splitserve.npPorts" .ports | fromJsonArray)) }}
{{- end }}

{{/* The serving components that are on (JSON list) */}}
{{- define "splitserve.npServing" -}}
{{- $on := list }}
{{- range $component := list "prefill" "decode" "mixed" }}
{{- if (index $.Values $component).enabled }}
{{- $on = append $on $component }}
{{- end }}
{{- end }}
{{- toJson $on }}
{{- end }}

{{/* The gRPC ports of `components` (JSON list) */}}
{{- define "splitserve.npGrpcPorts" -}}
{{- $ports := list }}
{{- range .components }}
{{- $ports = append $ports (index $.root.Values .).ports.grpc }}
{{- end }}
{{- toJson $ports }}
{{- end }}

{{/*
The NetworkPolicy of one component: `ingress` and `egress` are lists of rules; every component also reaches DNS
(and `redis`: the registry) and lets scrapers reach `metricsPort`.
*/}}
{{- define "splitserve.networkPolicy" -}}
{{- $root := .root }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $np := $root.Values.networkPolicy }}
{{- if $np.enabled }}
{{- $metrics := dict "ports" (include "splitserve.npPorts" (list .metricsPort) | fromJsonArray) }}
{{- with $np.metricsFrom }}
{{- $_ := set $metrics "from" . }}
{{- end }}
{{- $egress := .egress | default list }}
{{- range $np.dns }}
{{- $dnsPorts := list }}
{{- range .ports }}
{{- $dnsPorts = append (append $dnsPorts (dict "port" (int .) "protocol" "UDP")) (dict "port" (int .) "protocol" "TCP") }}
{{- end }}
{{- $egress = append $egress (dict "to" .to "ports" $dnsPorts) }}
{{- end }}
{{- if .redis }}
{{- if $root.Values.redis.enabled }}
{{- $egress = append $egress (include "splitserve.npComponentsRule" (dict "root" $root "direction" "to" "components" (list "redis") "ports" (list $root.Values.redis.port)) | fromJson) }}
{{- else }}
{{- $egress = append $egress (dict "ports" (include "splitserve.npPorts" $np.externalRedisPorts | fromJsonArray)) }}
{{- end }}
{{- end }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "splitserve.componentName" $ctx }}
  labels:
    {{- include "splitserve.labels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "splitserve.selectorLabels" $ctx | nindent 6 }}
  policyTypes: [Ingress, Egress]
  ingress:
    {{- toYaml (append (.ingress | default list) $metrics) | nindent 4 }}
  egress:
    {{- toYaml $egress | nindent 4 }}
{{- end }}
{{- end }}

{{/* decode and mixed pods: called by the router and (KV) by prefill pods */}}
{{- define "splitserve.servingPodNetworkPolicy" -}}
{{- $values := index .root.Values .component }}
{{- if $values.enabled }}
{{- $callers := list "router" }}
{{- if .root.Values.prefill.enabled }}
{{- $callers = append $callers "prefill" }}
{{- end }}
{{- $ingress := include "splitserve.npComponentsRule" (dict "root" .root "direction" "from" "components" $callers "ports" (list $values.ports.grpc)) | fromJson }}
{{- include "splitserve.networkPolicy" (dict "root" .root "component" .component "metricsPort" $values.ports.metrics "ingress" (list $ingress) "redis" true) }}
{{- end }}
{{- end }}
