"""Retries and log lines during an outage (etcd unreachable, a watch that keeps breaking).

A loop that retries every tick floods the log and the server it waits for. :class:`Outage` keeps both quiet:
attempts during an outage are spaced by a capped exponential back-off with jitter, and the outage gets exactly
two log lines, one when it starts and one when it ends (with how long it lasted and how many attempts
failed). The decisions are pure functions over a frozen :class:`OutageState`, so the spacing and the log lines
are table-tested; :class:`Outage` is the small stateful shell that the I/O loops hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from stalwart.api.base import positive_seconds
from stalwart.jitter import RNG

__all__ = ["Backoff", "Outage", "OutageState", "attempt_due", "on_failure", "on_success"]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential back-off with jitter, validated on construction.

    The n-th consecutive failure waits ``min(cap, initial * factor ** (n - 1))`` seconds, scaled by a random
    factor in ``[1 - jitter, 1 + jitter]`` and capped again, so peers that failed together do not retry
    together.
    """

    initial: float = 0.2
    cap: float = 10.0
    factor: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        for name in ("initial", "cap"):
            positive_seconds(name, getattr(self, name))
        if self.cap < self.initial:
            raise ValueError(f"cap: must be >= initial ({self.initial}), got {self.cap}")
        if not self.factor >= 1:
            raise ValueError(f"factor: expected >= 1, got {self.factor!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter: expected 0 <= jitter < 1, got {self.jitter!r}")

    def delay(self, failures: int, u: float) -> float:
        """Seconds to wait after ``failures`` consecutive failures (>= 1); ``u`` is uniform in [0, 1)."""
        base = min(self.cap, self.initial * self.factor ** max(0, failures - 1))
        return min(self.cap, base * (1.0 - self.jitter + 2.0 * self.jitter * u))


@dataclass(frozen=True, slots=True)
class OutageState:
    """``since`` is the monotonic time the outage started (None: no outage); ``failures`` counts the failed
    attempts in it; no attempt is due before ``retry_at``."""

    since: float | None = None
    failures: int = 0
    retry_at: float = 0.0


def attempt_due(state: OutageState, now: float) -> bool:
    """Whether to try now: always outside an outage; during one, once its back-off has passed."""
    return state.since is None or now >= state.retry_at


def on_failure(state: OutageState, now: float, backoff: Backoff, u: float) -> tuple[OutageState, bool]:
    """The state after a failed attempt, and whether this failure starts the outage (log it)."""
    starts = state.since is None
    failures = state.failures + 1
    return OutageState(since=now if starts else state.since, failures=failures,
                       retry_at=now + backoff.delay(failures, u)), starts


def on_success(state: OutageState, now: float) -> tuple[OutageState, float | None, int]:
    """The state after a successful attempt, and (when this ends an outage) how long it lasted and how many
    attempts failed in it; ``(state, None, 0)`` when there was no outage."""
    if state.since is None:
        return state, None, 0
    return replace(state, since=None, failures=0, retry_at=0.0), now - state.since, state.failures


class Outage:
    """The shell around :class:`OutageState` for one retried operation (thread-safe).

    ``what`` names the operation in the two log lines (``"etcd for progress reports"``); ``context`` is
    prefixed to them (job, node). Call :meth:`due` before an attempt, then :meth:`failed` or :meth:`ok`.
    """

    def __init__(self, what: str, *, logger: logging.Logger, context: str = "", backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: Callable[[], float] = RNG.random) -> None:
        self.what = what
        self.log = logger
        self.context = f"{context}: " if context else ""
        self.backoff = backoff or Backoff()
        self._clock = clock
        self._rng = rng
        self._lock = threading.Lock()
        self.state = OutageState()

    @property
    def active(self) -> bool:
        return self.state.since is not None

    def due(self) -> bool:
        with self._lock:
            return attempt_due(self.state, self._clock())

    def wait_time(self) -> float:
        """Seconds until the next attempt is due (0 outside an outage)."""
        with self._lock:
            return max(0.0, self.state.retry_at - self._clock()) if self.state.since is not None else 0.0

    def failed(self, error: object) -> float:
        """Record a failed attempt; returns the seconds until the next one is due."""
        with self._lock:
            now = self._clock()
            self.state, starts = on_failure(self.state, now, self.backoff, self._rng())
            wait = self.state.retry_at - now
        if starts:
            self.log.warning("%s%s unreachable: %s; retrying with back-off (up to %gs apart), quietly until it "
                             "is back", self.context, self.what, error, self.backoff.cap)
        else:
            self.log.debug("%s%s still unreachable (attempt %d): %s", self.context, self.what,
                           self.state.failures, error)
        return wait

    def ok(self) -> None:
        """Record a successful attempt (logs the end of an outage, if one was going on)."""
        with self._lock:
            self.state, lasted, failures = on_success(self.state, self._clock())
        if lasted is not None:
            self.log.info("%s%s reachable again after %.1fs (%d failed attempt%s)", self.context, self.what,
                             lasted, failures, "" if failures == 1 else "s")
