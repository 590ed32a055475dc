"""N simulated agents through stalwart's real rendezvous: the driver, the pure protocol, the claim and the seal.

Each process is what one pod runs: its own :class:`~stalwart.agent.rendezvous.Rendezvous` (the real driver,
without its thread: the simulator feeds it the events its watch would bring) and its
:class:`~stalwart.agent.rendezvous.driver.NodeHandle`, registered with the real ``_register`` (lease grant,
create-if-absent transaction). A process reads and watches what the real driver does (``Rendezvous.load``: a
light view, or the whole prefix while one of its nodes holds the sealer's key), and reads again when that
changes. The holder plans and writes the manifest with the real ``step``/``plan_round``/``_seal``. A node
holds a round when the real ``_round_info`` (what ``join`` returns) gives it one. ``shared=True`` runs every
node in one process with one driver and one watch, as ``bench/rendezvous.py`` does (the validation rows).

Sharing, not shortcuts: every process that is sent one manifest decodes the same bytes into the same immutable
round, so the simulator decodes it once per epoch and hands every process that result, charging each the CPU
the decode took (see :mod:`.sim`: a process's driver steps are charged their CPU time, ``driver``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any
from unittest import mock

from bench.scalesim.sim import Background, Costs, Sim, Subscription, TimedStore
from stalwart.agent.rendezvous import view as views
from stalwart.agent.rendezvous.driver import NodeHandle, Rendezvous, _to_event
from stalwart.agent.rendezvous.protocol import ClaimFailed, KeyPut, Observed, SealedRound, SealFailed, Tick
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.api.manifest import MANIFEST_PARTS, decode_manifest
from stalwart.api.rendezvous import Manifest, NodeRecord
from stalwart.etcd.keys import MANIFEST, NODES, JobKeys
from stalwart.etcd.store import WatchEvent

KEYS = JobKeys("scale", "sim0")
PREFIX = KEYS.rendezvous


class SharedManifests:
    """``view._sealed`` computed once per epoch and set of buckets held: one manifest per revision, and the
    same header and buckets decode to the same round for every process."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.rounds: dict[tuple[int, bool, frozenset[tuple[str, int]]], tuple[SealedRound, float]] = {}
        self.decoded = 0

    def sealed(self, ev: KeyPut, parts: Any, *, whole: bool) -> SealedRound:
        key = (ev.mod_revision, whole, frozenset((k, hash(v)) for k, (v, _) in parts.items()) if not whole
               else frozenset())
        got = self.rounds.get(key)
        if got is None:
            # Raises while buckets are missing: nothing is kept then.
            got = self.rounds[key] = self.sim.measured(lambda: self._real(ev, parts, whole=whole))
            self.decoded += 1
        else:
            self.sim.charge(got[1])  # this process decodes the same bytes itself
        return got[0]

    _real = staticmethod(views._sealed)

    @contextmanager
    def installed(self) -> Iterator[None]:
        with mock.patch.object(views, "_sealed", self.sealed):
            yield


@dataclass
class Node:
    """One node of a simulated process, and when it held each round (epoch -> simulated second)."""

    proc: Proc
    handle: NodeHandle
    last_epoch: int = 0
    held: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)

    def register(self) -> None:
        with self.proc.sim.working(self.proc, "driver"):
            self.handle._register(math.inf)
            self.proc.after()


@dataclass
class Proc:
    """One simulated process: a driver, its watch (a subscription to the model's fan-out) and its nodes."""

    sim: Sim
    rdzv: Rendezvous
    nodes: list[Node] = field(default_factory=list)
    sub: Subscription | None = None
    alive: bool = True
    loads: int = 0
    #: Puts of node keys this process was sent (a light view is sent none).
    node_puts: int = 0
    _tick_at: float | None = None

    def start(self) -> None:
        """The driver's first read; pods start together, so every read is sent at once."""
        with self.sim.working(self, "driver"):
            self.load()
        for node in self.nodes:
            self.sim.at(self.sim.now, node.register)

    def load(self) -> None:
        """What the driver's loop does when it (re)starts its watch: read, watch from the next revision."""
        if self.sub is not None:
            self.sim.unsubscribe(self.sub)
        loaded, ranges = self.rdzv.load()
        self.loads += 1
        self.sub = self.sim.subscribe(ranges, loaded.view.revision + 1, self.sim.serial(self, self.deliver),
                                     owner=self)
        self.rdzv._feed(replace(loaded, now=self.sim.now))
        self.rdzv.read_buckets()
        self.after()

    def deliver(self, events: list[WatchEvent], when: float) -> None:
        if not self.alive:
            return
        self.sim.now = when
        self.node_puts += sum(1 for ev in events if ev.type == "put" and ev.kv.key.startswith(PREFIX + NODES))
        with self.sim.working(self, "driver"):
            self.rdzv._feed(Observed(tuple(_to_event(PREFIX, ev) for ev in events), self.sim.now))
            self.rdzv.read_buckets()
            self.after()

    def after(self) -> None:
        """What the driver's thread and the nodes' ``join`` would do next."""
        rdzv, now = self.rdzv, self.sim.now
        if rdzv._seal_retry_at is not None:
            rdzv._seal_retry_at = None
            self.sim.at(now + 0.35, lambda: self._feed_at(SealFailed))
        if rdzv._claim_retry_at is not None:
            rdzv._claim_retry_at = None
            self.sim.at(now + 0.35, lambda: self._feed_at(ClaimFailed))
        if rdzv._wake_at is not None and self._tick_at != rdzv._wake_at:
            self._tick_at = rdzv._wake_at
            self.sim.at(rdzv._wake_at, lambda: self._feed_at(Tick))
        if rdzv.wants_full() != rdzv.view().full:
            self.load()
            return
        view = rdzv.view()
        for node in self.nodes:
            if node.handle._holds_own_entry(view):
                info = node.handle._round_info(view, node.last_epoch)
                if info is not None:
                    node.last_epoch = info.epoch
                    node.held[info.epoch] = now
                    node.roles[info.epoch] = info.role

    def _feed_at(self, kind: type[SealFailed] | type[ClaimFailed] | type[Tick]) -> None:
        if self.alive:
            with self.sim.working(self, "driver"):
                self.rdzv._feed(kind(self.sim.now))
                self.after()


class _SealErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@dataclass
class RendezvousRun:
    """A simulated job: N agents and a spare, one first round, then (optionally) one node lost."""

    n: int
    costs: Costs
    record_limit: int | None = None  # raise the record cap (a what-if); None: the project's own
    spare: bool = True  # a spare stands by (it replaces the lost node in lose_one)
    shared: bool = False  # every node in one process, one driver and one watch (bench/rendezvous.py)
    #: The nodes (the spare last) in this many processes, each one driver and one watch, contiguous and as even
    #: as can be (the real validation's layout); ``None``: as ``shared`` says.
    processes: int | None = None
    cpu: bool = True  # charge the project's code its CPU time (see .sim)
    #: The running job's steady requests (.sim.Background) during a re-rendezvous (the first round has none:
    #: no rank runs yet, and the nodes' leases are granted as they register). None: none.
    background: Background | None = None
    sim: Sim = field(init=False)
    procs: list[Proc] = field(init=False)
    agents: list[Node] = field(init=False)
    errors: _SealErrors = field(init=False)

    def __post_init__(self) -> None:
        self.sim = Sim(self.costs, cpu=self.cpu, threads=self.processes is not None)
        self.shared_manifests = SharedManifests(self.sim)
        store = TimedStore(self.sim)
        settings = RendezvousSettings(min_nodes=self.n, max_nodes=self.n, node_ttl=30, join_timeout=600)
        self.procs = []
        self.agents = []
        total = self.n + (1 if self.spare else 0)
        if self.processes is not None and not 1 <= self.processes <= total:
            raise ValueError(f"processes: expected 1 to {total} (a node at least each), got {self.processes}")
        starts = {total * p // self.processes for p in range(self.processes)} if self.processes else set()
        for i in range(total):
            if not self.procs or (i in starts if self.processes else not self.shared):
                self.procs.append(Proc(self.sim, Rendezvous(store, KEYS, settings)))  # type: ignore[arg-type]
            proc = self.procs[-1]
            rec = NodeRecord(node_id=f"trainjob-worker-{i}" if i < self.n else "trainjob-spare-0",
                             address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", nproc=8,
                             spare=i == self.n)
            handle = NodeHandle(proc.rdzv, rec)
            proc.rdzv._handles[rec.node_id] = handle
            node = Node(proc, handle)
            proc.nodes.append(node)
            self.agents.append(node)
        self.errors = _SealErrors()

    @contextmanager
    def _patched(self) -> Iterator[None]:
        log = logging.getLogger("stalwart.agent.rendezvous.driver")
        log.addHandler(self.errors)
        try:
            with self.shared_manifests.installed():
                if self.record_limit is None:
                    yield
                else:
                    with mock.patch("stalwart.api.base.MAX_RECORD_BYTES", self.record_limit), \
                            mock.patch.object(self.sim.mem, "value_limit", self.record_limit):
                        yield
        finally:
            log.removeHandler(self.errors)

    def manifests(self) -> list[tuple[int, Manifest]]:
        """Every manifest written, with its epoch, in order."""
        out: list[tuple[int, Manifest]] = []
        parts: dict[str, tuple[bytes, int]] = {}
        with self._patched():
            for ev in self.sim.mem.log:
                if ev.type == "put" and ev.kv.key.startswith(PREFIX + MANIFEST_PARTS):
                    parts[ev.kv.key[len(PREFIX):]] = (ev.kv.value, ev.kv.mod_revision)
                elif ev.type == "put" and ev.kv.key == PREFIX + MANIFEST:
                    out.append((ev.kv.mod_revision, decode_manifest(ev.kv.value, ev.kv.mod_revision, parts)))
        return out

    def first_round(self, limit: float = 60.0) -> dict[str, Any]:
        """Every agent starts at 0; run until every ordinary node holds round 1 or ``limit`` seconds."""
        ordinary = self.agents[:self.n]
        with self._patched():
            for p in self.procs:
                self.sim.at(0.0, p.start)
            # A manifest over the record cap is refused before it is sent, at every retry alike: stop there.
            self.sim.run(limit, stop=lambda: all(a.held for a in self.agents) or any(
                "limit is" in m for m in self.errors.messages))
        done = [min(a.held.values()) for a in ordinary if a.held]
        sealed = self.manifests()
        return {"sealed": bool(sealed), "seconds": max(done) if len(done) == self.n else None,
                "seal_seconds": self.sim.committed_at[self._log_index(sealed[0][0])] if sealed else None,
                "nodes_done": len(done), "writes": self.sim.mem.counters.proposals,
                "peak_requests_per_second": self.sim.server.peak_rate(),
                "manifest_bytes": len(self._manifest_value()),
                "watch_events": self.sim.events_sent, "watch_bytes": self.sim.event_bytes_sent,
                "error": self.errors.messages[-1] if self.errors.messages and not sealed else None}

    def lose_one(self, limit: float = 60.0) -> dict[str, Any]:
        """One member's lease ends (etcd revokes it); run until every survivor holds the next round."""
        victim = self.agents[self.n // 2]
        survivors = [a for a in self.agents if a is not victim]
        epoch = victim.last_epoch
        writes0 = self.sim.mem.counters.proposals
        start = max(self.sim.now, self.sim.server.busy_until) + 1.0
        if self.background is not None:
            self.sim.background(self.background, start - 1.0, start + limit)
            self.sim.run(start - 1e-9)
        self.sim.now = start
        if not self.shared and self.processes is None:
            # The pod is gone with its process; in a process of several nodes only its node goes.
            victim.proc.alive = False
            if victim.proc.sub is not None:
                self.sim.unsubscribe(victim.proc.sub)
        victim.proc.nodes.remove(victim)
        position = len(self.sim.mem.log)
        with self._patched():
            assert victim.handle.lease is not None
            TimedStore(self.sim).lease_revoke(victim.handle.lease)
            lost_at = self.sim.committed_at[position]
            self.sim.run(start + limit, stop=lambda: all(max(a.held, default=0) > epoch for a in survivors))
        later = [max(a.held.values()) for a in survivors if max(a.held, default=0) > epoch]
        sealed = [m for m in self.manifests() if m[0] > epoch]
        return {"seconds": max(later) - lost_at if len(later) == len(survivors) else None,
                "seal_seconds": self.sim.committed_at[self._log_index(sealed[0][0])] - lost_at if sealed else None,
                "nodes_done": len(later), "writes": self.sim.mem.counters.proposals - writes0}

    def _log_index(self, revision: int) -> int:
        return next(i for i, ev in enumerate(self.sim.mem.log) if ev.kv.mod_revision == revision)

    def _manifest_value(self) -> bytes:
        """The manifest's bytes as written: its header and the parts of the header's revision."""
        kv = self.sim.mem.keys.get(PREFIX + MANIFEST)
        if kv is None:
            return b""
        kvs, _ = self.sim.mem.get_prefix(PREFIX + MANIFEST_PARTS)
        return kv.value + b"".join(p.value for p in kvs if p.mod_revision == kv.mod_revision)
