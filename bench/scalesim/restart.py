"""N simulated rank processes through one in-process restart of the whole world, on the real coordination code.

Each rank has its own :class:`~stalwart.restart.coordination.Coordinator` (the real etcd side: fenced fault
report, arrival, reads of the parts it needs, watch events applied to its view, create-if-absent seal) over
the simulated store; the seal's rank assignment is the real ``RankAssignment``, who seals the real
``barrier_sealer``. What the wrapper's loop does between those calls is followed step by step, as the
wrapper (``stalwart/restart/wrapper.py``) does it:

1. one rank reports a fault in iteration 0; every rank's monitor watch (one per rank, on the epoch's fault
   records and the heartbeats' deletions) brings it, and the rank is interrupted (``abort`` simulated seconds,
   0 by default: the process group's teardown is measured by ``bench/restart.py``, not here);
2. the rank arrives at the barrier of iteration 1 (a fenced put bound to its heartbeat lease) and reads, in the
   same request, the interrupted iteration's fault records (the cause, ``_take_cause``) and what its wait
   starts from;
3. the sealer (``barrier_sealer`` of iteration 0's seal: the lowest slot that took part) reads, after its
   arrival, what ``sealer_parts`` says (this barrier's arrivals and seal and the previous seal, while that seal
   places every slot; else the whole prefix) and keeps its view from a watch on the same
   (``Coordinator.wait_until``); when ``barrier_complete`` holds it writes the seal. Every other rank reads the
   seal's key with its arrival and, while it is absent, watches that key only; a rank is **released** when it
   holds the seal.

With the pods' relays (``relay``, the default; ``ranks_per_node`` ranks a pod, 8 by default), every arrival
(with its reads; the sealer's reads are its own, after it) goes through the pod's agent
(:mod:`stalwart.agent.relay`): the real ``due`` decides when a pod's requests are sent and the real
``execute`` sends them as one fenced transaction through the simulated store; the hop between a rank and its
agent (a Unix socket) costs ``hop`` seconds each way. Without (``relay=False``), every rank makes its request
itself.

Every rank's read of the same keys at one revision returns the same bytes, so the simulator parses them once
(with the real ``Coordinator.parse``) and charges every rank's read to the model server.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

from bench.scalesim.sim import Background, Costs, Sim, Subscription, TimedStore
from stalwart.agent.relay import DEFAULT_LINGER, Step, Waiting, due, execute
from stalwart.api.relay import RelayAnswer, RelayRequest
from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart import ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.keys import ALIVE, END, FAULT, MANIFEST, SEAL, JobKeys
from stalwart.etcd.store import KeyValue, WatchEvent, WatchRange
from stalwart.restart.assignment import RankAssignment
from stalwart.restart.coordination import Coordinator
from stalwart.restart.protocol import (
    Arrived,
    EpochView,
    Participant,
    barrier_sealer,
    barrier_state,
    completion_known,
    plan_seal,
    sealer_parts,
)

KEYS = JobKeys("scale", "sim1")


def pod_layout(ranks: int, per_pod: int, processes: int) -> list[range]:
    """The slots each of ``processes`` processes hosts: whole pods of ``per_pod`` ranks, contiguous, as even as
    whole pods allow (the real validation's processes, and the simulator's alike)."""
    if ranks < 1 or per_pod < 1:
        raise ValueError(f"ranks, per_pod: expected at least 1 each, got {ranks} and {per_pod}")
    pods = -(-ranks // per_pod)
    if not 1 <= processes <= pods:
        raise ValueError(f"processes: expected 1 to {pods} (one pod of {per_pod} ranks at least each), got {processes}")
    bounds = [pods * p // processes for p in range(processes + 1)]
    return [range(bounds[p] * per_pod, min(bounds[p + 1] * per_pod, ranks)) for p in range(processes)]


class _Reads:
    """One read and one parse per (keys, revision): every rank reading them then gets the same answer."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.kvs: dict[tuple[str, int], tuple[list[KeyValue], int]] = {}
        self.cost: dict[tuple[str, int], float] = {}
        self.parsed: dict[tuple[Any, ...], tuple[EpochView, float]] = {}  # the view, the CPU its parse took

    def get_prefix(self, store: TimedStore, prefix: str) -> tuple[list[KeyValue], int]:
        with self.sim.untimed():
            key = (prefix, self.sim.mem.revision_now)
            hit = self.kvs.get(key)
            if hit is None:
                hit = self.kvs[key] = self.sim.mem.get_prefix(prefix)
                self.cost[key] = store._read_cost(hit[0])
                if len(self.kvs) > 4:
                    old = next(iter(self.kvs))
                    del self.kvs[old], self.cost[old]
            else:
                self.sim.mem.counters.reads += 1
            return self.sim.request(self.cost[key], lambda: hit, reads=1.0)

    def parse(self, real: Any, coord: Coordinator, kvs: list[KeyValue], revision: int) -> EpochView:
        # A few keys (a rank's read of the seal's key with its arrival) are the same bytes at many revisions.
        key: tuple[Any, ...] = (coord.base, tuple((kv.key, kv.mod_revision) for kv in kvs)) if len(kvs) <= 8 else \
            (coord.base, revision, len(kvs), kvs[0].key, kvs[-1].key)
        hit = self.parsed.get(key)
        if hit is None:
            if len(self.parsed) > 64:
                self.parsed.clear()
            hit = self.parsed[key] = self.sim.measured(lambda: real(coord, kvs, revision))
        else:
            self.sim.charge(hit[1])  # this rank parses the same bytes itself
        view = hit[0]
        return view if view.revision == revision else replace(view, revision=revision)


class _Applied:
    """Watch events applied to a view, once per (view, batch): the ranks that wait for the seal's key hold the
    same view (but for its revision) and are sent the same batch."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.last: tuple[EpochView, int, EpochView, float] | None = None

    def __call__(self, coord: Coordinator, view: EpochView, events: list[WatchEvent]) -> EpochView:
        bare = replace(view, revision=0)
        if self.last is not None and self.last[1] == id(events) and self.last[0] == bare:
            self.sim.charge(self.last[3])  # this rank applies the same batch itself
            return self.last[2]
        new, took = self.sim.measured(lambda: coord._apply(view, events))
        self.last = (bare, id(events), new, took)
        return new


class NodeRelay:
    """One pod's agent relay: requests reach it ``hop`` seconds after a rank sends them, the real :func:`due`
    decides when they go, the real :func:`execute` sends them (one at a time: the relay has one thread), and
    each answer reaches its rank ``hop`` seconds after the transaction's."""

    def __init__(self, sim: Sim, store: TimedStore, clients: frozenset[int], *, linger: float, hop: float,
                 host: object | None = None) -> None:
        self.sim, self.store, self.clients, self.linger, self.hop = sim, store, clients, linger, hop
        #: The simulated process whose CPU this relay's work takes (itself: the pod's agent).
        self.host = self if host is None else host
        self.waiting: list[Waiting] = []
        self.then: dict[int, Callable[[RelayAnswer], None]] = {}
        self.served: dict[Step, frozenset[int]] = {}
        self.busy_until = 0.0
        self.transactions = 0

    def submit(self, client: int, request: RelayRequest, then: Callable[[RelayAnswer], None]) -> None:
        self.sim.at(self.sim.now + self.hop, lambda: self._received(Waiting(client, request, self.sim.now), then))

    def _received(self, waiting: Waiting, then: Callable[[RelayAnswer], None]) -> None:
        self.waiting.append(waiting)
        self.then[waiting.client] = then
        self.sim.at(waiting.since + self.linger + 1e-9, self._consider)  # past the linger, rounding aside
        self._consider()

    def _consider(self) -> None:
        if self.sim.now < self.busy_until:
            self.sim.at(self.busy_until, self._consider)
            return
        with self.sim.working(self.host, "relay"):
            go = due(self.waiting, self.clients, self.served, self.sim.now, self.linger)
        if not go:
            return
        batch, self.waiting = self.waiting, []
        self.transactions += 1
        with self.sim.working(self.host, "relay"):
            # Each connection is its rank's own: the client is the slot the relay bound it to.
            answers = execute(self.store, KEYS, [w.request for w in batch], [w.client for w in batch])  # type: ignore[arg-type]
        self.busy_until = self.sim.now
        for w, answer in zip(batch, answers, strict=True):
            assert answer.ok, answer.reason
            self.served[w.step] = self.served.get(w.step, frozenset()) | {w.client}
            then = self.then.pop(w.client)
            self.sim.at(self.sim.now + self.hop, lambda t=then, a=answer: t(a))  # type: ignore[misc]


@dataclass
class Rank:
    sim: Sim
    coord: Coordinator
    slots: int
    applied: _Applied
    relay: NodeRelay | None = None
    sealer: bool = False
    #: What this rank reads with its arrival and then watches (the sealer's: ``sealer_parts``; ``None``: all).
    parts: tuple[WatchRange, ...] | None = (WatchRange(f"{SEAL}1"),)
    state: str = "running"  # running -> aborting -> waiting -> released
    view: EpochView | None = None
    watch: Subscription | None = None
    released_at: float | None = None
    releases: int = 0
    seal: SealRecord | None = None
    #: The simulated process whose CPU this rank's work takes (``None``: its own, as a rank process).
    host: object | None = None
    #: The what-if of one watch per pod (``RestartRun.pod_fanout``): the pod whose agent watches for this rank.
    pod: object | None = None
    hop: float = 0.0

    @property
    def cpu(self) -> object:
        return self if self.host is None else self.host

    def on_monitor(self, events: list[WatchEvent], when: float, abort: float) -> None:
        """The monitor's watch (fault records, heartbeat deletions) brings a batch."""
        if self.state == "running" and any(ev.type == "put" and ev.kv.key.startswith(self.coord.base + FAULT + "0/")
                                           for ev in events):
            self.state = "aborting"
            self.sim.at(when + abort, self.arrive)

    def arrive(self) -> None:
        """The arrival, with the read of what this rank's wait looks at and of the interrupted iteration's
        fault records (its cause), in one request (the pod's relay's; the sealer reads ``parts``, what
        ``sealer_parts`` says, itself after it: as the wrapper's ``_barrier`` does); then
        ``Coordinator.wait_until`` from that view: a watch on ``parts`` from the next revision."""
        parts = self.parts
        read = None if parts is None else (*parts, WatchRange(f"{FAULT}0/", prefix=True))
        rec = ArrivalRecord(slot=self.coord.slot, node_id=self.coord.node_id)
        if self.relay is None:
            with self.sim.working(self.cpu, self.phase):
                view = self.coord.arrive(1, rec, read)
                view.cause(0)
            self.arrived(view, parts)
            return

        def answered(answer: RelayAnswer) -> None:
            with self.sim.working(self.cpu, self.phase):
                view = self.coord.view(read) if self.sealer else self.coord.answered(answer)
                view.cause(0)
            self.arrived(view, parts)
        with self.sim.working(self.cpu, "arrive"):
            request = self.coord.arrival_request(1, rec, () if self.sealer or read is None else read)
        self.relay.submit(self.coord.slot, request, answered)

    @property
    def phase(self) -> str:
        """What this rank's work at the barrier is charged as: the sealer's is the job's critical path."""
        return "sealer" if self.sealer else "wait"

    def arrived(self, view: EpochView, parts: tuple[WatchRange, ...] | None) -> None:
        self.view = view
        self.state = "waiting"
        if self.check():
            return
        ranges = tuple(WatchRange(self.coord.base + p.key, prefix=p.prefix, no_put=p.no_put)
                       for p in (parts or (WatchRange("", prefix=True),)))
        self.watch = self.sim.subscribe(ranges, self.view.revision + 1, self.sim.serial(self.cpu, self.on_barrier),
                                        group=None if self.sealer else self.pod, hop=self.hop,
                                        per_transaction=self.sealer and self.pod is not None, owner=self.cpu)

    def on_barrier(self, events: list[WatchEvent], when: float) -> None:
        assert self.view is not None
        fresh = [ev for ev in events if ev.kv.mod_revision > self.view.revision]
        if self.state != "waiting" or not fresh:
            return
        self.sim.now = when
        with self.sim.working(self.cpu, self.phase):
            self.view = self.applied(self.coord, self.view, fresh)
        self.check()

    def check(self) -> bool:
        assert self.view is not None
        with self.sim.working(self.cpu, self.phase):
            if self.sealer:
                result = barrier_state(self.view, 1, self.slots)
                if isinstance(result, Arrived):
                    me = Participant(slot=self.coord.slot, node_id=self.coord.node_id, slots=self.slots,
                                     target_world=self.slots)
                    result = self.coord.try_seal(plan_seal(self.view, 1, me, RankAssignment(), timed_out=False))
            else:
                result = self.view.seals.get(1)
        if result is None:
            return False
        assert isinstance(result, SealRecord)
        self.seal, self.state, self.released_at = result, "released", self.sim.now
        self.releases += 1
        if self.watch is not None:
            self.sim.unsubscribe(self.watch)
            self.watch = None
        return True


@dataclass
class RestartRun:
    """A world of ``n`` ranks at iteration 0 (set up through the same code, untimed); then one fault."""

    n: int
    costs: Costs
    abort: float = 0.0
    #: Each rank's abort takes ``abort`` plus up to this many seconds more (uniform, seeded): the ranks of a pod
    #: then ask their relay apart, as they do on a loaded machine.
    abort_spread: float = 0.0
    ranks_per_node: int = 8
    #: The pods' agents relay their ranks' barrier requests (the default, as the agent does).
    relay: bool = True
    linger: float = DEFAULT_LINGER
    hop: float = 0.0001
    #: Charge the project's code its CPU time (see :mod:`.sim`).
    cpu: bool = True
    #: The running job's steady requests beside the barrier's (:class:`.sim.Background`), from a second before
    #: the fault; ``None``: none.
    background: Background | None = None
    #: A what-if, not the code: every watch of a pod's ranks (the monitors', the waits for the seal) is one watch
    #: of its agent, which hands each batch on to its ranks (``hop`` later), and a pod's arrivals are one record
    #: (the sealer is sent one event per pod). What one etcd would serve were the fan-out per pod.
    pod_fanout: bool = False
    #: The ranks and their pods' relays in this many processes, each computing one thing at a time
    #: (:func:`pod_layout`: the real validation's layout); ``None``: every rank and every relay its own process.
    processes: int | None = None
    sim: Sim = field(init=False)
    ranks: list[Rank] = field(init=False)
    seal0: SealRecord | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.sim = Sim(self.costs, cpu=self.cpu, threads=self.processes is not None)
        self.reads = _Reads(self.sim)
        self.store = TimedStore(self.sim)
        self.store.get_prefix = lambda prefix, **_: self.reads.get_prefix(self.store, prefix)  # type: ignore[method-assign]
        manifest = Manifest(round=1, members=[Member(node_id="trainjob-worker-0", address="10.0.0.1", group_rank=0,
                                                     rank_offset=0, nproc=self.n)],
                            world_size=self.n, master_addr="10.0.0.1", sealed_by="trainjob-worker-0")
        epoch = self.sim.mem.put(KEYS.rendezvous + MANIFEST, manifest.to_json_bytes())
        applied = _Applied(self.sim)
        per = self.ranks_per_node
        hosts: list[object | None] = [None] * self.n
        if self.processes is not None:
            for slots in pod_layout(self.n, per, self.processes):
                host = object()
                hosts[slots.start:slots.stop] = [host] * len(slots)
        self.relays = [NodeRelay(self.sim, self.store, frozenset(range(k, min(k + per, self.n))), linger=self.linger,
                                 hop=self.hop, host=hosts[k]) for k in range(0, self.n, per)] if self.relay else []
        self.ranks = [Rank(self.sim, Coordinator(self.store, KEYS, epoch, slot=i,  # type: ignore[arg-type]
                                                 node_id=f"trainjob-worker-{i // per}"), self.n, applied,
                           self.relays[i // per] if self.relay else None, host=hosts[i],
                           pod=self.relays[i // per] if self.pod_fanout and self.relay else None,
                           hop=self.hop if self.pod_fanout else 0.0)
                      for i in range(self.n)]

    def _patched(self) -> Any:
        real = Coordinator.parse
        return mock.patch.object(Coordinator, "parse",
                                 lambda coord, kvs, rev: self.reads.parse(real, coord, kvs, rev))

    def setup(self) -> None:
        """Every rank starts (lease, alive key) and arrives at iteration 0; one of them seals it."""
        with self._patched():
            for r in self.ranks:
                r.coord.start()
                r.coord.arrive(0, ArrivalRecord(slot=r.coord.slot, node_id=r.coord.node_id))
            first = self.ranks[0]
            view = first.coord.view()
            me = Participant(slot=0, node_id=first.coord.node_id, slots=self.n, target_world=self.n)
            seal = first.coord.try_seal(plan_seal(view, 0, me, RankAssignment(), timed_out=False))
        self.seal0 = seal
        sealer = barrier_sealer(seal)
        narrow = sealer_parts(1, seal, self.n)
        for r in self.ranks:
            r.sealer = r.coord.slot == sealer
            if r.sealer:
                r.parts = None if narrow is None else tuple(narrow)
        self.sim._sent = len(self.sim.mem.log)  # the setup's changes are old news
        self.sim.committed_at = [0.0] * len(self.sim.mem.log)

    def restart(self, limit: float = 600.0) -> dict[str, Any]:
        """Rank ``n // 3`` reports a fault; run until every rank is released into iteration 1."""
        self.setup()
        sim = self.sim
        start = sim.server.busy_until + 1.0
        if self.background is not None:
            sim.background(self.background, start - 1.0, start + limit)
            sim.run(start)
        sim.now = start
        writes0, reads0, requests0 = sim.mem.counters.proposals, sim.mem.counters.reads, len(sim.server.done_at)
        base = self.ranks[0].coord.base
        # Each rank's monitor: one watch on the fault records and the heartbeats' deletions.
        monitor = (WatchRange(base + FAULT, prefix=True), WatchRange(base + ALIVE, prefix=True, no_put=True))
        rng = random.Random(7)
        aborts = [self.abort + rng.uniform(0.0, self.abort_spread) for _ in self.ranks]
        for r in self.ranks:
            sim.subscribe(monitor, sim.mem.revision_now + 1,
                          lambda evs, when, r=r, a=aborts[r.coord.slot]: r.on_monitor(evs, when, a),  # type: ignore[misc]
                          group=r.pod, hop=r.hop, owner=r.cpu, created_now=False)
        with self._patched():
            culprit = self.ranks[self.n // 3]
            position = len(sim.mem.log)
            culprit.coord.report_fault(FaultRecord(slot=culprit.coord.slot, rank=culprit.coord.slot,
                                                   node_id=culprit.coord.node_id, iteration=0,
                                                   kind="exception", reason="injected", time=0.0))
            fault_at = sim.committed_at[position]
            sim.run(start + limit, stop=lambda: all(r.state == "released" for r in self.ranks))
        released = [r.released_at for r in self.ranks if r.released_at is not None]
        written = {ev.kv.key for ev in sim.mem.log[position:] if ev.type == "put"}
        seal_key = self.ranks[0].coord.round_keys.seal(1)
        seals = [ev for ev in sim.mem.log if ev.type == "put" and ev.kv.key == seal_key]
        sealed_at = next((sim.committed_at[i] for i, ev in enumerate(sim.mem.log)
                          if ev.type == "put" and ev.kv.key == seal_key), None)
        return {"seconds": max(released) - fault_at if len(released) == self.n else None,
                "seal_seconds": None if sealed_at is None else sealed_at - fault_at,
                "released": len(released), "seals": len(seals),
                "relay_transactions": sum(r.transactions for r in self.relays), "keys_written": len(written),
                "writes": sim.mem.counters.proposals - writes0, "reads": sim.mem.counters.reads - reads0,
                "requests": len(sim.server.done_at) - requests0,
                "watch_events": sim.events_sent, "watch_bytes": sim.event_bytes_sent,
                "peak_requests_per_second": sim.server.peak_rate(), "cpu_seconds": dict(sim.cpu_seconds),
                "background_requests": sim.background_requests}

    def complete(self, limit: float = 600.0) -> dict[str, Any]:
        """Every rank's function returns in iteration 0 at once; run until every rank knows the iteration
        ended (the completion barrier: ``Coordinator.mark_done``, then the wrapper's ``_wait_end``)."""
        self.setup()
        sim, seal = self.sim, self.seal0
        assert seal is not None
        start = sim.server.busy_until + 1.0
        writes0 = sim.mem.counters.proposals
        base = self.ranks[0].coord.base
        parts = (WatchRange(f"{FAULT}0/", prefix=True), WatchRange(f"{END}0"))
        ranges = (*(WatchRange(base + p.key, prefix=p.prefix) for p in parts),
                  WatchRange(base + ALIVE, prefix=True, no_put=True))
        ended_at: dict[int, float] = {}

        def returned(r: Rank) -> None:
            with sim.working(r, "done"):
                last = r.coord.mark_done(seal)
            if last:
                ended_at[r.coord.slot] = sim.now
                return
            sim.at(sim.now, lambda: wait(r))

        def wait(r: Rank) -> None:
            with sim.working(r, "end"):
                view = r.coord.view(parts)
                known = completion_known(view, 0)
            if known is not None:
                ended_at[r.coord.slot] = sim.now
                return
            holder: list[Any] = [view, None]

            def deliver(events: list[WatchEvent], when: float) -> None:
                fresh = [ev for ev in events if ev.kv.mod_revision > holder[0].revision]
                if not fresh or r.coord.slot in ended_at:
                    return
                sim.now = when
                with sim.working(r, "end"):
                    holder[0] = r.applied(r.coord, holder[0], fresh)
                    known = completion_known(holder[0], 0)
                if known is not None:
                    ended_at[r.coord.slot] = sim.now
                    sim.unsubscribe(holder[1])
            holder[1] = sim.subscribe(ranges, view.revision + 1, sim.serial(r, deliver), owner=r)

        for r in self.ranks:
            sim.at(start, lambda r=r: returned(r))  # type: ignore[misc]
        with self._patched():
            sim.run(start + limit, stop=lambda: len(ended_at) == self.n)
        return {"seconds": max(ended_at.values()) - start if len(ended_at) == self.n else None,
                "ended": len(ended_at), "writes": sim.mem.counters.proposals - writes0,
                "watch_events": sim.events_sent, "cpu_seconds": dict(sim.cpu_seconds)}
