{{/*
The operator's permissions: exactly the resources and verbs it calls (tests/helm compares these rules with
the operator's own list of API calls). Argument: a dict with "peering" (bool).
*/}}
{{- define "stalwart.rbac.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- if .peering }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{- define "stalwart.rbac.namespacedRules" -}}
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["services", "secrets"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .peering }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}
