"""The restart barrier on a real etcd: thousands of ranks' real Coordinators in a few processes.

:func:`run_barrier` does on a real etcd what :class:`.restart.RestartRun` simulates: ``ranks`` ranks in pods
of ``per_pod``, each with its own real :class:`~stalwart.restart.coordination.Coordinator` (its alive key on its
pod's lease, kept alive by the real keep-alive, and its arrival at iteration 0), then one rank's fault
report, and every rank through the barrier of iteration 1 until it holds the seal. The ranks live in
``processes`` worker processes (whole pods each, :func:`.restart.pod_layout`), as the simulator's
``processes`` option lays them out; each process has one etcd connection (one Store, as a pod's relay has)
and one gRPC watch stream carrying every watch of its ranks, each still a watch of its own in etcd (its own
id, sent its own events), as etcd's own client shares a stream between watches.

A rank's steps are those of the simulator's ``Rank``, which follows the wrapper: its monitor's watch (fault
records, heartbeat deletions) brings the fault; it arrives through its pod's relay with the read of the
cause (the interrupted iteration's fault records) and of what its wait starts from (the sealer then reads what
``sealer_parts`` says itself); it waits on a watch of the seal's key (the sealer: of those parts, and seals
with the real ``plan_seal`` /
``RankAssignment`` / ``try_seal``). A pod's relay is what the simulator models of the agent's
(:mod:`stalwart.agent.relay`): the real ``due`` says when a pod's requests go and the real ``execute`` sends
them as one fenced transaction; without its Unix socket (the ranks hand it their requests in the process).
The steps run on one event loop per process; blocking etcd calls (the relays' transactions, the sealer's
read and seal) on a pool of threads, the sealer's on a thread of its own.

Seconds are from just before the fault report is sent to the last rank holding the seal (one clock: this
machine's monotonic clock, shared by its processes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc

from bench.scalesim.real_etcd import (
    Access,
    add_worker_arguments,
    admin,
    busy_share,
    counters,
    cpu_seconds,
    job_access,
    machine_busy,
    say,
    workers,
)
from bench.scalesim.restart import pod_layout
from stalwart.agent.relay import DEFAULT_LINGER, Step, Waiting, due, execute
from stalwart.api.relay import RelayAnswer, RelayRequest
from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart import AliveRecord, ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.fence import Fence
from stalwart.etcd.keys import ALIVE, FAULT, MANIFEST, SEAL, JobKeys
from stalwart.etcd.records import KeyValue, WatchEvent, WatchRange, as_bytes, prefix_range_end
from stalwart.etcd.store import Put, Store
from stalwart.restart.assignment import RankAssignment
from stalwart.restart.coordination import Coordinator
from stalwart.restart.protocol import (
    Arrived,
    EpochView,
    Participant,
    barrier_sealer,
    barrier_state,
    plan_seal,
    sealer_parts,
)

T = TypeVar("T")

#: The pods' liveness lease TTL, kept alive at a third of it. Not the Coordinator's default of 10 s: with
#: 2,000 leases a process (a lease per rank, before the pods lent theirs) on this shared 2-core machine, a loaded
#: moment let the keep-alive fall behind and a lease lapse mid-run (the relay's transaction then refused, the run
#: lost). The model's background is the same.
LEASE_TTL = 30
Handler = Callable[[list[WatchEvent]], None]


class WatchMux:
    """Many watches on one gRPC watch stream of ``store``: each range a watch of its own in etcd, whose events
    are handed to its handler on ``loop``. etcd answers a stream's create requests in order, so the n-th
    ``created`` answer is the n-th range asked. What arrived while the loop was busy is handed over in one go
    (etcd sends one change to its watchers in no set order: the ranks of a pod hear of it together, as
    processes of their own would, not spread over the time this one process takes to read every answer)."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        member = store._members.current()
        metadata = [*(store._metadata(member, "watch") or []), ("hasleader", "true")]
        self._requests: queue.Queue[Any] = queue.Queue()
        self._call = member.watch.Watch(iter(self._requests.get, None), metadata=metadata)
        self._pending: collections.deque[Handler] = collections.deque()
        self._handlers: dict[int, Handler] = {}
        self._lock = threading.Lock()
        self._created = 0
        self._created_cond = threading.Condition(self._lock)
        self._inbox: list[tuple[Handler, list[WatchEvent]]] = []
        self.failure: str | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._pump, name="watch-mux", daemon=True)
        self._thread.start()

    def add(self, ranges: Sequence[WatchRange], start_revision: int, handler: Handler) -> None:
        with self._lock:
            for r in ranges:
                key = as_bytes(r.key)
                self._pending.append(handler)
                self._requests.put(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                    key=key, range_end=prefix_range_end(key) if r.prefix else b"", start_revision=start_revision,
                    filters=[rpc.WatchCreateRequest.NOPUT] if r.no_put else [])))

    def wait_created(self, count: int, timeout: float) -> bool:
        with self._created_cond:
            return self._created_cond.wait_for(lambda: self._created >= count or self.failure is not None, timeout) \
                and self.failure is None

    def _pump(self) -> None:
        try:
            for resp in self._call:
                if resp.created:
                    with self._lock:
                        handler = self._pending.popleft()
                        if resp.canceled:
                            self.failure = f"watch refused: {resp.cancel_reason}"
                        self._handlers[resp.watch_id] = handler
                        self._created += 1
                        self._created_cond.notify_all()
                    continue
                if resp.canceled or resp.compact_revision:
                    self.failure = f"watch {resp.watch_id} ended: {resp.cancel_reason or 'compacted'}"
                    continue
                if resp.events:
                    events = [WatchEvent("put" if ev.type == 0 else "delete", KeyValue._from_pb(ev.kv))
                              for ev in resp.events]
                    with self._lock:
                        self._inbox.append((self._handlers[resp.watch_id], events))
                        first = len(self._inbox) == 1
                    if first:
                        self.loop.call_soon_threadsafe(self._drain)
        except grpc.RpcError as e:
            if not self._closing:
                self.failure = f"watch stream broke: {e.code()}: {e.details()}"
        finally:
            with self._created_cond:
                self._created_cond.notify_all()

    def _drain(self) -> None:
        with self._lock:
            batch, self._inbox = self._inbox, []
        for handler, events in batch:
            handler(events)

    def close(self) -> None:
        self._closing = True
        self._requests.put(None)
        self._call.cancel()
        self._thread.join(5)


class World:
    """One worker process's ranks, relays, loop and threads."""

    def __init__(self, store: Store, keys: JobKeys, epoch: int, *, slots: range, n: int, per_pod: int,
                 linger: float) -> None:
        self.store, self.keys, self.epoch, self.n = store, keys, epoch, n
        self.loop = asyncio.new_event_loop()
        pods = -(-len(slots) // per_pod)
        self.pool = concurrent.futures.ThreadPoolExecutor(min(64, pods), thread_name_prefix="relay")
        self.own = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sealer")
        self.coords = {s: Coordinator(store, keys, epoch, slot=s, node_id=f"trainjob-worker-{s // per_pod}")
                       for s in slots}
        self.relays = [PodRelay(self, frozenset(range(k, min(k + per_pod, slots.stop))), linger)
                       for k in range(slots.start, slots.stop, per_pod)]
        self.ranks: list[LiveRank] = []
        self.mux: WatchMux | None = None
        self.done = threading.Event()
        self.failure: str | None = None
        self.released = 0
        self.sealed_at: float | None = None

    def blocking(self, fn: Callable[[], T], then: Callable[[T], None], *, own: bool = False) -> None:
        """``fn`` on a thread (the pool's, or the sealer's own), then ``then(result)`` on the loop."""
        fut = self.loop.run_in_executor(self.own if own else self.pool, fn)

        def finished(f: asyncio.Future[T]) -> None:
            if f.exception() is not None:
                self.fail(f"{type(f.exception()).__name__}: {f.exception()}")
            else:
                then(f.result())
        fut.add_done_callback(finished)

    def fail(self, why: str) -> None:
        self.failure = self.failure or why
        self.done.set()

    def one_released(self) -> None:
        self.released += 1
        if self.released == len(self.ranks):
            self.done.set()


class PodRelay:
    """A pod's relay as the simulator models the agent's: the real :func:`due` decides when the pod's requests
    go, the real :func:`execute` sends them as one fenced transaction, one transaction at a time."""

    def __init__(self, world: World, clients: frozenset[int], linger: float) -> None:
        self.world, self.clients, self.linger = world, clients, linger
        self.waiting: list[Waiting] = []
        self.then: dict[int, Callable[[RelayAnswer], None]] = {}
        self.served: dict[Step, frozenset[int]] = {}
        self.busy = False
        self.transactions = 0

    def submit(self, client: int, request: RelayRequest, then: Callable[[RelayAnswer], None]) -> None:
        self.waiting.append(Waiting(client, request, time.monotonic(), slot=client))
        self.then[client] = then
        self.world.loop.call_later(self.linger + 1e-4, self.consider)
        self.consider()

    def consider(self) -> None:
        if self.busy or not due(self.waiting, self.clients, self.served, time.monotonic(), self.linger):
            return
        batch, self.waiting = self.waiting, []
        self.busy = True
        self.transactions += 1
        w = self.world
        self.world.blocking(lambda: execute(w.store, w.keys, [b.request for b in batch], [b.client for b in batch],
                                            timeout=30), lambda answers: self.answered(batch, answers))

    def answered(self, batch: list[Waiting], answers: list[RelayAnswer]) -> None:
        self.busy = False
        for waiting, answer in zip(batch, answers, strict=True):
            if not answer.ok:
                self.world.fail(f"slot {waiting.client}: the relay's transaction was refused: {answer.reason}")
                return
            self.served[waiting.step] = self.served.get(waiting.step, frozenset()) | {waiting.client}
            self.then.pop(waiting.client)(answer)
        self.consider()


class LiveRank:
    """One rank through the barrier of iteration 1, step by step as the simulator's ``Rank``."""

    def __init__(self, world: World, coord: Coordinator, relay: PodRelay, sealer: bool,
                 parts: tuple[WatchRange, ...] | None = (WatchRange(f"{SEAL}1"),)) -> None:
        self.world, self.coord, self.relay, self.sealer = world, coord, relay, sealer
        self.state = "running"
        self.view: EpochView | None = None
        self.parts = parts
        self.read = None if parts is None else (*parts, WatchRange(f"{FAULT}0/", prefix=True))

    def on_monitor(self, events: list[WatchEvent]) -> None:
        fault = self.coord.base + FAULT + "0/"
        if self.state == "running" and any(ev.type == "put" and ev.kv.key.startswith(fault) for ev in events):
            self.state = "aborting"
            rec = ArrivalRecord(slot=self.coord.slot, node_id=self.coord.node_id)
            self.relay.submit(self.coord.slot, self.coord.arrival_request(
                1, rec, () if self.sealer or self.read is None else self.read), self.arrived)

    def arrived(self, answer: RelayAnswer) -> None:
        if self.sealer:  # it reads its parts itself after its arrival, as Coordinator.arrive does
            self.world.blocking(lambda: self.coord.view(self.read), self.waiting, own=True)
        else:
            self.waiting(self.coord.answered(answer))

    def waiting(self, view: EpochView) -> None:
        view.cause(0)
        self.view, self.state = view, "waiting"
        if self.check():
            return
        assert self.world.mux is not None
        ranges = [WatchRange(self.coord.base + p.key, prefix=p.prefix)
                  for p in (self.parts or (WatchRange("", prefix=True),))]
        self.world.mux.add(ranges, view.revision + 1, self.on_barrier)

    def on_barrier(self, events: list[WatchEvent]) -> None:
        assert self.view is not None
        fresh = [ev for ev in events if ev.kv.mod_revision > self.view.revision]
        if self.state != "waiting" or not fresh:
            return
        self.view = self.coord._apply(self.view, fresh)
        self.check()

    def check(self) -> bool:
        assert self.view is not None
        if not self.sealer:
            seal = self.view.seals.get(1)
            if seal is not None:
                self.released(seal)
            return seal is not None
        result = barrier_state(self.view, 1, self.world.n)
        if isinstance(result, Arrived):
            self.state = "sealing"
            me = Participant(slot=self.coord.slot, node_id=self.coord.node_id, slots=self.world.n,
                             target_world=self.world.n)
            seal = plan_seal(self.view, 1, me, RankAssignment(), timed_out=False)
            self.world.blocking(lambda: self.coord.try_seal(seal), self.sealed, own=True)
            return True
        if result is not None:
            self.released(result)
        return result is not None

    def sealed(self, seal: SealRecord) -> None:
        self.world.sealed_at = time.monotonic()
        self.released(seal)

    def released(self, seal: SealRecord) -> None:
        if self.state == "released":
            return
        self.state = "released"
        self.world.one_released()


# -- the worker process ---------------------------------------------------------------------------------------


def setup(world: World) -> None:
    """Every pod's liveness lease (kept alive by the Store), as its agent lends it to its ranks
    (:mod:`stalwart.agent.rank_liveness`), each rank's alive key on it and its arrival at iteration 0, each pod's
    in one fenced transaction (the arrivals through the real ``execute``)."""
    store = world.store

    def pod(relay: PodRelay) -> None:
        mine = [world.coords[s] for s in sorted(relay.clients)]
        lease = store.lease_grant(LEASE_TTL)
        for c in mine:
            c.lease = c.lent_lease = lease
        Fence(store, world.keys, world.epoch).txn((), [
            Put(c.round_keys.alive(c.slot), AliveRecord(slot=c.slot, node_id=c.node_id, pid=os.getpid())
                .to_json_bytes(), c.lease) for c in mine])
        answers = execute(store, world.keys, [c.arrival_request(0, ArrivalRecord(slot=c.slot, node_id=c.node_id), ())
                                              for c in mine], [c.slot for c in mine], timeout=30)
        if not all(a.ok for a in answers):
            raise RuntimeError(f"arrivals at iteration 0 refused: {answers[0].reason}")
    list(world.pool.map(pod, world.relays))


def worker(args: argparse.Namespace) -> int:
    access = Access(args.endpoint, args.secret_dir, args.tls)
    keys = JobKeys(args.namespace, args.uid)
    try:
        store = access.connect()
    except Exception as e:
        say("FAILED", f"etcd at {args.endpoint}: {e}")
        return 1
    world = World(store, keys, args.epoch, slots=range(args.lo, args.hi), n=args.ranks, per_pod=args.per_pod,
                  linger=args.linger)
    try:
        return _serve(world, args)
    except Exception as e:  # the run says which worker failed, and why
        say("FAILED", f"{type(e).__name__}: {e}")
        return 1
    finally:
        world.loop.call_soon_threadsafe(world.loop.stop)
        if world.mux is not None:
            world.mux.close()
        world.pool.shutdown(wait=False, cancel_futures=True)
        world.own.shutdown(wait=False, cancel_futures=True)
        store.close()  # the keep-alives stop; etcd expires the leases


def _serve(world: World, args: argparse.Namespace) -> int:
    store = world.store
    setup(world)
    say("READY")
    line = sys.stdin.readline().split()
    if line[:1] != ["ARM"]:
        return 0
    sealer = int(line[1])
    world.mux = WatchMux(store, world.loop)
    monitor = (WatchRange(world.coords[args.lo].base + FAULT, prefix=True),
               WatchRange(world.coords[args.lo].base + ALIVE, prefix=True, no_put=True))
    narrow: tuple[WatchRange, ...] | None = (WatchRange(f"{SEAL}1"),)
    if sealer in world.coords:
        seal0 = world.coords[sealer].view([WatchRange(f"{SEAL}0")]).seals.get(0)
        parts = sealer_parts(1, seal0, args.ranks)
        narrow = None if parts is None else tuple(parts)
    for slot, coord in world.coords.items():
        rank = LiveRank(world, coord, world.relays[(slot - args.lo) // args.per_pod], slot == sealer,
                        narrow if slot == sealer else (WatchRange(f"{SEAL}1"),))
        world.ranks.append(rank)
        world.mux.add(monitor, 0, rank.on_monitor)
    if not world.mux.wait_created(2 * len(world.ranks), 60):
        say("FAILED", world.mux.failure or "the monitors' watches were not created within 60 s")
        return 1
    threading.Thread(target=world.loop.run_forever, name="loop", daemon=True).start()
    cpu0 = cpu_seconds()
    say("ARMED")
    while not world.done.wait(0.5):
        if world.mux.failure is not None:
            world.fail(world.mux.failure)
        # The watch stream keeps the login token it was opened with, and etcd ends a token left unused for its
        # TTL (300 s by default, 3 s in the tests): a read of a key of the job every half second keeps it in use.
        store.get(world.keys.job)
    if world.failure is not None:
        say("FAILED", world.failure)
        return 1
    say("DONE", {"last": time.monotonic(), "released": world.released, "sealed_at": world.sealed_at,
                 "cpu_seconds": cpu_seconds() - cpu0,
                 "relay_transactions": sum(r.transactions for r in world.relays)})
    sys.stdin.readline()  # STOP
    return 0


# -- the run ----------------------------------------------------------------------------------------------


def run_barrier(endpoint: str, credentials: EtcdCredentials | None, metrics: Sequence[str], ranks: int,
                processes: int, *,
                per_pod: int = 8, linger: float = DEFAULT_LINGER, timeout: float = 300.0) -> dict[str, Any]:
    """The barrier of ``ranks`` ranks in ``processes`` processes on the etcd at ``endpoint`` (its root login in
    ``credentials``; the ranks log in as the job's own user); what it measured. Raises
    :class:`ValidationError` (naming the endpoint and the cause) when etcd cannot be reached or refuses the
    client, or naming the worker when one fails."""
    layout = pod_layout(ranks, per_pod, processes)
    store = admin(endpoint, credentials)
    keys = JobKeys("validate", uuid.uuid4().hex[:12])
    try:
        with job_access(store, endpoint, credentials, keys) as access:
            return _run(store, keys, access, metrics=metrics, n=ranks, layout=layout, per_pod=per_pod,
                        linger=linger, timeout=timeout)
    finally:
        store.delete_prefix(keys.prefix)
        store.close()


def _run(store: Store, keys: JobKeys, access: Access, *, metrics: Sequence[str], n: int, layout: list[range],
         per_pod: int, linger: float, timeout: float) -> dict[str, Any]:
    manifest = Manifest(round=1, members=[Member(node_id="trainjob-worker-0", address="10.0.0.1", group_rank=0,
                                                 rank_offset=0, nproc=n)],
                        world_size=n, master_addr="10.0.0.1", sealed_by="trainjob-worker-0")
    epoch = store.put(keys.rendezvous + MANIFEST, manifest.to_json_bytes())
    t_setup = time.monotonic()
    deadline = t_setup + timeout
    specs = [(f"barrier worker {i} (slots {r.start}-{r.stop - 1})",
              ["-m", "bench.scalesim.real_barrier", *access.args(), "--namespace", keys.namespace, "--uid", keys.uid,
               "--epoch", str(epoch), "--lo", str(r.start), "--hi", str(r.stop), "--ranks", str(n),
               "--per-pod", str(per_pod), "--linger", str(linger)]) for i, r in enumerate(layout)]
    with workers(specs) as ws:
        for w in ws:
            w.expect("READY", deadline)
        # The leases were granted before READY: from a third of their TTL on, each is refreshed at its own time.
        steady = time.monotonic() + LEASE_TTL / 3 + 0.5
        first = Coordinator(store, keys, epoch, slot=0, node_id="trainjob-worker-0")
        me = Participant(slot=0, node_id=first.node_id, slots=n, target_world=n)
        seal0 = first.try_seal(plan_seal(first.view(), 0, me, RankAssignment(), timed_out=False))
        sealer = barrier_sealer(seal0)
        for w in ws:
            w.send(f"ARM {sealer}")
        for w in ws:
            w.expect("ARMED", deadline)
        setup_seconds = time.monotonic() - t_setup
        culprit = Coordinator(store, keys, epoch, slot=n // 3, node_id=f"trainjob-worker-{n // 3 // per_pod}")
        time.sleep(max(0.0, steady - 1.0 - time.monotonic()))
        before, t_before = counters(metrics), time.monotonic()
        time.sleep(1.0)
        counters0, busy0 = counters(metrics), machine_busy()
        t0 = time.monotonic()
        culprit.report_fault(FaultRecord(slot=culprit.slot, rank=culprit.slot, node_id=culprit.node_id, iteration=0,
                                         kind="exception", reason="injected", time=0.0))
        done = [json.loads(w.expect("DONE", deadline)) for w in ws]
        busy1, counters1 = machine_busy(), counters(metrics)
    last = max(d["last"] for d in done)
    sealed_at = next(d["sealed_at"] for d in done if d["sealed_at"] is not None)
    return {"seconds": last - t0, "seal_seconds": sealed_at - t0, "released": sum(d["released"] for d in done),
            "writes": counters1["proposals"] - counters0["proposals"],
            "lease_renewals_per_second": (counters0["renewals"] - before["renewals"]) / (t0 - t_before),
            "relay_transactions": sum(d["relay_transactions"] for d in done),
            "client_cpu_seconds": [round(d["cpu_seconds"], 3) for d in done],
            "machine_busy": busy_share(busy0, busy1), "setup_seconds": setup_seconds}


def main() -> int:
    p = argparse.ArgumentParser(description="a worker process of the real-etcd barrier validation")
    add_worker_arguments(p)
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--per-pod", type=int, default=8)
    p.add_argument("--linger", type=float, default=DEFAULT_LINGER)
    return worker(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
