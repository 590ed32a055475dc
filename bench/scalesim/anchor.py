"""The anchor: one shared record updated by compare-and-swap, on the same simulated etcd.

This is the shape of torch's ``DynamicRendezvousHandler`` on an etcd or c10d backend (every node reads the
one state record, adds itself, and writes it back only if nobody wrote in between; a refused write returns
the current state and the node tries again) and of a store-based barrier on etcd (a counter, incremented
the same way, since etcd has no atomic add). Every node watches the record and is through when it shows
all ``n``. Here the record is a JSON list of the node ids (``grow``) or a count.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.scalesim.sim import Costs, Sim, TimedStore
from stalwart.etcd.store import Compare, Get, Put

KEY = "/scale/anchor/state"


@dataclass
class CasRun:
    n: int
    costs: Costs
    grow: bool = True
    sim: Sim = field(init=False)
    through: dict[int, float] = field(default_factory=dict)
    refused: int = 0

    def __post_init__(self) -> None:
        self.sim = Sim(self.costs)
        self.sim.watch_prefix = KEY
        self.store = TimedStore(self.sim)
        self.joined: set[int] = set()
        for i in range(self.n):
            self.sim.watchers.append(self._watcher(i))

    def _watcher(self, i: int) -> Callable[[int, int, float], None]:
        def deliver(start: int, end: int, when: float) -> None:
            self._notified(i, end, when)
        return deliver

    def _value(self, current: bytes, i: int) -> bytes:
        if self.grow:
            return json.dumps([*json.loads(current or b"[]"), f"trainjob-worker-{i}"]).encode()
        return str(int(current or b"0") + 1).encode()

    def _size(self, value: bytes) -> int:
        return len(json.loads(value)) if self.grow else int(value)

    def _attempt(self, i: int, current: bytes, mod: int) -> None:
        res = self.store.txn([Compare(KEY, "mod", "==", mod)], [Put(KEY, self._value(current, i))], [Get(KEY)])
        if res.succeeded:
            self.joined.add(i)
            return
        self.refused += 1
        kv = res.responses[0][0]
        self.sim.at(self.sim.now, lambda: self._attempt(i, kv.value, kv.mod_revision))

    def _start(self, i: int) -> None:
        kv = self.store.get(KEY)
        value, mod = (kv.value, kv.mod_revision) if kv else (b"", 0)
        self.sim.at(self.sim.now, lambda: self._attempt(i, value, mod))

    def _notified(self, i: int, end: int, when: float) -> None:
        if i in self.through:
            return
        kv = self.sim.mem.log[end - 1].kv
        if self._size(kv.value) == self.n:
            self.through[i] = when

    def run(self, limit: float = 3600.0) -> dict[str, Any]:
        for i in range(self.n):
            self.sim.at(0.0, functools.partial(self._start, i))
        self.sim.run(limit, stop=lambda: len(self.through) == self.n)
        return {"seconds": max(self.through.values()) if len(self.through) == self.n else None,
                "nodes_done": len(self.through), "writes": self.sim.mem.counters.proposals,
                "refused": self.refused, "watch_events": self.sim.events_sent,
                "watch_bytes": self.sim.event_bytes_sent}
