"""The agent's Prometheus metrics: rendezvous rounds, restarts by tier, and how long each recovery took.

Every figure is a fact the agent already keeps in its :class:`~stalwart.agent.progress.ProgressBook`;
:func:`events` turns the change between two looks at the book into :class:`RoundJoined`, :class:`Restarted`
and :class:`Recovered` records (a pure function over frozen records, table-tested), and :class:`AgentMetrics`
counts them in a registry of its own, served on the pod's metrics port when the operator gives it one
(``STALWART_METRICS_PORT``). One metric per fact: pod replacements and the job's phase are the operator's.

A recovery is measured on this node from the wall-clock time of the fault behind it (the newest failure
any of the node's ranks, or the agent, recorded) to the first step one of the node's ranks reported after it.
Its phases: ``resume``, from the fault until the agent first saw a rank of the node running its training
function again (detection, interrupt, barrier, process group: what the platform does), then ``first_step``,
from there to that rank's first step (the user's code: loading, the step itself). The agent reads its ranks'
status files on its supervision tick, so a phase boundary is known to that tick (0.1 s); a phase that the
tick did not see in order (a step reported before the agent saw the rank running) is left out, the total kept.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Literal
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stalwart.agent.progress import ProgressBook

__all__ = ["AgentMetrics", "MetricsState", "Recovered", "Restarted", "RoundJoined", "events", "pod_snapshot"]

log = logging.getLogger(__name__)

RestartTier = Literal["in_process", "process"]

#: Recovery seconds' histogram buckets: from an in-process restart (a tenth of a second) to a pod's
#: replacement on a busy cluster (minutes).
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True, slots=True)
class RoundJoined:
    """The node's ranks entered a rendezvous round (``kept``: with the processes they already ran)."""

    kept: bool


@dataclass(frozen=True, slots=True)
class Restarted:
    """``count`` restarts of ``tier``: ``in_process`` iterations of the node's ranks ended by a fault (each
    followed by an in-process restart), ``process`` rank processes started again by the agent."""

    tier: RestartTier
    count: int


@dataclass(frozen=True, slots=True)
class Recovered:
    """A step after a fault of ``kind``: ``seconds`` from the fault to the first step, with its phases when the
    agent saw them in order (see the module docstring)."""

    kind: str
    seconds: float
    resume: float | None = None
    first_step: float | None = None


Event = RoundJoined | Restarted | Recovered


@dataclass(frozen=True, slots=True)
class MetricsState:
    """What :func:`events` last saw: the round and its last faulted iteration, the process restarts, the time
    of the last failure whose recovery was counted, and when a rank was first seen running in the newest
    ``(round, iteration)`` that had not stepped yet."""

    round: int | None = None
    faulted: int | None = None
    process_restarts: int = 0
    recovered: float = 0.0
    running: tuple[tuple[int, int], float] | None = None


def pod_snapshot(book: ProgressBook) -> tuple[int, float] | None:
    """(step, time) of the oldest peer snapshot of the pod's ranks, when every rank has one. Pure."""
    if not book.ranks or any(r.snapshot_step is None or r.snapshot_time is None for r in book.ranks):
        return None
    oldest = min(book.ranks, key=lambda r: (r.snapshot_step or 0, r.snapshot_time or 0.0))
    return (oldest.snapshot_step or 0, oldest.snapshot_time or 0.0)


def _faults(faulted: int | None) -> int:
    """Iterations ended by a fault in a round whose last faulted iteration is ``faulted``: each iteration
    after the first starts after a fault, so iterations 0..faulted all ended in one."""
    return 0 if faulted is None else faulted + 1


def events(state: MetricsState, book: ProgressBook, *, wall: float) -> tuple[MetricsState, tuple[Event, ...]]:
    """What changed since ``state`` in ``book`` (looked at at wall-clock time ``wall``)."""
    out: list[Event] = []
    last = book.history[-1] if book.history else None
    faulted_before = state.faulted
    if last is not None and last.round != state.round:
        out.append(RoundJoined(kept=last.kept))
        faulted_before = None
    if last is not None and _faults(last.faulted) > _faults(faulted_before):
        out.append(Restarted("in_process", _faults(last.faulted) - _faults(faulted_before)))
    if book.process_restarts > state.process_restarts:
        out.append(Restarted("process", book.process_restarts - state.process_restarts))
    running = state.running
    for r in book.ranks:
        key = (book.round, r.iteration)
        if r.state == "running" and r.first_step_time is None and (running is None or running[0] < key):
            running = (key, wall)
    recovered = state.recovered
    failure = book.last_failure
    stepped = [r.first_step_time for r in book.ranks if r.first_step_time is not None]
    if failure is not None and failure.time > recovered and stepped and max(stepped) > failure.time:
        first = min(t for t in stepped if t > failure.time)
        recovery = Recovered(kind=failure.kind or "unknown", seconds=first - failure.time)
        if running is not None and failure.time <= running[1] <= first:  # the phases, seen in order
            recovery = replace(recovery, resume=running[1] - failure.time, first_step=first - running[1])
        out.append(recovery)
        recovered = failure.time
        running = None
    new = replace(state, round=last.round if last is not None else state.round,
                  faulted=last.faulted if last is not None else state.faulted,
                  process_restarts=book.process_restarts, recovered=recovered, running=running)
    return new, tuple(out)


class AgentMetrics:
    """The agent's counters, in a registry of their own (the agent's process serves nothing else), fed by
    :meth:`observe` from the agent's supervision loop (its one thread) and served by :meth:`serve` until
    :meth:`close`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.rounds = Counter("stalwart_agent_rendezvous_rounds_total",
                              "Rendezvous rounds this pod's ranks entered (kept: with the processes they ran).",
                              ["kept"], registry=self.registry)
        self.restarts = Counter("stalwart_agent_restarts_total",
                                "Restarts of this pod's ranks, by tier: in_process (an iteration ended by a fault, "
                                "the process kept) or process (a rank process started again).",
                                ["tier"], registry=self.registry)
        self.recovery = Histogram("stalwart_agent_recovery_seconds",
                                  "Seconds from a fault to the first step of this pod's ranks after it, by the "
                                  "fault's kind.", ["kind"], buckets=BUCKETS, registry=self.registry)
        self.phase = Histogram("stalwart_agent_recovery_phase_seconds",
                               "A recovery's phases: resume (fault to the ranks running the training function "
                               "again), first_step (from there to the first step), by the fault's kind.",
                               ["kind", "phase"], buckets=BUCKETS, registry=self.registry)
        self.snapshot_step = Gauge("stalwart_agent_peer_snapshot_step",
                                   "The newest step of which every rank of this pod has a peer snapshot landed on "
                                   "its buddy (stalwart.restart.PeerSnapshots); 0 until there is one.",
                                   registry=self.registry)
        self.snapshot_time = Gauge("stalwart_agent_peer_snapshot_timestamp_seconds",
                                   "When that snapshot's last copy landed (its age: time() minus this).",
                                   registry=self.registry)
        self.state = MetricsState()
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe(self, book: ProgressBook, *, wall: float) -> tuple[Event, ...]:
        self.state, happened = events(self.state, book, wall=wall)
        for e in happened:
            self._count(e)
        snap = pod_snapshot(book)
        if snap is not None:
            self.snapshot_step.set(snap[0])
            self.snapshot_time.set(snap[1])
        return happened

    def _count(self, e: Event) -> None:
        if isinstance(e, RoundJoined):
            self.rounds.labels(kept="true" if e.kept else "false").inc()
        elif isinstance(e, Restarted):
            self.restarts.labels(tier=e.tier).inc(e.count)
        else:
            self.recovery.labels(kind=e.kind).observe(e.seconds)
            if e.resume is not None and e.first_step is not None:
                self.phase.labels(kind=e.kind, phase="resume").observe(e.resume)
                self.phase.labels(kind=e.kind, phase="first_step").observe(e.first_step)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` (a daemon thread, stopped by :meth:`close`)."""
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics on %s:%d/metrics", addr, port)

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving: the server's loop ends and its thread is joined within ``timeout``."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout)
