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

{{/* An image reference under global.imageRegistry, where one is set: the reference's own
registry (a first part with a "." or ":", or localhost) replaced by it, or put in front. */}}
{{- define "costexporter.registry" -}}
{{- $ref := .ref -}}
{{- with (.root.Values.global | default dict).imageRegistry -}}
{{- $parts := splitList "/" $ref -}}
{{- $head := first $parts -}}
{{- if and (gt (len $parts) 1) (or (contains "." $head) (contains ":" $head) (eq $head "localhost")) -}}
{{- $ref = join "/" (rest $parts) -}}
{{- end -}}
{{- $ref = printf "%s/%s" (trimSuffix "/" .) $ref -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{- define "costexporter.image" -}}
{{- $repo := include "costexporter.registry" (dict "root" . "ref" .Values.image.repository) -}}
{{- if .Values.image.digest -}}
{{ $repo }}@{{ .Values.image.digest }}
{{- else -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "costexporter.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{- define "costexporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ default (include "costexporter.fullname" .) .Values.serviceAccount.name }}
{{- else -}}
{{ default "default" .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{/* Whether the agents read pods from the Kubernetes API ("true" or ""): the only pods that get a token. */}}
{{- define "costexporter.agentReadsPods" -}}
{{- if and (eq .Values.agent.source "dcgm") .Values.agent.kubernetesJobs.enabled .Values.agent.kubernetesJobs.api -}}true{{- end -}}
{{- end -}}

{{/* Whether the Prometheus Operator's objects are rendered ("true" or ""). */}}
{{- define "costexporter.monitoring" -}}
{{- if eq .Values.monitoringCRDs "present" -}}true
{{- else if and (eq .Values.monitoringCRDs "auto") (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}true
{{- end -}}
{{- end -}}

{{/* The node-local dcgm-exporter Service (agent.dcgm.localService), when the agent uses it. */}}
{{- define "costexporter.dcgmLocalService" -}}
{{- if and (eq .Values.agent.source "dcgm") (not .Values.agent.dcgmUrl) .Values.agent.dcgm.localService.enabled -}}
{{ include "costexporter.fullname" . }}-dcgm-local
{{- end -}}
{{- end -}}

{{- define "costexporter.dcgmUrl" -}}
{{- if .Values.agent.dcgmUrl -}}
{{ .Values.agent.dcgmUrl }}
{{- else if include "costexporter.dcgmLocalService" . -}}
{{- $svc := .Values.agent.dcgm.localService -}}
http://{{ include "costexporter.dcgmLocalService" . }}.{{ default (include "costexporter.namespace" .) $svc.namespace }}.svc:{{ $svc.port }}/metrics
{{- else -}}
{{- fail "costexporter: agent.source=dcgm needs agent.dcgmUrl, or agent.dcgm.localService.enabled=true" -}}
{{- end -}}
{{- end -}}

{{/* What every pod of the chart carries: the pod labels and annotations of the values. */}}
{{- define "costexporter.podLabels" -}}
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The pod spec's common part: service account, token, priority, pull secrets. */}}
{{- define "costexporter.podCommon" -}}
serviceAccountName: {{ include "costexporter.serviceAccountName" .root }}
automountServiceAccountToken: {{ .token | default false }}
{{- with (.priorityClassName | default .root.Values.priorityClassName) }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A monitor's relabelings: the `cluster` label first, then the values'. */}}
{{- define "costexporter.relabelings" -}}
{{- $out := list -}}
{{- if .root.Values.cluster -}}
{{- $out = append $out (dict "targetLabel" "cluster" "replacement" .root.Values.cluster "action" "replace") -}}
{{- end -}}
{{- $out = concat $out (.m.relabelings | default list) -}}
{{- with $out }}
relabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .m.metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
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

{{/* Whether the in-chart Redis runs with one user per part (redis.acl.enabled). */}}
{{- define "costexporter.redisAcl" -}}
{{- if .Values.redis.acl.enabled -}}
{{- if not .Values.redis.enabled -}}
{{- fail "costexporter: redis.acl.enabled writes the users of the in-chart Redis (redis.enabled=true); for your own Redis, create them with `costexporter acl` and set redis.acl.secrets" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* A trainer's user and its key in the ACL Secret: {team: t} or {job: j}. */}}
{{- define "costexporter.trainerUser" -}}
costexporter-trainer-{{ .team | default .job }}
{{- end -}}

{{/* Environment every component shares: its Redis URL (its own user's with redis.acl) and the
key prefix. `role`: agent, watcher or api. */}}
{{- define "costexporter.env" -}}
{{- $root := .root -}}
{{- $acl := $root.Values.redis.acl -}}
{{- if include "costexporter.redisAcl" $root }}
- name: REDIS_ACL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "costexporter.fullname" $root }}-redis-acl
      key: {{ .role }}
- name: COSTEXPORTER_REDIS_URL
  value: {{ printf "redis://costexporter-%s:$(REDIS_ACL_PASSWORD)@%s-redis:6379/0" .role (include "costexporter.fullname" $root) | quote }}
{{- else if (index $acl.secrets .role) }}
- name: COSTEXPORTER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ index $acl.secrets .role }}
      key: url
{{- else }}
- name: COSTEXPORTER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "costexporter.redisSecret" $root }}
      key: {{ include "costexporter.redisSecretKey" $root }}
{{- end }}
{{- with $root }}
- name: COSTEXPORTER_PREFIX
  value: {{ .Values.prefix | quote }}
{{- if and .Values.cluster (has $.role (list "watcher" "api")) }}
{{- /* The watcher's alerts and the API's OpenCost `cluster` name the cluster the monitors'
relabelings give every series. */}}
- name: COSTEXPORTER_CLUSTER
  value: {{ .Values.cluster | quote }}
{{- end }}
{{- if and .Values.prometheusRule.runbookUrl (eq $.role "watcher") }}
{{- /* The watcher's own alerts link the runbooks the rules' alerts link. */}}
- name: COSTEXPORTER_WATCH_RUNBOOK_URL
  value: {{ .Values.prometheusRule.runbookUrl | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}
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

{{/* The Secret holding the API's tokens.yaml: the values', the user's, or the generated one. */}}
{{- define "costexporter.tokensSecret" -}}
{{- if .Values.api.tokensSecret -}}
{{ .Values.api.tokensSecret }}
{{- else if .Values.api.tokens -}}
{{ include "costexporter.fullname" . }}-api-tokens
{{- else if not .Values.api.allowOpen -}}
{{ include "costexporter.fullname" . }}-api-token
{{- end -}}
{{- end -}}

{{- define "costexporter.generatesToken" -}}
{{- if and .Values.api.enabled (not .Values.api.tokensSecret) (not .Values.api.tokens) (not .Values.api.allowOpen) -}}true{{- end -}}
{{- end -}}

{{/* The files the agents and the watchers read: the policy (--policy) and band profiles
(--profile DIR), each from the chart's ConfigMap or an existing one; then the extra volumes. */}}
{{- define "costexporter.policyConfigMap" -}}
{{- if .Values.policyConfigMap }}{{ .Values.policyConfigMap }}{{- else if .Values.policy }}{{ include "costexporter.fullname" . }}-policy{{- end }}
{{- end -}}

{{- define "costexporter.profilesConfigMap" -}}
{{- if .Values.profilesConfigMap }}{{ .Values.profilesConfigMap }}{{- else if .Values.profiles }}{{ include "costexporter.fullname" . }}-profiles{{- end }}
{{- end -}}

{{- define "costexporter.policyArg" -}}
{{- if include "costexporter.policyConfigMap" . }}
- --policy=/etc/costexporter/policy/policy.json
{{- end }}
{{- if include "costexporter.profilesConfigMap" . }}
- --profile=/etc/costexporter/profiles
{{- end }}
{{- end -}}

{{- define "costexporter.policyMount" -}}
{{- if include "costexporter.policyConfigMap" . }}
- {name: policy, mountPath: /etc/costexporter/policy, readOnly: true}
{{- end }}
{{- if include "costexporter.profilesConfigMap" . }}
- {name: profiles, mountPath: /etc/costexporter/profiles, readOnly: true}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "costexporter.policyVolume" -}}
{{- with include "costexporter.policyConfigMap" . }}
- name: policy
  configMap: {name: {{ . }}}
{{- end }}
{{- with include "costexporter.profilesConfigMap" . }}
- name: profiles
  configMap: {name: {{ . }}}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The archive's cluster partition: archive.cluster, else cluster; one is required, and where
both are given they are the same (the API names one cluster). */}}
{{- define "costexporter.archiveCluster" -}}
{{- $c := .Values.archive.cluster | default .Values.cluster -}}
{{- if not .Values.archive.url -}}
{{- fail "costexporter: archive.enabled needs archive.url (s3://bucket/root, gs://..., or a path on archive.existingClaim)" -}}
{{- end -}}
{{- if not $c -}}
{{- fail "costexporter: archive.enabled needs a cluster name: archive.cluster or cluster (its partition of the archive)" -}}
{{- end -}}
{{- if and .Values.cluster .Values.archive.cluster (ne .Values.cluster .Values.archive.cluster) -}}
{{- fail "costexporter: archive.cluster and cluster differ; the API reads one cluster's partition: give one of them" -}}
{{- end -}}
{{- if and (hasPrefix "/" .Values.archive.url) (not .Values.archive.existingClaim) -}}
{{- fail "costexporter: archive.url is a path: give archive.existingClaim, the volume it is on (or use object storage)" -}}
{{- end -}}
{{- $c -}}
{{- end -}}

{{/* The archive's credentials (a Secret's keys as environment variables), if any. */}}
{{- define "costexporter.archiveEnvFrom" -}}
{{- with .Values.archive.credentialsSecret }}
envFrom:
  - secretRef: {name: {{ . }}}
{{- end }}
{{- end -}}

{{/* The archive's volume and its mount, for a path on a PVC. */}}
{{- define "costexporter.archiveVolume" -}}
{{- if and .Values.archive.enabled .Values.archive.existingClaim }}
- name: archive
  persistentVolumeClaim: {claimName: {{ .Values.archive.existingClaim }}}
{{- end }}
{{- end -}}
{{- define "costexporter.archiveMount" -}}
{{- if and .Values.archive.enabled .Values.archive.existingClaim (hasPrefix "/" .Values.archive.url) }}
- {name: archive, mountPath: {{ .Values.archive.url }}}
{{- end }}
{{- end -}}

{{/* The Redis users of the parts this release runs (redis.acl), but the trainers'. */}}
{{- define "costexporter.aclRoles" -}}
{{- $r := list "agent" "watcher" "api" -}}
{{- if .Values.archive.enabled }}{{ $r = append $r "sealer" }}{{ if .Values.archive.retention.enabled }}{{ $r = append $r "retention" }}{{ end }}{{ end -}}
{{- join " " $r -}}
{{- end -}}
