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
