"""Fault injection: a transport that wraps the real one and drops, duplicates, reorders and delays messages.

Faults are drawn from a seeded random generator per message type and direction, so a failing run can be
replayed. A dropped message is silently lost (the sender only notices through its attempt timeout), a
duplicate is sent twice, a delayed one is sent after a random delay, and a reordered one is held back until
the next message on the same path has gone (or a short time has passed). Used by the tests; it can also
harden a deployment's own code against a bad network.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.rpc.transport import (
    LinkDownHandler,
    OutFrame,
    ReplyChannel,
    ReplyHandler,
    RequestHandler,
    Transport,
)


@dataclass(frozen=True, slots=True)
class Faults:
    """Probabilities (each in [0, 1]) of what happens to one message, and the delay range in seconds."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_range: tuple[float, float] = (0.001, 0.05)

    def __post_init__(self) -> None:
        for name in ("drop", "duplicate", "reorder", "delay"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}: a probability in [0, 1], got {p}")
        lo, hi = self.delay_range
        if not 0.0 <= lo <= hi:
            raise ValueError(f"delay_range: expected 0 <= low <= high, got {self.delay_range}")


@dataclass
class FaultStats:
    """How many faults were injected, by kind (tests check that the faults really happened)."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1


class FaultyTransport:
    """Wraps ``inner``; ``requests``/``replies`` map message types (``call``, ``fork``, ...; ``*`` for any
    other) to the :class:`Faults` applied to requests and replies of that type."""

    def __init__(self, inner: Transport, *, seed: int, requests: Mapping[str, Faults] | None = None,
                 replies: Mapping[str, Faults] | None = None, reorder_flush: float = 0.05) -> None:
        self.inner = inner
        self.rng = random.Random(seed)
        self.requests = dict(requests or {})
        self.replies = dict(replies or {})
        self.stats = FaultStats()
        self._held: dict[Any, tuple[Any, OutFrame, str, bool]] = {}
        self._flush = reorder_flush
        self._tasks: set[asyncio.Task[None]] = set()

    def configure(self, *, seed: int | None = None, requests: Mapping[str, Faults] | None = None,
                  replies: Mapping[str, Faults] | None = None) -> None:
        """Change the faults (call on the agent's loop, or before the agent starts)."""
        if seed is not None:
            self.rng = random.Random(seed)
        if requests is not None:
            self.requests = dict(requests)
        if replies is not None:
            self.replies = dict(replies)

    def set_handlers(self, on_request: RequestHandler, on_reply: ReplyHandler,
                     on_link_down: LinkDownHandler) -> None:
        self.inner.set_handlers(on_request, on_reply, on_link_down)

    async def start(self, host: str, port: int) -> str:
        return await self.inner.start(host, port)

    async def _deliver(self, path: Any, frame: OutFrame, mtype: str, is_request: bool) -> None:
        if is_request:
            await self.inner.send_request(path, frame, mtype)
        else:
            await self.inner.send_reply(path, frame, mtype)

    def _later(self, delay: float, path: Any, frame: OutFrame, mtype: str, is_request: bool) -> None:
        async def go() -> None:
            await asyncio.sleep(delay)
            with contextlib.suppress(Exception):  # a lost delayed message is just another drop
                await self._deliver(path, frame, mtype, is_request)

        task = asyncio.get_running_loop().create_task(go())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, path: Any, frame: OutFrame, mtype: str, is_request: bool) -> None:
        table = self.requests if is_request else self.replies
        faults = table.get(mtype) or table.get("*")
        key = (id(path) if not isinstance(path, str) else path, is_request)
        if faults is None:
            await self._deliver(path, frame, mtype, is_request)
            await self._release_held(key)
            return
        rng = self.rng
        if rng.random() < faults.drop:
            self.stats.add(f"drop:{mtype}")
            return
        if rng.random() < faults.reorder and key not in self._held:
            self.stats.add(f"reorder:{mtype}")
            self._held[key] = (path, frame, mtype, is_request)
            loop = asyncio.get_running_loop()
            loop.call_later(self._flush, lambda: self._flush_held(key))
            return
        copies = 2 if rng.random() < faults.duplicate else 1
        if copies == 2:
            self.stats.add(f"duplicate:{mtype}")
        for _ in range(copies):
            if rng.random() < faults.delay:
                self.stats.add(f"delay:{mtype}")
                self._later(rng.uniform(*faults.delay_range), path, frame, mtype, is_request)
            else:
                await self._deliver(path, frame, mtype, is_request)
        await self._release_held(key)

    async def _release_held(self, key: Any) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            with contextlib.suppress(Exception):
                await self._deliver(*held)

    def _flush_held(self, key: Any) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._later(0.0, *held)

    async def send_request(self, address: str, frame: OutFrame, mtype: str) -> None:
        await self._send(address, frame, mtype, True)

    async def send_reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None:
        await self._send(channel, frame, mtype, False)

    def send_request_nowait(self, address: str, frame: OutFrame) -> bool:
        return False  # every message goes through the fault draw

    def send_reply_nowait(self, channel: ReplyChannel, frame: OutFrame) -> bool:
        return False

    async def disconnect(self, address: str) -> None:
        await self.inner.disconnect(address)

    async def stop(self, grace: float) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._held.clear()
        await self.inner.stop(grace)
