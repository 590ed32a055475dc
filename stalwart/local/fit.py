"""Where a pod may run: kube-scheduler's filters and its choice among the nodes that pass, as pure functions
over plain records (no store, no clock).

Filters, in kube-scheduler's order; the first that fails gives the node's reasons:

1. NodeUnschedulable: a cordoned node (``spec.unschedulable``), unless the pod tolerates
   ``node.kubernetes.io/unschedulable:NoSchedule``.
2. TaintToleration: the first NoSchedule/NoExecute taint the pod does not tolerate.
3. NodeAffinity: ``spec.nodeSelector`` and the required node affinity terms.
4. NodeResourcesFit: the pod count and every requested resource (cpu, memory, ``nvidia.com/gpu``, any
   extended resource) against what the node has left. A pod's request is, per resource, the larger of the sum
   over its containers and the largest init container, plus ``spec.overhead``; a container that sets only a
   limit requests that limit (the API server's defaulting).

The first three are unresolvable by preemption, the last is not; the message of an unschedulable pod is the one
kube-scheduler writes: ``0/3 nodes are available: 1 node(s) had untolerated taint {k: v}, 2 Insufficient cpu.
preemption: 0/3 nodes are available: 1 Preemption is not helpful for scheduling, 2 No preemption victims found
for incoming pod..`` (every pod has the same priority here, so preemption never finds a victim).

Among the nodes that pass, the least allocated wins (cpu and memory, counting a container without requests
as 100m and 200Mi, as the scheduler's scoring does), then the one with fewer pods, then the name.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.local.quantity import QuantityError, milli, whole

JSON = dict[str, Any]

UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
#: What the scoring assumes of a container that requests nothing (kube-scheduler's non-zero defaults).
DEFAULT_MILLI_CPU = 100
DEFAULT_MEMORY = 200 * 1024 * 1024
_NOT_HELPFUL = "Preemption is not helpful for scheduling"
_NO_VICTIMS = "No preemption victims found for incoming pod"


def amount(resource: str, value: Any) -> int:
    """A quantity in the scheduler's unit: cpu in millicores, everything else whole (bytes, devices)."""
    return milli(value) if resource == "cpu" else whole(value)


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """What a pod asks of its node, per resource (see the module docstring). Unparsable quantities count 0."""

    def of(container: Mapping[str, Any]) -> dict[str, int]:
        res = container.get("resources") or {}
        wanted = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out: dict[str, int] = {}
        for name, value in wanted.items():
            try:
                out[str(name)] = amount(str(name), value)
            except QuantityError:
                continue
        return out

    total: Counter[str] = Counter()
    for c in spec.get("containers") or []:
        total.update(of(c))
    for c in spec.get("initContainers") or []:
        for name, value in of(c).items():
            total[name] = max(total[name], value)
    for name, value in (spec.get("overhead") or {}).items():
        try:
            total[str(name)] += amount(str(name), value)
        except QuantityError:
            continue
    return {k: v for k, v in total.items() if v}


def score_requests(spec: Mapping[str, Any]) -> tuple[int, int]:
    """(milli-cpu, memory bytes) for scoring, with the non-zero defaults for containers that set none."""
    cpu = mem = 0
    for c in spec.get("containers") or []:
        one = pod_requests({"containers": [c]})
        cpu += one.get("cpu", DEFAULT_MILLI_CPU)
        mem += one.get("memory", DEFAULT_MEMORY)
    return cpu, mem


def tolerates(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any toleration matches ``taint`` (key, operator Equal/Exists, value, effect)."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator"), [str(v) for v in expr.get("values") or []]
    present = key in labels
    if op == "In":
        return present and labels[key] in values
    if op == "NotIn":
        return not present or labels[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            have, bound = int(labels[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def matches_node_selector(spec: Mapping[str, Any], node_name: str, labels: Mapping[str, str]) -> bool:
    """``nodeSelector`` and ``requiredDuringSchedulingIgnoredDuringExecution`` (terms ORed, expressions ANDed;
    ``matchFields`` knows ``metadata.name``)."""
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        return True
    fields = {"metadata.name": node_name}
    return any(all(_expression_matches(e, labels) for e in term.get("matchExpressions") or [])
               and all(_expression_matches(e, fields) for e in term.get("matchFields") or [])
               for term in terms)


@dataclass(frozen=True)
class NodeFit:
    """A node as the scheduler sees it: what it offers and what the pods bound to it already take."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, Any], ...] = ()
    unschedulable: bool = False
    allocatable: Mapping[str, int] = field(default_factory=dict)
    requested: Mapping[str, int] = field(default_factory=dict)
    pods: int = 0
    score_cpu: int = 0
    score_memory: int = 0

    @classmethod
    def of(cls, node: Mapping[str, Any], bound: Iterable[Mapping[str, Any]]) -> NodeFit:
        """From a Node object and the specs of the pods bound to it that still hold resources."""
        spec, status = node.get("spec") or {}, node.get("status") or {}
        allocatable: dict[str, int] = {}
        for name, value in (status.get("allocatable") or status.get("capacity") or {}).items():
            try:
                allocatable[str(name)] = amount(str(name), value)
            except QuantityError:
                continue
        requested: Counter[str] = Counter()
        count = cpu = mem = 0
        for pod_spec in bound:
            requested.update(pod_requests(pod_spec))
            c, m = score_requests(pod_spec)
            count, cpu, mem = count + 1, cpu + c, mem + m
        return cls(name=str(node["metadata"]["name"]), labels=dict(node["metadata"].get("labels") or {}),
                   taints=tuple(spec.get("taints") or ()), unschedulable=bool(spec.get("unschedulable")),
                   allocatable=allocatable, requested=dict(requested), pods=count, score_cpu=cpu,
                   score_memory=mem)

    def with_pod(self, pod_spec: Mapping[str, Any]) -> NodeFit:
        """This node once ``pod_spec`` is bound to it (the next pod of the same pass sees less room)."""
        requested = Counter(self.requested)
        requested.update(pod_requests(pod_spec))
        cpu, mem = score_requests(pod_spec)
        return NodeFit(self.name, self.labels, self.taints, self.unschedulable, self.allocatable, dict(requested),
                       self.pods + 1, self.score_cpu + cpu, self.score_memory + mem)


def insufficient(pod_spec: Mapping[str, Any], node: NodeFit) -> list[str]:
    """NodeResourcesFit's reasons: ``Too many pods`` and ``Insufficient <resource>``, in its order."""
    reasons = []
    if node.pods + 1 > node.allocatable.get("pods", 110):
        reasons.append("Too many pods")
    wanted = pod_requests(pod_spec)
    order = ["cpu", "memory", "ephemeral-storage", *sorted(set(wanted) - {"cpu", "memory", "ephemeral-storage"})]
    for name in order:
        need = wanted.get(name, 0)
        if need and node.requested.get(name, 0) + need > node.allocatable.get(name, 0):
            reasons.append(f"Insufficient {name}")
    return reasons


def rejection(pod_spec: Mapping[str, Any], node: NodeFit) -> tuple[str, str] | None:
    """The kubelet's own admission of a pod bound to ``node``: None when it fits, else the pod's reason
    (``OutOf<resource>``) and message, worded as the kubelet words them (the first resource short)."""
    reasons = insufficient(pod_spec, node)
    if not reasons:
        return None
    resource = "pods" if reasons[0] == "Too many pods" else reasons[0].removeprefix("Insufficient ")
    wanted = 1 if resource == "pods" else pod_requests(pod_spec).get(resource, 0)
    used = node.pods if resource == "pods" else node.requested.get(resource, 0)
    return f"OutOf{resource}", (f"Pod was rejected: Node didn't have enough resource: {resource}, requested: "
                                f"{wanted}, used: {used}, capacity: {node.allocatable.get(resource, 0)}")


def filter_node(pod_spec: Mapping[str, Any], node: NodeFit) -> tuple[list[str], bool]:
    """Why the pod cannot go to ``node`` (empty: it can) and whether preemption could help."""
    tolerations = pod_spec.get("tolerations") or []
    if node.unschedulable and not tolerates({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}, tolerations):
        return ["node(s) were unschedulable"], False
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(taint, tolerations):
            return [f"node(s) had untolerated taint {{{taint.get('key', '')}: {taint.get('value', '')}}}"], False
    if not matches_node_selector(pod_spec, node.name, node.labels):
        return ["node(s) didn't match Pod's node affinity/selector"], False
    return insufficient(pod_spec, node), True


def _histogram(reasons: Iterable[str]) -> str:
    return ", ".join(sorted(f"{n} {reason}" for reason, n in Counter(reasons).items()))


def unschedulable_message(verdicts: Mapping[str, tuple[list[str], bool]]) -> str:
    """kube-scheduler's FitError text for the per-node verdicts of :func:`filter_node`."""
    total = len(verdicts)
    if not total:
        return "no nodes available to schedule pods"
    text = f"0/{total} nodes are available"
    reasons = [r for rs, _ in verdicts.values() for r in rs]
    text += f": {_histogram(reasons)}." if reasons else ":"
    post = _histogram(_NO_VICTIMS if resolvable else _NOT_HELPFUL for _, resolvable in verdicts.values())
    return f"{text} preemption: 0/{total} nodes are available: {post}.."


def choose(pod_spec: Mapping[str, Any], nodes: Iterable[NodeFit]) -> tuple[str | None, str]:
    """``(node name, "")`` for the best node that passes every filter, else ``(None, message)``."""
    verdicts: dict[str, tuple[list[str], bool]] = {}
    feasible: list[NodeFit] = []
    for node in nodes:
        verdicts[node.name] = filter_node(pod_spec, node)
        if not verdicts[node.name][0]:
            feasible.append(node)
    if not feasible:
        return None, unschedulable_message(verdicts)
    cpu, mem = score_requests(pod_spec)

    def load(n: NodeFit) -> tuple[float, int, str]:
        used = ((n.score_cpu + cpu) / max(n.allocatable.get("cpu", 1), 1)
                + (n.score_memory + mem) / max(n.allocatable.get("memory", 1), 1))
        return used, n.pods, n.name

    return min(feasible, key=load).name, ""
