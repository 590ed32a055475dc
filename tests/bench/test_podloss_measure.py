"""The pod-loss benchmark's figures of one case (bench/podloss.py's ``measure``) from the ranks' step and resume
lines: raw, net of the median step, the time to the last resumption, the steps recomputed. A table over made-up
lines, as the example script prints them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.podloss import measure

FAULT = 100.0


def steps(rank: int, times: list[float], first: int = 1) -> list[dict[str, Any]]:
    return [{"event": "step", "rank": rank, "time": t, "step": first + i} for i, t in enumerate(times)]


def resume(rank: int, time: float, step: int) -> dict[str, Any]:
    return {"event": "resume", "rank": rank, "time": time, "step": step}


def figures(events: list[dict[str, Any]], survivor: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    rows = measure("stalwart", "force-delete", 1_000_000, t_fault=FAULT, events=events, survivor=survivor or [])
    return {r["metric"]: r["value"] for r in rows}


# Four steps of 1 s before the fault on both ranks; rank 0 resumes at +1.5 s, rank 1 at +2.0 s; their first steps
# after it end at +3.0 and +3.5 s.
BEFORE = [*steps(0, [96.0, 97.0, 98.0, 99.0]), *steps(1, [96.0, 97.0, 98.0, 99.0])]
AFTER = [resume(0, 101.5, 4), resume(1, 102.0, 4), *steps(0, [103.0], 5), *steps(1, [103.5], 5)]


def test_raw_net_and_resume_seconds() -> None:
    got = figures(BEFORE + AFTER)
    assert got["raw_seconds"] == pytest.approx(3.5)        # the fault to the last rank's first step
    assert got["step_seconds"] == pytest.approx(1.0)
    assert got["seconds"] == pytest.approx(2.5)            # net of the median step
    assert got["resume_seconds"] == pytest.approx(2.0)     # the last resumption: no median in it
    assert got["steps_recomputed"] == 0 and got["survivor_process_starts"] == 0


def test_a_slow_warm_up_flatters_the_net_figure_but_not_the_resume_time() -> None:
    slow = [*steps(0, [90.0, 94.0, 98.0, 99.0]), *steps(1, [90.0, 94.0, 98.0, 99.0])]  # median step 4 s
    got = figures(slow + AFTER)
    assert got["seconds"] == pytest.approx(-0.5)
    assert got["resume_seconds"] == pytest.approx(2.0)


def test_steps_done_again_after_a_restart_from_a_checkpoint() -> None:
    after = [resume(0, 101.5, 2), resume(1, 102.0, 2), *steps(0, [103.0], 3), *steps(1, [103.5], 3)]
    got = figures(BEFORE + after, survivor=[{"event": "start", "time": 101.0}])
    assert got["steps_recomputed"] == 2 and got["survivor_process_starts"] == 1


def test_a_case_that_never_recovers_says_why() -> None:
    # Rank 0 resumed and stepped, rank 1 never came back: no figure, though one rank has one.
    rows = measure("stalwart", "force-delete", 1_000_000, t_fault=FAULT,
                   events=[*BEFORE, resume(0, 101.5, 4), *steps(0, [103.0], 5)], survivor=[], why="the job failed")
    by = {r["metric"]: r for r in rows}
    assert by["raw_seconds"]["value"] is None and by["raw_seconds"]["reason"] == "the job failed"
    assert by["seconds"]["value"] is None
    assert by["resume_seconds"]["value"] is None and by["resume_seconds"]["reason"] == "the job failed"
