"""The partition soak's judgement of the status after one cut (bench/soak_partitions.py), as tables: no cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import soak_partitions as sp  # noqa: E402

VICTIM = "soak-worker-1"
BEFORE: dict[str, Any] = {"phase": "Running", "restarts": {"inProcess": 1, "podReplacements": 1}, "totalRestarts": 1,
                          "lastFailure": {"pod": "soak-worker-0", "reason": "NodeLost"}}


def after(in_process: int, pods: int, pod: str | None, total: int | None = None) -> dict[str, Any]:
    lf = BEFORE["lastFailure"] if pod is None else {"pod": pod, "reason": "PeerLost"}
    return {"phase": "Running", "restarts": {"inProcess": in_process, "podReplacements": pods},
            "totalRestarts": in_process if total is None else total, "lastFailure": lf}


@pytest.mark.parametrize(("new_round", "fenced", "moves"), [
    (False, False, (0, 0, 0)),  # the collective waited: nothing to recover
    (True, False, (1, 0, 0)),  # its lease ran out and it came back: the spare took over, no pod replaced
    (True, True, (1, 0, 1)),  # counted lost and fenced: replaced too
])
def test_expected_moves(new_round: bool, fenced: bool, moves: tuple[int, int, int]) -> None:
    assert sp.expected_moves(new_round, fenced) == moves


RECOVERED = ["Running", "Restarting", "Running"]


@pytest.mark.parametrize(("status", "moves", "phases", "culprit", "problems"), [
    (after(1, 1, None), (0, 0, 0), ["Running"], None, []),
    (after(2, 2, VICTIM), (1, 0, 1), RECOVERED, VICTIM, []),
    (after(2, 1, VICTIM), (1, 0, 0), ["Running"], VICTIM, []),  # the Restarting between two looks was missed
    # What the soak showed before lastFailure named a member whose lease ran out and came back:
    (after(2, 1, None), (1, 0, 0), RECOVERED, VICTIM, [f"lastFailure names soak-worker-0, expected {VICTIM}"]),
    (after(3, 1, VICTIM), (1, 0, 0), RECOVERED, VICTIM, ["counters moved (2, 0, 0), expected (1, 0, 0)"]),
    (after(2, 1, VICTIM, total=1), (1, 0, 0), RECOVERED, VICTIM, ["totalRestarts 1 is not the recoveries"]),
    (after(1, 1, None), (0, 0, 0), ["Running", "Restarting", "Running"], None,
     ["phases seen ['Running', 'Restarting', 'Running']"]),
    (after(2, 2, VICTIM), (1, 0, 1), ["Running", "Failed"], VICTIM, ["phases seen ['Running', 'Failed']"]),
    (after(1, 1, VICTIM), (0, 0, 0), ["Running"], None, [f"lastFailure changed without a new round: "
                                                         f"{{'pod': '{VICTIM}', 'reason': 'PeerLost'}}"]),
], ids=["nothing", "fenced", "missed-restarting", "unnamed", "double-count", "total", "restart-unneeded",
        "failed", "blamed-without-round"])
def test_judge(status: dict[str, Any], moves: tuple[int, int, int], phases: list[str], culprit: str | None,
               problems: list[str]) -> None:
    assert sp.judge(BEFORE, status, moves, phases, culprit) == problems


def test_the_phases_seen_start_with_the_phase_before_the_cut() -> None:
    s = sp.Soak(Path("/nonexistent"), 4, 100)
    s.seen = [(1.0, "Running"), (2.0, "Running"), (3.0, "Restarting"), (3.5, "Restarting"), (4.0, "Running")]
    assert s.phases_since(2.5) == ["Running", "Restarting", "Running"]
    assert s.phases_since(5.0) == ["Running"]
