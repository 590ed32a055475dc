"""The agent's progress reports: what its rank processes did, as facts the operator decides the status from.

:class:`ProgressBook` is the pure core: a frozen record of this agent's view, changed only by the functions
below (``state + observation -> state``), so what the operator is told is table-tested. It keeps, per round, the
last in-process iteration in which one of the node's ranks completed a step and the iterations that respawned
processes joined (the operator counts recoveries from these, exactly once, however often it reads them), the
rank processes that ended on their own (exit code or signal, slot, rank, round, iteration: the culprit of a
process death), and each rank's last step and progress.

A step is what the training function reports with ``CallWrapper.ping(step=...)``. A rank that reports none
counts as stepping once it has been in its training function for :data:`NO_STEP_GRACE` seconds, and a process
that never writes a status file (a script without the restart wrapper) once it has run that long: there is no
better evidence of them.

:class:`ProgressReporter` is the shell: it writes the book's record to ``JobKeys.progress + node`` at most once
per interval, and backs off (capped, with jitter) while etcd is unreachable, logging one line when that starts
and one when it ends.

A record that speaks of a round is written through that round's :class:`~stalwart.etcd.fence.Fence` (the epoch
and this node's key, its incarnation in the rendezvous): an agent paused across a new round, or fenced by the
operator (its lease revoked), can change nothing when it resumes; the write is refused with
:class:`~stalwart.etcd.fence.StaleEpoch` and the reporter writes nothing more until it joins another round.
Only a record of an agent that never joined a round (epoch 0: no facts of any round in it) goes unfenced.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from stalwart.api.pacing import progress_interval
from stalwart.api.restart import (
    MAX_EXITS,
    MAX_HISTORY,
    FailureInfo,
    ProgressRecord,
    RankExit,
    RankReport,
    RankStatus,
    RoundSummary,
)
from stalwart.etcd.fence import Fence, StaleEpoch
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.outage import Backoff, Outage
from stalwart.etcd.store import Store, StoreError

__all__ = [
    "NO_STEP_GRACE",
    "NodeState",
    "ProcView",
    "ProgressBook",
    "ProgressReporter",
    "WriteGuard",
    "exited",
    "joined",
    "observed",
    "parked_failed",
    "record",
    "respawned",
    "restarted_all",
    "write_guard",
]

log = logging.getLogger(__name__)

#: Seconds a rank that reports no steps must have run its training function before it counts as stepping.
NO_STEP_GRACE = 10.0

_STEPPED_STATES = ("running", "restarting", "barrier", "done", "inactive")


@dataclass(frozen=True, slots=True)
class ProcView:
    """One local rank process as the agent sees it now. ``started`` and ``now`` are monotonic seconds;
    ``status`` is its status file (None: none read)."""

    local_rank: int
    slot: int
    pid: int
    started: float
    status: RankStatus | None = None
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class ProgressBook:
    """This agent's view of its rank processes (see the module docstring). ``pending`` are respawned processes
    ``(local_rank, pid)`` whose first iteration is not known yet; ``running_since`` when a process was first
    seen running an iteration ``(local_rank, pid, iteration) -> monotonic time``."""

    node_id: str
    incarnation: str
    round: int = 0
    epoch: int = 0
    history: tuple[RoundSummary, ...] = ()
    exits: tuple[RankExit, ...] = ()
    ranks: tuple[RankReport, ...] = ()
    pending: frozenset[tuple[int, int]] = frozenset()
    running_since: tuple[tuple[tuple[int, int, int], float], ...] = ()
    process_restarts: int = 0
    last_failure: FailureInfo | None = None
    #: The last parked process of the node that ended before a round took it (its prepare hook raised).
    parked_failure: FailureInfo | None = None


def joined(book: ProgressBook, round_: int, epoch: int, *, kept: bool = False, wall: float | None = None,
           ended: float | None = None) -> ProgressBook:
    """The node runs ranks in a new round (``kept``: with the processes it already ran, none started for it),
    joined at ``wall``; ``ended``: when the agent saw the round it ran before end (marks of a recovery)."""
    if book.history and book.history[-1].round == round_:
        return replace(book, round=round_, epoch=epoch)
    summary = RoundSummary(round=round_, epoch=epoch, kept=kept, joined=wall, previous_end_seen=ended)
    history = (*book.history, summary)[-MAX_HISTORY:]
    return replace(book, round=round_, epoch=epoch, history=history, ranks=(), pending=frozenset(),
                   running_since=())


def respawned(book: ProgressBook, local_rank: int, pid: int) -> ProgressBook:
    """A rank process was started again (``pid``) in the current round: a process restart, whose iteration is
    known once the new process says which one it joins."""
    return replace(book, pending=book.pending | {(local_rank, pid)}, process_restarts=book.process_restarts + 1)


def restarted_all(book: ProgressBook) -> ProgressBook:
    """Every rank process of the node is stopped to start again in a new round (a script without the restart
    wrapper failed): a process restart, which the operator counts when the new round steps."""
    return replace(book, process_restarts=book.process_restarts + 1)


def parked_failed(book: ProgressBook, failure: FailureInfo) -> ProgressBook:
    """A parked process of the node (a warm spare's, or the standby) ended before a round took it: not a
    failure of the running job (``last_failure`` stays), said apart for the operator."""
    return replace(book, parked_failure=failure)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exited(book: ProgressBook, proc: ProcView, *, now: float, hung: bool = False) -> ProgressBook:
    """A rank process ended on its own (not stopped by its agent) or was killed for a hang."""
    code = proc.exit_code
    st = proc.status
    signame = _signal_name(code) if code is not None and code < 0 else None
    ex = RankExit(local_rank=proc.local_rank, slot=st.slot if st else proc.slot, rank=st.rank if st else None,
                  round=book.round, iteration=st.iteration if st else 0, pid=proc.pid,
                  exit_code=code if code is not None and code >= 0 else None, signal=signame, hung=hung, time=now)
    what = "no progress within its hard timeout" if hung else (f"killed by {signame}" if signame
                                                                else f"exited {code}")
    failure = FailureInfo(rank=ex.rank, pod=book.node_id, reason=f"local rank {proc.local_rank} {what}",
                          kind="hard_timeout" if hung else "process_died", time=now)
    return replace(book, exits=(*book.exits, ex)[-MAX_EXITS:], last_failure=failure)


def gave_up(book: ProgressBook, statuses: Sequence[RankStatus]) -> ProgressBook:
    """The ranks gave up (restarts exhausted, non-retryable): the failure behind it is the newest one a rank
    recorded (the exception, with its type and message), not its exit code; the exits stay recorded."""
    failures = [st.last_failure for st in statuses if st.last_failure is not None]
    if not failures:
        return book
    return replace(book, last_failure=max(failures, key=lambda f: f.time))


def _ended_iteration(st: RankStatus) -> int | None:
    """The last iteration a rank's status shows to have ended in a fault (None: none)."""
    if st.state in ("restarting", "failed"):  # failed: it gave up after the fault of that iteration
        return st.iteration
    if st.state in ("barrier", "running", "inactive") and st.iteration >= 1:
        return st.iteration - 1
    return None


def _stepped_iteration(p: ProcView, since: dict[tuple[int, int, int], float], now: float) -> int | None:
    """The iteration in which this process is known to have completed a step (None: none known)."""
    st = p.status
    if st is None:
        # No status file: not the restart wrapper (or not yet); after the grace, running is the evidence.
        ran = now - p.started >= NO_STEP_GRACE and p.exit_code is None
        return 0 if ran else None
    if st.first_step is not None and st.state in _STEPPED_STATES:
        return st.iteration
    if st.state == "done" and st.pid == p.pid:
        # The training function returned in this iteration: it completed its work, steps reported or not (a
        # script that never pings shows no steps, and a short iteration may end before the grace below).
        return st.iteration
    if st.state == "running" and st.step is None:
        first = since.get((p.local_rank, p.pid, st.iteration))
        if first is not None and now - first >= NO_STEP_GRACE:
            return st.iteration
    return None


def observed(book: ProgressBook, procs: Sequence[ProcView], *, now: float, wall: float) -> ProgressBook:
    """What the processes' status files say now (``now`` monotonic, ``wall`` the wall clock)."""
    since = dict(book.running_since)
    live = set()
    for p in procs:
        if p.status is not None and p.status.state == "running":
            key = (p.local_rank, p.pid, p.status.iteration)
            since.setdefault(key, now)
            live.add(key)
    since = {k: v for k, v in since.items() if k in live}
    stepped = [it for p in procs if (it := _stepped_iteration(p, since, now)) is not None]
    # Iterations are numbered per round and each one after the first starts after a fault: a rank at iteration k
    # shows that iteration k - 1 ran and a fault ended it (k itself, once the rank is restarting from it).
    faulted = [i for p in procs if p.status is not None and p.status.pid == p.pid
               and (i := _ended_iteration(p.status)) is not None]
    history = list(book.history)
    # A respawn whose process is gone before it joined (replaced by another) will never say where it joined.
    pending = set(book.pending) & {(p.local_rank, p.pid) for p in procs}
    joined_at: list[int] = []
    for p in procs:
        st = p.status
        if (p.local_rank, p.pid) in pending and st is not None and st.pid == p.pid \
                and st.state in ("barrier", "running"):
            joined_at.append(st.iteration)
            pending.discard((p.local_rank, p.pid))
    if history and (stepped or faulted or joined_at):
        last = history[-1]
        best = max([*stepped, *([last.stepped] if last.stepped is not None else [])], default=None)
        worst = max([*faulted, *([last.faulted] if last.faulted is not None else [])], default=None)
        history[-1] = last.model_copy(update={
            "stepped": best, "faulted": worst, "respawned": sorted(set(last.respawned) | set(joined_at))})
    ranks = tuple(_report(p, now, wall) for p in procs)
    # The newest failure any rank saw (the first fault of its last faulted iteration), or the agent's own.
    failures = [f for f in [book.last_failure, *(p.status.last_failure for p in procs if p.status)] if f is not None]
    newest = max(failures, key=lambda f: f.time) if failures else None
    return replace(book, ranks=ranks, history=tuple(history), pending=frozenset(pending),
                   running_since=tuple(sorted(since.items())), last_failure=newest)


def _report(p: ProcView, now: float, wall: float) -> RankReport:
    st = p.status
    if st is None or st.pid != p.pid:
        return RankReport(local_rank=p.local_rank, slot=p.slot, pid=p.pid)
    progress = wall - (now - st.heartbeat) if st.state == "running" else wall
    return RankReport(local_rank=p.local_rank, slot=st.slot, rank=st.rank, pid=p.pid, state=st.state,
                      iteration=st.iteration, step=st.step, step_time=st.step_time, first_step=st.first_step,
                      first_step_time=st.first_step_time, progress_time=progress,
                      soft_timeout=st.soft_timeout if st.soft_timeout and st.soft_timeout > 0 else None,
                      stall_limit=st.stall_limit,
                      snapshot_step=st.snapshot_step, snapshot_time=st.snapshot_time,
                      snapshot_fallback=st.snapshot_fallback, recovery=st.recovery)


NodeState = Literal["joining", "running", "restarting", "succeeded", "failed"]


def record(book: ProgressBook, state: NodeState, *, wall: float, world_size: int | None = None) -> ProgressRecord:
    """The record the operator reads."""
    steps = [r.step for r in book.ranks if r.step is not None]
    return ProgressRecord(
        node_id=book.node_id, epoch=book.epoch, round=book.round, state=state,
        step=max(steps) if steps else None, world_size=world_size,
        restarts_in_process=max((r.iteration for r in book.ranks), default=0),
        process_restarts=book.process_restarts, respawns_unplaced=len(book.pending), last_failure=book.last_failure,
        updated=wall,
        incarnation=book.incarnation, ranks=list(book.ranks), exits=list(book.exits), history=list(book.history),
        parked_failure=book.parked_failure)


WriteGuard = Literal["plain", "fenced", "hold"]


def write_guard(book: ProgressBook, fence_epoch: int | None, refused_epoch: int) -> WriteGuard:
    """How the record of ``book`` may be written: ``plain`` before any round (epoch 0: it holds no round's
    facts), ``fenced`` through the fence of the book's round (``fence_epoch``), ``hold`` (not at all) when
    there is no fence of that round or the round already refused a write (``refused_epoch``: it is over)."""
    if book.epoch == 0:
        return "plain"
    if fence_epoch != book.epoch or refused_epoch == book.epoch:
        return "hold"
    return "fenced"


class ProgressReporter:
    """Keeps the :class:`ProgressBook` and writes its record (at most every ``interval`` seconds; a forced
    write skips the interval but not the back-off of an etcd outage). :meth:`join` enters a round with its
    fence; see the module docstring for what is fenced."""

    def __init__(self, store: Store, keys: JobKeys, node_id: str, *, interval: float = 1.0,
                 context: str = "", write_timeout: float = 2.0, backoff: Backoff | None = None) -> None:
        self.store = store
        self.key = keys.progress_of(node_id)
        #: The agent's setting; :attr:`interval` is what the round's size makes of it (:func:`progress_interval`).
        self.least = interval
        self.interval = interval
        self.write_timeout = write_timeout
        self.book = ProgressBook(node_id=node_id, incarnation=uuid.uuid4().hex[:12])
        self.outage = Outage("etcd (progress reports)", logger=log, context=context,
                             backoff=backoff or Backoff(initial=0.5, cap=10.0))
        self.world_size: int | None = None
        self._written = 0.0
        self.writes = 0
        self.fence: Fence | None = None
        #: The epoch of the round that refused a write (0: none): nothing more is written in it.
        self.refused_epoch = 0
        self.context = context

    def join(self, round_: int, epoch: int, fence: Fence, *, kept: bool = False, ended: float | None = None,
             world_size: int | None = None, nodes: int | None = None, soft_timeout: float | None = None) -> None:
        """The node runs ranks in the round sealed at ``epoch`` (``kept``: with the processes it already ran;
        ``ended``: when the agent saw its previous round end), ``world_size`` ranks, ``nodes`` pods (the
        interval between writes follows it: :func:`progress_interval`); its records are written through
        ``fence``."""
        if fence.epoch != epoch:
            raise ValueError(f"fence: the fence of epoch {fence.epoch} cannot fence the round of epoch {epoch}")
        if nodes is not None:
            self.interval = progress_interval(nodes, least=self.least, soft_timeout=soft_timeout)
        self.book = joined(self.book, round_, epoch, kept=kept, wall=time.time(), ended=ended)
        self.fence = fence
        if world_size is not None:
            self.world_size = world_size

    def publish(self, state: NodeState, *, force: bool = False) -> bool:
        """Write the record if it is due; True when it was written."""
        now = time.monotonic()
        if not force and now - self._written < self.interval:
            return False
        if not self.outage.due():
            return False
        guard = write_guard(self.book, self.fence.epoch if self.fence is not None else None, self.refused_epoch)
        if guard == "hold":
            return False
        rec = record(self.book, state, wall=time.time(), world_size=self.world_size)
        try:
            if guard == "fenced":
                assert self.fence is not None
                self.fence.put(self.key, rec.to_json_bytes(), timeout=self.write_timeout)
            else:
                self.store.put(self.key, rec.to_json_bytes(), timeout=self.write_timeout)
        except StaleEpoch as e:
            self.refused_epoch = self.book.epoch
            log.info("%s: progress of round %d not written, the round is over: %s", self.context, self.book.round, e)
            return False
        except StoreError as e:
            self.outage.failed(e)
            return False
        self.outage.ok()
        self._written = now
        self.writes += 1
        return True
