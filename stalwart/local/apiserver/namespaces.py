"""The namespace's own semantics in the object store: the namespaces every cluster starts with, and where a
namespaced object may be created (its namespace exists and is not being terminated). Emptying a Terminating
namespace is a controller's work (:mod:`stalwart.local.garbage`)."""

from __future__ import annotations

from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError, bad_request
from stalwart.local.apiserver.storage import Storage

JSON = dict[str, Any]
#: The namespaces of a new cluster.
INITIAL = ("default", "kube-system", "kube-public", "kube-node-lease")


def creatable(storage: Storage, info: ResourceInfo, namespace: str, meta: JSON) -> str:
    """The namespace an object of ``info`` with ``meta`` is created in (the URL's, else its own, else
    ``default``), or the API server's error: a mismatch is 400, a missing namespace 404, a Terminating one 403."""
    body_ns = meta.get("namespace")
    if body_ns and namespace and body_ns != namespace:
        raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
    namespace = namespace or body_ns or "default"
    ns_obj = storage.objects.get(("", "namespaces", "", namespace))
    if ns_obj is None:
        raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                       {"name": namespace, "kind": "namespaces"})
    if ns_obj["metadata"].get("deletionTimestamp"):
        raise ApiError(403, "Forbidden", f'{info.plural} "{meta["name"]}" is forbidden: unable to create new '
                                         f"content in namespace {namespace} because it is being terminated",
                       {"name": meta["name"], "group": info.group, "kind": info.plural})
    return str(namespace)
