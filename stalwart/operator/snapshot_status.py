"""The status of a job's peer snapshots (``status.peerSnapshot``) from its ranks' reports. Pure.

Each rank reports the newest step of its own shard's snapshot that landed on its buddy, and why its last
restore found no snapshot to use. The job's snapshot step is the oldest of the round's ranks' (a lost pod
costs the steps since: the copies of every rank must be there); none while a rank of the round reports none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import UTC, datetime

from stalwart.api.restart import ProgressRecord
from stalwart.api.status import PeerSnapshotStatus

__all__ = ["peer_snapshot"]


def peer_snapshot(progress: Sequence[ProgressRecord], members: Collection[str], epoch: int | None,
                  world: int) -> PeerSnapshotStatus | None:
    """``status.peerSnapshot`` from the reports of ``members`` in the round ``epoch`` (of ``world`` ranks);
    None when no rank of theirs takes snapshots."""
    ranks = sorted(((r.rank if r.rank is not None else r.slot, r) for rec in progress
                    if rec.node_id in members and (epoch is None or rec.epoch == epoch) for r in rec.ranks),
                   key=lambda pair: pair[0])
    reports = [r for _, r in ranks]
    if not any(r.snapshot_step is not None or r.snapshot_fallback for r in reports):
        return None
    fallback = next((r.snapshot_fallback for r in reports if r.snapshot_fallback), None)
    steps = [r for r in reports if r.snapshot_step is not None]
    if len(steps) < max(world, len(reports)):
        return PeerSnapshotStatus(fallback=fallback)
    oldest = min(steps, key=lambda r: (r.snapshot_step or 0, r.snapshot_time or 0.0))
    when = datetime.fromtimestamp(oldest.snapshot_time, UTC) if oldest.snapshot_time is not None else None
    return PeerSnapshotStatus(step=oldest.snapshot_step, time=when, fallback=fallback)
