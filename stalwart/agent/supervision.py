"""What the agent does about its rank processes: a pure function over what it observes.

The agent polls its processes and their status files and asks :func:`supervise` what to do. A process that
runs :func:`stalwart.restartable` (it has written a status file) is *wrapped*: when it dies it is respawned
alone and rejoins at the next restart iteration. A plain script is restarted the way torchrun does it:
every rank of the job starts again, in a new rendezvous round.

A wrapped process that shows no progress is killed (and then respawned like any dead one): past its hard
timeout, or past its soft timeout when it is stopped (SIGSTOP, state ``T``): a stopped process can neither
make progress nor obey the interrupt its peers' restart sends, so waiting for the hard timeout only holds the
job up. A process being traced (a debugger, state ``t``) is left alone.

A wrapped process that cannot record its own fault (killed, or dead) has it recorded by the agent
(:func:`fault_for`), in the iteration its status file names, and only when that iteration is of the agent's
current round: a process still in a round that ended (handed over, it has not left the old round yet)
names an iteration of that round, and the same number in the new round is a different iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from stalwart.api.exit_codes import Disposition, ExitCode, disposition
from stalwart.api.restart import FaultKind, FaultRecord, RankStatus

__all__ = ["ProcView", "RankAction", "fault_for", "supervise"]


@dataclass(frozen=True, slots=True)
class ProcView:
    """One local rank process as the agent sees it. ``exit_code`` is ``None`` while it runs (negative:
    killed by that signal). ``heartbeat_age`` is seconds since its last progress (``None``: no status)."""

    local_rank: int
    exit_code: int | None
    wrapped: bool = False
    heartbeat_age: float | None = None
    hard_timeout: float | None = None
    soft_timeout: float | None = None
    #: The process is stopped by a signal (``/proc/PID/stat`` state ``T``).
    stopped: bool = False


@dataclass(frozen=True, slots=True)
class RankAction:
    """``kind``: ``wait``; ``kill`` (hung: SIGKILL, respawned once it is gone; ``fault`` says why, as a fault
    record's kind: ``hard_timeout`` or ``stopped``); ``respawn`` (start the local rank again); ``restart_all``
    (every rank of the job, new round); ``finish`` (exit ``exit_code``)."""

    kind: Literal["wait", "kill", "respawn", "restart_all", "finish"]
    local_ranks: tuple[int, ...] = ()
    exit_code: int = 0
    reason: str = ""
    fault: Literal["hard_timeout", "stopped"] | None = None


def supervise(procs: Sequence[ProcView], *, restarts_used: int, max_restarts: int) -> list[RankAction]:
    """The actions for this poll, in order. ``restarts_used`` counts process restarts so far on this node."""
    if not procs:
        return [RankAction("finish", exit_code=int(ExitCode.OK), reason="no rank processes")]
    actions: list[RankAction] = []
    hung = tuple(p.local_rank for p in procs
                 if p.exit_code is None and p.hard_timeout is not None and p.heartbeat_age is not None
                 and p.heartbeat_age > p.hard_timeout)
    if hung:
        actions.append(RankAction("kill", hung, int(ExitCode.HARD_TIMEOUT),
                              f"no progress within the hard timeout (local ranks {list(hung)})", "hard_timeout"))
    stopped = tuple(p.local_rank for p in procs
                    if p.exit_code is None and p.stopped and p.local_rank not in hung and p.soft_timeout is not None
                    and p.heartbeat_age is not None and p.heartbeat_age > p.soft_timeout)
    if stopped:
        actions.append(RankAction("kill", stopped, int(ExitCode.HARD_TIMEOUT),
                              f"stopped (SIGSTOP) past the soft timeout (local ranks {list(stopped)})", "stopped"))
    exited = [p for p in procs if p.exit_code is not None]
    if len(exited) == len(procs) and all(p.exit_code == 0 for p in exited):
        return [RankAction("finish", exit_code=int(ExitCode.OK), reason="every rank returned")]
    for p in exited:
        code = int(p.exit_code or 0)
        if code == 0:
            continue
        what = disposition(code)
        if p.wrapped and what in (Disposition.JOB_FAILURE, Disposition.POD_REPLACEMENT) \
                and code in ExitCode._value2member_map_:
            return [RankAction("finish", (p.local_rank,), code,
                           f"local rank {p.local_rank} exited {code} ({ExitCode(code).name})")]
        if p.wrapped and code == ExitCode.STALE_EPOCH:
            return [RankAction("restart_all", (p.local_rank,), code, "the rendezvous round is over")]
        if restarts_used >= max_restarts:
            final = code if 0 < code < 256 else int(ExitCode.FAILED)
            return [RankAction("finish", (p.local_rank,), final,
                           f"local rank {p.local_rank} exited {code}; {restarts_used} process restarts used "
                           f"(max {max_restarts})")]
        if p.wrapped:
            why = (f"local rank {p.local_rank} ended itself (exit code {code}): its main thread stayed blocked after "
                   "its interrupt" if code == ExitCode.ABANDONED else f"local rank {p.local_rank} exited {code}")
            actions.append(RankAction("respawn", (p.local_rank,), code, why))
        else:
            return [RankAction("restart_all", (p.local_rank,), code, f"local rank {p.local_rank} exited {code}")]
    return actions or [RankAction("wait")]


def fault_for(status: RankStatus | None, *, epoch: int, slot: int, node_id: str, kind: FaultKind,
              reason: str, time: float) -> FaultRecord | None:
    """The fault record the agent writes for a wrapped process it killed or found dead (its last ``status``),
    in the round of ``epoch`` (the agent's current one), or ``None`` when there is nothing to record there:
    the process was neither running nor at a barrier, or it was in another round (see the module docstring)."""
    if status is None or status.epoch != epoch or status.state not in ("running", "barrier"):
        return None
    return FaultRecord(slot=slot, pid=status.pid, rank=status.rank if status.state == "running" else None,
                       node_id=node_id, iteration=status.iteration, kind=kind, reason=reason[:2048], time=time)
