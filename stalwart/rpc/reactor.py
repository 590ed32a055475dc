"""The agent's event loop on its own thread, its tasks and its one timer heap.

Every piece of the agent's state is touched only on this loop; user threads enter through
:meth:`Reactor.call_soon` (or wait on :meth:`Reactor.run`). Deadlines, attempt timeouts and retry times are
entries of ONE :class:`~.timers.TimerHeap`, served by one loop callback armed for the earliest entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from stalwart.rpc.timers import Timer, TimerHeap

log = logging.getLogger(__name__)


class Reactor:
    """The loop of the agent named ``name``; :meth:`start` runs it on thread ``stalwart-rpc-<name>``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run_loop, name=f"stalwart-rpc-{name}", daemon=True)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.timers = TimerHeap()
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at: float | None = None
        self._progress: asyncio.Event | None = None

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self.thread.start()
        self.run(self._make_progress(), timeout=30)

    async def _make_progress(self) -> None:
        self._progress = asyncio.Event()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop from a user thread and wait for it."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("blocking RPC API called on the agent's own event loop; use rpc_async from "
                               "coroutine functions")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the loop. Does nothing once the loop is closed."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fn, *args)

    def time(self) -> float:
        return self.loop.time()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task of ours (shutdown cancels what is left of them, and only them)."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def schedule(self, due: float, action: Callable[[], Any]) -> Timer:
        timer = self.timers.schedule(due, action)
        if self._armed_at is None or due < self._armed_at:
            if self._armed is not None:
                self._armed.cancel()
            self._armed_at = due
            self._armed = self.loop.call_at(due, self._fire)
        return timer

    def cancel(self, timer: Timer | None) -> None:
        if timer is not None:
            self.timers.cancel(timer)

    def _fire(self) -> None:
        self._armed, self._armed_at = None, None
        for action in self.timers.pop_due(self.loop.time()):
            try:
                action()
            except Exception:
                log.exception("%s: scheduled action failed", self.name)
        due = self.timers.next_due()
        if due is not None and self._armed is None:
            self._armed_at = due
            self._armed = self.loop.call_at(due, self._fire)

    def disarm(self) -> None:
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None

    def poke(self) -> None:
        """Something changed: wake :meth:`wait_until`."""
        if self._progress is not None:
            self._progress.set()

    async def wait_until(self, pred: Callable[[], bool], deadline: float, flush: Callable[[], None]) -> bool:
        """Wait until ``pred()`` holds (True) or the loop time ``deadline`` passed (False); ``flush`` runs
        before every check after the first (work queued from other threads)."""
        assert self._progress is not None
        while not pred():
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                return False
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), min(remaining, 0.5))
            flush()
        return True
