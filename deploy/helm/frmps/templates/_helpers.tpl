{{/* Name of the release's objects, at most 63 characters. */}}
{{- define "frmps.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "frmps.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "frmps.labels" -}}
{{ include "frmps.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "frmps.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "frmps.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "frmps.image" -}}
{{- $variant := ternary "gpu" "cpu" (eq .Values.device "cuda") -}}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag) -}}
{{- end -}}

{{/*
terminationGracePeriodSeconds: the preStop sleep, the front door's drain
(shutdown grace + 5s), the engines' shutdown grace, MPS stop and the admin
API (10s + 5s), and 5s of margin; frmps's serve command shuts down in that order.
*/}}
{{- define "frmps.terminationGrace" -}}
{{- add .Values.preStopSleepSeconds (mul 2 .Values.shutdownGraceSeconds) 25 -}}
{{- end -}}
