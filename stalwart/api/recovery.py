"""The phases of a recovery, from the marks the ranks and the agents recorded (pure; read by bench/podloss.py,
``stalwart drill`` and the tests).

A recovery runs from a fault (its time is the injector's: the benchmark's or the drill's) to the first step
every rank of the new world completed. Its six phases, each ending at a mark (the latest rank's, since the
job moves on only when every rank did):

* ``detect``: to the first rank or agent that knew of the fault (a rank's ``knew``: an interrupt, its own
  collective's error, a handover; an agent's: it saw its round end);
* ``round``: to the last rank passing the new iteration's barrier (``sealed``): fencing, the new rendezvous
  round, the handover to the processes kept and the promoted spare's, the restart wrapper's barrier;
* ``group``: to the last rank with its process group built (``group``);
* ``prepare``: to the last rank entering the state copy (``copy_start``): what the training function builds
  before it can take state (nothing when the decorator's prepare hook built it while the spare was parked).
  A prepare hook that ran after the fault (a process started for the new round runs it before its barrier)
  is counted here too, its time taken out of ``round``;
* ``copy``: to the last rank leaving the copy (``copy_end``), with its bytes and GB/s;
* ``first_step``: to the last rank's first completed step (DDP's construction and the step itself).

A boundary no rank marked (no copy after a process restart: the state came from the checkpoint, inside the
training function) leaves its phase ``None`` and its time to the next phase that has one. Boundaries are taken
in order: one earlier than the one before it (a rank marked it before another rank marked the previous one)
counts as the previous one, so every phase is >= 0 and the phases add up to the raw time, fault to the first
full step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stalwart.api.restart import ProgressRecord, RecoveryMarks

__all__ = ["PHASES", "RankRecovery", "RecoveryPhases", "from_records", "phases"]

PHASES = ("detect", "round", "group", "prepare", "copy", "first_step")


@dataclass(frozen=True, slots=True)
class RankRecovery:
    """One rank of the new world: its marks and the time of its first step in the iteration (None: not yet)."""

    marks: RecoveryMarks
    first_step: float | None


@dataclass(frozen=True, slots=True)
class RecoveryPhases:
    """Seconds of each phase (``None``: no rank marked its end), in :data:`PHASES` order; ``raw``: the fault to
    the first full step; the copy's bytes (the most any receiver got), seconds and GB/s (1e9 bytes a second)."""

    seconds: tuple[tuple[str, float | None], ...]
    raw: float
    copy_bytes: int = 0
    copy_sources: int = 0
    first_knower: str = ""
    #: Of ``round``: from the last rank taking up the new round (its handover) to the last one past the barrier
    #: (the restart wrapper's session and barrier); None when a rank did not mark it.
    barrier: float | None = None
    #: Of ``detect`` and ``round``: from the fault to the last rank of the new world leaving the training function
    #: it was running (an interrupt waits for native compute in flight); None when none of them was running one.
    leave: float | None = None

    def of(self, phase: str) -> float | None:
        if phase not in PHASES:
            raise ValueError(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
        return dict(self.seconds)[phase]

    @property
    def copy_gbps(self) -> float | None:
        s = self.of("copy")
        return self.copy_bytes / s / 1e9 if self.copy_bytes and s else None


def _latest(values: Sequence[float | None]) -> float | None:
    """The latest of ``values``, or None when any is missing (a boundary is passed when every rank passed it)."""
    if not values or any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


def phases(fault: float, ranks: Sequence[RankRecovery], agents_saw: Sequence[tuple[str, float]] = ()) \
        -> RecoveryPhases | None:
    """The phases of the recovery from the fault at ``fault`` (wall clock) to the first step of every rank of
    ``ranks`` (the new world); ``agents_saw``: (node, when its agent saw its round end). ``None`` while a rank
    has not stepped yet (or there is none)."""
    if not ranks:
        return None
    end = _latest([r.first_step for r in ranks])
    if end is None or end < fault:
        return None
    knowers = [(m.knew, "rank") for r in ranks if (m := r.marks).knew is not None and m.knew >= fault]
    knowers += [(t, f"agent of {node}") for node, t in agents_saw if t >= fault]
    detect = min(knowers) if knowers else None
    copiers = [r.marks for r in ranks if r.marks.copy_start is not None and r.marks.copy_end is not None]
    marks = (detect[0] if detect else None, _latest([r.marks.sealed for r in ranks]),
             _latest([r.marks.group for r in ranks]),
             max((m.copy_start or 0.0 for m in copiers), default=None),
             max((m.copy_end or 0.0 for m in copiers), default=None), end)
    out: list[float | None] = []
    at = fault
    for mark in marks:
        if mark is None:
            out.append(None)
            continue
        passed = min(max(mark, at), end)
        out.append(passed - at)
        at = passed
    # A prepare hook that ran after the fault ran before its process's barrier: its time moves from round.
    hook = max((min(m.prepare_end, end) - max(m.prepare_start, fault) for r in ranks
                if (m := r.marks).prepare_start is not None and m.prepare_end is not None
                and m.prepare_end > fault), default=0.0)
    if hook > 0 and out[1] is not None:
        carried = min(hook, out[1])
        out[1] -= carried
        out[3] = (out[3] or 0.0) + carried
    received = [m.copy_bytes for m in copiers if m.copy_role == "received"]
    took_up = _latest([r.marks.entered for r in ranks])
    sealed = marks[1]
    barrier = None if took_up is None or sealed is None else max(0.0, sealed - max(took_up, fault))
    lefts = [min(m.left, end) - fault for r in ranks if (m := r.marks).left is not None and m.left >= fault]
    return RecoveryPhases(seconds=tuple(zip(PHASES, out, strict=True)), raw=end - fault, barrier=barrier,
                          leave=max(lefts, default=None),
                          copy_bytes=max(received, default=0),
                          copy_sources=max((m.copy_sources for m in copiers), default=0),
                          first_knower=detect[1] if detect else "")


def from_records(records: Sequence[ProgressRecord], fault: float) -> RecoveryPhases | None:
    """The phases of the recovery from the fault at ``fault``, from the agents' progress records: the ranks of
    the newest round that stepped after the fault, all in one iteration (``None`` until every rank of it
    reported its marks and first step)."""
    current = [rec for rec in records if rec.ranks]
    if not current:
        return None
    newest = max(rec.round for rec in current)
    ranks = [r for rec in current if rec.round == newest for r in rec.ranks if r.rank is not None]
    if not ranks or any(r.recovery is None for r in ranks):
        return None
    iteration = max(r.iteration for r in ranks)
    ranks = [r for r in ranks if r.iteration == iteration]
    rows = [RankRecovery(r.recovery, r.first_step_time) for r in ranks if r.recovery is not None]
    saw = [(rec.node_id, s.previous_end_seen) for rec in records for s in rec.history
           if s.previous_end_seen is not None]
    return phases(fault, rows, saw)
