"""status.peerSnapshot from the ranks' reports (stalwart/operator/snapshot_status.py): table tests."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from stalwart.api.restart import ProgressRecord, RankReport
from stalwart.api.status import PeerSnapshotStatus
from stalwart.operator.snapshot_status import peer_snapshot

T0 = 1_800_000_000.0


def node(name: str, epoch: int, *ranks: tuple[int, int | None, str | None]) -> ProgressRecord:
    """``ranks``: (rank, snapshot step, fallback)."""
    return ProgressRecord(node_id=name, epoch=epoch, round=1, state="running", updated=T0, ranks=[
        RankReport(local_rank=i, slot=r, rank=r, pid=100 + r, snapshot_step=step,
                   snapshot_time=None if step is None else T0 + step, snapshot_fallback=why)
        for i, (r, step, why) in enumerate(ranks)])


def at(step: int) -> datetime:
    return datetime.fromtimestamp(T0 + step, UTC)


LOST = "shard 2 has no copy on any rank: its rank and its buddy were both lost"


@pytest.mark.parametrize(("progress", "world", "expected"), [
    # No rank takes snapshots: no field.
    ([node("w-0", 3, (0, None, None)), node("w-1", 3, (1, None, None))], 2, None),
    # The oldest rank's step: a lost pod costs the steps since.
    ([node("w-0", 3, (0, 41, None), (1, 42, None)), node("w-1", 3, (2, 42, None), (3, 40, None))], 4,
     PeerSnapshotStatus(step=40, time=at(40))),
    # A rank of the round without one yet (a spare just promoted): no step the whole job holds.
    ([node("w-0", 3, (0, 41, None)), node("w-1", 3, (1, None, None))], 2, PeerSnapshotStatus()),
    # The last restore found none covering every shard: why, from the first rank that says so.
    ([node("w-0", 3, (0, None, LOST)), node("w-1", 3, (1, None, LOST))], 2, PeerSnapshotStatus(fallback=LOST)),
    # Reports of another round (an old epoch) and of pods outside the round are not the job's now: w-1's rank
    # of this round has not reported, so no step covers the whole world.
    ([node("w-0", 3, (0, 50, None)), node("w-1", 2, (1, 10, None)), node("gone", 3, (1, 5, None))], 2,
     PeerSnapshotStatus()),
])
def test_peer_snapshot(progress: list[ProgressRecord], world: int, expected: PeerSnapshotStatus | None) -> None:
    assert peer_snapshot(progress, {"w-0", "w-1"}, 3, world) == expected
