"""Counting recoveries exactly once (the pure :func:`~stalwart.operator.ledger.advance`), one row per case."""

from __future__ import annotations

import pytest

from stalwart.api.restart import ProgressRecord, RoundSummary
from stalwart.api.status import Position
from stalwart.operator.ledger import RoundFacts, Tally, advance, round_facts


def at(round_: int, iteration: int) -> Position:
    return Position(round=round_, iteration=iteration)


def facts(**rounds: int | tuple[int | None, set[int]] | tuple[int | None, set[int], int] | None) \
        -> dict[int, RoundFacts]:
    """``r1=2`` (round 1 stepped in iteration 2), ``r2=(1, {1})`` (iteration 1 joined by a respawned process),
    ``r1=(0, set(), 2)`` (stepped in iteration 0, and iteration 2 ran into a fault)."""
    out = {}
    for name, value in rounds.items():
        if isinstance(value, tuple):
            stepped, respawned, faulted = (*value, None) if len(value) == 2 else value
        else:
            stepped, respawned, faulted = value, set(), None
        out[int(name[1:])] = RoundFacts(stepped, frozenset(respawned), faulted)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(("position", "rounds", "incident", "is_open", "expected"), [
    # A rank raised; every rank re-ran the function in its own process and stepped in iteration 1.
    (at(1, 0), facts(r1=1), at(1, 0), True, Tally(1, 0, at(1, 1), True, at(1, 1))),
    # A rank process was killed: its respawned process joined iteration 1. One recovery, with a new process.
    (at(1, 0), facts(r1=(1, {1})), at(1, 0), True, Tally(0, 1, at(1, 1), True, at(1, 1))),
    # Two in-process restarts in round 1, a pod lost, a new round, two more in round 2: 4 + 1, not 2.
    (at(1, 0), facts(r1=2, r2=2), at(1, 2), True, Tally(4, 1, at(2, 2), True, at(2, 2))),
    # A pod lost: the survivors' next iteration never ran (the round ended first); the new round did.
    (at(1, 3), facts(r1=3, r2=0), at(1, 3), True, Tally(0, 1, at(2, 0), True, at(2, 0))),
    # Warm spares: a pod lost, the new round's nodes all entered it with the processes they ran (survivors
    # handed over, a spare's parked processes promoted): one recovery, in process.
    (at(1, 3), {1: RoundFacts(3), 2: RoundFacts(0, kept=True)}, at(1, 3), True,
     Tally(1, 0, at(2, 0), True, at(2, 0))),
    # ... but one node of the new round started its processes for it (a cold spare): a process restart.
    (at(1, 3), {1: RoundFacts(3), 2: RoundFacts(0, kept=False)}, at(1, 3), True,
     Tally(0, 1, at(2, 0), True, at(2, 0))),
    # Warm spares, a second loss before the new round's first step: round 2 ran into it, round 3 stepped,
    # every process kept throughout. One recovery (counted at round 2), in process.
    (at(1, 3), {1: RoundFacts(3), 2: RoundFacts(None, faulted=0, kept=True), 3: RoundFacts(0, kept=True)},
     at(1, 3), True, Tally(1, 0, at(3, 0), True, at(3, 0))),
    # A new round with no fault behind it (a scale change, a resume): not a recovery.
    (at(1, 3), facts(r2=0), None, False, Tally(0, 0, at(2, 0), False, at(2, 0))),
    # The operator was away for three in-process restarts: each is counted, once.
    (at(1, 0), facts(r1=3), None, False, Tally(3, 0, at(1, 3), False, at(1, 3))),
    # Read again from the position it wrote: nothing new (an operator restart counts nothing twice).
    (at(2, 2), facts(r1=2, r2=2), None, False, Tally(0, 0, at(2, 2), False, at(2, 2))),
    # Rounds that ended before the counted position are history.
    (at(3, 1), facts(r1=5, r2=5, r3=1), None, False, Tally(0, 0, at(3, 1), False, at(3, 1))),
    # Nothing stepped yet.
    (None, facts(r1=None), None, False, Tally(0, 0, None, False, None)),
    # The first step ever: training started, nothing to count.
    (None, facts(r1=0), None, False, Tally(0, 0, at(1, 0), False, at(1, 0))),
    # A rank failed before the first step; the restart stepped.
    (None, facts(r1=1), at(1, 0), True, Tally(1, 0, at(1, 1), True, at(1, 1))),
    # A fault is open and nothing moved: still waiting.
    (at(1, 4), facts(r1=4), at(1, 4), True, Tally(0, 0, at(1, 4), False, at(1, 4))),
    # The fault repeats: iterations 1 and 2 ran into it again before any step. Two restarts, no recovery.
    (at(1, 0), facts(r1=(0, set(), 2)), at(1, 0), True, Tally(2, 0, at(1, 2), False, at(1, 0))),
    # ... and read again: nothing more.
    (at(1, 2), facts(r1=(0, set(), 2)), at(1, 0), True, Tally(0, 0, at(1, 2), False, at(1, 0))),
    # A rank process was killed and respawned, and training already stepped in iteration 1, but the respawned
    # process's agent has not yet said which iteration it joined: nothing is counted until it has (or the
    # recovery would pass for one in process).
    (at(1, 0), {1: RoundFacts(1, unplaced=True)}, at(1, 0), True, Tally(0, 0, at(1, 0), False, None)),
    # ... a lost pod's last record, in an older round, holds nothing back.
    (at(1, 3), {1: RoundFacts(3, unplaced=True), 2: RoundFacts(0, kept=False)}, at(1, 3), True,
     Tally(0, 1, at(2, 0), True, at(2, 0))),
], ids=["exception", "killed-rank", "two-rounds", "pod-lost", "warm-pod-lost", "cold-spare", "warm-second-loss",
        "scale", "operator-away", "read-again",
        "old-rounds", "nothing", "first-step", "startup-fault", "waiting", "fault-repeats", "repeats-read-again",
        "respawn-unplaced", "unplaced-in-an-old-round"])
def test_advance(position: Position | None, rounds: dict[int, RoundFacts], incident: Position | None,
                 is_open: bool, expected: Tally) -> None:
    assert advance(position, rounds, incident, is_open) == expected


def test_round_facts_merge_every_nodes_report() -> None:
    def rec(node: str, *summaries: RoundSummary) -> ProgressRecord:
        return ProgressRecord(node_id=node, epoch=0, round=0, state="running", updated=0.0, history=list(summaries))

    merged = round_facts([
        rec("a", RoundSummary(round=1, epoch=5, stepped=2), RoundSummary(round=2, epoch=9, stepped=None)),
        rec("b", RoundSummary(round=1, epoch=5, stepped=3, respawned=[3], faulted=3)),
        rec("c", RoundSummary(round=2, epoch=9, stepped=1, respawned=[1], kept=True)),
        rec("dead-pod", RoundSummary(round=1, epoch=5, stepped=1, respawned=[1], faulted=4)),
        rec("d", RoundSummary(round=3, epoch=12, kept=True)),
        rec("e", RoundSummary(round=3, epoch=12, stepped=0, kept=True)),
    ])
    # A round is kept only when every node that reported it kept its processes.
    assert merged == {1: RoundFacts(3, frozenset({1, 3}), 4, kept=False), 2: RoundFacts(1, frozenset({1}), kept=False),
                      3: RoundFacts(0, kept=True)}


def test_a_node_with_an_unplaced_respawn_marks_its_round() -> None:
    summary = RoundSummary(round=2, epoch=9, stepped=1)
    records = [ProgressRecord(node_id="a", epoch=9, round=2, state="running", updated=0.0, history=[summary],
                              respawns_unplaced=1),
               ProgressRecord(node_id="b", epoch=9, round=2, state="running", updated=0.0, history=[summary])]
    assert round_facts(records)[2].unplaced is True
    assert round_facts(records[1:])[2].unplaced is False
