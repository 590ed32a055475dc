"""The node side of the process kubelet: each virtual node's kubelet registers its Node, posts the node's status
(Ready, capacity) and renews its Lease in ``kube-node-lease`` (the heartbeat the node lifecycle controller
watches), unless its node is lost.

A node is in one of four states (:class:`NodeState`):
- ``up``: its kubelet runs and reaches the API server;
- ``cut`` (``partition``, with a network per node): its network is cut from the API server; its processes run on
  and reach whatever the cut leaves them, its kubelet neither reports nor acts;
- ``partitioned``: cut off (``lose-node --partition``): its processes are paused, its kubelet neither reports
  nor acts; the API still shows what it last reported;
- ``down`` (``lose-node``): its processes are gone and its kubelet with them; restoring it starts a fresh
  kubelet that finds the pods still bound to the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import logging
import platform
import time
import uuid
from pathlib import Path
from typing import Any

from stalwart.local.apiserver.objects import ApiError, ObjectStore, now_rfc3339
from stalwart.local.settings import LocalClusterSettings

log = logging.getLogger(__name__)
JSON = dict[str, Any]
LEASE_NAMESPACE = "kube-node-lease"
KUBELET_VERSION = "v1.37.0-stalwart.local"
_HEALTHY = (("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"))


class NodeState(enum.StrEnum):
    UP = "up"
    CUT = "cut"
    PARTITIONED = "partitioned"
    DOWN = "down"


def micro_time(at: float | None = None) -> str:
    """A MicroTime (RFC 3339 with microseconds), as Lease.spec.renewTime carries."""
    t = datetime.datetime.fromtimestamp(time.time() if at is None else at, datetime.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_info(name: str) -> JSON:
    """``status.nodeInfo``: this machine's kernel and OS, identities stable per node name."""
    ident = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.stalwart.local"))
    os_image = "Linux"
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_image = line.partition("=")[2].strip().strip('"')
    machine = platform.machine()
    return {"kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": "", "operatingSystem": "linux",
            "architecture": {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine),
            "containerRuntimeVersion": "process://local", "kernelVersion": platform.release(),
            "osImage": os_image, "machineID": ident.replace("-", ""), "systemUUID": ident, "bootID": ident}


class NodeAgents:
    """The kubelets of the virtual nodes ``names``: their states, Node objects and Leases."""

    def __init__(self, store: ObjectStore, names: list[str], settings: LocalClusterSettings,
                 internal_ips: dict[str, str] | None = None) -> None:
        self.store = store
        self.settings = settings
        #: Each node's InternalIP: its address on the cluster network, or loopback where there is none.
        self.internal_ips = internal_ips or {}
        self.state: dict[str, NodeState] = dict.fromkeys(names, NodeState.UP)
        #: Set while the node is up: what a cut-off kubelet's pod workers wait on.
        self.reachable: dict[str, asyncio.Event] = {name: asyncio.Event() for name in names}
        for event in self.reachable.values():
            event.set()
        self._renewed: dict[str, float] = {}
        self.nodes_info = store.info("", "v1", "nodes")
        self.leases_info = store.info("coordination.k8s.io", "v1", "leases")

    def up(self, name: str) -> bool:
        return self.state.get(name) == NodeState.UP

    def set_state(self, name: str, state: NodeState) -> None:
        self.state[name] = state
        if state == NodeState.UP:
            self.reachable[name].set()
        else:
            self.reachable[name].clear()

    def check(self, name: str) -> None:
        """KeyError naming the nodes when ``name`` is not one of them."""
        if name not in self.state:
            raise KeyError(f"no node {name!r}; nodes are {sorted(self.state)}")

    def register(self) -> None:
        for name in self.state:
            with contextlib.suppress(ApiError):
                self.store.create(self.nodes_info, "", {"metadata": {"name": name, "labels": {
                    "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                    "stalwart.dev/local-node": "true"}}})
            self.post_status(name)

    def post_status(self, name: str) -> None:
        """The kubelet's node status: healthy conditions, addresses, capacity; and a fresh Lease."""
        try:
            node = self.store.get(self.nodes_info, "", name)
        except ApiError:
            return
        now = now_rfc3339()
        old = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
        conditions = []
        for type_, status, reason, message in _HEALTHY:
            prev = old.get(type_) or {}
            since = prev.get("lastTransitionTime") if prev.get("status") == status else None
            conditions.append({"type": type_, "status": status, "reason": reason, "message": message,
                               "lastHeartbeatTime": now, "lastTransitionTime": since or now})
        capacity = self.settings.capacity()
        node["status"] = {
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": self.internal_ips.get(name, "127.0.0.1")},
                          {"type": "Hostname", "address": name}],
            "nodeInfo": node_info(name),
            "capacity": capacity, "allocatable": dict(capacity),
        }
        with contextlib.suppress(ApiError):
            self.store.update(self.nodes_info, "", name, node, "status")
        self.renew(name)

    def renew(self, name: str) -> None:
        """Renew the node's Lease (create it if it is missing)."""
        spec = {"holderIdentity": name, "leaseDurationSeconds": int(self.settings.node_monitor_grace_period),
                "renewTime": micro_time()}
        try:
            lease = self.store.get(self.leases_info, LEASE_NAMESPACE, name)
            lease["spec"] = spec
            self.store.update(self.leases_info, LEASE_NAMESPACE, name, lease)
        except ApiError:
            try:
                uid = self.store.get(self.nodes_info, "", name)["metadata"]["uid"]
                self.store.create(self.leases_info, LEASE_NAMESPACE, {"metadata": {
                    "name": name, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                                       "uid": uid}]}, "spec": spec})
            except ApiError as exc:
                log.warning("node %s: cannot renew its lease: %s", name, exc.message)
                return
        self._renewed[name] = time.monotonic()

    def heartbeat(self) -> None:
        """Renew the Lease of every node that is up and due (every ``lease_renew_interval`` seconds)."""
        now = time.monotonic()
        for name, state in self.state.items():
            if state == NodeState.UP and now - self._renewed.get(name, 0.0) >= self.settings.lease_renew_interval:
                self.renew(name)
