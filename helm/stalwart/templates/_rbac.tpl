{{/*
The operator's permissions: exactly the resources and verbs it calls, as listed in stalwart/operator/rbac.py
(tests/helm compares the rendered rules with that list). Argument: a dict with "peering" (bool) and "gang" (the gang scheduler, or "").
*/}}
{{- define "stalwart.rbac.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
# Nodes whose kubelet is gone (Ready Unknown, the unreachable taint): their pods are lost long before eviction.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- if .peering }}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}

{{- define "stalwart.rbac.namespacedRules" -}}
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs"]
  verbs: ["list", "watch", "patch", "delete"]
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
# The pods' owner references set blockOwnerDeletion, which clusters enforcing OwnerReferencesPermissionEnforcement
# allow only to those who may update the owner's finalizers.
- apiGroups: ["stalwart.dev"]
  resources: ["trainingjobs/finalizers"]
  verbs: ["update"]
# get: an existing pod or Service of the name the operator meant to create is adopted only if the job controls it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "get", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "get"]
# Creating the job's RPC-token Secret, and reading the etcd credentials a job names in spec.rendezvous.secretRef.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if eq .gang "volcano" }}
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["create", "get", "patch"]
{{- else if eq .gang "coscheduling" }}
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "get", "patch"]
{{- end }}
{{- if .peering }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch", "patch"]
{{- end }}
{{- end }}
