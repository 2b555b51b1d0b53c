{{/* Names and labels shared by every template of the chart, defined once. */}}

{{- define "kubetrain.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kubetrain.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kubetrain.labels" -}}
{{ include "kubetrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kubetrain.serviceAccountName" -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) -}}
{{- fail "serviceAccount.create=false needs serviceAccount.name: set it to the existing ServiceAccount the operator runs as (or set serviceAccount.create=true)" -}}
{{- end -}}
{{- default (include "kubetrain.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- /* The operator image: repository@digest when image.digest is set (the tag is then ignored), else repository:tag. */ -}}
{{- define "kubetrain.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- /*
Namespaces whose TrainingJobs the operator manages, comma-separated: .Values.namespaces,
or the release namespace when that list is empty; empty with clusterWide (every namespace).
*/ -}}
{{- define "kubetrain.watchedNamespaces" -}}
{{- if and .Values.clusterWide .Values.namespaces -}}
{{- fail "clusterWide=true manages every namespace: leave namespaces empty, or set clusterWide=false to manage only the listed ones" -}}
{{- end -}}
{{- if not .Values.clusterWide -}}
{{- join "," (.Values.namespaces | default (list .Release.Namespace)) -}}
{{- end -}}
{{- end -}}

{{- /*
Refuses user labels that would take over a label the chart or the operator relies on. Called with
(dict "labels" <map> "value" "<values path>" "reserved" <list of keys> "context" .); a key under kubetrain.io/
is always reserved (the operator's own pod labels). A duplicate key would otherwise reach the API server
as the last one written: the Deployment's selector no longer matching its pods, Services and the
PodDisruptionBudget selecting nothing, or (app.kubernetes.io/managed-by: kubetrain) the operator taking
its own pod for a training pod.
*/ -}}
{{- define "kubetrain.refuseReservedLabels" -}}
{{- range $key, $_ := .labels -}}
{{- if or (has $key $.reserved) (hasPrefix "kubetrain.io/" $key) -}}
{{- fail (printf "%s[%q]: %s is a label kubetrain sets itself and selects by (the operator's Deployment, Services, PodDisruptionBudget and pod matching); a second value would break them: remove it from %s (reserved: %s and kubetrain.io/*)" $.value $key $key $.value (join ", " $.reserved)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
