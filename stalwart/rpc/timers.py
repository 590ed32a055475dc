"""One time-ordered heap for every pending retry and timeout of an agent (the pure data structure).

The agent serves all of them from one scheduler task that sleeps until :meth:`TimerHeap.next_due` and then
fires :meth:`TimerHeap.pop_due`: there is no thread, timer or sleeping task per request. Cancelling is O(1)
(the entry is marked dead and skipped when it reaches the top); dead entries are compacted away when they
outnumber the live ones, so the heap stays O(live) in size and each operation O(log n) amortised.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Timer:
    """A handle on one scheduled entry; :meth:`TimerHeap.cancel` takes it."""

    __slots__ = ("action", "due", "live", "seq")

    def __init__(self, due: float, seq: int, action: Callable[[], Any]) -> None:
        self.due = due
        self.seq = seq
        self.action: Callable[[], Any] | None = action
        self.live = True

    def __lt__(self, other: Timer) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


class TimerHeap:
    """Entries ordered by due time (ties: first scheduled first). Not thread-safe: one owner drives it."""

    def __init__(self) -> None:
        self._heap: list[Timer] = []
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        """The number of live (not cancelled, not yet fired) entries."""
        return self._live

    def schedule(self, due: float, action: Callable[[], Any]) -> Timer:
        """Add an entry firing ``action`` at time ``due`` (same clock as :meth:`pop_due`'s ``now``)."""
        timer = Timer(due, next(self._seq), action)
        heapq.heappush(self._heap, timer)
        self._live += 1
        return timer

    def cancel(self, timer: Timer) -> bool:
        """Cancel ``timer``; False if it already fired or was cancelled."""
        if not timer.live:
            return False
        timer.live = False
        timer.action = None  # what it would have run may hold large objects; let them go now
        self._live -= 1
        if len(self._heap) > 64 and len(self._heap) > 2 * self._live:
            self._heap = [t for t in self._heap if t.live]
            heapq.heapify(self._heap)
        return True

    def next_due(self) -> float | None:
        """The due time of the earliest live entry, or None when there is none."""
        heap = self._heap
        while heap and not heap[0].live:
            heapq.heappop(heap)
        return heap[0].due if heap else None

    def pop_due(self, now: float) -> list[Callable[[], Any]]:
        """Remove and return the actions of every live entry due at or before ``now``, earliest first."""
        heap = self._heap
        actions: list[Callable[[], Any]] = []
        while heap and heap[0].due <= now:
            timer = heapq.heappop(heap)
            if timer.live and timer.action is not None:
                timer.live = False
                self._live -= 1
                actions.append(timer.action)
                timer.action = None
        return actions
