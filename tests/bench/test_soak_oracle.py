"""The soak's early culprit check (issue 37), on status histories as its phase watch records them: no cluster."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import soak  # noqa: E402

BEFORE = {"lastFailure": {"pod": "minimal-worker-1", "reason": "Exception", "rank": 1}}
LOST = {"pod": "minimal-worker-1", "reason": "PeerLost", "rank": 1}
SURVIVOR = {"pod": "minimal-worker-0", "reason": "Exception", "message": "Connection closed by peer"}


def check(kind: str, shown: list[tuple[float, Any]], rank: int | None = None) -> list[str]:
    s = soak.Soak(Path("/nonexistent"), faults=1)
    s._lost_members = {"minimal-worker-1"}
    return s.judge_early(kind, "minimal-worker-1", rank, BEFORE, shown)


@pytest.mark.parametrize(("kind", "shown", "rank", "ok"), [
    ("node-loss", [(0.0, BEFORE["lastFailure"]), (1.2, LOST), (4.0, {**LOST, "reason": "NodeLost"})], None, True),
    # What today's status showed: the survivor first, the lost pod only once its loss was confirmed.
    ("node-loss", [(1.2, SURVIVOR), (4.0, {**LOST, "reason": "NodeLost"})], None, False),
    ("node-loss", [(6.0, LOST)], None, False),  # too late
    ("node-loss", [], None, False),
    ("rank-hang", [(10.4, LOST), (40.0, {**LOST, "reason": "Hang"})], 1, True),
    ("rank-hang", [(10.4, {"pod": "minimal-worker-0", "reason": "PeerLost", "rank": 0})], 1, False),
    ("rank-hang", [(10.4, {**LOST, "rank": 0})], 1, False),
], ids=["named-then-confirmed", "survivor-first", "late", "nothing", "hang", "hang-survivor", "hang-wrong-rank"])
def test_the_early_culprit(kind: str, shown: list[tuple[float, Any]], rank: int | None, ok: bool) -> None:
    assert (check(kind, shown, rank) == []) is ok


@pytest.mark.parametrize(("last_failure", "problems"), [
    ({"reason": "PeerLost", "detectedBy": "Heartbeat", "pod": "minimal-worker-1", "rank": 1}, []),
    # Thawed but stuck, so killed at its hard timeout: its agent's record names the hang (a CI run showed it).
    ({"reason": "Hang", "detectedBy": "Process", "pod": "minimal-worker-1", "rank": 1, "signal": "SIGQUIT"}, []),
    ({"reason": "ProcessExited", "detectedBy": "Process", "pod": "minimal-worker-1", "rank": 1, "signal": "SIGKILL"},
     ["lastFailure {'reason': 'ProcessExited'}, expected {'reason': 'Hang'}"]),
    ({"reason": "Hang", "detectedBy": "Process", "pod": "minimal-worker-0", "rank": 0, "signal": "SIGKILL"},
     ["lastFailure {'pod': 'minimal-worker-0', 'rank': 0}, expected {'pod': 'minimal-worker-1', 'rank': 1}"]),
], ids=["heartbeat", "hard-timeout", "hard-timeout-not-a-hang", "hard-timeout-survivor"])
def test_after_a_hang_the_frozen_rank_is_named(last_failure: dict[str, Any], problems: list[str]) -> None:
    s = soak.Soak(Path("/nonexistent"), faults=1)
    before = {"phase": "Running", "restarts": {"inProcess": 2}, "totalRestarts": 2, **BEFORE}
    moved = (3, 0) if last_failure["detectedBy"] == "Heartbeat" else (2, 1)
    after = {"phase": "Running", "restarts": {"inProcess": moved[0], "processRestarts": moved[1]},
             "totalRestarts": 3, "lastFailure": last_failure}
    assert s.judge("rank-hang", "minimal-worker-1", 1, before, after) == problems
