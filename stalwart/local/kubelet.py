"""The process kubelet of the local cluster: it runs each pod bound to one of its virtual nodes as local
processes, one per container. This module is the pod's lifecycle (which pods run, admission, start, stop on
deletion, status, node loss as the API sees it); :mod:`.podruns` holds the running pods' processes,
:mod:`.podworker` runs one pod's containers, :mod:`.processes` is the container runtime.

Contract, per pod:
- It runs pods bound to a node that is up (the scheduler, :mod:`.scheduler`, binds them). Before starting one
  it checks that the pod fits the node's capacity (a pod bound by name past the scheduler may not): one that
  does not is Failed with reason ``OutOf<resource>``.
- Each pod gets its own address as ``status.podIP``: with a network per node (:mod:`.netns`) one of its node's
  /24, on the node's interface, and its processes run in the node's network namespace with the pod's hostname;
  else a loopback address 127.s.x.y (Linux routes all of 127/8 to ``lo``; ``s`` is the cluster's own, picked at
  random: see :class:`.podruns.PodRuns`). And a directory ``<workdir>/pods/<namespace>_<name>_<uid>/`` that is
  the default working directory and holds the container logs (``<container>.log``, the previous instance's as
  ``<container>.previous.log``).
- Environment: :mod:`.podenv`. The image is recorded and ignored; a container without ``command`` cannot run
  (there is no image entrypoint) and terminates with reason ``ContainerCannotRun``. Of the volumes only Secrets
  are mounted, as files under the pod's directory (:mod:`.podenv`).
- Init containers run one by one before the containers; each container is restarted per ``restartPolicy`` with
  an exponential back-off (``CrashLoopBackOff`` while waiting). Status (:mod:`.pods`): phase, conditions,
  container statuses with state, last state, exit code, signal and restart count; probes: :mod:`.probes`.
- Deletion: each container's main process gets SIGTERM, every process of the container SIGKILL once the grace
  period ends; then the pod is removed. A pod removed from the API without that (force-deleted) is stopped
  the same way with a 2 s grace, the kubelet's minimum.

Node loss (:mod:`.nodes` has the states). :meth:`ProcessKubelet.lose_node` with ``partition=True`` pauses the
node's processes (SIGSTOP) and cuts its kubelet off: it neither reports nor acts, so the API keeps showing its
pods as they were, and their processes are zombies that act again once :meth:`~ProcessKubelet.restore_node`
resumes them (the kubelet then stops whatever the API no longer has). Without ``partition`` the node is gone:
its processes are killed and its kubelet forgets them; restored, a fresh kubelet finds the pods still bound to
the node and restarts their containers (restart count + 1, last state ``ContainerStatusUnknown``), or fails
pods whose ``restartPolicy`` is Never. Either way the node lifecycle controller (:mod:`.nodelifecycle`), not
the kubelet, is what turns the node Unknown, taints it and evicts its pods.

Network faults (a network per node only): :meth:`ProcessKubelet.partition` cuts the node's network from
everything or from some of etcd, the API server and other nodes (:mod:`.netplan`); its processes run on. A cut
that includes the API server cuts the kubelet off as well (state ``cut``): it neither reports (so the node's
Lease expires and the node turns Unknown) nor acts, so a container that ends meanwhile is restarted only after
:meth:`~ProcessKubelet.heal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from stalwart.local.apiserver import podlife
from stalwart.local.apiserver.objects import ApiError, Event, ObjectStore, now_rfc3339
from stalwart.local.containerbook import BOOK, ContainerBook
from stalwart.local.fit import NodeFit, rejection
from stalwart.local.netns import NodeNetwork, hosts_text
from stalwart.local.netplan import Cut
from stalwart.local.nodes import NodeAgents, NodeState
from stalwart.local.podenv import PodEnvironment
from stalwart.local.podlogs import pod_dir, stream_logs
from stalwart.local.podruns import PodRuns
from stalwart.local.pods import ContainerRun, PodRun, had_started, pod_status, unknown_termination
from stalwart.local.podworker import PodWorker, current_pod
from stalwart.local.recorder import record_event
from stalwart.local.scheduler import holds_resources
from stalwart.local.settings import LocalClusterSettings

log = logging.getLogger(__name__)
JSON = dict[str, Any]
#: The grace a container gets when its pod left the API without the kubelet stopping it (kubelet's minimum).
MINIMUM_GRACE = 2.0


def graceful_deletion(pod: JSON) -> bool:
    """kube-apiserver's rule: a pod bound to a node and not finished is deleted gracefully (it is Terminating
    until its kubelet confirms); others go at once."""
    return bool((pod.get("spec") or {}).get("nodeName")) and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


class ProcessKubelet:
    """Runs the pods of the virtual nodes ``nodes`` from ``store`` as local processes under ``workdir``."""

    def __init__(self, store: ObjectStore, workdir: Path, nodes: list[str], *, api_port: int = 0,
                 settings: LocalClusterSettings | None = None, backoff: tuple[float, float] = (1.0, 20.0),
                 network: NodeNetwork | None = None) -> None:
        self.store = store
        self.workdir = workdir
        self.settings = settings or LocalClusterSettings()
        self.network = network
        ips = {n: network.plan.node_ip(n) for n in nodes} if network else {}
        self.node_agents = NodeAgents(store, nodes, self.settings, ips)
        self.env = PodEnvironment(store, workdir, api_port, network.plan.api_ip if network else "127.0.0.1")
        self.backoff = backoff
        self.runs = PodRuns(book=ContainerBook(workdir / BOOK), network=network)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.pods_info = store.info("", "v1", "pods")
        store.listeners.append(self._on_event)
        store.graceful_pods = graceful_deletion

    @property
    def nodes(self) -> dict[str, NodeState]:
        return self.node_agents.state

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.node_agents.register()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every pod (paused ones are resumed first) and the reconcile loop."""
        self._closing = True
        await self.runs.shutdown(grace, [r for r in self.runs if self.nodes.get(r.node) == NodeState.PARTITIONED])
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _on_event(self, ev: Event) -> None:
        if ev.group == "" and ev.plural in ("pods", "secrets", "configmaps"):
            self._wake.set()

    # --- node loss ---------------------------------------------------------------------------------------------

    async def lose_node(self, name: str, *, partition: bool = False) -> list[str]:
        """Lose node ``name`` (see the module docstring); returns the ``namespace/name`` of the pods it ran."""
        self.node_agents.check(name)
        lost = self.runs.on(name)
        if partition and self.nodes[name] != NodeState.DOWN:
            self.node_agents.set_state(name, NodeState.PARTITIONED)
            paused = await self.runs.pause(lost)
            log.warning("node %s partitioned: %d process(es) of %d pod(s) paused", name, len(paused), len(lost))
        elif not partition:
            self.node_agents.set_state(name, NodeState.DOWN)
            await self.runs.kill(lost)
            log.warning("node %s lost: the processes of %d pod(s) killed", name, len(lost))
        return [f"{r.namespace}/{r.name}" for r in lost]

    async def restore_node(self, name: str) -> None:
        """Bring node ``name`` back: its paused processes resume, its kubelet reports again (unless its network is
        still cut from the API server: then it stays ``cut`` until healed)."""
        self.node_agents.check(name)
        before = self.nodes[name]
        if before in (NodeState.UP, NodeState.CUT):
            return
        if before == NodeState.PARTITIONED:
            await self.runs.resume(self.runs.on(name))
        if self.network is not None and self.network.cut_from_api(name):
            self.node_agents.set_state(name, NodeState.CUT)
            log.info("node %s is back (it was %s), its network still cut from the API server", name, before)
            return
        self._reporting_again(name, before)

    def _reporting_again(self, name: str, before: NodeState) -> None:
        self.node_agents.set_state(name, NodeState.UP)
        self.node_agents.post_status(name)
        for run in self.runs.on(name):
            self._write_pod_status(run)
        log.info("node %s is back (it was %s)", name, before)
        self._wake.set()

    # --- network faults ----------------------------------------------------------------------------------------

    def _network(self) -> NodeNetwork:
        if self.network is None:
            raise LookupError("network faults need a network per node, and this cluster runs every pod on "
                              "loopback (network mode loopback: see stalwart local status)")
        return self.network

    def partition(self, cut: Cut) -> list[str]:
        """Put ``cut`` in force on its node (see the module docstring); returns the ``namespace/name`` of the pods
        it runs. KeyError for a node that is not one; LookupError without a network per node."""
        self.node_agents.check(cut.node)
        network = self._network()
        network.partition(cut)
        if cut.cuts("api") and self.nodes[cut.node] == NodeState.UP:
            self.node_agents.set_state(cut.node, NodeState.CUT)
        elif not cut.cuts("api") and self.nodes[cut.node] == NodeState.CUT:
            self._reporting_again(cut.node, NodeState.CUT)
        log.warning("node %s cut from %s; its processes run on", cut.node, cut.describe())
        return [f"{r.namespace}/{r.name}" for r in self.runs.on(cut.node)]

    def heal(self, name: str) -> Cut:
        """End the network cut of node ``name``; returns the cut it was. KeyError for a node that is not one;
        LookupError without a network per node or when the node is not cut."""
        self.node_agents.check(name)
        network = self._network()
        if name not in network.cuts:
            raise LookupError(f"node {name!r} is not partitioned (cut nodes: {sorted(network.cuts) or 'none'})")
        cut = network.heal(name)
        if self.nodes[name] == NodeState.CUT:
            self._reporting_again(name, NodeState.CUT)
        log.info("node %s healed (it was cut from %s)", name, cut.describe())
        return cut

    # --- reconcile ---------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while not self._closing:
            self._wake.clear()
            try:
                self._reconcile()
            except Exception:
                log.exception("kubelet reconcile failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    def _reconcile(self) -> None:
        pods, _ = self.store.list_objects(self.pods_info, None)
        present = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        for run in self.runs:
            if not self.node_agents.up(run.node):
                continue  # a lost node's kubelet sees nothing
            pod = present.get(run.key)
            if (pod is None or pod["metadata"]["uid"] != run.uid) and not run.stopping:
                log.info("pod %s/%s left the API: stopping its containers", *run.key)
                self.runs.spawn(self.runs.stop(run, MINIMUM_GRACE))
        for key, pod in present.items():
            meta, spec = pod["metadata"], pod.get("spec") or {}
            node = spec.get("nodeName")
            if not node or not self.node_agents.up(node):
                continue
            current = self.runs.get(key)
            if meta.get("deletionTimestamp"):
                if current is not None and current.uid == meta["uid"]:
                    if not current.stopping:
                        current.stopping = True
                        self.runs.spawn(self._stop_and_finish(current, float(meta.get("deletionGracePeriodSeconds")
                                                                             or 0)))
                elif current is None:
                    podlife.finish_pod(self.store, *key)
                continue
            if current is not None or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            if self._admit(pod, node, pods):
                self._start(pod, node)

    def _admit(self, pod: JSON, node: str, pods: list[JSON]) -> bool:
        """The kubelet's resource check; a pod that does not fit is Failed with ``OutOf<resource>``."""
        try:
            node_obj = self.store.get(self.store.info("", "v1", "nodes"), "", node)
        except ApiError:
            return False
        uid = pod["metadata"]["uid"]
        others = [p.get("spec") or {} for p in pods if holds_resources(p) and p["spec"]["nodeName"] == node
                  and p["metadata"]["uid"] != uid]
        rejected = rejection(pod.get("spec") or {}, NodeFit.of(node_obj, others))
        if rejected is None:
            return True
        reason, message = rejected
        pod["status"] = {**(pod.get("status") or {}), "phase": "Failed", "reason": reason, "message": message}
        with contextlib.suppress(ApiError):
            self.store.update(self.pods_info, pod["metadata"]["namespace"], pod["metadata"]["name"], pod, "status")
        record_event(self.store, pod, "Warning", reason, message, component="kubelet")
        return False

    def _start(self, pod: JSON, node: str) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        directory = pod_dir(self.workdir, meta["namespace"], meta["name"], meta["uid"])
        directory.mkdir(parents=True, exist_ok=True)
        ip = self.runs.free_ip((pod.get("status") or {}).get("podIP") if had_started(pod) else None, node)
        run = PodRun(meta["namespace"], meta["name"], meta["uid"], node, ip, directory,
                     [ContainerRun(c) for c in spec.get("containers") or []],
                     [ContainerRun(c, init=True) for c in spec.get("initContainers") or []],
                     grace=float(spec.get("terminationGracePeriodSeconds", 30)))
        if self.network is not None:
            # As a kubelet does: the hostname is spec.hostname else the pod's name, and /etc/hosts names it at
            # the pod's IP.
            hostname = str(spec.get("hostname") or meta["name"])[:63]
            hosts = directory / "etc-hosts"
            hosts.write_text(hosts_text(ip, hostname))
            run.host_ip = self.network.plan.node_ip(node)
            run.enter = self.network.enter(node, hostname, hosts)
        self.runs.add(run)
        if had_started(pod) and not self._resume_after_node_loss(run, pod, spec):
            return
        worker = PodWorker(run, spec, store=self.store, env=self.env, backoff=self.backoff,
                           reachable=self.node_agents.reachable[node],
                           report=lambda **kw: self._write_pod_status(run, **kw), spawn=self.runs.spawn,
                           book=self.runs.book, stop=self.runs.stop_container)
        run.task = asyncio.get_running_loop().create_task(worker.main())

    def _resume_after_node_loss(self, run: PodRun, pod: JSON, spec: JSON) -> bool:
        """A pod whose containers ran before its node went down: carry its restart counts on; with
        restartPolicy Never it is over (returns False: nothing to run)."""
        previous = {s.get("name"): s for s in (pod.get("status") or {}).get("containerStatuses") or []}
        never = spec.get("restartPolicy", "Always") == "Never"
        run.initialized = True
        for c in run.containers:
            c.last_state = unknown_termination()
            c.restarts = int((previous.get(c.name) or {}).get("restartCount") or 0) + (0 if never else 1)
            if never:
                c.state, c.done = dict(c.last_state), True
        for c in run.inits:
            c.done = True
        if never:
            self._write_pod_status(run)
            run.stopped.set()
            return False
        return True

    # --- stopping ----------------------------------------------------------------------------------------------

    async def _stop_and_finish(self, run: PodRun, grace: float) -> None:
        pod = current_pod(self.store, run)
        if pod is not None:
            record_event(self.store, pod, "Normal", "Killing", f"Stopping containers (grace period {grace:g}s)",
                         component="kubelet")
        await self.runs.stop(run, grace)
        for c in run.containers:
            if "running" in c.state or "waiting" in c.state:
                c.state = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": now_rfc3339()}}
        with contextlib.suppress(ApiError):
            self._write_pod_status(run)
        if self.node_agents.up(run.node):
            podlife.finish_pod(self.store, run.namespace, run.name)
        self._wake.set()

    # --- status ------------------------------------------------------------------------------------------------

    def _write_pod_status(self, run: PodRun, phase: str | None = None, reason: str | None = None,
                          message: str | None = None) -> None:
        """Report the pod's status, unless its node is cut off (then nobody hears it)."""
        if not self.node_agents.up(run.node):
            return
        pod = current_pod(self.store, run)
        if pod is None:
            return
        pod["status"] = pod_status(run, pod, phase, reason, message)
        with contextlib.suppress(ApiError):
            self.store.update(self.pods_info, run.namespace, run.name, pod, "status")

    # --- logs --------------------------------------------------------------------------------------------------

    async def logs(self, namespace: str, name: str, container: str | None, *, follow: bool,
                   tail_lines: int | None, previous: bool, limit_bytes: int | None) -> AsyncIterator[bytes]:
        """The container's log, as ``kubectl logs`` reads it (``follow`` streams until the container stops)."""
        pod = self.store.get(self.pods_info, namespace, name)
        uid = pod["metadata"]["uid"]
        path = pod_dir(self.workdir, namespace, name, uid) / (
            f"{container}.previous.log" if previous else f"{container}.log")
        async for chunk in stream_logs(path, self.runs.by_key, (namespace, name), uid, container, follow=follow,
                                       tail_lines=tail_lines, previous=previous, limit_bytes=limit_bytes):
            yield chunk
