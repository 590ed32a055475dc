"""The process kubelet of the local cluster: it schedules pending pods onto its virtual nodes and runs each
container's ``command`` + ``args`` as a local process.

Contract, per pod:
- Binding: a pod without ``spec.nodeName`` goes to the Ready, schedulable node with the fewest pods among those
  matching its ``nodeSelector`` whose NoSchedule/NoExecute taints it tolerates; a pod naming a node is run there
  if that node is Ready.
- Each pod gets its own loopback address 127.0.x.y as ``status.podIP`` (Linux routes all of 127/8 to ``lo``),
  and a directory ``<workdir>/pods/<namespace>_<name>_<uid>/`` that is the default working directory and holds
  the container logs (``<container>.log``, the previous instance's as ``<container>.previous.log``).
- Environment: a small base (PATH with this interpreter's directory first, HOME, LANG, HOSTNAME, the API server
  address as ``KUBERNETES_SERVICE_HOST/PORT``), then ``envFrom`` and ``env`` in order: ``value`` (with ``$(VAR)``
  expansion), ``valueFrom.secretKeyRef``, ``configMapKeyRef``, ``fieldRef`` (metadata.name/namespace/uid/labels/
  annotations, spec.nodeName, spec.serviceAccountName, status.podIP/hostIP). A missing secret or config map
  keeps the container waiting with ``CreateContainerConfigError`` until it appears.
- The image is recorded and ignored; a container without ``command`` cannot run (there is no image entrypoint)
  and terminates with reason ``ContainerCannotRun``. Volumes are not mounted.
- Init containers run one by one before the containers; each container is restarted per ``restartPolicy`` with
  an exponential back-off (``CrashLoopBackOff`` while waiting). Status: phase, the PodScheduled, Initialized,
  ContainersReady and Ready conditions (a container is ready while it runs and passes its readiness probe:
  exec, tcpSocket or httpGet; a failing liveness probe restarts it), container statuses with state, last state,
  exit code, signal and restart count.
- Deletion: SIGTERM to each container's process group, SIGKILL after the grace period, then the pod is removed.
- :meth:`ProcessKubelet.lose_node` simulates losing a node: its processes are killed at once, its pods become
  Failed with reason ``NodeLost``, the node turns NotReady with the ``unreachable`` taint; a pod deleted there is
  removed at once (there is no kubelet left to wait for). :meth:`restore_node` makes it Ready again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import ctypes
import logging
import os
import re
import shutil
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from stalwart.local.apiserver.objects import ApiError, Event, ObjectStore, now_rfc3339

log = logging.getLogger(__name__)
JSON = dict[str, Any]
_PASSTHROUGH = ("LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "STALWART_ETCD_BIN")
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class ConfigError(Exception):
    """A container's environment cannot be built yet (a missing secret, config map or key)."""


def _pdeathsig() -> None:
    """In the child: die with the kubelet, so no container outlives a crashed control plane."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# Environment markers: they let the kubelet find every process of a container, including those that left its
# process group (a container runtime would use the container's cgroup).
POD_MARKER = "STALWART_LOCAL_POD_UID"
CONTAINER_MARKER = "STALWART_LOCAL_CONTAINER"
CLUSTER_MARKER = "STALWART_LOCAL_CLUSTER"


def marked_pids(name: str, value: str) -> list[int]:
    """Processes whose environment has ``name=value`` (those of other users are not readable: skipped)."""
    needle = f"{name}={value}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry.name))
    return out


def signal_marked(name: str, value: str, sig: int) -> int:
    """Send ``sig`` to every process marked ``name=value``; return how many were signalled."""
    n = 0
    for pid in marked_pids(name, value):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            n += 1
    return n


def tolerated(taint: JSON, tolerations: list[JSON]) -> bool:
    """Whether a pod with ``tolerations`` tolerates ``taint`` (key, operator Equal/Exists, value, effect)."""
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _open_log(cwd: Path, log: Path) -> BinaryIO:
    """Create the working directory and open the container's log for appending (the child inherits it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return open(log, "ab")  # handed to the child process, closed by the caller


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: known variables are replaced, ``$$(VAR)`` escapes, unknown stay."""
    out = re.sub(r"\$\$\(", "\0(", text)
    out = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), out)
    return out.replace("\0(", "$(")


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
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    initialized: bool = False
    start_time: str = field(default_factory=now_rfc3339)


class ProcessKubelet:
    """Runs the pods of ``nodes`` (virtual node names) from ``store`` as local processes under ``workdir``."""

    def __init__(self, store: ObjectStore, workdir: Path, nodes: list[str], *, api_port: int = 0,
                 backoff: tuple[float, float] = (1.0, 20.0)) -> None:
        self.store = store
        self.workdir = workdir
        self.nodes: dict[str, bool] = dict.fromkeys(nodes, True)  # name -> Ready
        self.api_port = api_port
        self.backoff = backoff
        self.runs: dict[tuple[str, str], PodRun] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_ip = 2
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.pods_info = store.info("", "v1", "pods")
        store.listeners.append(self._on_event)
        store.graceful_pods = self._runs_gracefully

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        info = self.store.info("", "v1", "nodes")
        for name in self.nodes:
            with contextlib.suppress(ApiError):
                self.store.create(info, "", {"metadata": {"name": name, "labels": {
                    "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "stalwart.dev/local-node": "true"}}})
            self._write_node_status(name)
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop every pod (SIGTERM, then SIGKILL after ``grace``) and the reconcile loop."""
        self._closing = True
        await asyncio.gather(*(self._stop_run(r, grace) for r in list(self.runs.values())),
                             return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background step, keeping a reference until it ends (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_event(self, ev: Event) -> None:
        if ev.group == "" and ev.plural in ("pods", "secrets", "configmaps"):
            self._wake.set()

    def _runs_gracefully(self, pod: JSON) -> bool:
        node = (pod.get("spec") or {}).get("nodeName")
        key = (pod["metadata"].get("namespace", ""), pod["metadata"]["name"])
        return bool(node and self.nodes.get(node) and key in self.runs)

    # --- nodes -------------------------------------------------------------------------------------------------

    def _write_node_status(self, name: str) -> None:
        info = self.store.info("", "v1", "nodes")
        try:
            node = self.store.get(info, "", name)
        except ApiError:
            return
        ready = self.nodes.get(name, False)
        now = now_rfc3339()
        node["status"] = {
            "conditions": [{"type": "Ready", "status": "True" if ready else "Unknown",
                            "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                            "message": "local process kubelet is posting ready status" if ready
                            else "Kubelet stopped posting node status.",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": name}],
            "nodeInfo": {"kubeletVersion": "v1.37.0-stalwart.local", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "process://local"},
            "capacity": {"cpu": str(os.cpu_count() or 1), "pods": "110"},
            "allocatable": {"cpu": str(os.cpu_count() or 1), "pods": "110"},
        }
        spec = node.setdefault("spec", {})
        taints = [t for t in spec.get("taints") or [] if t.get("key") != "node.kubernetes.io/unreachable"]
        if not ready:
            taints.append({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": now})
        if taints:
            spec["taints"] = taints
        else:
            spec.pop("taints", None)
        self.store.update(info, "", name, node)
        self.store.update(info, "", name, {**node, "metadata": self.store.get(info, "", name)["metadata"]},
                          "status")

    async def lose_node(self, name: str) -> list[str]:
        """Simulate losing node ``name``; returns the ``namespace/name`` of the pods that failed with it."""
        if name not in self.nodes:
            raise KeyError(f"no node {name!r}; nodes are {sorted(self.nodes)}")
        log.warning("node %s lost: killing its pods' processes", name)
        self.nodes[name] = False
        self._write_node_status(name)
        lost = [r for r in self.runs.values() if r.node == name]
        for run in lost:
            run.stopping = True
            for c in run.inits + run.containers:
                if c.proc is not None and c.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(c.proc.pid, signal.SIGKILL)
            signal_marked(POD_MARKER, run.uid, signal.SIGKILL)
        for run in lost:
            if run.task is not None:
                run.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run.task
            for c in run.inits + run.containers:
                if c.proc is not None:
                    with contextlib.suppress(Exception):
                        await c.proc.wait()
                if "running" in c.state or "waiting" in c.state:
                    c.state = {"terminated": {"exitCode": 137, "reason": "NodeLost", "signal": 9,
                                              "finishedAt": now_rfc3339()}}
            self._write_pod_status(run, phase="Failed", reason="NodeLost",
                                   message=f"Node {name} which was running pod {run.name} is unresponsive")
            self.runs.pop((run.namespace, run.name), None)
            run.stopped.set()
        # Pods being deleted there have nobody left to wait for.
        for pod in self._pods():
            if (pod.get("spec") or {}).get("nodeName") == name and pod["metadata"].get("deletionTimestamp"):
                self.store.finish_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._wake.set()
        return [f"{r.namespace}/{r.name}" for r in lost]

    def restore_node(self, name: str) -> None:
        if name not in self.nodes:
            raise KeyError(f"no node {name!r}; nodes are {sorted(self.nodes)}")
        self.nodes[name] = True
        self._write_node_status(name)
        self._wake.set()

    # --- reconcile ---------------------------------------------------------------------------------------------

    def _pods(self) -> list[JSON]:
        items, _ = self.store.list_objects(self.pods_info, None)
        return items

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
        pods = self._pods()
        present = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in pods}
        for key, run in list(self.runs.items()):
            pod = present.get(key)
            gone = pod is None or pod["metadata"]["uid"] != run.uid
            if gone and not run.stopping:  # removed without grace (force delete): stop at once
                self._spawn(self._stop_run(run, 0.0))
        for key, pod in present.items():
            meta, spec = pod["metadata"], pod.get("spec") or {}
            current = self.runs.get(key)
            if meta.get("deletionTimestamp"):
                if current is not None and current.uid == meta["uid"]:
                    if not current.stopping:
                        current.stopping = True
                        grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                        self._spawn(self._stop_and_finish(current, grace))
                elif current is None and not self._runs_gracefully(pod):
                    self.store.finish_pod(*key)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") or current is not None:
                continue
            node = spec.get("nodeName")
            if not node:
                node = self._schedule(pod)
                if node is None:
                    continue
                pod["spec"]["nodeName"] = node
                self.store.update(self.pods_info, key[0], key[1], pod)
                self._set_condition(key, "PodScheduled", "True")
                self._event(pod, "Normal", "Scheduled", f"Successfully assigned {key[0]}/{key[1]} to {node}")
            if self.nodes.get(node):
                self._start(self.store.get(self.pods_info, *key), node)

    def _schedule(self, pod: JSON) -> str | None:
        selector = (pod.get("spec") or {}).get("nodeSelector") or {}
        info = self.store.info("", "v1", "nodes")
        load = {n: 0 for n, ready in self.nodes.items() if ready}
        for r in self.runs.values():
            if r.node in load:
                load[r.node] += 1
        tolerations = (pod.get("spec") or {}).get("tolerations") or []
        candidates = []
        for name in load:
            try:
                node = self.store.get(info, "", name)
            except ApiError:
                continue
            labels = node["metadata"].get("labels") or {}
            spec = node.get("spec") or {}
            if spec.get("unschedulable") or not all(labels.get(k) == v for k, v in selector.items()):
                continue
            if all(tolerated(t, tolerations) for t in spec.get("taints") or []
                   if t.get("effect") in ("NoSchedule", "NoExecute")):
                candidates.append(name)
        return min(candidates, key=lambda n: (load[n], n)) if candidates else None

    def _alloc_ip(self) -> str:
        used = {r.ip for r in self.runs.values()}
        while True:
            n = self._next_ip
            self._next_ip = 2 if self._next_ip >= 65000 else self._next_ip + 1
            ip = f"127.0.{n // 256}.{n % 256}"
            if n % 256 in (0, 1, 255) or ip in used:
                continue
            return ip

    def _start(self, pod: JSON, node: str) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        pod_dir = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        run = PodRun(meta["namespace"], meta["name"], meta["uid"], node, self._alloc_ip(), pod_dir,
                     [ContainerRun(c) for c in spec.get("containers") or []],
                     [ContainerRun(c, init=True) for c in spec.get("initContainers") or []])
        self.runs[(run.namespace, run.name)] = run
        run.task = asyncio.get_running_loop().create_task(self._run_pod(run, spec))

    # --- running a pod -----------------------------------------------------------------------------------------

    async def _run_pod(self, run: PodRun, spec: JSON) -> None:
        policy = spec.get("restartPolicy", "Always")
        self._write_pod_status(run)
        try:
            for c in run.inits:
                while True:
                    code = await self._run_once(run, c)
                    if run.stopping:
                        return
                    if code == 0:
                        c.done = True
                        break
                    if policy == "Never":
                        c.done = True
                        self._write_pod_status(run, phase="Failed")
                        return
                    await self._backoff(run, c)
            run.initialized = True
            await asyncio.gather(*(self._supervise(run, c, policy) for c in run.containers))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s: kubelet error", run.namespace, run.name)
        finally:
            run.stopped.set()

    async def _supervise(self, run: PodRun, c: ContainerRun, policy: str) -> None:
        while not run.stopping:
            code = await self._run_once(run, c)
            if run.stopping:
                return
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                c.done = True
                self._write_pod_status(run)
                return
            await self._backoff(run, c)

    async def _backoff(self, run: PodRun, c: ContainerRun) -> None:
        delay = min(self.backoff[0] * (2 ** c.restarts), self.backoff[1])
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off {delay:g}s restarting failed container={c.name} "
                                          f"pod={run.name}_{run.namespace}({run.uid})"}}
        self._write_pod_status(run)
        await asyncio.sleep(delay)
        c.restarts += 1

    async def _run_once(self, run: PodRun, c: ContainerRun) -> int:
        """Start one instance of a container and wait for it; return its exit code."""
        pod = self._get_pod(run)
        if pod is None:
            return 0
        while True:
            try:
                env = self._environment(pod, run, c.spec)
                break
            except ConfigError as exc:
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self._write_pod_status(run)
                await asyncio.sleep(1.0)
                if run.stopping:
                    return 0
                pod = self._get_pod(run) or pod
        argv = [expand(str(a), env) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        logf = run.dir / f"{c.name}.log"
        if c.last_state and logf.exists():
            with contextlib.suppress(OSError):
                shutil.move(str(logf), str(run.dir / f"{c.name}.previous.log"))
        started = now_rfc3339()
        if not c.spec.get("command"):
            return self._cannot_run(run, c, started, "the local kubelet runs a container's command; images have "
                                                     "no entrypoint here, so set command")
        cwd = Path(c.spec.get("workingDir") or run.dir)
        try:
            out = await asyncio.to_thread(_open_log, cwd, logf)
            try:
                c.proc = await asyncio.create_subprocess_exec(
                    *argv, env=env, cwd=str(cwd), stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_pdeathsig)
            finally:
                out.close()
        except OSError as exc:
            return self._cannot_run(run, c, started, f"starting {argv[0]!r}: {exc}")
        c.state = {"running": {"startedAt": started}}
        c.ready = not c.init and "readinessProbe" not in c.spec
        log.info("pod %s/%s on %s (%s): container %s started, pid %d, restarts %d", run.namespace, run.name,
                 run.node, run.ip, c.name, c.proc.pid, c.restarts)
        self._event(pod, "Normal", "Started", f"Started container {c.name}")
        self._write_pod_status(run)
        probes = [asyncio.get_running_loop().create_task(self._probe(run, c, kind, env, cwd))
                  for kind in ("readinessProbe", "livenessProbe") if not c.init and kind in c.spec]
        try:
            code = await c.proc.wait()
        finally:
            for task in probes:
                task.cancel()
            for task in probes:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        c.ready = False
        # The container is over when its main process is: whatever it left running goes with it.
        await asyncio.to_thread(signal_marked, CONTAINER_MARKER, f"{run.uid}/{c.name}", signal.SIGKILL)
        term: JSON = {"exitCode": code if code >= 0 else 128 - code, "startedAt": started,
                      "finishedAt": now_rfc3339(), "containerID": f"process://{c.proc.pid}"}
        if code < 0:
            term["signal"] = -code
        term["reason"] = "Completed" if code == 0 else "Error"
        c.last_state = {"terminated": term}
        c.state = {"terminated": term}
        log.info("pod %s/%s: container %s exited with %s", run.namespace, run.name, c.name, term["exitCode"])
        self._write_pod_status(run)
        return int(term["exitCode"])

    async def _probe(self, run: PodRun, c: ContainerRun, kind: str, env: dict[str, str], cwd: Path) -> None:
        """Run a readiness or liveness probe (exec, tcpSocket or httpGet) while the container runs. Readiness
        sets ``c.ready``; a liveness failure past the threshold kills the container (it restarts per policy)."""
        spec = c.spec[kind]
        period = float(spec.get("periodSeconds", 10))
        failures_allowed = int(spec.get("failureThreshold", 3))
        successes_needed = int(spec.get("successThreshold", 1))
        await asyncio.sleep(float(spec.get("initialDelaySeconds", 0)))
        fails = oks = 0
        while c.proc is not None and c.proc.returncode is None:
            ok = await self._probe_once(run, c, spec, env, cwd)
            fails, oks = (0, oks + 1) if ok else (fails + 1, 0)
            if kind == "readinessProbe":
                ready = c.ready
                if ok and oks >= successes_needed:
                    ready = True
                elif not ok and fails >= failures_allowed:
                    ready = False
                if ready != c.ready:
                    c.ready = ready
                    self._write_pod_status(run)
            elif fails >= failures_allowed:
                pod = self._get_pod(run)
                if pod is not None:
                    self._event(pod, "Warning", "Unhealthy", f"Liveness probe failed; restarting {c.name}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                return
            await asyncio.sleep(period)

    async def _probe_once(self, run: PodRun, c: ContainerRun, spec: JSON, env: dict[str, str], cwd: Path) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        def port_of(value: Any) -> int:
            if isinstance(value, int):
                return value
            for p in c.spec.get("ports") or []:
                if p.get("name") == value:
                    return int(p["containerPort"])
            return int(value)

        try:
            if "exec" in spec:
                proc = await asyncio.create_subprocess_exec(
                    *[str(a) for a in spec["exec"].get("command") or []], env=env, cwd=str(cwd),
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
                try:
                    return await asyncio.wait_for(proc.wait(), timeout) == 0
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
                    return False
            if "tcpSocket" in spec:
                host = spec["tcpSocket"].get("host") or run.ip
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port_of(spec["tcpSocket"].get("port"))), timeout)
                writer.close()
                return True
            if "httpGet" in spec:
                import aiohttp

                http = spec["httpGet"]
                url = (f"{str(http.get('scheme', 'HTTP')).lower()}://{http.get('host') or run.ip}:"
                       f"{port_of(http.get('port'))}{http.get('path', '/')}")
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                        session.get(url, headers={h["name"]: h["value"] for h in http.get("httpHeaders") or []}) \
                        as resp:
                    return 200 <= resp.status < 400
        except (OSError, TimeoutError, ValueError):
            return False
        except Exception as exc:  # an aiohttp client error is a failed probe, like any other
            log.debug("probe of %s/%s %s failed: %r", run.namespace, run.name, c.name, exc)
            return False
        return False

    def _cannot_run(self, run: PodRun, c: ContainerRun, started: str, message: str) -> int:
        term = {"exitCode": 128, "reason": "ContainerCannotRun", "message": message, "startedAt": started,
                "finishedAt": now_rfc3339()}
        c.state = {"terminated": term}
        c.last_state = {"terminated": term}
        self._write_pod_status(run)
        return 128

    def _get_pod(self, run: PodRun) -> JSON | None:
        try:
            pod = self.store.get(self.pods_info, run.namespace, run.name)
        except ApiError:
            return None
        return pod if pod["metadata"]["uid"] == run.uid else None

    async def _stop_run(self, run: PodRun, grace: float) -> None:
        run.stopping = True
        procs = [c.proc for c in run.inits + run.containers if c.proc is not None and c.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        await asyncio.to_thread(signal_marked, POD_MARKER, run.uid, signal.SIGTERM)
        if procs:
            try:
                await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), max(grace, 0.0) or 0.01)
            except TimeoutError:
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                await asyncio.gather(*(p.wait() for p in procs))
        # Whatever the containers left behind, in their process groups or elsewhere, goes too.
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        await asyncio.to_thread(signal_marked, POD_MARKER, run.uid, signal.SIGKILL)
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run.task
        self.runs.pop((run.namespace, run.name), None)
        run.stopped.set()

    async def _stop_and_finish(self, run: PodRun, grace: float) -> None:
        pod = self._get_pod(run)
        if pod is not None:
            self._event(pod, "Normal", "Killing", f"Stopping containers (grace period {grace:g}s)")
        await self._stop_run(run, grace)
        for c in run.containers:
            if "running" in c.state or "waiting" in c.state:
                c.state = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": now_rfc3339()}}
        with contextlib.suppress(ApiError):
            self._write_pod_status(run)
        self.store.finish_pod(run.namespace, run.name)
        self._wake.set()

    # --- environment -------------------------------------------------------------------------------------------

    def _environment(self, pod: JSON, run: PodRun, container: JSON) -> dict[str, str]:
        meta = pod["metadata"]
        bindir = str(Path(sys.executable).parent)
        env: dict[str, str] = {
            "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
            "HOME": os.environ.get("HOME", str(run.dir)),
            "HOSTNAME": meta["name"],
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.api_port),
            POD_MARKER: run.uid,
            CONTAINER_MARKER: f"{run.uid}/{container.get('name', '')}",
            CLUSTER_MARKER: str(self.workdir.resolve()),
        }
        for k in _PASSTHROUGH:
            if k in os.environ:
                env[k] = os.environ[k]
        ns = meta["namespace"]
        for src in container.get("envFrom") or []:
            prefix = str(src.get("prefix") or "")
            if "configMapRef" in src:
                data = self._config(ns, "configmaps", src["configMapRef"], None)
            else:
                data = self._config(ns, "secrets", src.get("secretRef") or {}, None)
            for k, v in data.items():
                env[prefix + k] = v
        for item in container.get("env") or []:
            name = str(item.get("name"))
            if "value" in item:
                env[name] = expand(str(item["value"]), env)
                continue
            vf = item.get("valueFrom") or {}
            if "secretKeyRef" in vf:
                val = self._config(ns, "secrets", vf["secretKeyRef"], vf["secretKeyRef"].get("key"))
            elif "configMapKeyRef" in vf:
                val = self._config(ns, "configmaps", vf["configMapKeyRef"], vf["configMapKeyRef"].get("key"))
            elif "fieldRef" in vf:
                val = {"": self._field(pod, run, str(vf["fieldRef"].get("fieldPath", "")))}
            elif "resourceFieldRef" in vf:
                val = {"": "0"}
            else:
                val = {"": ""}
            if val:
                env[name] = next(iter(val.values()))
        return env

    def _config(self, namespace: str, plural: str, ref: JSON, key: str | None) -> dict[str, str]:
        optional = bool(ref.get("optional"))
        kind = "secret" if plural == "secrets" else "configmap"
        try:
            obj = self.store.get(self.store.info("", "v1", plural), namespace, str(ref.get("name")))
        except ApiError:
            if optional:
                return {}
            raise ConfigError(f'{kind} "{ref.get("name")}" not found') from None
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode("utf-8", "replace") for k, v in (obj.get("data") or {}).items()}
        else:
            data = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if key is None:
            return data
        if key not in data:
            if optional:
                return {}
            raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref.get('name')}")
        return {key: data[key]}

    def _field(self, pod: JSON, run: PodRun, path: str) -> str:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta["uid"], "spec.nodeName": run.node,
                  "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
                  "status.podIP": run.ip, "status.podIPs": run.ip, "status.hostIP": "127.0.0.1",
                  "status.hostIPs": "127.0.0.1"}
        if path not in values:
            raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
        return str(values[path])

    # --- status ------------------------------------------------------------------------------------------------

    def _container_status(self, c: ContainerRun, image: str) -> JSON:
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

    def _write_pod_status(self, run: PodRun, phase: str | None = None, reason: str | None = None,
                          message: str | None = None) -> None:
        pod = self._get_pod(run)
        if pod is None:
            return
        cs = run.containers
        if phase is None:
            if cs and all(c.done for c in cs):
                phase = "Succeeded" if all(
                    (c.state.get("terminated") or {}).get("exitCode") == 0 for c in cs) else "Failed"
            elif run.initialized and all("waiting" not in c.state or c.restarts > 0 or c.last_state for c in cs):
                phase = "Running"
            else:
                phase = "Pending"
        ready = phase == "Running" and all("running" in c.state and c.ready for c in cs)
        images = {c.get("name"): c.get("image", "") for c in
                  ((pod.get("spec") or {}).get("containers") or []) + ((pod.get("spec") or {}).get("initContainers")
                                                                       or [])}
        old = pod.get("status") or {}
        now = now_rfc3339()

        def cond(type_: str, ok: bool) -> JSON:
            status = "True" if ok else "False"
            prev = next((x for x in old.get("conditions") or [] if x.get("type") == type_), None)
            since = prev["lastTransitionTime"] if prev and prev.get("status") == status else now
            return {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": since}

        status: JSON = {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": run.ip,
            "podIPs": [{"ip": run.ip}], "startTime": run.start_time, "qosClass": old.get("qosClass", "BestEffort"),
            "conditions": [cond("PodReadyToStartContainers", True), cond("Initialized", run.initialized),
                           cond("Ready", ready), cond("ContainersReady", ready), cond("PodScheduled", True)],
            "containerStatuses": [self._container_status(c, str(images.get(c.name, ""))) for c in cs],
        }
        if run.inits:
            status["initContainerStatuses"] = [self._container_status(c, str(images.get(c.name, "")))
                                               for c in run.inits]
        if reason:
            status["reason"] = reason
        if message:
            status["message"] = message
        pod["status"] = status
        with contextlib.suppress(ApiError):
            self.store.update(self.pods_info, run.namespace, run.name, pod, "status")

    def _set_condition(self, key: tuple[str, str], type_: str, value: str) -> None:
        pod = self.store.get(self.pods_info, *key)
        status = pod.setdefault("status", {})
        conds = [c for c in status.get("conditions") or [] if c.get("type") != type_]
        conds.append({"type": type_, "status": value, "lastProbeTime": None, "lastTransitionTime": now_rfc3339()})
        status["conditions"] = conds
        self.store.update(self.pods_info, key[0], key[1], pod, "status")

    def _event(self, obj: JSON, type_: str, reason: str, message: str) -> None:
        meta = obj["metadata"]
        now = now_rfc3339()
        event = {"metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": meta["namespace"]},
                 "involvedObject": {"kind": obj.get("kind", "Pod"), "apiVersion": obj.get("apiVersion", "v1"),
                                    "name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
                 "reason": reason, "message": message, "type": type_, "count": 1, "firstTimestamp": now,
                 "lastTimestamp": now, "source": {"component": "kubelet"}, "reportingComponent": "kubelet"}
        with contextlib.suppress(ApiError):
            self.store.create(self.store.info("", "v1", "events"), meta["namespace"], event)

    # --- logs --------------------------------------------------------------------------------------------------

    async def logs(self, namespace: str, name: str, container: str | None, *, follow: bool,
                   tail_lines: int | None, previous: bool, limit_bytes: int | None) -> AsyncIterator[bytes]:
        """The container's log, as ``kubectl logs`` reads it (``follow`` streams until the container stops)."""
        pod = self.store.get(self.pods_info, namespace, name)
        uid = pod["metadata"]["uid"]
        pod_dir = self.workdir / "pods" / f"{namespace}_{name}_{uid}"
        path = pod_dir / (f"{container}.previous.log" if previous else f"{container}.log")
        if not path.exists():
            if previous:
                raise ApiError(400, "BadRequest", f'previous terminated container "{container}" in pod "{name}" '
                                                  "not found")
            return
        sent = 0
        f = await asyncio.to_thread(open, path, "rb")
        try:
            data = await asyncio.to_thread(f.read)
            if tail_lines is not None:
                lines = data.splitlines(keepends=True)
                data = b"".join(lines[-tail_lines:]) if tail_lines > 0 else b""
            if limit_bytes is not None:
                data = data[:limit_bytes]
            sent += len(data)
            if data:
                yield data
            if not follow or previous:
                return
            while True:
                chunk = await asyncio.to_thread(f.read, 65536)
                if chunk:
                    if limit_bytes is not None:
                        chunk = chunk[: max(limit_bytes - sent, 0)]
                    sent += len(chunk)
                    yield chunk
                    continue
                run = self.runs.get((namespace, name))
                if run is None or run.uid != uid or run.stopped.is_set():
                    tail = await asyncio.to_thread(f.read)
                    if tail:
                        yield tail
                    return
                c = next((x for x in run.containers + run.inits if x.name == container), None)
                if c is None or c.done:
                    tail = await asyncio.to_thread(f.read)
                    if tail:
                        yield tail
                    return
                await asyncio.sleep(0.2)
        finally:
            f.close()
