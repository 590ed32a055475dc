"""What the kubelet knows of each pod it runs (:class:`PodRun`, :class:`ContainerRun`) and the status it reports
from that: phase, conditions, container statuses, QoS class. The status functions are pure."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.local.apiserver.objects import now_rfc3339
from stalwart.local.apiserver.podspec import qos_class
from stalwart.local.podenv import Placement

JSON = dict[str, Any]


@dataclass
class ContainerRun:
    spec: JSON
    init: bool = False
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    state: JSON = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: JSON = field(default_factory=dict)
    done: bool = False  # terminated and will not restart
    ready: bool = False  # running and, with a readiness probe, passing it

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))


@dataclass
class PodRun:
    namespace: str
    name: str
    uid: str
    node: str
    ip: str
    dir: Path
    containers: list[ContainerRun]
    inits: list[ContainerRun]
    grace: float = 30.0  # spec.terminationGracePeriodSeconds
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    initialized: bool = False
    start_time: str = field(default_factory=now_rfc3339)
    #: The node's address (status.hostIP).
    host_ip: str = "127.0.0.1"
    #: Run in each of the pod's processes between fork and exec: enter the node's network (None: stay here).
    enter: Callable[[], None] | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def placement(self) -> Placement:
        return Placement(self.uid, self.node, self.ip, self.dir, self.host_ip)

    def all_containers(self) -> list[ContainerRun]:
        return self.inits + self.containers


def container_status(c: ContainerRun, image: str) -> JSON:
    running = "running" in c.state
    st: JSON = {"name": c.name, "image": image, "imageID": f"local://{image}", "ready": running and c.ready,
                "started": running, "restartCount": c.restarts, "state": copy.deepcopy(c.state)}
    if c.proc is not None:
        st["containerID"] = f"process://{c.proc.pid}"
    if c.last_state and not ("terminated" in c.state and c.state == c.last_state):
        st["lastState"] = copy.deepcopy(c.last_state)
    else:
        st["lastState"] = {}
    return st


def pod_phase(run: PodRun) -> str:
    cs = run.containers
    if cs and all(c.done for c in cs):
        return "Succeeded" if all((c.state.get("terminated") or {}).get("exitCode") == 0 for c in cs) else "Failed"
    if run.initialized and all("waiting" not in c.state or c.restarts > 0 or c.last_state for c in cs):
        return "Running"
    return "Pending"


def pod_status(run: PodRun, pod: JSON, phase: str | None = None, reason: str | None = None,
               message: str | None = None) -> JSON:
    """The status the kubelet reports for ``run``; conditions keep their lastTransitionTime while unchanged, and
    conditions other components own (PodScheduled, DisruptionTarget) are kept."""
    phase = phase or pod_phase(run)
    cs = run.containers
    ready = phase == "Running" and all("running" in c.state and c.ready for c in cs)
    spec = pod.get("spec") or {}
    images = {c.get("name"): c.get("image", "") for c in (spec.get("containers") or [])
              + (spec.get("initContainers") or [])}
    old = pod.get("status") or {}
    now = now_rfc3339()

    def cond(type_: str, ok: bool) -> JSON:
        status = "True" if ok else "False"
        prev = next((x for x in old.get("conditions") or [] if x.get("type") == type_), None)
        since = prev["lastTransitionTime"] if prev and prev.get("status") == status else now
        return {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": since}

    mine = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
    others = [c for c in old.get("conditions") or [] if c.get("type") not in mine]
    status: JSON = {
        "phase": phase, "hostIP": run.host_ip, "hostIPs": [{"ip": run.host_ip}], "podIP": run.ip,
        "podIPs": [{"ip": run.ip}], "startTime": run.start_time, "qosClass": qos_class(spec),
        "conditions": [cond("PodReadyToStartContainers", True), cond("Initialized", run.initialized),
                       cond("Ready", ready), cond("ContainersReady", ready), cond("PodScheduled", True), *others],
        "containerStatuses": [container_status(c, str(images.get(c.name, ""))) for c in cs],
    }
    if run.inits:
        status["initContainerStatuses"] = [container_status(c, str(images.get(c.name, ""))) for c in run.inits]
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    return status


def unknown_termination() -> JSON:
    """A container that was running when its node went down and is not there when the kubelet comes back."""
    return {"terminated": {"exitCode": 137, "reason": "ContainerStatusUnknown",
                           "message": "The container could not be located when the pod was terminated",
                           "finishedAt": now_rfc3339()}}


def had_started(pod: JSON) -> bool:
    """Whether the API shows a pod whose containers ran (its sandbox existed) before."""
    status = pod.get("status") or {}
    return any("running" in (cs.get("state") or {}) or "terminated" in (cs.get("state") or {})
               or cs.get("restartCount") for cs in status.get("containerStatuses") or [])
