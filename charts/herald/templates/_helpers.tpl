{{/* The chart's name (nameOverride wins). */}}
{{- define "herald.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the release name alone when it contains the chart's name. */}}
{{- define "herald.fullname" -}}
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

{{- define "herald.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "herald.selectorLabels" -}}
app.kubernetes.io/name: {{ include "herald.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "herald.labels" -}}
helm.sh/chart: {{ include "herald.chart" . }}
{{ include "herald.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: herald
{{- end -}}

{{- define "herald.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "herald.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "herald.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Non-empty when herald's store is a shared PostgreSQL (store.postgres). */}}
{{- define "herald.postgres" -}}
{{- if .Values.store.postgres.existingSecret -}}true{{- end -}}
{{- end -}}

{{- define "herald.claimName" -}}
{{- default (printf "%s-data" (include "herald.fullname" .)) .Values.store.existingClaim -}}
{{- end -}}

{{/*
What herald does in the namespaces it watches (all of them through the ClusterRole, or
each listed one through a Role). Kept in one place so that both grant the same.
*/}}
{{- define "herald.namespacedRules" -}}
# WebhookSubscriptions: watched (list, watch), the finalizer herald.dev/purge is added
# and removed with a JSON patch, status is written with server-side apply.
- apiGroups: ["herald.dev"]
  resources: ["webhooksubscriptions"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["herald.dev"]
  resources: ["webhooksubscriptions/status"]
  verbs: ["patch"]
# WebhookQuotas: watched; status says which one is in force.
- apiGroups: ["herald.dev"]
  resources: ["webhookquotas"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["herald.dev"]
  resources: ["webhookquotas/status"]
  verbs: ["patch"]
# Secrets: watched as metadata only, to notice a changed signing secret; a reconcile
# reads the referenced ones with a GET. Never written.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch"]
# Events on subscriptions (kube-runtime's Recorder creates and patches event series).
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* What herald needs cluster-wide whatever it watches: authenticating and authorizing producers. */}}
{{- define "herald.clusterRules" -}}
# The ingest API checks a producer's bearer token (TokenReview) and its right to the call
# (SubjectAccessReview).
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
- apiGroups: ["authorization.k8s.io"]
  resources: ["subjectaccessreviews"]
  verbs: ["create"]
{{- end -}}

{{/*
What replicas sharing PostgreSQL do with their Leases (src/controller/shard_leases.rs), in
herald's own namespace only: list them by label, get, create and replace (update) one,
delete a member Lease when leaving.
*/}}
{{- define "herald.leaseRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "create", "update", "delete"]
{{- end -}}

{{/* The Secret holding the ingest API's certificate and key (ingest.tls). */}}
{{- define "herald.ingestTlsSecret" -}}
{{- if .Values.ingest.tls.secretName -}}
{{- .Values.ingest.tls.secretName -}}
{{- else -}}
{{- printf "%s-ingest-tls" (include "herald.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
