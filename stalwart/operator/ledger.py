"""Counting recoveries exactly once: a pure function from what the agents report to the restart counters.

A recovery is counted when training moves past a fault: when a step completes in a later in-process
iteration or in a later rendezvous round than the last step counted. The status keeps where that last
counted step was (``status.position``), next to the counters, in the same patch; the operator writes it with
the resourceVersion it was computed from. So each recovery is counted once, whatever restarts: a reconcile
that looks again, an operator that restarts (it starts from the written position), an agent that restarts
(the facts are per round, merged over every node's report), a new round (rounds are numbered).

What counts, and as what (one fault is one recovery):

* iteration ``k >= 1`` of a round, once its ranks ran it (a step completed in it, or a fault of its own ended
  it: a restart that failed again was still a restart), is an in-process restart, or a process restart when a
  respawned rank process joined it (some rank did not keep its process);
* an iteration cut short before it ran (its round ended first) is not a restart of its own: the new round is;
* a new round in which a step completed is a recovery when it follows a fault the operator knew of (an open
  incident, from an earlier round): in process when every node of the round entered it with the rank
  processes it already ran (warm spares: survivors handed over, spares' parked processes promoted), else a
  process restart (every rank started again). A round that follows no fault (a scale change, a resume after
  suspension) is not a recovery.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from stalwart.api.restart import ProgressRecord
from stalwart.api.status import Position

__all__ = ["RoundFacts", "Tally", "advance", "round_facts"]


@dataclass(frozen=True, slots=True)
class RoundFacts:
    """One round as the nodes saw it, merged: the last iteration in which a step completed (None: none yet),
    the iterations that respawned rank processes joined, the last iteration that ran into a fault, and whether
    every node entered the round with the processes it already ran (None: no node said)."""

    stepped: int | None = None
    respawned: frozenset[int] = field(default_factory=frozenset)
    faulted: int | None = None
    kept: bool | None = None
    #: A node respawned a rank process in this round that has not yet said which iteration it joined.
    unplaced: bool = False

    @property
    def ran(self) -> int | None:
        """The last iteration the ranks ran (to a step or to a fault)."""
        known = [i for i in (self.stepped, self.faulted) if i is not None]
        return max(known) if known else None


def round_facts(records: Iterable[ProgressRecord]) -> dict[int, RoundFacts]:
    """Merge the nodes' round summaries: the furthest step of any node, the respawns of every node."""
    out: dict[int, RoundFacts] = {}
    records = list(records)
    for rec in records:
        for summary in rec.history:
            old = out.get(summary.round, RoundFacts())
            out[summary.round] = RoundFacts(_most(old.stepped, summary.stepped),
                                            old.respawned | frozenset(summary.respawned),
                                            _most(old.faulted, summary.faulted),
                                            summary.kept if old.kept is None else old.kept and summary.kept)
    for rec in records:
        if rec.respawns_unplaced and rec.round in out:
            out[rec.round] = replace(out[rec.round], unplaced=True)
    return out


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass(frozen=True, slots=True)
class Tally:
    """What :func:`advance` found: recoveries to add, the new counted position, whether the open incident (if
    any) is over (training completed a step past it), and the furthest (round, iteration) that stepped."""

    in_process: int = 0
    process_restarts: int = 0
    position: Position | None = None
    recovered: bool = False
    stepped: Position | None = None


def advance(position: Position | None, rounds: Mapping[int, RoundFacts], incident: Position | None,
            incident_open: bool) -> Tally:
    """Count the recoveries between the last counted step ``position`` and the furthest step the nodes
    report. ``incident`` is where the open fault happened (None: before any round), counted only when
    ``incident_open``."""
    in_process = process = 0
    current = position
    stepped: Position | None = None
    pending = incident_open
    newest = max(rounds, default=None)
    for r in sorted(rounds):
        facts = rounds[r]
        if facts.unplaced and r == newest:
            # A respawned process has not said which iteration it joined: counted now, its recovery would pass
            # for one in process. Its agent says so within a progress interval; count then. (Only the newest
            # round waits: an older round's record of a lost pod would hold the count for ever.)
            break
        ran = facts.ran
        if facts.stepped is not None:
            stepped = Position(round=r, iteration=facts.stepped)
        if ran is None or (current is not None and r < current.round):
            continue
        same_round = current is not None and r == current.round
        if not same_round and pending and (incident is None or r > incident.round):
            if facts.kept:
                in_process += 1  # a new round after a fault, every rank in the process it ran before
            else:
                process += 1  # a new round after a fault: every rank started again
            pending = False
        start = current.iteration if same_round and current is not None else 0
        for iteration in range(start + 1, ran + 1):
            if iteration in facts.respawned:
                process += 1
            else:
                in_process += 1
        new = Position(round=r, iteration=ran)
        if current is None or new.key() > current.key():
            current = new
    recovered = incident_open and stepped is not None and (incident is None or stepped.key() > incident.key())
    return Tally(in_process, process, current, recovered, stepped)
