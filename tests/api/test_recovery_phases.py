"""The phases of a recovery from the ranks' and agents' marks (stalwart.api.recovery), as tables."""

from __future__ import annotations

import pytest

from stalwart.api.recovery import PHASES, RankRecovery, from_records, phases
from stalwart.api.restart import ProgressRecord, RankReport, RecoveryMarks, RoundSummary

FAULT = 1000.0


def marks(**kw: object) -> RecoveryMarks:
    base: dict[str, object] = {"epoch": 2, "iteration": 0, "sealed": FAULT + 1.0}
    base.update(kw)
    return RecoveryMarks.model_validate(base)


SURVIVOR = marks(knew=FAULT + 0.1, sealed=FAULT + 1.0, group=FAULT + 1.2, copy_start=FAULT + 1.25,
                 copy_end=FAULT + 1.9, copy_bytes=800, copy_role="sent", copy_sources=1)
SPARE = marks(knew=FAULT + 0.6, sealed=FAULT + 1.1, group=FAULT + 1.2, prepare_start=FAULT - 50,
              prepare_end=FAULT - 49, prepare_parked=True, copy_start=FAULT + 1.3, copy_end=FAULT + 2.0,
              copy_bytes=800, copy_role="received", copy_sources=1)


def secs(p: object) -> dict[str, float | None]:
    assert p is not None
    return {k: (None if v is None else round(v, 6)) for k, v in p.seconds}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("ranks", "agents", "want", "raw"), [
    # The warm spare: the survivor knew first, the hook ran while parked (prepare: the gap to the copy only).
    ([RankRecovery(SURVIVOR, FAULT + 2.5), RankRecovery(SPARE, FAULT + 2.6)], [],
     {"detect": 0.1, "round": 1.0, "group": 0.1, "prepare": 0.1, "copy": 0.1 + 0.6, "first_step": 0.6}, 2.6),
    # An agent that saw its round end before any rank knew is the detection.
    ([RankRecovery(SURVIVOR, FAULT + 2.5), RankRecovery(SPARE, FAULT + 2.6)], [("pod-a", FAULT + 0.05)],
     {"detect": 0.05, "round": 1.05, "group": 0.1, "prepare": 0.1, "copy": 0.7, "first_step": 0.6}, 2.6),
    # Knowledge from before the fault (an older recovery's agent mark) does not count.
    ([RankRecovery(SURVIVOR, FAULT + 2.5)], [("pod-a", FAULT - 5)],
     {"detect": 0.1, "round": 0.9, "group": 0.2, "prepare": 0.05, "copy": 0.65, "first_step": 0.6}, 2.5),
    # A process restart: no rank knew (new processes), no copy (the checkpoint, inside the function), the
    # hook ran after the fault in the new process: its second moves from round to prepare.
    ([RankRecovery(marks(sealed=FAULT + 5, group=FAULT + 5.5, prepare_start=FAULT + 3, prepare_end=FAULT + 4),
                   FAULT + 8)], [("pod-a", FAULT + 0.5)],
     {"detect": 0.5, "round": 3.5, "group": 0.5, "prepare": 1.0, "copy": None, "first_step": 2.5}, 8.0),
    # Nothing detected at all (no rank nor agent mark after the fault): its time goes to round.
    ([RankRecovery(marks(sealed=FAULT + 2, group=FAULT + 2.5), FAULT + 3)], [],
     {"detect": None, "round": 2.0, "group": 0.5, "prepare": None, "copy": None, "first_step": 0.5}, 3.0),
    # A rank that marked a boundary before another passed the one before: boundaries stay in order.
    ([RankRecovery(marks(knew=FAULT + 0.2, sealed=FAULT + 1, group=FAULT + 0.5), FAULT + 2)], [],
     {"detect": 0.2, "round": 0.8, "group": 0.0, "prepare": None, "copy": None, "first_step": 1.0}, 2.0),
])
def test_phases(ranks: list[RankRecovery], agents: list[tuple[str, float]], want: dict[str, float | None],
                raw: float) -> None:
    got = phases(FAULT, ranks, agents)
    assert got is not None
    assert secs(got) == pytest.approx(want)
    assert list(dict(got.seconds)) == list(PHASES)
    assert got.raw == pytest.approx(raw)
    assert sum(v for _, v in got.seconds if v is not None) == pytest.approx(raw)
    assert all(v is None or v >= 0 for _, v in got.seconds)


def test_the_barrier_part_of_round_runs_from_the_last_handover() -> None:
    survivor = SURVIVOR.model_copy(update={"entered": FAULT + 0.7})
    spare = SPARE.model_copy(update={"entered": FAULT + 0.8})
    got = phases(FAULT, [RankRecovery(survivor, FAULT + 2.5), RankRecovery(spare, FAULT + 2.6)])
    assert got is not None and got.barrier == pytest.approx(0.3)
    assert phases(FAULT, [RankRecovery(SURVIVOR, FAULT + 2.5)]).barrier is None  # type: ignore[union-attr]


def test_leave_is_the_last_survivor_out_of_its_training_function() -> None:
    # Two survivors: one left its function 0.4 s after the fault, one (in a long native call) 1.9 s after.
    quick = SURVIVOR.model_copy(update={"left": FAULT + 0.4})
    slow = SURVIVOR.model_copy(update={"left": FAULT + 1.9})
    got = phases(FAULT, [RankRecovery(quick, FAULT + 2.5), RankRecovery(slow, FAULT + 2.5),
                         RankRecovery(SPARE, FAULT + 2.6)])
    assert got is not None and got.leave == pytest.approx(1.9)
    # A spare ran no function, and a leaving before the fault (an earlier recovery's) is not this one's.
    stale = SURVIVOR.model_copy(update={"left": FAULT - 3.0})
    got = phases(FAULT, [RankRecovery(stale, FAULT + 2.5), RankRecovery(SPARE, FAULT + 2.6)])
    assert got is not None and got.leave is None


def test_copy_bytes_and_rate_come_from_the_receivers() -> None:
    got = phases(FAULT, [RankRecovery(SURVIVOR, FAULT + 2.5), RankRecovery(SPARE, FAULT + 2.6)])
    assert got is not None
    assert got.copy_bytes == 800 and got.copy_sources == 1
    assert got.copy_gbps == pytest.approx(800 / 0.7 / 1e9)
    assert got.first_knower == "rank"


@pytest.mark.parametrize("ranks", [
    [],
    [RankRecovery(SURVIVOR, FAULT + 2.5), RankRecovery(SPARE, None)],  # a rank has not stepped yet
    [RankRecovery(SURVIVOR, FAULT - 1.0)],  # its first step is of before the fault
])
def test_no_phases_until_every_rank_stepped(ranks: list[RankRecovery]) -> None:
    assert phases(FAULT, ranks) is None


def test_a_phase_is_named() -> None:
    got = phases(FAULT, [RankRecovery(SURVIVOR, FAULT + 2.5)])
    assert got is not None and got.of("copy") == pytest.approx(0.65)
    with pytest.raises(ValueError, match="phase: expected one of detect"):
        got.of("barrier")


def _record(node: str, round_: int, ranks: list[RankReport], ended: float | None = None) -> ProgressRecord:
    return ProgressRecord(node_id=node, epoch=round_ + 1, round=round_, state="running", updated=FAULT + 9,
                          ranks=ranks, history=[RoundSummary(round=round_, epoch=round_ + 1, previous_end_seen=ended)])


def _report(rank: int, m: RecoveryMarks | None, first: float | None, iteration: int = 0) -> RankReport:
    return RankReport(local_rank=0, slot=rank, rank=rank, pid=100 + rank, state="running", iteration=iteration,
                      first_step_time=first, recovery=m)


def test_from_records_reads_the_newest_round() -> None:
    old = _record("lost", 1, [_report(1, marks(epoch=1, sealed=FAULT - 100), FAULT - 99)])
    survivor = _record("w0", 2, [_report(0, SURVIVOR, FAULT + 2.5)], ended=FAULT + 0.05)
    spare = _record("s0", 2, [_report(1, SPARE, FAULT + 2.6)])
    got = from_records([old, survivor, spare], FAULT)
    assert got is not None
    assert secs(got)["detect"] == pytest.approx(0.05) and got.first_knower == "agent of w0"
    assert got.raw == pytest.approx(2.6)


def test_from_records_waits_for_every_rank_s_marks() -> None:
    survivor = _record("w0", 2, [_report(0, SURVIVOR, FAULT + 2.5)])
    spare = _record("s0", 2, [_report(1, None, None)])
    assert from_records([survivor, spare], FAULT) is None
    assert from_records([], FAULT) is None
