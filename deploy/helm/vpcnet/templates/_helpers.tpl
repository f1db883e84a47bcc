{{- define "vpcnet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "vpcnet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vpcnet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vpcnet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vpcnet.labels" -}}
{{ include "vpcnet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "vpcnet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "vpcnet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "vpcnet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "vpcnet.rollbackName" -}}
{{- printf "%s-rollback" (include "vpcnet.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The rollback's pods: never the agent's (a selector of one never takes the other's). */}}
{{- define "vpcnet.rollbackSelectorLabels" -}}
app.kubernetes.io/name: {{ include "vpcnet.name" . }}-rollback
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "vpcnet.rollbackLabels" -}}
{{ include "vpcnet.rollbackSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The agent's pods for the monitors: by name only, so that the
kustomized DaemonSet's pods (without the instance label) are found too. */}}
{{- define "vpcnet.monitorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "vpcnet.name" . }}
{{- end -}}

{{/* The agent's metrics port, by name, in its pod. */}}
{{- define "vpcnet.metricsPort" -}}
metrics
{{- end -}}

{{/* The relabelings of a monitor: the node's name as `node`, then the values' own. */}}
{{- define "vpcnet.relabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- with . }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* extraEnv as YAML; a variable with both value and valueFrom is refused. */}}
{{- define "vpcnet.extraEnv" -}}
{{- range .Values.extraEnv }}
{{- if and (hasKey . "value") (hasKey . "valueFrom") }}
{{- fail (printf "extraEnv: %s has both value and valueFrom: give one" .name) }}
{{- end }}
{{- end }}
{{- toYaml .Values.extraEnv }}
{{- end -}}
