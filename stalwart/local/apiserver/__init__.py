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

Module map:
- the object store: :mod:`.storage` (objects, revisions, history, watches, snapshots, pages), :mod:`.objects`
  (the write semantics every kind shares), :mod:`.subresources`, :mod:`.deletion`, :mod:`.fieldmanager`
  (managedFields, apply), and one kind's own: :mod:`.podlife` (binding, the kubelet's end of a deletion),
  :mod:`.namespaces` (initial ones, where objects may be created), :mod:`.crds` (serving a CRD's resource);
- admission: :mod:`.admission` (the order of checks), :mod:`.metadata` (names, labels, annotations),
  :mod:`.core_schema` (built-in kinds against their OpenAPI schemas), :mod:`.builtins` and :mod:`.podspec`
  (defaults and semantic checks; quantities by :mod:`stalwart.local.quantity`), :mod:`.crds` and :mod:`.celcheck`
  (CRDs when stored),
  :mod:`.schema` and :mod:`.cel` (custom resources: structural schema, defaulting, pruning, the CEL subset);
- security: :mod:`.authentication` (tokens), :mod:`.authorization` (RBAC), :mod:`.security` (the gate, the
  record of decisions, the default roles), :mod:`.reviews` (TokenRequest, token and access reviews);
- HTTP: :mod:`.requestinfo` (request attributes), :mod:`.http` (routes), :mod:`.watching` (watch streams),
  :mod:`.errors` (Status bodies), :mod:`.catalog` (resources, discovery), :mod:`.selectors`, :mod:`.patches`,
  :mod:`.tables` (Table output), :mod:`.openapi` (OpenAPI for ``kubectl explain``), :mod:`.protobuf` (the
  protobuf bodies typed Go clients send).

Garbage collection and namespace deletion are controllers outside the API server (:mod:`stalwart.local.garbage`).
"""
