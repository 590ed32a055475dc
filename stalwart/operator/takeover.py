"""Which spare took which ranks: the ``SpareTookOver`` Event of a new rendezvous round, as a pure function.

When a round is sealed with a spare pod among its members (the job's JobRecord lists it as a spare), that spare
took the ranks of a lost worker: the Event names the spare, its global ranks in the new round, the round, and
the pod whose loss the job is recovering from (``lastFailure``). With ``restartPolicy.inProcess.warmSpares``
the spare's processes were already running, parked, and took the ranks in process; without, they start now.
A spare that was a member of an earlier round (promoted before) is not announced again: the status keeps the
spares announced (``promotedSpares``), since a spare whose first round was superseded within a moment may
never have written a record of it; its progress history is the second witness (a status written before the
field existed).
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import ProgressRecord
from stalwart.api.status import FailureRecord

__all__ = ["REASON_SPARE_TOOK_OVER", "takeovers"]

REASON_SPARE_TOOK_OVER = "SpareTookOver"


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def takeovers(previous_round: int | None, manifest: Manifest | None, record: JobRecord | None,
              progress: Sequence[ProgressRecord], lost: FailureRecord | None, *, warm: bool,
              announced: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(spare, message)`` of the Events for the round ``manifest`` seals, when it is new (its round is past
    ``previous_round``, the round the last decided status showed; None: the job's first round, which replaces
    nobody): one per spare member that is not in ``announced`` (the status' ``promotedSpares``) and was a member
    of no earlier round (its progress history shows none)."""
    if manifest is None or record is None or previous_round is None or manifest.round <= previous_round:
        return []
    spares = set(record.spares) - set(announced)
    earlier = {rec.node_id for rec in progress if any(s.round < manifest.round for s in rec.history)}
    how = "in process (its parked processes were already running)" if warm else "with processes started now"
    replacing = f", replacing pod {lost.pod} ({lost.reason})" if lost is not None and lost.pod and (
        manifest.member(lost.pod) is None) else ""
    return [(m.node_id, f"spare pod {m.node_id} took {_ranks(m.rank_offset, m.nproc)} of world size "
             f"{manifest.world_size} in round {manifest.round}{replacing}, {how}")
            for m in manifest.members if m.node_id in spares and m.node_id not in earlier]
