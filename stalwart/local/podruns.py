"""The process side of the local kubelet: the pods whose processes run on this machine (one :class:`PodRun`
each, by ``(namespace, name)``), and what happens to those processes: stopped as a container runtime stops
them, paused and resumed with a partitioned node, killed with a lost one. Which pods should run, and what the
API hears of them, is the kubelet's (:mod:`.kubelet`); the processes themselves are :mod:`.processes`'."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Coroutine, Iterator
from typing import Any

from stalwart.local import processes
from stalwart.local.containerbook import ContainerBook
from stalwart.local.netns import NodeNetwork
from stalwart.local.pods import ContainerRun, PodRun

log = logging.getLogger(__name__)

Key = tuple[str, str]


class PodRuns:
    """See the module docstring. Every task it is given (:meth:`spawn`) is cancelled by :meth:`shutdown`."""

    def __init__(self, subnet: int | None = None, book: ContainerBook | None = None, *,
                 network: NodeNetwork | None = None) -> None:
        self.by_key: dict[Key, PodRun] = {}
        #: The network per node, if the cluster has one: pods get their node's addresses, put on (and taken off)
        #: its interface as they start (and stop).
        self.network = network
        #: Where each container process's start and end are noted (see :mod:`.containerbook`).
        self.book = book or ContainerBook(None)
        self._tasks: set[asyncio.Task[None]] = set()
        self._next_ip = 2
        self._next_by_node: dict[str, int] = {}
        # The cluster's pod addresses, 127.<subnet>.x.y: its own /16 of the loopback network, as a real cluster
        # has its own pod CIDR, so that two local clusters on one machine (a demo beside a test run) do not give
        # two pods one address (a server of one would find its port taken by the other's).
        if subnet is not None and not 1 <= subnet <= 254:
            raise ValueError(f"subnet: expected 1 to 254 (the second octet of 127/8), got {subnet}")
        self.subnet = subnet if subnet is not None else random.SystemRandom().randint(1, 254)

    def __len__(self) -> int:
        return len(self.by_key)

    def __iter__(self) -> Iterator[PodRun]:
        return iter(list(self.by_key.values()))

    def get(self, key: Key) -> PodRun | None:
        return self.by_key.get(key)

    def on(self, node: str) -> list[PodRun]:
        return [r for r in self.by_key.values() if r.node == node]

    def add(self, run: PodRun) -> None:
        """Hold ``run``; with a network per node its address goes on its node's interface (OSError if refused)."""
        if self.network is not None:
            self.network.add_address(run.node, run.ip)
        self.by_key[run.key] = run

    def _forget(self, run: PodRun) -> None:
        if self.by_key.get(run.key) is run:
            self.by_key.pop(run.key)
            if self.network is not None:
                try:
                    self.network.remove_address(run.node, run.ip)
                except OSError as exc:
                    log.warning("pod %s/%s: %s", run.namespace, run.name, exc)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background step, keeping a reference until it ends (the loop holds tasks only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def free_ip(self, previous: str | None = None, node: str | None = None) -> str:
        """An address for a pod: ``previous`` (the pod's, from before its node went down) while no other pod holds
        it, else the next free one; one of ``node``'s with a network per node, else a loopback address
        127.<subnet>.x.y. OSError when the node has none left."""
        used = {r.ip for r in self.by_key.values()}
        if self.network is not None and node is not None:
            plan = self.network.plan
            if previous and previous not in used and plan.node_of(previous) == node and previous != plan.node_ip(node):
                return previous
            # Round the node's addresses from the last one handed out, as host-local IPAM does: a pod that just
            # left does not lend its address to the next one at once (a peer's error naming that address would
            # then name the newcomer).
            ips = plan.pod_ips(node)
            start = self._next_by_node.get(node, 0)
            for k in range(len(ips)):
                ip = ips[(start + k) % len(ips)]
                if ip not in used:
                    self._next_by_node[node] = (start + k + 1) % len(ips)
                    return ip
            raise OSError(f"node {node} has no pod address left ({len(plan.pod_ips(node))} in use)")
        if previous and previous not in used:
            return previous
        while True:
            n = self._next_ip
            self._next_ip = 2 if self._next_ip >= 65000 else self._next_ip + 1
            ip = f"127.{self.subnet}.{n // 256}.{n % 256}"
            if n % 256 in (0, 1, 255) or ip in used:
                continue
            return ip

    async def stop(self, run: PodRun, grace: float) -> None:
        """Stop every container of the pod as a runtime does (see :func:`processes.stop_container`)."""
        run.stopping = True
        await asyncio.gather(*(self.stop_container(run, c, grace) for c in run.all_containers()
                               if c.proc is not None and c.proc.returncode is None))
        # Whatever else carries the pod's marker (a process that outlived its container) goes too.
        await asyncio.to_thread(processes.kill_pods, [run.uid])
        await _cancel(run)
        self._forget(run)
        run.stopped.set()

    async def stop_container(self, run: PodRun, c: ContainerRun, grace: float) -> None:
        """Stop one container (:func:`processes.stop_container`), its end and leftovers noted in the book."""
        proc = c.proc
        if proc is None:
            return
        left = await processes.stop_container(proc, processes.container_id(run.uid, c.name), grace)
        self.book.ended(run, c.name, proc)
        self.book.leftovers(run, c.name, proc.pid, left)

    async def pause(self, runs: list[PodRun]) -> list[int]:
        """SIGSTOP every process of ``runs`` (a partitioned node); returns the pids paused."""
        return await asyncio.to_thread(processes.pause_pods, [r.uid for r in runs])

    async def resume(self, runs: list[PodRun]) -> None:
        await asyncio.to_thread(processes.resume_pods, [r.uid for r in runs])

    async def kill(self, runs: list[PodRun]) -> None:
        """SIGKILL every process of ``runs`` and forget them (their node is gone, and nothing is reported)."""
        for run in runs:
            run.stopping = True
        await asyncio.to_thread(processes.kill_pods, [r.uid for r in runs])
        for run in runs:
            await _cancel(run)
            for c in run.all_containers():
                if c.proc is not None:
                    with contextlib.suppress(Exception):
                        await c.proc.wait()
                        self.book.ended(run, c.name, c.proc)
            self._forget(run)
            run.stopped.set()

    async def shutdown(self, grace: float, paused: list[PodRun]) -> None:
        """Stop every pod (``paused`` ones are resumed first, or they could not hear SIGTERM) and every task."""
        await self.resume(paused)
        await asyncio.gather(*(self.stop(r, grace) for r in self), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _cancel(run: PodRun) -> None:
    if run.task is not None and not run.task.done():
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await run.task
