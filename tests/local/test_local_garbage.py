"""Garbage collection and namespace deletion as kube-controller-manager does them: after the API call, not in it.

On the store with the collector run by hand (``sweep``), so each step is seen in between; and over HTTP with
the real kubernetes client, where the collector runs on its own."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch
from local_helpers import wait_until

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.garbage import GarbageCollector

JSON = dict[str, Any]


@pytest.fixture
def store() -> ObjectStore:
    return ObjectStore(history=1000)


def cms(store: ObjectStore) -> ResourceInfo:
    return store.info("", "v1", "configmaps")


def names(store: ObjectStore, ns: str = "default") -> list[str]:
    return [o["metadata"]["name"] for o in store.list_objects(cms(store), ns)[0]]


def owned(store: ObjectStore, name: str, owner: JSON, *, block: bool = True, finalizers: list[str] | None = None,
          extra_refs: list[JSON] | None = None) -> JSON:
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"],
           "uid": owner["metadata"]["uid"], "blockOwnerDeletion": block}
    meta: JSON = {"name": name, "ownerReferences": [ref, *(extra_refs or [])]}
    if finalizers:
        meta["finalizers"] = finalizers
    return store.create(cms(store), "default", {"metadata": meta})


def test_background_deletion_removes_the_owner_now_and_its_dependents_later(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    owner = store.create(cms(store), "default", {"metadata": {"name": "owner"}})
    child = owned(store, "child", owner)
    owned(store, "grandchild", child)
    store.delete(cms(store), "default", "owner")
    assert names(store) == ["child", "grandchild"]  # the API call returned before any collection
    gc.sweep()
    assert names(store) == []


def test_a_dependent_with_another_live_owner_only_loses_the_dead_reference(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    a = store.create(cms(store), "default", {"metadata": {"name": "a"}})
    b = store.create(cms(store), "default", {"metadata": {"name": "b"}})
    ref_b = {"apiVersion": "v1", "kind": "ConfigMap", "name": "b", "uid": b["metadata"]["uid"]}
    owned(store, "shared", a, extra_refs=[ref_b])
    store.delete(cms(store), "default", "a")
    gc.sweep()
    shared = store.get(cms(store), "default", "shared")
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["b"]


def test_a_dependent_whose_owner_never_existed_is_collected(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    ghost = {"metadata": {"name": "ghost", "uid": str(uuid.uuid4())}}
    owned(store, "orphaned", ghost)
    gc.sweep()
    assert names(store) == []


def test_orphan_deletion_keeps_dependents_and_drops_their_reference(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    owner = store.create(cms(store), "default", {"metadata": {"name": "owner"}})
    owned(store, "child", owner)
    held = store.delete(cms(store), "default", "owner", {"propagationPolicy": "Orphan"})
    assert held["metadata"]["finalizers"] == ["orphan"] and held["metadata"]["deletionTimestamp"]
    gc.sweep()
    assert names(store) == ["child"]
    assert "ownerReferences" not in store.get(cms(store), "default", "child")["metadata"]


def test_foreground_deletion_waits_for_blocking_dependents_only(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    owner = store.create(cms(store), "default", {"metadata": {"name": "owner"}})
    owned(store, "blocker", owner, finalizers=["example.dev/slow"])
    owned(store, "bystander", owner, block=False, finalizers=["example.dev/slow"])
    held = store.delete(cms(store), "default", "owner", {"propagationPolicy": "Foreground"})
    assert held["metadata"]["finalizers"] == ["foregroundDeletion"]
    gc.sweep()
    # Both dependents are being deleted; the owner waits only for the one that blocks its deletion.
    for name in ("blocker", "bystander"):
        assert store.get(cms(store), "default", name)["metadata"]["deletionTimestamp"]
    assert store.get(cms(store), "default", "owner")["metadata"]["deletionTimestamp"]
    store.patch(cms(store), "default", "bystander", "merge", {"metadata": {"finalizers": None}})
    gc.sweep()
    assert "owner" in names(store)
    store.patch(cms(store), "default", "blocker", "merge", {"metadata": {"finalizers": None}})
    gc.sweep()
    assert names(store) == []


def test_namespace_deletion_empties_it_then_removes_it(store: ObjectStore) -> None:
    gc = GarbageCollector(store)
    nss = store.info("", "v1", "namespaces")
    store.create(nss, "", {"metadata": {"name": "gone"}})
    store.create(cms(store), "gone", {"metadata": {"name": "a", "finalizers": ["x/y"]}})
    store.create(cms(store), "gone", {"metadata": {"name": "b"}})
    ns = store.delete(nss, "", "gone")
    assert ns["status"]["phase"] == "Terminating" and ns["spec"]["finalizers"] == ["kubernetes"]
    with pytest.raises(ApiError) as refused:
        store.create(cms(store), "gone", {"metadata": {"name": "c"}})
    assert refused.value.code == 403
    gc.sweep()
    assert names(store, "gone") == ["a"]  # held by its finalizer: the namespace stays
    assert store.get(nss, "", "gone")["status"]["phase"] == "Terminating"
    store.patch(cms(store), "gone", "a", "merge", {"metadata": {"finalizers": None}})
    gc.sweep()
    with pytest.raises(ApiError) as gone:
        store.get(nss, "", "gone")
    assert gone.value.code == 404


@pytest.mark.integration
def test_background_cascade_over_http_is_seen_after_the_owner_is_gone(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    owner = core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    for i in range(3):
        core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": f"dep-{i}", "ownerReferences": [ref]}})
    rv = core.list_namespaced_config_map(k8s_namespace).metadata.resource_version
    core.delete_namespaced_config_map("owner", k8s_namespace)
    deleted: list[str] = []
    for event in watch.Watch().stream(core.list_namespaced_config_map, k8s_namespace, resource_version=rv,
                                      timeout_seconds=10):
        if event["type"] == "DELETED":
            deleted.append(event["object"].metadata.name)
        if len(deleted) == 4:
            break
    assert deleted[0] == "owner" and sorted(deleted[1:]) == ["dep-0", "dep-1", "dep-2"]


@pytest.mark.integration
def test_foreground_deletion_over_http(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    owner = core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid,
           "blockOwnerDeletion": True}
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "dep", "ownerReferences": [ref],
                                                                   "finalizers": ["example.dev/hold"]}})
    core.delete_namespaced_config_map("owner", k8s_namespace, propagation_policy="Foreground")
    wait_until(lambda: core.read_namespaced_config_map("dep", k8s_namespace).metadata.deletion_timestamp,
               "the dependent being deleted", timeout=30)
    time.sleep(0.5)  # the collector had its chance: the owner still waits for its blocking dependent
    assert core.read_namespaced_config_map("owner", k8s_namespace).metadata.finalizers == ["foregroundDeletion"]
    core.patch_namespaced_config_map("dep", k8s_namespace, {"metadata": {"finalizers": None}})

    def owner_gone() -> bool:
        try:
            core.read_namespaced_config_map("owner", k8s_namespace)
        except k8s.ApiException as exc:
            return exc.status == 404
        return False

    wait_until(owner_gone, "the owner to go after its dependent", timeout=30)
