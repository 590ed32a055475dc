"""The shape every control loop of the local cluster shares: one pass on every wake-up (an event it cares about)
and at least every ``period`` seconds, on the store's event loop; a failed pass is logged and the loop goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


class ControlLoop:
    """Subclasses implement :meth:`step` and call :meth:`wake` from their store listener."""

    def __init__(self, name: str, period: float) -> None:
        self.name = name
        self.period = period
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def step(self) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                self.step()
            except Exception:
                log.exception("%s: a pass failed", self.name)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.period)
