"""The emulator over HTTP with the real kubernetes client: discovery, list and watch with resource versions
(410 Gone inside the stream when too old), Table output, delete propagation, logs."""

from __future__ import annotations

import json
from typing import Any

import pytest
from local_helpers import wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def test_discovery_and_version(kube_api: Any) -> None:
    from kubernetes import client

    assert client.VersionApi(kube_api).get_code().git_version.startswith("v1.")
    groups = {g.name for g in client.ApisApi(kube_api).get_api_versions().groups}
    assert {"apps", "apiextensions.k8s.io", "coordination.k8s.io", "rbac.authorization.k8s.io"} <= groups
    core = {r.name for r in client.CoreV1Api(kube_api).get_api_resources().resources}
    assert {"pods", "pods/log", "pods/status", "services", "secrets", "configmaps", "events"} <= core


def test_list_then_watch_from_the_list_version(kube_api: Any, k8s_namespace: str) -> None:
    from kubernetes import client, watch

    core = client.CoreV1Api(kube_api)
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "before"}})
    listed = core.list_namespaced_config_map(k8s_namespace)
    assert [i.metadata.name for i in listed.items] == ["before"]
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "after", "labels": {"w": "1"}}})
    core.patch_namespaced_config_map("after", k8s_namespace, {"data": {"k": "v"}})
    core.delete_namespaced_config_map("after", k8s_namespace)
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_config_map, k8s_namespace,
                       resource_version=listed.metadata.resource_version, label_selector="w=1",
                       timeout_seconds=30):
        seen.append((ev["type"], ev["object"].metadata.name))
        if ev["type"] == "DELETED":
            w.stop()
    assert seen == [("ADDED", "after"), ("MODIFIED", "after"), ("DELETED", "after")]


def test_watch_from_a_compacted_version_reports_410(local_cluster: LocalCluster, kube_api: Any,
                                                    k8s_namespace: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    old = core.list_namespaced_config_map(k8s_namespace).metadata.resource_version
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "x"}})
    with local_cluster.open("/stalwart/compact", method="POST", body=b""):
        pass
    path = f"/api/v1/namespaces/{k8s_namespace}/configmaps?watch=true&resourceVersion={old}&timeoutSeconds=5"
    with local_cluster.open(path) as resp:
        event = json.loads(resp.readline())
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"


def test_table_output_for_pods_and_custom_columns(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    with local_cluster.open(f"/api/v1/namespaces/{k8s_namespace}/pods",
                            headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}) as resp:
        table = json.loads(resp.read())
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:5] == ["Name", "Ready", "Status", "Restarts", "Age"]


def test_delete_propagation_over_http(kube_api: Any, k8s_namespace: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    owner = core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "dep", "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner", k8s_namespace, propagation_policy="Background")
    assert [i.metadata.name for i in core.list_namespaced_config_map(k8s_namespace).items] == []


def test_follow_logs_with_the_client(kube_api: Any, k8s_namespace: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    core.create_namespaced_pod(k8s_namespace, {
        "metadata": {"name": "talker"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "c", "image": "x",
            "command": ["python3", "-c", "import time\nfor i in range(3):\n print(i, flush=True); time.sleep(0.2)"],
        }]}})
    # Started, not only listed: a container still waiting has no log yet (under load the status lists it first).
    def started() -> bool:
        statuses = core.read_namespaced_pod("talker", k8s_namespace).status.container_statuses or []
        return any(c.state.running is not None or c.state.terminated is not None for c in statuses)

    wait_until(started, "talker to start")
    text = core.read_namespaced_pod_log("talker", k8s_namespace, follow=True, _request_timeout=60)
    assert text == "0\n1\n2\n"


def test_each_namespace_gets_a_default_service_account(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    wait_until(lambda: local_cluster.kubectl("-n", k8s_namespace, "get", "serviceaccount", "default",
                                             check=False).returncode == 0, "the default ServiceAccount")
