"""What the agents' reports say about training right now: the latest step, where each rank is, who is stalled.
Pure functions over the :class:`~stalwart.api.restart.ProgressRecord` of the current round.

A rank is *stalled* when it is in its training function (state ``running``) and its main thread has not made
progress for longer than the limit it judges itself by (the one the rank reports: its startup allowance before
the iteration's first ping, its soft timeout after; else the spec's soft timeout), or when its node
is a member of the round and its agent has not reported for the spec's soft timeout. Ranks at a barrier or
waiting as spares are not stalled: they wait on etcd with deadlines of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stalwart.api.restart import ProgressRecord, RankReport
from stalwart.operator.failures import RankPlace

__all__ = ["Evidence", "gather"]


@dataclass(frozen=True, slots=True)
class Evidence:
    """``step``/``step_time``: the furthest step of the current round and when it completed (None: none);
    ``stalled``: ``(rank or None, pod)`` of the stalled ranks; ``stalled_for``: seconds since the oldest of
    them progressed; ``places``: slot -> where it runs in the current round; ``soft_timeout``: the soft timeout
    the oldest stalled rank was judged by."""

    step: int | None = None
    step_time: float | None = None
    stalled: tuple[tuple[int | None, str], ...] = ()
    stalled_for: float = 0.0
    places: dict[int, RankPlace] | None = None
    soft_timeout: float | None = None
    #: What that limit is: the soft timeout, or a rank's startup allowance before its iteration's first ping.
    limit_name: str = "soft timeout"


def _current(records: Iterable[ProgressRecord], epoch: int) -> list[ProgressRecord]:
    return [r for r in records if epoch and r.epoch == epoch]


def gather(records: Sequence[ProgressRecord], *, epoch: int, members: Iterable[str], now: float,
           soft_timeout: float, seen_since: float = 0.0) -> Evidence:
    """The evidence of the round sealed at ``epoch`` (``members``: its nodes) at time ``now``. ``seen_since`` is
    when the operator could last start reading etcd again (after an outage): silence from before then is no
    evidence of a stall (the agents could not write either)."""
    current = _current(records, epoch)
    steps = [(rank.step, rank.step_time if rank.step_time is not None else rec.updated)
             for rec in current for rank in rec.ranks if rank.step is not None]
    step, step_time = max(steps, key=lambda s: (s[0], s[1])) if steps else (None, None)
    places = {rank.slot: RankPlace(rank.rank, rec.node_id) for rec in current for rank in rec.ranks}
    stalled: list[tuple[int | None, str]] = []
    oldest, judged_by, named = now, None, "soft timeout"
    member_set = set(members)
    for rec in current:
        agent_silent = now - max(rec.updated, seen_since) > soft_timeout and rec.node_id in member_set
        for rank in rec.ranks:
            seen = max(_progress(rank, rec.updated), seen_since)
            # The limit the rank judges itself by now, where it says: before its first ping in the iteration the
            # startup allowance (its group may wait for a peer still starting), else its soft timeout.
            limit = rank.stall_limit or rank.soft_timeout or soft_timeout
            if rank.state == "running" and (now - seen > limit or agent_silent):
                stalled.append((rank.rank, rec.node_id))
                if seen <= oldest:
                    oldest, judged_by = seen, (soft_timeout if agent_silent else limit)
                    startup = not agent_silent and limit > (rank.soft_timeout or soft_timeout)
                    named = "startup allowance" if startup else "soft timeout"
        if agent_silent and not rec.ranks:
            stalled.append((None, rec.node_id))
            if max(rec.updated, seen_since) <= oldest:
                oldest, judged_by, named = max(rec.updated, seen_since), soft_timeout, "soft timeout"
    stalled.sort(key=lambda s: (s[0] is None, s[0] or 0, s[1]))
    return Evidence(step, step_time, tuple(stalled), now - oldest if stalled else 0.0, places,
                    judged_by if stalled else None, named)


def _progress(rank: RankReport, updated: float) -> float:
    """When the rank last progressed, as far as its agent knows."""
    times = [t for t in (rank.progress_time, rank.step_time) if t is not None]
    return max(times) if times else updated
