"""Lists and watches as the API server serves them, through the kubernetes client and kubectl: paged lists
(``limit``/``continue``, ``remainingItemCount``, consistent pages, 410 for a token older than the history),
lists at an exact resourceVersion, and watches whose selector objects enter (ADDED) and leave (DELETED)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def make(core: k8s.CoreV1Api, ns: str, count: int, labels: dict[str, str] | None = None) -> None:
    for i in range(count):
        core.create_namespaced_config_map(ns, {"metadata": {"name": f"cm-{i:02d}", "labels": labels or {}}})


def test_pages_are_consistent_and_count_what_remains(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    make(core, k8s_namespace, 7)
    first = core.list_namespaced_config_map(k8s_namespace, limit=3)
    assert [c.metadata.name for c in first.items] == ["cm-00", "cm-01", "cm-02"]
    assert first.metadata.remaining_item_count == 4 and first.metadata._continue
    # Changes after the first page do not show in the later pages: they read the first page's snapshot.
    core.delete_namespaced_config_map("cm-05", k8s_namespace)
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "cm-99"}})
    second = core.list_namespaced_config_map(k8s_namespace, limit=3, _continue=first.metadata._continue)
    third = core.list_namespaced_config_map(k8s_namespace, limit=3, _continue=second.metadata._continue)
    assert [c.metadata.name for c in second.items + third.items] == ["cm-03", "cm-04", "cm-05", "cm-06"]
    assert second.metadata.resource_version == first.metadata.resource_version
    assert third.metadata._continue is None and third.metadata.remaining_item_count is None
    # A list at an exact older version shows the state then.
    then = core.list_namespaced_config_map(k8s_namespace, resource_version=first.metadata.resource_version,
                                           resource_version_match="Exact")
    assert "cm-05" in [c.metadata.name for c in then.items] and "cm-99" not in [c.metadata.name for c in then.items]
    # With a selector the remaining count is not given, as on a real server.
    labelled = core.list_namespaced_config_map(k8s_namespace, limit=2, label_selector="!absent")
    assert labelled.metadata._continue and labelled.metadata.remaining_item_count is None


def test_a_continue_token_older_than_the_history_is_410(local_cluster: LocalCluster, kube_api: Any,
                                                       k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    make(core, k8s_namespace, 4)
    first = core.list_namespaced_config_map(k8s_namespace, limit=2)
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "cm-50"}})
    with local_cluster.open("/stalwart/compact", method="POST", body=b""):
        pass
    with pytest.raises(k8s.ApiException) as err:
        core.list_namespaced_config_map(k8s_namespace, limit=2, _continue=first.metadata._continue)
    status = json.loads(err.value.body)
    assert err.value.status == 410 and status["reason"] == "Expired"
    assert status["message"].startswith("The provided continue parameter is too old to display a consistent list")
    # The token in the answer goes on at the latest version, inconsistently, as the message says.
    rest = core.list_namespaced_config_map(k8s_namespace, limit=10, _continue=status["metadata"]["continue"])
    assert [c.metadata.name for c in rest.items] == ["cm-02", "cm-03", "cm-50"]


def test_kubectl_reads_in_chunks(local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str) -> None:
    make(k8s.CoreV1Api(kube_api), k8s_namespace, 5)
    got = local_cluster.kubectl("get", "configmaps", "-n", k8s_namespace, "--chunk-size=2", "-o", "name").stdout
    assert got.split() == [f"configmap/cm-{i:02d}" for i in range(5)]
    limits = [a for a in local_cluster.access("kubernetes-admin") if a["resource"] == "configmaps"
              and a["namespace"] == k8s_namespace and a["verb"] == "list"]
    assert limits and limits[0]["count"] >= 3  # three pages of two


def test_watches_see_objects_enter_and_leave_their_selector(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "mover", "labels": {"tier": "a"}}})
    rv = core.list_namespaced_config_map(k8s_namespace).metadata.resource_version
    for tier in ("b", "a", "b"):
        core.patch_namespaced_config_map("mover", k8s_namespace, {"metadata": {"labels": {"tier": tier}}})
    seen = []
    for event in watch.Watch().stream(core.list_namespaced_config_map, k8s_namespace, label_selector="tier=a",
                                      resource_version=rv, timeout_seconds=5):
        seen.append((event["type"], event["object"].metadata.labels["tier"]))
        if len(seen) == 3:
            break
    # Leaving: DELETED with the object as it was; entering again: ADDED.
    assert seen == [("DELETED", "a"), ("ADDED", "a"), ("DELETED", "a")]


def test_lists_and_watches_across_all_namespaces(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    make(core, k8s_namespace, 2)
    everywhere = core.list_config_map_for_all_namespaces(label_selector="")
    assert {(c.metadata.namespace, c.metadata.name) for c in everywhere.items} >= {
        (k8s_namespace, "cm-00"), (k8s_namespace, "cm-01")}
    names = []
    for event in watch.Watch().stream(core.list_config_map_for_all_namespaces, timeout_seconds=2):
        if event["object"].metadata.namespace == k8s_namespace:
            names.append(event["object"].metadata.name)
    assert names == ["cm-00", "cm-01"]
