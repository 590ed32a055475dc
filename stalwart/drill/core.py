"""The pure core of ``stalwart drill``: which faults, where training stands, when it recovered, the table.

Recovery is measured from the ranks' own reports (their agents' progress records): the fault is injected at a
wall-clock time while training stands at some (round, iteration); it has recovered when a rank reports the
first step of a later iteration or round, and that step's time is the end of the recovery. Steps recomputed are
the steps done before the fault that had to be done again (from the step training went on from). The phases of
the recovery (:mod:`stalwart.api.recovery`, from the same records once every rank of the new world stepped) go
on a line under the fault's row (:func:`format_phases`).
"""

from __future__ import annotations

import math
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
    "KNOWN_KINDS",
    "PARTITION_KINDS",
    "POD_KINDS",
    "RankPoint",
    "Recovery",
    "Row",
    "check_partitions",
    "cut_of",
    "format_phases",
    "format_row",
    "format_table",
    "parse_kinds",
    "partition_targets",
    "plan",
    "points",
    "recovery",
    "standing",
    "status_summary",
    "table_line",
    "went_on",
]

POD_KINDS: tuple[str, ...] = ("pod-delete", "pod-force-delete")
#: The default kinds: they work on any cluster.
ALL_KINDS: tuple[str, ...] = (*POD_KINDS, *AGENT_KINDS)
#: Network cuts of a member's node, healed after ``--heal-after`` seconds: only on a ``stalwart local`` cluster
#: with a network per node (``--local-dir``), which can cut a node's network while its processes run on.
PARTITION_KINDS: tuple[str, ...] = ("partition-full", "partition-etcd", "partition-api", "partition-peer")
KNOWN_KINDS: tuple[str, ...] = (*ALL_KINDS, *PARTITION_KINDS)


def parse_kinds(text: str, allowed: Sequence[str] = KNOWN_KINDS) -> tuple[str, ...]:
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


def check_partitions(kinds: Sequence[str], local_dir: str | None, heal_after: float) -> None:
    """ValueError naming the argument when a partition kind is asked for without a local cluster's directory,
    or ``--heal-after`` is not a positive number of seconds."""
    if not 0 < heal_after < math.inf:  # NaN compares false too
        raise ValueError(f"--heal-after: expected seconds > 0, got {heal_after!r}")
    cuts = list(dict.fromkeys(k for k in kinds if k in PARTITION_KINDS))
    if cuts and not local_dir:
        raise ValueError(f"--local-dir: {', '.join(cuts)} cut a node's network on a `stalwart local` cluster "
                         "with a network per node; give that cluster's directory (as `stalwart local up --dir`)")


def cut_of(kind: str, peer_node: str | None = None) -> list[str] | None:
    """What a partition kind cuts the target's node from (``stalwart local partition --from``; None: everything):
    ``partition-peer`` cuts it from ``peer_node``, the node of another member."""
    if kind == "partition-full":
        return None
    if kind in ("partition-etcd", "partition-api"):
        return [kind.removeprefix("partition-")]
    if kind == "partition-peer":
        if not peer_node:
            raise ValueError("partition-peer: no other member runs on another node to cut it from")
        return [peer_node]
    raise ValueError(f"--kinds: {kind!r} is not a partition kind ({', '.join(PARTITION_KINDS)})")


def partition_targets(members: Sequence[str], node_of: Mapping[str, str | None],
                      job_pods: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """The members a cut of their node takes alone (no other pod of the job runs there), each as (pod, its node,
    the node of another member for a peer cut, None when every other member shares its node), in ``members``'
    order."""
    on: dict[str | None, int] = {}
    for pod in job_pods:
        on[node_of.get(pod)] = on.get(node_of.get(pod), 0) + 1
    out = []
    for pod in members:
        node = node_of.get(pod)
        if node is None or on.get(node, 0) != 1:
            continue
        peer = next((n for m in members if m != pod and (n := node_of.get(m)) is not None and n != node), None)
        out.append((pod, node, peer))
    return out


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
    step_time: float | None = None

    @property
    def position(self) -> tuple[int, int]:
        return (self.round, self.iteration)


def points(records: Iterable[ProgressRecord]) -> list[RankPoint]:
    """Every rank of every node's latest report."""
    return [RankPoint(rec.node_id, r.local_rank, r.slot, r.rank, r.state, rec.round, r.iteration, r.step,
                      r.first_step, r.first_step_time, r.step_time) for rec in records for r in rec.ranks]


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


def went_on(pts: Sequence[RankPoint], before: tuple[int, int], injected_at: float, step_before: int,
            healed_at: float) -> Recovery | None:
    """The recovery from a network cut: as :func:`recovery` when the job restarted (a later iteration or round),
    else the first step past ``step_before`` a rank of the same round reports at or after the heal (the cut
    held the collective, which went on once the link was back: nothing recomputed)."""
    found = recovery(pts, before, injected_at, step_before)
    if found is not None:
        return found
    later = [p for p in pts if p.position == before and p.step is not None and p.step > step_before
             and p.step_time is not None and p.step_time >= healed_at]
    if not later:
        return None
    first = min(later, key=lambda p: p.step_time or 0.0)
    assert first.step is not None and first.step_time is not None
    return Recovery(round(first.step_time - injected_at, 3), first.step, 0)


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
