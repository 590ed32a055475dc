"""The local cluster's kube-scheduler: binds each pending pod to a node with room for it (:mod:`.fit` decides),
one pod at a time in priority and creation order, as the default scheduler does.

- A pod it binds gets ``spec.nodeName``, the condition ``PodScheduled=True`` and a ``Scheduled`` Event.
- A pod that fits nowhere stays Pending with ``PodScheduled=False``, reason ``Unschedulable`` and
  kube-scheduler's message, and a ``FailedScheduling`` Event whenever that message changes. It is tried again
  whenever pods come or go or a node changes, and every few seconds.
- Pods with ``spec.schedulingGates`` wait, unbound and Pending, until the last gate is removed.
- Pods naming another ``schedulerName`` (Volcano, the coscheduling plugin's scheduler) are left to it: here
  nobody schedules them, as on a cluster without that scheduler.

Because pods are bound one by one, a job whose pods do not all fit gets some of them running and the rest
Unschedulable: gang scheduling is the job controller's business (or a gang scheduler's), as on a real cluster.
"""

from __future__ import annotations

import logging
from typing import Any

from stalwart.local.apiserver import podlife
from stalwart.local.apiserver.objects import ApiError, Event, ObjectStore
from stalwart.local.fit import NodeFit, choose
from stalwart.local.loop import ControlLoop
from stalwart.local.recorder import record_event, with_condition

log = logging.getLogger(__name__)
JSON = dict[str, Any]
COMPONENT = "default-scheduler"
#: How often unschedulable pods are tried again even when nothing was seen to change.
RETRY_SECONDS = 5.0


def holds_resources(pod: JSON) -> bool:
    """A bound pod counts against its node until it ends or is removed (Terminating pods still count)."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


def wants_scheduling(pod: JSON) -> bool:
    spec = pod.get("spec") or {}
    # A pod with scheduling gates (Kueue's admission gate, say) waits until every gate is removed.
    return (not spec.get("nodeName") and not pod["metadata"].get("deletionTimestamp")
            and not spec.get("schedulingGates")
            and spec.get("schedulerName") in (None, "", COMPONENT)
            and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))


def node_fits(store: ObjectStore, pods: list[JSON]) -> dict[str, NodeFit]:
    """Every node with what its bound pods take."""
    nodes, _ = store.list_objects(store.info("", "v1", "nodes"), None)
    bound: dict[str, list[JSON]] = {}
    for pod in pods:
        if holds_resources(pod):
            bound.setdefault(pod["spec"]["nodeName"], []).append(pod.get("spec") or {})
    return {n["metadata"]["name"]: NodeFit.of(n, bound.get(n["metadata"]["name"], [])) for n in nodes}


class Scheduler(ControlLoop):
    """Schedules the pods of ``store``; ``start``/``stop`` bracket its loop."""

    def __init__(self, store: ObjectStore) -> None:
        super().__init__("scheduler", RETRY_SECONDS)
        self.store = store
        self.pods_info = store.info("", "v1", "pods")
        store.listeners.append(self._on_event)

    def _on_event(self, ev: Event) -> None:
        if ev.group != "":
            return
        if ev.plural == "nodes" or (ev.plural == "pods" and (
                ev.type != "MODIFIED" or ev.obj["metadata"].get("deletionTimestamp")
                or (ev.obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
                or not (ev.obj.get("spec") or {}).get("nodeName"))):
            self.wake()

    def step(self) -> None:
        self.schedule_pending()

    def schedule_pending(self) -> None:
        """One pass over the pending pods."""
        pods, _ = self.store.list_objects(self.pods_info, None)
        pending = [p for p in pods if wants_scheduling(p)]
        if not pending:
            return
        fits = node_fits(self.store, pods)
        pending.sort(key=lambda p: (-int((p.get("spec") or {}).get("priority") or 0),
                                    p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))
        for pod in pending:
            node, message = choose(pod.get("spec") or {}, fits.values())
            if node is None:
                self._unschedulable(pod, message)
                continue
            if self._bind(pod, node):
                fits[node] = fits[node].with_pod(pod.get("spec") or {})

    def _bind(self, pod: JSON, node: str) -> bool:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        try:
            current = self.store.get(self.pods_info, ns, name)
            if current["metadata"]["uid"] != meta["uid"] or (current.get("spec") or {}).get("nodeName"):
                return False
            bound = podlife.bind(self.store, ns, name, node)  # the binding subresource: spec.nodeName is immutable
            with_condition(bound, "PodScheduled", "True")
            self.store.update(self.pods_info, ns, name, bound, "status")
        except ApiError as exc:
            log.info("scheduler: binding %s/%s to %s failed: %s", ns, name, node, exc.message)
            return False
        record_event(self.store, bound, "Normal", "Scheduled", f"Successfully assigned {ns}/{name} to {node}",
                     component=COMPONENT)
        return True

    def _unschedulable(self, pod: JSON, message: str) -> None:
        before = next((c for c in (pod.get("status") or {}).get("conditions") or []
                       if c.get("type") == "PodScheduled"), None)
        if not with_condition(pod, "PodScheduled", "False", "Unschedulable", message):
            return
        pod["status"].setdefault("phase", "Pending")
        meta = pod["metadata"]
        try:
            self.store.update(self.pods_info, meta["namespace"], meta["name"], pod, "status")
        except ApiError:
            return
        if before is None or before.get("message") != message:
            log.info("scheduler: %s/%s is unschedulable: %s", meta["namespace"], meta["name"], message)
            record_event(self.store, pod, "Warning", "FailedScheduling", message, component=COMPONENT)
