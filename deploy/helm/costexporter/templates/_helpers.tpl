{{- define "costexporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "costexporter.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "costexporter.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "costexporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "costexporter.selector" -}}
app.kubernetes.io/name: {{ include "costexporter.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "costexporter.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The Secret and key holding the Redis URL; fails closed when none is configured. */}}
{{- define "costexporter.redisSecret" -}}
{{- if .Values.redis.existingSecret -}}
{{ .Values.redis.existingSecret }}
{{- else if or .Values.redis.enabled .Values.redis.url -}}
{{ include "costexporter.fullname" . }}-redis-url
{{- else -}}
{{- fail "costexporter: set redis.enabled=true, or redis.existingSecret (a Secret with the URL), or redis.url" -}}
{{- end -}}
{{- end -}}

{{- define "costexporter.redisSecretKey" -}}
{{- if .Values.redis.existingSecret -}}{{ .Values.redis.existingSecretKey }}{{- else -}}url{{- end -}}
{{- end -}}

{{/* Environment every component shares: the Redis URL and the key prefix. */}}
{{- define "costexporter.env" -}}
- name: COSTEXPORTER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "costexporter.redisSecret" . }}
      key: {{ include "costexporter.redisSecretKey" . }}
- name: COSTEXPORTER_PREFIX
  value: {{ .Values.prefix | quote }}
{{- end -}}

{{- define "costexporter.priceArgs" -}}
- --currency={{ .Values.prices.currency }}
- --price-per-gpu-hour={{ .Values.prices.pricePerGpuHour }}
{{- with .Values.prices.wastedPricePerGpuHour }}
- --wasted-price-per-gpu-hour={{ . }}
{{- end }}
{{- with .Values.prices.pricePerKwh }}
- --price-per-kwh={{ . }}
{{- end }}
- --pue={{ .Values.prices.pue }}
{{- end -}}

{{- define "costexporter.tokensSecret" -}}
{{- if .Values.api.tokensSecret -}}
{{ .Values.api.tokensSecret }}
{{- else if .Values.api.tokens -}}
{{ include "costexporter.fullname" . }}-api-tokens
{{- else if not .Values.api.allowOpen -}}
{{- fail "costexporter: the finance API needs api.tokens (SHA-256 hashes) or api.tokensSecret; set api.allowOpen=true only on a trusted network" -}}
{{- end -}}
{{- end -}}
