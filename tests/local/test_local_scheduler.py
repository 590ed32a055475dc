"""The local cluster's scheduler and kubelet admission against each node's capacity (the session cluster's nodes
have the default 8 CPUs, 32Gi and no GPU), seen through the real kubernetes client and kubectl."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s
from local_helpers import wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def pod(name: str, requests: dict[str, str], *, node: str | None = None, limits_only: bool = False) -> dict[str, Any]:
    resources = {"limits": requests} if limits_only else {"requests": requests}
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "local/python", "resources": resources,
                                            "command": ["python3", "-c", "import time; time.sleep(600)"]}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def scheduled(core: Any, ns: str, name: str) -> Any:
    got = core.read_namespaced_pod(name, ns)
    return next((c for c in got.status.conditions or [] if c.type == "PodScheduled"), None)


def unschedulable_message(core: Any, ns: str, name: str) -> str:
    cond = wait_until(lambda: (c := scheduled(core, ns, name)) is not None and c.status == "False" and c,
                      f"{name} to be found unschedulable")
    assert cond.reason == "Unschedulable"
    return str(cond.message)


def on_node(core: Any, ns: str, name: str) -> str | None:
    got = core.read_namespaced_pod(name, ns)
    return str(got.spec.node_name) if got.status.phase == "Running" else None


@pytest.mark.parametrize(("body", "resource"), [
    (pod("huge", {"cpu": "1000"}), "cpu"),
    (pod("huge", {"memory": "64Gi"}), "memory"),
    (pod("huge", {"nvidia.com/gpu": "1"}, limits_only=True), "nvidia.com/gpu"),  # a limit alone is the request
], ids=["cpu", "memory", "extended-resource"])
def test_a_pod_that_fits_no_node_is_unschedulable_with_kube_schedulers_message(
        local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str, body: dict[str, Any], resource: str) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    core.create_namespaced_pod(ns, body)
    message = unschedulable_message(core, ns, "huge")
    assert message == (f"0/3 nodes are available: 3 Insufficient {resource}. preemption: 0/3 nodes are available: "
                       "3 No preemption victims found for incoming pod..")
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=huge").items
    assert [(e.type, e.reason, e.message) for e in events] == [("Warning", "FailedScheduling", message)]
    assert "Pending" in local_cluster.kubectl("get", "pod", "huge", "-n", ns).stdout
    assert core.read_namespaced_pod("huge", ns).spec.node_name is None


def test_the_kubelet_refuses_a_pod_bound_past_the_scheduler_that_does_not_fit(
        local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    core.create_namespaced_pod(ns, pod("forced", {"cpu": "9"}, node=local_cluster.nodes[0]))
    got = wait_until(lambda: (p := core.read_namespaced_pod("forced", ns)).status.phase == "Failed" and p,
                     "the kubelet to refuse the pod")
    assert got.status.reason == "OutOfcpu"
    assert got.status.message == ("Pod was rejected: Node didn't have enough resource: cpu, requested: 9000, "
                                  "used: 0, capacity: 8000")


def test_requests_are_counted_per_node_and_a_freed_node_takes_the_waiting_pod(
        local_cluster: LocalCluster, kube_api: Any, k8s_namespace: str) -> None:
    core, ns = k8s.CoreV1Api(kube_api), k8s_namespace
    # 5 of a node's 8 CPUs: one such pod per node.
    for i in range(3):
        core.create_namespaced_pod(ns, pod(f"five-{i}", {"cpu": "5"}))
    nodes = [wait_until(lambda i=i: on_node(core, ns, f"five-{i}"), f"five-{i} to run") for i in range(3)]
    assert sorted(nodes) == sorted(local_cluster.nodes)
    core.create_namespaced_pod(ns, pod("five-3", {"cpu": "5"}))
    assert unschedulable_message(core, ns, "five-3").startswith("0/3 nodes are available: 3 Insufficient cpu.")
    # Something small still fits beside them.
    core.create_namespaced_pod(ns, pod("small", {"cpu": "2", "memory": "1Gi"}))
    wait_until(lambda: on_node(core, ns, "small"), "small to run")
    core.delete_namespaced_pod("five-1", ns, grace_period_seconds=1)
    assert wait_until(lambda: on_node(core, ns, "five-3"), "five-3 to be scheduled once five-1 is gone",
                      timeout=60) == nodes[1]
    cond = scheduled(core, ns, "five-3")
    assert cond.status == "True"
