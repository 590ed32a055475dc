"""kube-controller-manager's node lifecycle and taint eviction controllers, for the local cluster.

Node health: every ``node_monitor_period`` the controller looks at each node's Lease. A node whose Lease was not
renewed for ``node_monitor_grace_period`` (as the controller's own clock measures it) gets its conditions set
to ``Unknown`` (reason ``NodeStatusUnknown``, "Kubelet stopped posting node status."), the taints
``node.kubernetes.io/unreachable`` with effects NoSchedule and NoExecute (``timeAdded``), a ``NodeNotReady``
Event, and its pods the condition ``Ready=False`` with a ``NodeNotReady`` Event each. The pods stay ``Running``:
nobody is left to say otherwise. A node whose kubelet reports Ready again loses those taints. (A node whose
kubelet reports ``Ready=False`` gets the ``node.kubernetes.io/not-ready`` taints the same way.)

Taint eviction: a pod on a node with NoExecute taints is deleted once it no longer tolerates them: at once for
a taint it does not tolerate, else ``tolerationSeconds`` after the taint was added (the smallest of its
matching tolerations; none means never). Before deleting, the pod gets ``DisruptionTarget=True`` (reason
``DeletionByTaintManager``) and a ``TaintManagerEviction`` Event. The deletion is graceful, so a pod on an
unreachable node stays Terminating until it is force-deleted or its node comes back.

Pod garbage collection: a pod bound to a node that does not exist (a typo in ``nodeName``, a deleted Node) is
force-deleted once the node stayed missing for the grace period (``DisruptionTarget``, reason
``DeletionByPodGC``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from stalwart.local.apiserver.objects import ApiError, ObjectStore, now_rfc3339
from stalwart.local.fit import tolerates
from stalwart.local.nodes import LEASE_NAMESPACE
from stalwart.local.recorder import record_event, with_condition
from stalwart.local.settings import LocalClusterSettings

log = logging.getLogger(__name__)
JSON = dict[str, Any]
UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"
_CONTROLLER_TAINTS = (UNREACHABLE, NOT_READY)


def taints_for(ready: str) -> set[str]:
    """The controller's taint keys for a node whose Ready condition is ``ready``."""
    return {"True": set(), "False": {NOT_READY}}.get(ready, {UNREACHABLE})


def eviction_time(tolerations: list[Mapping[str, Any]], taints: Iterable[Mapping[str, Any]],
                  first_seen: Mapping[tuple[str, str], float], now: float) -> float | None:
    """When a pod with ``tolerations`` is to be evicted from a node with ``taints`` (Unix seconds; ``now`` for
    an untolerated NoExecute taint), or None (no NoExecute taint, or tolerated forever). A taint counts from
    when the controller first saw it (``first_seen`` by (key, effect)), as the taint manager's own timer does."""
    due: float | None = None
    for taint in taints:
        if taint.get("effect") != "NoExecute":
            continue
        matching = [t for t in tolerations if tolerates(taint, [t])]
        if not matching:
            return now
        limits = [float(t["tolerationSeconds"]) for t in matching if t.get("tolerationSeconds") is not None]
        if not limits:
            continue
        start = first_seen.get((str(taint.get("key")), "NoExecute"), now)
        at = start + max(min(limits), 0.0)
        due = at if due is None else min(due, at)
    return due


class NodeLifecycleController:
    """See the module docstring. :meth:`tick` does one round; it returns how long to wait for the next."""

    def __init__(self, store: ObjectStore, settings: LocalClusterSettings) -> None:
        self.store = store
        self.settings = settings
        self.nodes_info = store.info("", "v1", "nodes")
        self.pods_info = store.info("", "v1", "pods")
        self.leases_info = store.info("coordination.k8s.io", "v1", "leases")
        #: node -> (the Lease renewTime last seen, when this controller saw it change: monotonic seconds)
        self._probes: dict[str, tuple[str, float]] = {}
        self._first_seen: dict[tuple[str, str, str], float] = {}
        self._orphans: dict[str, float] = {}  # pod uid -> when first seen bound to a missing node

    def tick(self) -> float:
        nodes, _ = self.store.list_objects(self.nodes_info, None)
        pods, _ = self.store.list_objects(self.pods_info, None)
        by_node: dict[str, list[JSON]] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node:
                by_node.setdefault(node, []).append(pod)
        wait = self.settings.node_monitor_period
        for listed in nodes:
            name = listed["metadata"]["name"]
            try:
                node = self._monitor(listed, by_node.get(name, []))
            except ApiError as exc:
                log.warning("node lifecycle: node %s: %s", name, exc.message)
                continue
            due = self._evict(node, by_node.get(name, []))
            if due is not None:
                wait = min(wait, max(due - time.time(), 0.05))
        known = {n["metadata"]["name"] for n in nodes}
        self._collect_orphans([p for node, bound in by_node.items() if node not in known for p in bound])
        return wait

    # -- health --------------------------------------------------------------------------------------------

    def _stale(self, name: str) -> bool:
        try:
            renew = str(self.store.get(self.leases_info, LEASE_NAMESPACE, name)["spec"].get("renewTime") or "")
        except ApiError:
            renew = ""
        now = time.monotonic()
        seen = self._probes.get(name)
        if seen is None or seen[0] != renew:
            self._probes[name] = (renew, now)
            return False
        return now - seen[1] > self.settings.node_monitor_grace_period

    def _monitor(self, node: JSON, pods: list[JSON]) -> JSON:
        name = node["metadata"]["name"]
        conditions = (node.get("status") or {}).get("conditions") or []
        ready = next((c for c in conditions if c.get("type") == "Ready"), {"status": "Unknown"})
        if self._stale(name) and ready.get("status") != "Unknown":
            now = now_rfc3339()
            for c in conditions:
                c.update(status="Unknown", reason="NodeStatusUnknown", message="Kubelet stopped posting node status.",
                         lastTransitionTime=now)
            node = self.store.update(self.nodes_info, "", name, node, "status")
            ready = {"status": "Unknown"}
            log.warning("node %s: no heartbeat for %gs: Ready is Unknown", name,
                        self.settings.node_monitor_grace_period)
            record_event(self.store, node, "Normal", "NodeNotReady", f"Node {name} status is now: NodeNotReady",
                         component="node-controller")
        node = self._set_taints(node, taints_for(str(ready.get("status"))))
        if ready.get("status") != "True":
            self._mark_pods_not_ready(pods)
        return node

    def _set_taints(self, node: JSON, keys: set[str]) -> JSON:
        spec = node.setdefault("spec", {})
        current = list(spec.get("taints") or [])
        kept = [t for t in current if t.get("key") not in _CONTROLLER_TAINTS or t.get("key") in keys]
        have = {(t.get("key"), t.get("effect")) for t in kept}
        now = now_rfc3339()
        added = [{"key": key, "effect": effect, **({"timeAdded": now} if effect == "NoExecute" else {})}
                 for key in sorted(keys) for effect in ("NoSchedule", "NoExecute") if (key, effect) not in have]
        if not added and len(kept) == len(current):
            return node
        spec["taints"] = kept + added
        if not spec["taints"]:
            spec.pop("taints")
        return self.store.update(self.nodes_info, "", node["metadata"]["name"], node)

    def _mark_pods_not_ready(self, pods: list[JSON]) -> None:
        for pod in pods:
            ready = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
                         None)
            if ready is None or ready.get("status") == "False":
                continue
            with_condition(pod, "Ready", "False")
            meta = pod["metadata"]
            with contextlib.suppress(ApiError):
                self.store.update(self.pods_info, meta["namespace"], meta["name"], pod, "status")
                record_event(self.store, pod, "Warning", "NodeNotReady", "Node is not ready",
                             component="node-controller")

    # -- pod garbage collection ----------------------------------------------------------------------------

    def _collect_orphans(self, orphans: list[JSON]) -> None:
        """Pods bound to a node that does not exist: force-deleted once the node stayed missing for the grace
        period (kube-controller-manager's pod GC), since no kubelet will ever confirm their end."""
        now = time.monotonic()
        uids = {p["metadata"]["uid"] for p in orphans}
        self._orphans = {uid: t for uid, t in self._orphans.items() if uid in uids}
        for pod in orphans:
            meta = pod["metadata"]
            since = self._orphans.setdefault(meta["uid"], now)
            if now - since < self.settings.node_monitor_grace_period:
                continue
            log.warning("pod %s/%s is bound to node %s, which does not exist: deleting it", meta["namespace"],
                        meta["name"], pod["spec"]["nodeName"])
            with contextlib.suppress(ApiError):
                if with_condition(pod, "DisruptionTarget", "True", "DeletionByPodGC",
                                  "PodGC: node no longer exists"):
                    self.store.update(self.pods_info, meta["namespace"], meta["name"], pod, "status")
                self.store.delete(self.pods_info, meta["namespace"], meta["name"], {"gracePeriodSeconds": 0})

    # -- eviction ------------------------------------------------------------------------------------------

    def _evict(self, node: JSON, pods: list[JSON]) -> float | None:
        """Evict the pods that are due; return when the next one is (Unix seconds), if any."""
        name = node["metadata"]["name"]
        taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == "NoExecute"]
        now = time.time()
        for t in taints:
            self._first_seen.setdefault((name, str(t.get("key")), "NoExecute"), now)
        for key in [k for k in self._first_seen if k[0] == name and (k[1], k[2]) not in
                    {(str(t.get("key")), "NoExecute") for t in taints}]:
            del self._first_seen[key]
        if not taints:
            return None
        first_seen = {(k[1], k[2]): v for k, v in self._first_seen.items() if k[0] == name}
        next_due: float | None = None
        for pod in pods:
            if pod["metadata"].get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in (
                    "Succeeded", "Failed"):
                continue
            due = eviction_time((pod.get("spec") or {}).get("tolerations") or [], taints, first_seen, now)
            if due is None:
                continue
            if due <= now:
                self._delete(pod, name)
            else:
                next_due = due if next_due is None else min(next_due, due)
        return next_due

    def _delete(self, pod: JSON, node: str) -> None:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        log.warning("node %s: evicting pod %s/%s (NoExecute taint)", node, ns, name)
        with contextlib.suppress(ApiError):
            if with_condition(pod, "DisruptionTarget", "True", "DeletionByTaintManager",
                              "Taint manager: deleting due to NoExecute taint"):
                self.store.update(self.pods_info, ns, name, pod, "status")
        record_event(self.store, pod, "Normal", "TaintManagerEviction", f"Marking for deletion Pod {ns}/{name}",
                     component="taint-eviction-controller")
        with contextlib.suppress(ApiError):
            self.store.delete(self.pods_info, ns, name)
