"""A Kubernetes API emulator for the local cluster: enough of kube-apiserver for kopf, the kubernetes client,
kubectl and the Helm library to work against it unmodified.

Why not kmock's ``KubernetesEmulator`` as it is: it stores objects as plain dicts merged on every write, so it has
no resourceVersion (kopf's list-then-watch never resumes and reacts to nothing), no ``kind``/``apiVersion`` on list
items (``kubectl get`` of a custom resource fails with "Object 'Kind' is missing"), no 409 conflicts, generation,
status subresource, selectors, CRD serving, schema validation, Table output, strategic merge, JSON patch or
server-side apply, and its request routing is a pattern DSL meant for mocking individual responses. Each of those
is a semantic of the object store itself, so the store is written here (:mod:`.objects`) and served by a small
aiohttp application (:mod:`.http`). What is reused from kmock is its catalogue of the built-in API groups and
resources (``kmock/_internal/resources.json.gz``, a discovery dump of a real cluster), so every built-in kind
(Deployment, RBAC, ServiceAccount, Lease, ...) is discoverable and stored without being listed by hand here.

Module map: :mod:`.catalog` (resource descriptions, discovery documents), :mod:`.selectors` (label/field
selectors), :mod:`.patches` (merge, strategic merge, JSON patch, apply), :mod:`.schema` (CRD structural schema:
validation, defaulting, pruning), :mod:`.cel` (the CEL subset for ``x-kubernetes-validations``), :mod:`.tables`
(server-side Table output), :mod:`.openapi` (OpenAPI v3 documents for ``kubectl explain``), :mod:`.objects`
(the object store: metadata semantics, watch history, finalizers, garbage collection) and :mod:`.http` (routes).
"""
