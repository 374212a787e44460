{{/* Chart name, truncated to a DNS label. */}}
{{- define "shardline.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release full name: the release name, prefixed with the chart name unless it contains it. */}}
{{- define "shardline.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels (immutable subset). */}}
{{- define "shardline.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardline.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Recommended labels of every object of the chart. */}}
{{- define "shardline.labels" -}}
{{ include "shardline.selectorLabels" . }}
app.kubernetes.io/part-of: shardline
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* ServiceAccount name. */}}
{{- define "shardline.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shardline.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Operator image with its tag pinned to the appVersion by default. */}}
{{- define "shardline.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
