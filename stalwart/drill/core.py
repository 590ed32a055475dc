"""The pure core of ``stalwart drill``: which faults, where training stands, when it recovered, the table.

Recovery is measured from the ranks' own reports (their agents' progress records): the fault is injected at a
wall-clock time while training stands at some (round, iteration); it has recovered when a rank reports the
first step of a later iteration or round, and that step's time is the end of the recovery. Steps recomputed are
the steps done before the fault that had to be done again (from the step training went on from). The phases of
the recovery (:mod:`stalwart.api.recovery`, from the same records once every rank of the new world stepped) go
on a line under the fault's row (:func:`format_phases`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalwart.api.drill import AGENT_KINDS
from stalwart.api.recovery import PHASES, RecoveryPhases
from stalwart.api.restart import ProgressRecord

__all__ = [
    "ALL_KINDS",
    "HEADER",
    "POD_KINDS",
    "RankPoint",
    "Recovery",
    "Row",
    "format_phases",
    "format_row",
    "format_table",
    "parse_kinds",
    "plan",
    "points",
    "recovery",
    "standing",
    "status_summary",
    "table_line",
]

POD_KINDS: tuple[str, ...] = ("pod-delete", "pod-force-delete")
ALL_KINDS: tuple[str, ...] = (*POD_KINDS, *AGENT_KINDS)


def parse_kinds(text: str, allowed: Sequence[str] = ALL_KINDS) -> tuple[str, ...]:
    """``"rank-kill,pod-delete"`` -> the kinds, in order, without repeats; ValueError naming ``--kinds``."""
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kinds if k not in allowed]
    if unknown or not kinds:
        raise ValueError(f"--kinds: expected a comma-separated list of {', '.join(allowed)}; "
                         f"got {', '.join(unknown) if unknown else 'none'}")
    return kinds


def plan(faults: int, kinds: Sequence[str], seed: int) -> list[str]:
    """``faults`` kinds drawn so that every kind comes up as evenly as possible, in a seeded random order."""
    if faults < 1:
        raise ValueError(f"--faults: expected at least 1, got {faults}")
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < faults:
        block = list(kinds)
        rng.shuffle(block)
        out.extend(block)
    return out[:faults]


@dataclass(frozen=True, slots=True)
class RankPoint:
    """One rank as its agent last reported it."""

    node: str
    local_rank: int
    slot: int
    rank: int | None
    state: str | None
    round: int
    iteration: int
    step: int | None
    first_step: int | None
    first_step_time: float | None

    @property
    def position(self) -> tuple[int, int]:
        return (self.round, self.iteration)


def points(records: Iterable[ProgressRecord]) -> list[RankPoint]:
    """Every rank of every node's latest report."""
    return [RankPoint(rec.node_id, r.local_rank, r.slot, r.rank, r.state, rec.round, r.iteration, r.step,
                      r.first_step, r.first_step_time) for rec in records for r in rec.ranks]


def standing(pts: Sequence[RankPoint]) -> tuple[tuple[int, int], int]:
    """Where training stands (the furthest (round, iteration)) and the furthest step any rank reported."""
    position = max((p.position for p in pts), default=(0, 0))
    step = max((p.step for p in pts if p.step is not None), default=0)
    return position, step


@dataclass(frozen=True, slots=True)
class Recovery:
    """Seconds from the fault to the first step after it; the step training went on with; steps recomputed."""

    seconds: float
    resumed_step: int
    recomputed: int


def recovery(pts: Sequence[RankPoint], before: tuple[int, int], injected_at: float,
             step_before: int) -> Recovery | None:
    """The recovery once a rank reports the first step of a later iteration or round, else None."""
    after = [p for p in pts if p.position > before and p.first_step is not None and p.first_step_time is not None
             and p.first_step_time >= injected_at]
    if not after:
        return None
    first = min(after, key=lambda p: p.first_step_time or 0.0)
    assert first.first_step is not None and first.first_step_time is not None
    return Recovery(round(first.first_step_time - injected_at, 3), first.first_step,
                    max(0, step_before - (first.first_step - 1)))


@dataclass(frozen=True, slots=True)
class Row:
    """One fault of the drill and what came of it."""

    index: int
    kind: str
    target: str
    recovery: Recovery | None
    status: str
    note: str = ""
    phases: RecoveryPhases | None = None


def status_summary(status: Mapping[str, Any]) -> str:
    """What ``kubectl get tj -o yaml`` says, in one line: phase, recoveries and replacements, last failure."""
    restarts = status.get("restarts") or {}
    parts = [str(status.get("phase") or "?"),
             f"restarts {restarts.get('inProcess', 0)} in-process/{restarts.get('processRestarts', 0)} process/"
             f"{restarts.get('podReplacements', 0)} pod"]
    lf = status.get("lastFailure") or {}
    if lf:
        what = str(lf.get("reason") or "?")
        if lf.get("exceptionType"):
            what += f" {lf['exceptionType']}"
        if lf.get("signal"):
            what += f" {lf['signal']}"
        where = ", ".join(x for x in (f"rank {lf['rank']}" if lf.get("rank") is not None else "",
                                      str(lf.get("pod") or "")) if x)
        parts.append(f"lastFailure {what}" + (f" ({where})" if where else ""))
    return "; ".join(parts)


#: Column widths of the table (the last column, the status, is not padded).
WIDTHS = (3, 17, 30, 9, 10)
HEADER = ("#", "FAULT", "TARGET", "RECOVERY", "RECOMPUTED", "STATUS AFTER")


def table_line(cells: Sequence[str]) -> str:
    return "  ".join([*(c.ljust(w) for c, w in zip(cells[:-1], WIDTHS, strict=True)), cells[-1]]).rstrip()


def format_row(r: Row) -> str:
    rec = f"{r.recovery.seconds:.1f}s" if r.recovery else (r.note or "-")
    return table_line((str(r.index), r.kind, r.target, rec, str(r.recovery.recomputed) if r.recovery else "-",
                  r.status))


def format_phases(p: RecoveryPhases) -> str:
    """The phases of one recovery on one line: each phase's seconds (``n/a``: no rank marked it), the copy's
    bytes and rate."""
    parts = [f"{name.replace('_', ' ')} {'n/a' if s is None else f'{s:.2f}s'}" for name, s in p.seconds]
    if p.copy_bytes:
        rate = f", {p.copy_gbps:.2f} GB/s" if p.copy_gbps else ""
        parts[PHASES.index("copy")] += f" ({p.copy_bytes / 1e6:.0f} MB from {p.copy_sources}{rate})"
    return f"    phases: {', '.join(parts)}; fault to first full step {p.raw:.2f}s"


def format_table(rows: Sequence[Row]) -> str:
    """The drill's table: a header and one row per fault (and its phases' line, when known)."""
    lines = [table_line(HEADER)]
    for r in rows:
        lines.append(format_row(r))
        if r.phases is not None:
            lines.append(format_phases(r.phases))
    return "\n".join(lines)
