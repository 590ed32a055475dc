"""N simulated rank processes through one in-process restart of the whole world, on the real coordination code.

Each rank has its own :class:`~stalwart.restart.coordination.Coordinator` (the real etcd side: fenced fault
report, arrival, prefix read and parse, create-if-absent seal) over the simulated store; the seal's rank
assignment is the real ``_Session._decide`` (``RankAssignment.assign``). What the wrapper's loop does
between those calls is followed step by step, as the wrapper on this branch does it:

1. one rank reports a fault in iteration 0; every rank's monitor watch (one per rank, on the epoch's prefix)
   brings it, and the rank is interrupted (``abort`` simulated seconds, 0 by default: the process group's
   teardown is measured by ``bench/restart.py``, not here);
2. the rank arrives at the barrier of iteration 1 (``ensure_lease``: a lease read; a fenced put), reads the
   epoch's prefix, and, while not every slot has arrived, watches the prefix (a second watch) and reads the
   whole prefix again after every batch of changes (``Coordinator.wait_until``);
3. the first rank that reads every arrival writes the seal; a rank is **released** when a read shows it.

The barrier's completion rule is the real ``barrier_complete``.
Every rank's read at one revision returns the same bytes, so the simulator reads and parses once per
revision (with the real ``Coordinator.parse``) and charges every rank's read to the model server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from bench.scalesim.sim import Costs, Sim, TimedStore
from stalwart.api.rendezvous import Manifest, Member
from stalwart.api.restart import ArrivalRecord, FaultRecord, SealRecord
from stalwart.etcd.keys import MANIFEST, JobKeys
from stalwart.etcd.store import KeyValue
from stalwart.restart.assignment import RankAssignment
from stalwart.restart.coordination import Coordinator
from stalwart.restart.protocol import EpochView, Participant, barrier_complete, plan_seal

KEYS = JobKeys("scale", "sim1")


class _Reads:
    """One read and one parse per (prefix, revision): every rank reading then gets the same answer."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.kvs: dict[tuple[str, int], tuple[list[KeyValue], int]] = {}
        self.cost: dict[tuple[str, int], float] = {}
        self.parsed: dict[tuple[str, int], EpochView] = {}

    def get_prefix(self, store: TimedStore, prefix: str) -> tuple[list[KeyValue], int]:
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
        return self.sim.request(self.cost[key], lambda: hit)

    def parse(self, real: Any, coord: Coordinator, kvs: list[KeyValue], revision: int) -> EpochView:
        key = (coord.base, revision)
        view = self.parsed.get(key)
        if view is None:
            view = self.parsed[key] = real(coord, kvs, revision)
        return view


@dataclass
class Rank:
    sim: Sim
    coord: Coordinator
    slots: int
    state: str = "running"  # running -> waiting -> released
    seen: int = 0  # the revision of the last read
    released_at: float | None = None
    releases: int = 0
    seal: SealRecord | None = None

    def deliver(self, batch: tuple[bool, int], when: float, abort: float) -> None:
        """A batch of changes under the epoch's prefix: (has a fault in iteration 0, its last revision)."""
        fault, last = batch
        if self.state == "running":
            if fault:
                self.state = "aborting"
                self.sim.at(when + abort, self.arrive)
        elif self.state == "waiting" and last > self.seen:
            self.sim.now = when
            self.check()

    def arrive(self) -> None:
        self.coord.arrive(1, ArrivalRecord(slot=self.coord.slot, node_id=self.coord.node_id))
        self.state = "waiting"
        # The read is a new request, sent when the put's answer is back: other ranks' puts sent before it
        # are served first.
        self.sim.at(self.sim.now, self.check)

    def check(self) -> None:
        if self.state == "released":
            return
        view = self.coord.view()
        self.seen = view.revision
        seal = view.seals.get(1)
        if seal is None and barrier_complete(view, 1, self.slots):
            me = Participant(slot=self.coord.slot, node_id=self.coord.node_id, slots=self.slots,
                             target_world=self.slots)
            seal = self.coord.try_seal(plan_seal(view, 1, me, RankAssignment(), timed_out=False))
        if seal is not None:
            self.seal, self.state, self.released_at = seal, "released", self.sim.now
            self.releases += 1


@dataclass
class RestartRun:
    """A world of ``n`` ranks at iteration 0 (set up through the same code, untimed); then one fault."""

    n: int
    costs: Costs
    abort: float = 0.0
    sim: Sim = field(init=False)
    ranks: list[Rank] = field(init=False)

    def __post_init__(self) -> None:
        self.sim = Sim(self.costs)
        self.sim.watch_prefix = KEYS.restart
        self.sim.streams = 2  # the monitor's watch and the barrier's, per rank
        self.reads = _Reads(self.sim)
        self.store = TimedStore(self.sim)
        self.store.get_prefix = lambda prefix, **_: self.reads.get_prefix(self.store, prefix)  # type: ignore[method-assign]
        manifest = Manifest(round=1, members=[Member(node_id="trainjob-worker-0", address="10.0.0.1", group_rank=0,
                                                     rank_offset=0, nproc=self.n)],
                            world_size=self.n, master_addr="10.0.0.1", sealed_by="trainjob-worker-0")
        epoch = self.sim.mem.put(KEYS.rendezvous + MANIFEST, manifest.to_json_bytes())
        self.ranks = [Rank(self.sim, Coordinator(self.store, KEYS, epoch, slot=i,  # type: ignore[arg-type]
                                                 node_id=f"trainjob-worker-{i // 8}"), self.n)
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
            first.coord.try_seal(plan_seal(view, 0, me, RankAssignment(), timed_out=False))
        self.sim._sent = len(self.sim.mem.log)  # the setup's changes are old news
        self.sim.committed_at = [0.0] * len(self.sim.mem.log)

    def restart(self, limit: float = 600.0) -> dict[str, Any]:
        """Rank ``n // 3`` reports a fault; run until every rank is released into iteration 1."""
        self.setup()
        sim = self.sim
        start = sim.server.busy_until + 1.0
        sim.now = start
        writes0, reads0 = sim.mem.counters.proposals, sim.mem.counters.reads
        summaries: dict[tuple[int, int], tuple[bool, int]] = {}
        base = self.ranks[0].coord.base

        def summary(s: int, e: int) -> tuple[bool, int]:
            if (s, e) not in summaries:
                events = [ev for ev in sim.mem.log[s:e] if ev.kv.key.startswith(base)]
                summaries[(s, e)] = (any(ev.type == "put" and ev.kv.key.startswith(base + "fault/0/")
                                         for ev in events), max((ev.kv.mod_revision for ev in events), default=0))
            return summaries[(s, e)]
        def watcher(r: Rank) -> Callable[[int, int, float], None]:
            return lambda s, e, w: r.deliver(summary(s, e), w, self.abort)
        sim.watchers.extend(watcher(r) for r in self.ranks)
        with self._patched():
            culprit = self.ranks[self.n // 3]
            position = len(sim.mem.log)
            culprit.coord.report_fault(FaultRecord(slot=culprit.coord.slot, rank=culprit.coord.slot,
                                                   node_id=culprit.coord.node_id, iteration=0,
                                                   kind="exception", reason="injected", time=0.0))
            fault_at = sim.committed_at[position]
            sim.run(start + limit, stop=lambda: all(r.state == "released" for r in self.ranks))
        released = [r.released_at for r in self.ranks if r.released_at is not None]
        seals = [ev for ev in sim.mem.log if ev.type == "put" and ev.kv.key == self.ranks[0].coord.round_keys.seal(1)]
        return {"seconds": max(released) - fault_at if len(released) == self.n else None,
                "released": len(released), "seals": len(seals),
                "writes": sim.mem.counters.proposals - writes0, "reads": sim.mem.counters.reads - reads0,
                "watch_events": sim.events_sent, "watch_bytes": sim.event_bytes_sent,
                "peak_requests_per_second": sim.server.peak_rate()}
