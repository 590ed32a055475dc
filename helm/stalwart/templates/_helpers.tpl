{{/* The chart name, shortened to the 63 characters a label value allows. */}}
{{- define "stalwart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name. Truncated to 40 characters so that the longest derived name
("<fullname>-etcd-2" as a pod's DNS label, "<fullname>-operator") stays well inside 63.
*/}}
{{- define "stalwart.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stalwart.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "stalwart.labels" -}}
helm.sh/chart: {{ include "stalwart.chart" . }}
app.kubernetes.io/name: {{ include "stalwart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stalwart
{{- end }}

{{/* Selector labels of the operator pods; never change across upgrades (Deployment selectors are immutable). */}}
{{- define "stalwart.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stalwart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "stalwart.etcd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stalwart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
{{- end }}

{{- define "stalwart.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "stalwart.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository@digest when a digest is given, else repository:tag (tag defaulting to the given fallback). */}}
{{- define "stalwart.imageRef" -}}
{{- $img := index . 0 }}
{{- $fallbackTag := index . 1 }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default $fallbackTag $img.tag) }}
{{- end }}
{{- end }}

{{- define "stalwart.etcd.name" -}}
{{- printf "%s-etcd" (include "stalwart.fullname" .) }}
{{- end }}

{{/* The stable DNS name of every bundled etcd member, through the headless Service. */}}
{{- define "stalwart.etcd.memberHosts" -}}
{{- $name := include "stalwart.etcd.name" . }}
{{- $hosts := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $hosts = append $hosts (printf "%s-%d.%s.%s.svc" $name $i $name $.Release.Namespace) }}
{{- end }}
{{- join "," $hosts }}
{{- end }}

{{/* The default rendezvous endpoints handed to the operator: the bundled etcd's members, else the external list. */}}
{{- define "stalwart.defaultEtcdEndpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $eps := list }}
{{- range $h := splitList "," (include "stalwart.etcd.memberHosts" .) }}
{{- $eps = append $eps (printf "%s:2379" $h) }}
{{- end }}
{{- join "," $eps }}
{{- else }}
{{- join "," .Values.etcd.externalEndpoints }}
{{- end }}
{{- end }}

{{/* Peering (kopf's active/standby election) is needed only when more than one operator runs. */}}
{{- define "stalwart.peeringName" -}}
{{- include "stalwart.fullname" . }}
{{- end }}
