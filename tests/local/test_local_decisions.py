"""The local cluster's pure decisions, table by table: quantities, a pod's requests, the scheduler's filters,
choice and message, the default tolerations, when a pod is evicted, the QoS class."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from stalwart.local.admission import add_default_tolerations
from stalwart.local.fit import NodeFit, choose, filter_node, pod_requests, rejection, unschedulable_message
from stalwart.local.nodelifecycle import eviction_time, taints_for
from stalwart.local.pods import qos_class
from stalwart.local.quantity import QuantityError, parse_quantity
from stalwart.local.settings import LocalClusterSettings

GI = 2**30


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Decimal("0.5")), ("2", Decimal(2)), ("1.5", Decimal("1.5")), ("2Gi", Decimal(2 * GI)),
    ("1e3", Decimal(1000)), ("128974848", Decimal(128974848)), ("129M", Decimal(129_000_000)), (3, Decimal(3)),
])
def test_quantities(text: Any, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["1x", "", "Gi", "1.2.3", "--1"])
def test_bad_quantities_are_refused(text: str) -> None:
    with pytest.raises(QuantityError, match="expected a quantity"):
        parse_quantity(text)


def container(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return {"name": "c", "resources": resources}


@pytest.mark.parametrize(("spec", "wanted"), [
    ({"containers": [container({"cpu": "500m", "memory": "1Gi"}), container({"cpu": "1"})]},
     {"cpu": 1500, "memory": GI}),
    # A limit alone is the request (the API server's defaulting).
    ({"containers": [container(limits={"cpu": "2", "nvidia.com/gpu": "1"})]}, {"cpu": 2000, "nvidia.com/gpu": 1}),
    # Init containers run before, one at a time: the larger of their max and the containers' sum.
    ({"containers": [container({"cpu": "1"})], "initContainers": [container({"cpu": "3"}), container({"cpu": "2"})]},
     {"cpu": 3000}),
    ({"containers": [container({"cpu": "1"})], "overhead": {"cpu": "250m"}}, {"cpu": 1250}),
    ({"containers": [container()]}, {}),
])
def test_pod_requests(spec: dict[str, Any], wanted: dict[str, int]) -> None:
    assert pod_requests(spec) == wanted


def node(name: str, *, cpu: str = "8", gpus: int = 0, taints: tuple[dict[str, Any], ...] = (),
         unschedulable: bool = False, labels: dict[str, str] | None = None, bound: int = 0,
         bound_cpu: str = "0") -> NodeFit:
    capacity = LocalClusterSettings(node_cpu=cpu, node_gpus=gpus).capacity()
    obj = {"metadata": {"name": name, "labels": labels or {"kubernetes.io/hostname": name}},
           "spec": {"taints": list(taints), "unschedulable": unschedulable}, "status": {"allocatable": capacity}}
    return NodeFit.of(obj, [{"containers": [container({"cpu": bound_cpu})]}] * bound)


def pod_spec(cpu: str = "0", **extra: Any) -> dict[str, Any]:
    return {"containers": [container({"cpu": cpu} if cpu != "0" else None)], **extra}


UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}


@pytest.mark.parametrize(("spec", "fit", "reasons", "resolvable"), [
    (pod_spec("1"), node("a"), [], True),
    (pod_spec("9"), node("a"), ["Insufficient cpu"], True),
    (pod_spec("4"), node("a", bound=1, bound_cpu="5"), ["Insufficient cpu"], True),
    ({"containers": [container({"nvidia.com/gpu": "1", "memory": "64Gi"})]}, node("a"),
     ["Insufficient memory", "Insufficient nvidia.com/gpu"], True),
    ({"containers": [container({"nvidia.com/gpu": "1"})]}, node("a", gpus=1), [], True),
    (pod_spec(), node("a", bound=110), ["Too many pods"], True),
    (pod_spec(), node("a", unschedulable=True), ["node(s) were unschedulable"], False),
    (pod_spec(tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
                            "effect": "NoSchedule"}]), node("a", unschedulable=True), [], True),
    (pod_spec(), node("a", taints=(UNREACHABLE,)),
     ["node(s) had untolerated taint {node.kubernetes.io/unreachable: }"], False),
    # The default tolerations cover NoExecute only: the NoSchedule taint still keeps new pods away.
    (pod_spec(tolerations=[{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
                            "tolerationSeconds": 300}]), node("a", taints=(UNREACHABLE,)),
     ["node(s) had untolerated taint {node.kubernetes.io/unreachable: }"], False),
    (pod_spec(nodeSelector={"disk": "ssd"}), node("a"), ["node(s) didn't match Pod's node affinity/selector"], False),
    (pod_spec(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["b", "c"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a"]}]}]}}}), node("a"), [], True),
], ids=["fits", "too-big", "taken", "memory-and-gpu", "device-fits", "pods", "cordoned", "cordon-tolerated",
        "tainted", "noexecute-only", "selector", "affinity"])
def test_filter_node(spec: dict[str, Any], fit: NodeFit, reasons: list[str], resolvable: bool) -> None:
    got, can_preempt = filter_node(spec, fit)
    assert got == reasons
    if reasons:
        assert can_preempt is resolvable


@pytest.mark.parametrize(("spec", "fit", "expected"), [
    (pod_spec("1"), node("a"), None),
    (pod_spec("4"), node("a", bound=1, bound_cpu="5"),
     ("OutOfcpu", "Pod was rejected: Node didn't have enough resource: cpu, requested: 4000, used: 5000, "
                  "capacity: 8000")),
    ({"containers": [container({"nvidia.com/gpu": "1", "memory": "64Gi"})]}, node("a"),
     ("OutOfmemory", f"Pod was rejected: Node didn't have enough resource: memory, requested: {64 * GI}, used: 0, "
                     f"capacity: {32 * GI}")),
    (pod_spec(), node("a", bound=110),
     ("OutOfpods", "Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 110, "
                   "capacity: 110")),
], ids=["fits", "cpu", "first-resource-short", "pods"])
def test_the_kubelets_own_admission(spec: dict[str, Any], fit: NodeFit, expected: tuple[str, str] | None) -> None:
    assert rejection(spec, fit) == expected


def test_the_least_allocated_node_is_chosen_and_the_message_names_every_node() -> None:
    nodes = [node("a", bound=1, bound_cpu="4"), node("b"), node("c", bound=1)]
    assert choose(pod_spec("1"), nodes) == ("b", "")
    full = [node("a", bound=1, bound_cpu="6"), node("b", taints=(UNREACHABLE,)), node("c", unschedulable=True)]
    name, message = choose(pod_spec("4"), full)
    assert name is None and message == (
        "0/3 nodes are available: 1 Insufficient cpu, 1 node(s) had untolerated taint "
        "{node.kubernetes.io/unreachable: }, 1 node(s) were unschedulable. preemption: 0/3 nodes are available: "
        "1 No preemption victims found for incoming pod, 2 Preemption is not helpful for scheduling..")
    assert unschedulable_message({}) == "no nodes available to schedule pods"


def test_a_node_takes_what_the_pods_of_one_pass_bound_to_it() -> None:
    empty = node("a")
    assert filter_node(pod_spec("5"), empty)[0] == []
    assert filter_node(pod_spec("5"), empty.with_pod(pod_spec("5")))[0] == ["Insufficient cpu"]


@pytest.mark.parametrize(("given", "added"), [
    ([], {("node.kubernetes.io/not-ready", 300), ("node.kubernetes.io/unreachable", 300)}),
    ([{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5}],
     {("node.kubernetes.io/not-ready", 300)}),
    # No effect tolerates every effect, NoExecute included; an empty key with Exists tolerates every taint.
    ([{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}], {("node.kubernetes.io/unreachable", 300)}),
    ([{"operator": "Exists"}], set()),
    # A NoSchedule toleration does not count.
    ([{"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoSchedule"}],
     {("node.kubernetes.io/not-ready", 300), ("node.kubernetes.io/unreachable", 300)}),
])
def test_default_tolerations(given: list[dict[str, Any]], added: set[tuple[str, int]]) -> None:
    spec: dict[str, Any] = {"tolerations": list(given)}
    add_default_tolerations(spec, 300, 300)
    assert spec["tolerations"][:len(given)] == given
    assert {(t["key"], t["tolerationSeconds"]) for t in spec["tolerations"][len(given):]} == added
    assert all(t["effect"] == "NoExecute" and t["operator"] == "Exists" for t in spec["tolerations"][len(given):])


NOW = 1_800_000_000.0
NO_EXECUTE = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2027-01-15T07:59:50Z"}
ADDED = NOW - 10  # when the controller saw the taint


def toleration(seconds: int | None, key: str = "node.kubernetes.io/unreachable") -> dict[str, Any]:
    out: dict[str, Any] = {"key": key, "operator": "Exists", "effect": "NoExecute"}
    if seconds is not None:
        out["tolerationSeconds"] = seconds
    return out


@pytest.mark.parametrize(("tolerations", "taints", "due"), [
    ([toleration(300)], [NO_EXECUTE], ADDED + 300),
    ([toleration(300), toleration(60)], [NO_EXECUTE], ADDED + 60),  # the smallest matching one
    ([toleration(None)], [NO_EXECUTE], None),  # tolerated for ever
    ([toleration(300, key="other")], [NO_EXECUTE], NOW),  # not tolerated: at once
    ([], [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}], None),  # no NoExecute taint
    # A taint the controller sees for the first time now: from now.
    ([toleration(30)], [{"key": "other", "effect": "NoExecute"}], NOW),
    ([toleration(30), toleration(30, key="other")], [{"key": "other", "effect": "NoExecute"}], NOW + 30),
])
def test_eviction_time(tolerations: list[dict[str, Any]], taints: list[dict[str, Any]], due: float | None) -> None:
    first_seen = {("node.kubernetes.io/unreachable", "NoExecute"): NOW - 10}
    assert eviction_time(tolerations, taints, first_seen, NOW) == due


def test_the_controller_taints_by_the_ready_condition() -> None:
    assert taints_for("True") == set()
    assert taints_for("False") == {"node.kubernetes.io/not-ready"}
    assert taints_for("Unknown") == {"node.kubernetes.io/unreachable"}


@pytest.mark.parametrize(("containers", "qos"), [
    ([container()], "BestEffort"),
    ([container({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"})], "Guaranteed"),
    ([container(limits={"cpu": "1", "memory": "1Gi"})], "Guaranteed"),  # requests default to the limits
    ([container({"cpu": "1"}, {"cpu": "2", "memory": "1Gi"})], "Burstable"),
    ([container({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}), container()], "Burstable"),
])
def test_qos_class(containers: list[dict[str, Any]], qos: str) -> None:
    assert qos_class({"containers": containers}) == qos


def test_settings_name_the_bad_field() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="node_cpu"):
        LocalClusterSettings(node_cpu="1x")
    with pytest.raises(ValidationError, match="node_monitor_grace_period"):
        LocalClusterSettings(node_monitor_grace_period=0)
    assert LocalClusterSettings(node_monitor_grace_period=3).node_monitor_period == 0.75
