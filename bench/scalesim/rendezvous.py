"""N simulated agents through stalwart's real rendezvous: the driver, the pure protocol and the seal.

Each agent is what one pod runs: its own :class:`~stalwart.agent.rendezvous.Rendezvous` (the real driver,
without its thread: the simulator feeds it the events its prefix watch would bring) and its own
:class:`~stalwart.agent.rendezvous.driver.NodeHandle`, registered with the real ``_register`` (lease grant,
create-if-absent transaction). The oldest node's driver plans and writes the manifest with the real
``step``/``plan_round``/``_seal``. A node holds a round when the real ``_round_info`` (what ``join`` returns)
gives it one.

Sharing, not shortcuts: every agent applies the same changes to the same view, and ``protocol.apply`` is
pure, so the simulator computes each (view, batch) once and hands every agent the same immutable result.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from bench.scalesim.sim import Costs, Sim, TimedStore
from stalwart.agent.rendezvous import protocol
from stalwart.agent.rendezvous.driver import NodeHandle, Rendezvous, _to_event
from stalwart.agent.rendezvous.protocol import KeyEvent, KeyPut, Observed, Reloaded, SealFailed, Tick, View
from stalwart.agent.rendezvous.settings import RendezvousSettings
from stalwart.api.rendezvous import MANIFEST_PARTS, Manifest, NodeRecord, decode_manifest
from stalwart.etcd.keys import MANIFEST, JobKeys

KEYS = JobKeys("scale", "sim0")
PREFIX = KEYS.rendezvous


class SharedViews:
    """Views by log position and change batches by log range, so N agents share one ``apply`` per batch."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.views: dict[int, View] = {}
        self.position: dict[int, int] = {}  # id(view) -> log position
        self.batches: dict[tuple[int, int], tuple[KeyEvent, ...]] = {}
        self.batch_range: dict[int, tuple[int, int]] = {}  # id(batch) -> (start, end)
        self.applied = 0

    def batch(self, start: int, end: int) -> tuple[KeyEvent, ...]:
        b = self.batches.get((start, end))
        if b is None:
            b = tuple(_to_event(PREFIX, ev) for ev in self.sim.mem.log[start:end]
                      if ev.kv.key.startswith(PREFIX))
            self.batches[(start, end)] = b
            self.batch_range[id(b)] = (start, end)
        return b

    def at(self, position: int, view: View) -> View:
        """The shared view at ``position`` (``view`` itself when it is the first one seen there)."""
        shared = self.views.setdefault(position, view)
        self.position[id(shared)] = position
        return shared

    def apply(self, view: View, events: Any) -> View:
        """``protocol.apply``, computed once per log position: a view is a function of the log up to it."""
        rng = self.batch_range.get(id(events))
        if rng is None or self.position.get(id(view)) != rng[0]:
            return self._real_apply(view, events)
        shared = self.views.get(rng[1])
        if shared is None:
            self.applied += 1
            shared = self.at(rng[1], self._real_apply(view, events))
        return shared

    _real_apply = staticmethod(protocol.apply)

    @contextmanager
    def installed(self) -> Iterator[None]:
        with mock.patch.object(protocol, "apply", self.apply):
            yield


@dataclass
class Agent:
    """One simulated pod: a driver, one node, and when it held each round (epoch -> simulated second)."""

    sim: Sim
    shared: SharedViews
    rdzv: Rendezvous
    handle: NodeHandle
    cursor: int = 0
    alive: bool = True
    last_epoch: int = 0
    held: dict[int, float] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    _tick_at: float | None = None

    def start(self) -> None:
        """The driver's first read of the prefix; pods start together, so every read is sent at once."""
        kvs, revision = self.rdzv.store.get_prefix(PREFIX)
        self.cursor = len(self.sim.mem.log)
        view = self.shared.views.get(self.cursor)
        if view is None:
            # As the driver's loop builds its first view from a read of the prefix.
            view = protocol.apply(View(), [KeyPut(kv.key[len(PREFIX):], kv.value, kv.create_revision,
                                                  kv.mod_revision, kv.lease) for kv in kvs])
            view = self.shared.at(self.cursor, View(
                revision=revision, nodes=view.nodes, sealed=view.sealed, request=view.request,
                closed=view.closed, expected=view.expected, oldest=view.oldest, problems=view.problems))
        self.rdzv._feed(Reloaded(view, self.sim.now))
        self.sim.at(self.sim.now, self.register)

    def register(self) -> None:
        self.handle._register(math.inf)
        self.after()

    def deliver(self, start: int, end: int, when: float) -> None:
        if not self.alive or end <= self.cursor:
            return
        self.sim.now = when
        batch = self.shared.batch(self.cursor, end)
        self.cursor = end
        if batch:
            self.rdzv._feed(Observed(batch, when))
        self.after()

    def after(self) -> None:
        """What the driver's thread and the node's ``join`` would do next."""
        rdzv, now = self.rdzv, self.sim.now
        if rdzv._seal_retry_at is not None:
            rdzv._seal_retry_at = None
            self.sim.at(now + 0.35, lambda: self._feed_at(SealFailed))
        if rdzv._wake_at is not None and self._tick_at != rdzv._wake_at:
            self._tick_at = rdzv._wake_at
            self.sim.at(rdzv._wake_at, lambda: self._feed_at(Tick))
        view = rdzv.view()
        if self.handle.create_revision is not None and view.revision >= self.handle.create_revision:
            info = self.handle._round_info(view, self.last_epoch)
            if info is not None:
                self.last_epoch = info.epoch
                self.held[info.epoch] = now
                self.roles[info.epoch] = info.role

    def _feed_at(self, kind: type[SealFailed] | type[Tick]) -> None:
        if self.alive:
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
    """A simulated job: N agents and a hot spare, one first round, then (optionally) one node lost."""

    n: int
    costs: Costs
    record_limit: int | None = None  # raise the record cap (a what-if); None: the project's own
    spare: bool = True  # a hot spare stands by (it replaces the lost node in lose_one)
    sim: Sim = field(init=False)
    agents: list[Agent] = field(init=False)
    errors: _SealErrors = field(init=False)

    def __post_init__(self) -> None:
        self.sim = Sim(self.costs)
        self.sim.watch_prefix = PREFIX
        self.shared = SharedViews(self.sim)
        store = TimedStore(self.sim)
        settings = RendezvousSettings(min_nodes=self.n, max_nodes=self.n, node_ttl=30, join_timeout=600)
        self.agents = []
        for i in range(self.n + (1 if self.spare else 0)):
            rdzv = Rendezvous(store, KEYS, settings)  # type: ignore[arg-type]
            rec = NodeRecord(node_id=f"trainjob-worker-{i}" if i < self.n else "trainjob-spare-0",
                             address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", nproc=8,
                             spare=i == self.n)
            handle = NodeHandle(rdzv, rec)
            rdzv._handles[rec.node_id] = handle
            agent = Agent(self.sim, self.shared, rdzv, handle)
            self.agents.append(agent)
            self.sim.watchers.append(agent.deliver)
        self.errors = _SealErrors()

    @contextmanager
    def _patched(self) -> Iterator[None]:
        log = logging.getLogger("stalwart.agent.rendezvous.driver")
        log.addHandler(self.errors)
        try:
            with self.shared.installed():
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
            for a in self.agents:
                self.sim.at(0.0, a.start)
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
        self.sim.now = start
        victim.alive = False
        self.sim.watchers.remove(victim.deliver)
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
