"""The pod's own semantics in the object store: bound once to a node through the ``binding`` subresource, and
removed, after a graceful deletion, only when its kubelet says the containers are gone (:func:`finish_pod`).
Which pods are deleted gracefully is the kubelet's rule (:attr:`ObjectStore.graceful_pods`)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from stalwart.local.apiserver.errors import conflict, not_found

if TYPE_CHECKING:
    from stalwart.local.apiserver.objects import ObjectStore

JSON = dict[str, Any]


def bind(store: ObjectStore, namespace: str, name: str, node: str) -> JSON:
    """The binding subresource: set ``spec.nodeName`` of a pod that has none (the one way it changes)."""
    info = store.info("", "v1", "pods")
    key = store.key(info, namespace, name)
    old = store.storage.objects.get(key)
    if old is None:
        raise not_found(info, name)
    current = (old.get("spec") or {}).get("nodeName")
    if current:
        raise conflict(info, name, f'pod {name} is already assigned to node "{current}"')
    if old["metadata"].get("deletionTimestamp"):
        raise conflict(info, name, f"pod {name} is being deleted, cannot be assigned to a host")
    new = copy.deepcopy(old)
    new["spec"]["nodeName"] = node
    new["metadata"]["resourceVersion"] = store.storage.next_rv()
    store.storage.put(key, new, "MODIFIED")
    return store.serve(info, new)


def finish_pod(store: ObjectStore, namespace: str, name: str) -> None:
    """The kubelet's last word on a deleted pod: its processes are gone; remove it (finalizers allowing)."""
    info = store.info("", "v1", "pods")
    key = store.key(info, namespace, name)
    obj = store.storage.objects.get(key)
    if obj is None or not obj["metadata"].get("deletionTimestamp"):
        return
    if obj["metadata"].get("finalizers"):
        new = copy.deepcopy(obj)
        new["metadata"]["deletionGracePeriodSeconds"] = 0
        new["metadata"]["resourceVersion"] = store.storage.next_rv()
        store.storage.put(key, new, "MODIFIED")
        return
    store.remove(info, key)
