"""Running one pod's containers: init containers one by one, then the containers, each restarted per
``restartPolicy`` with an exponential back-off (``CrashLoopBackOff`` while waiting), probed while it runs, its
state reported after every change. The kubelet (:mod:`.kubelet`) decides which pods run; a :class:`PodWorker`
runs one until its containers are done or the kubelet stops it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from stalwart.local import processes
from stalwart.local.apiserver.objects import ApiError, ObjectStore, now_rfc3339
from stalwart.local.containerbook import ContainerBook
from stalwart.local.podenv import ConfigError, PodEnvironment, expand
from stalwart.local.pods import ContainerRun, PodRun
from stalwart.local.probes import probe_loop
from stalwart.local.recorder import record_event

log = logging.getLogger(__name__)
JSON = dict[str, Any]


def current_pod(store: ObjectStore, run: PodRun) -> JSON | None:
    """The API's pod of ``run`` (None when it is gone or was replaced by a pod of the same name)."""
    try:
        pod = store.get(store.info("", "v1", "pods"), run.namespace, run.name)
    except ApiError:
        return None
    return pod if pod["metadata"]["uid"] == run.uid else None


async def _stop_container(run: PodRun, c: ContainerRun, grace: float) -> None:
    if c.proc is not None:
        await processes.stop_container(c.proc, processes.container_id(run.uid, c.name), grace)


class PodWorker:
    """Runs the containers of ``run``. ``report(phase=None)`` writes the pod's status; ``reachable`` is set while
    the pod's node reaches the API (while it does not, nothing new is started or probed); ``spawn`` runs a
    background coroutine for the kubelet; ``book`` notes each container process's start and end; ``stop`` stops
    one container (a failed liveness probe)."""

    def __init__(self, run: PodRun, spec: JSON, *, store: ObjectStore, env: PodEnvironment,
                 backoff: tuple[float, float], reachable: asyncio.Event, report: Callable[..., None],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], book: ContainerBook | None = None,
                 stop: Callable[[PodRun, ContainerRun, float], Coroutine[Any, Any, None]] | None = None) -> None:
        self.run = run
        self.book = book or ContainerBook(None)
        self.stop = stop
        self.spec = spec
        self.store = store
        self.env = env
        self.backoff = backoff
        self.reachable = reachable
        self.report = report
        self.spawn = spawn

    async def main(self) -> None:
        run = self.run
        policy = self.spec.get("restartPolicy", "Always")
        self.report()
        try:
            for c in run.inits:
                while not c.done:
                    code = await self._run_once(c)
                    if run.stopping:
                        return
                    if code == 0:
                        c.done = True
                        break
                    if policy == "Never":
                        c.done = True
                        self.report(phase="Failed")
                        return
                    await self._backoff(c)
            run.initialized = True
            await asyncio.gather(*(self._supervise(c, policy) for c in run.containers))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pod %s/%s: kubelet error", run.namespace, run.name)
        finally:
            run.stopped.set()

    async def _supervise(self, c: ContainerRun, policy: str) -> None:
        while not self.run.stopping:
            code = await self._run_once(c)
            if self.run.stopping:
                return
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                c.done = True
                self.report()
                return
            await self._backoff(c)

    async def _backoff(self, c: ContainerRun) -> None:
        run = self.run
        delay = min(self.backoff[0] * (2 ** c.restarts), self.backoff[1])
        c.state = {"waiting": {"reason": "CrashLoopBackOff",
                               "message": f"back-off {delay:g}s restarting failed container={c.name} "
                                          f"pod={run.name}_{run.namespace}({run.uid})"}}
        self.report()
        await asyncio.sleep(delay)
        c.restarts += 1

    async def _until_up(self) -> None:
        """Wait while the pod's node is cut off: its kubelet starts nothing meanwhile."""
        await self.reachable.wait()

    async def _run_once(self, c: ContainerRun) -> int:
        """Start one instance of a container and wait for it; return its exit code."""
        run = self.run
        await self._until_up()
        pod = current_pod(self.store, run)
        if pod is None or run.stopping:
            return 0
        while True:
            try:
                env = self.env.build(pod, run.placement, c.spec)
                break
            except ConfigError as exc:
                c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
                self.report()
                await asyncio.sleep(1.0)
                if run.stopping:
                    return 0
                pod = current_pod(self.store, run) or pod
        argv = [expand(str(a), env) for a in (c.spec.get("command") or []) + (c.spec.get("args") or [])]
        logf = run.dir / f"{c.name}.log"
        if c.last_state and logf.exists():
            with contextlib.suppress(OSError):
                shutil.move(str(logf), str(run.dir / f"{c.name}.previous.log"))
        started = now_rfc3339()
        if not c.spec.get("command"):
            return self._cannot_run(c, started, "the local kubelet runs a container's command; images have no "
                                                "entrypoint here, so set command")
        cwd = Path(c.spec.get("workingDir") or run.dir)
        try:
            c.proc = await processes.start_process(argv, env, cwd, logf, run.enter)
        except OSError as exc:
            return self._cannot_run(c, started, f"starting {argv[0]!r}: {exc}")
        self.book.started(run, c.name, c.proc.pid, logf, argv)
        c.state = {"running": {"startedAt": started}}
        c.ready = not c.init and "readinessProbe" not in c.spec
        log.info("pod %s/%s on %s (%s): container %s started, pid %d, restarts %d", run.namespace, run.name,
                 run.node, run.ip, c.name, c.proc.pid, c.restarts)
        record_event(self.store, pod, "Normal", "Started", f"Started container {c.name}", component="kubelet")
        self.report()
        probes = [asyncio.get_running_loop().create_task(probe_loop(
            run, c, kind, env, cwd, active=self.reachable.is_set, on_ready_change=self.report,
            on_liveness_failure=lambda: self._liveness_failed(c)))
            for kind in ("readinessProbe", "livenessProbe") if not c.init and kind in c.spec]
        try:
            code = await c.proc.wait()
        finally:
            for task in probes:
                task.cancel()
            for task in probes:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.book.ended(run, c.name, c.proc)  # first: the book's time is when the wait returned
        c.ready = False
        left = await processes.kill_leftovers(processes.container_id(run.uid, c.name))
        self.book.leftovers(run, c.name, c.proc.pid, left)
        term: JSON = {"exitCode": code if code >= 0 else 128 - code, "startedAt": started,
                      "finishedAt": now_rfc3339(), "containerID": f"process://{c.proc.pid}"}
        if code < 0:
            term["signal"] = -code
        term["reason"] = "Completed" if code == 0 else "Error"
        c.last_state = {"terminated": term}
        c.state = {"terminated": term}
        log.info("pod %s/%s: container %s exited with %s", run.namespace, run.name, c.name, term["exitCode"])
        self.report()
        return int(term["exitCode"])

    def _liveness_failed(self, c: ContainerRun) -> None:
        pod = current_pod(self.store, self.run)
        if pod is not None:
            record_event(self.store, pod, "Warning", "Unhealthy", f"Liveness probe failed; restarting {c.name}",
                         component="kubelet")
        if c.proc is not None:
            self.spawn((self.stop or _stop_container)(self.run, c, self.run.grace))

    def _cannot_run(self, c: ContainerRun, started: str, message: str) -> int:
        term = {"exitCode": 128, "reason": "ContainerCannotRun", "message": message, "startedAt": started,
                "finishedAt": now_rfc3339()}
        c.state = {"terminated": term}
        c.last_state = {"terminated": term}
        self.report()
        return 128
