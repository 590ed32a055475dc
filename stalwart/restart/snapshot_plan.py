"""Peer snapshots of sharded state: where each rank's copy goes, and how a lost shard comes back. Pure.

A rank's *shard* is its local part of the model's and optimizer's state (FSDP's DTensor local tensors, or
plain tensors). Shard ``r`` is what rank ``r`` holds; a job that keeps its world size keeps its sharding, so
whichever process runs rank ``r`` after a fault needs shard ``r`` back.

* :func:`buddies`: each rank's shard is copied to a *buddy*, a rank on another pod (never its own: a pod lost
  takes its ranks' memory with it), the ranks of a pod spread over the other pods.
* :class:`Holding`: what one process still holds after a fault: its own shard (as the rank it was), at which
  snapshot steps, and the copies it keeps for its wards.
* :func:`plan_restore`: the newest step of which every shard has a copy somewhere, and for each rank where
  its shard comes from: its own memory, or another process (its buddy, or a survivor that ran that rank).
  A step whose copy landed on some holders but not all is passed over: a torn snapshot is never used.
  Copies of different timelines never mix: every restore starts a new *generation*, which the copies taken
  after it carry, and a holder of an older generation than the newest among the holders (a process that took
  the copies a hung one wrote out, but missed a restore since) holds copies of a timeline that no longer is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Holding", "Move", "NoSnapshot", "RestorePlan", "buddies", "decode_holdings", "encode_holding",
           "newest_generation", "plan_restore"]


def buddies(pods: Sequence[str]) -> list[int]:
    """The buddy of every rank: ``pods[r]`` names rank ``r``'s pod. Rank ``r``, the ``i``-th rank of the
    ``p``-th pod (pods in order of their first rank), is copied to the ``i``-th rank (round its ranks) of
    pod ``p + 1`` (round the pods). Raises ``ValueError`` when there is no other pod."""
    order: list[str] = []
    ranks_of: dict[str, list[int]] = {}
    for rank, pod in enumerate(pods):
        if pod not in ranks_of:
            order.append(pod)
            ranks_of[pod] = []
        ranks_of[pod].append(rank)
    if len(order) < 2:
        raise ValueError(f"peer snapshots need ranks on at least two pods (a buddy is never on its own pod); "
                         f"all {len(pods)} rank(s) are on pod {order[0] if order else '(none)'!r}")
    out = []
    for rank, pod in enumerate(pods):
        p = order.index(pod)
        i = ranks_of[pod].index(rank)
        other = ranks_of[order[(p + 1) % len(order)]]
        out.append(other[i % len(other)])
    return out


@dataclass(frozen=True, slots=True)
class Holding:
    """What one process holds: ``own``, the shard it ran (its rank then) and the snapshot steps of it it
    keeps (``None``: a new process, holding nothing); ``wards``: (shard, steps) of the copies it keeps for
    other ranks; ``world``: how many ranks the state was sharded over."""

    own: tuple[int, tuple[int, ...]] | None = None
    wards: tuple[tuple[int, tuple[int, ...]], ...] = ()
    #: The world size of the sharding its copies are of (0: it holds none).
    world: int = 0
    #: How many restores its copies' timeline has been through (see the module's docstring).
    generation: int = 0

    @property
    def holds(self) -> bool:
        return self.own is not None or bool(self.wards)


def newest_generation(holdings: Sequence[Holding]) -> int:
    """The generation of the newest timeline any holder's copies are of (0: none holds any)."""
    return max((h.generation for h in holdings if h.holds), default=0)


@dataclass(frozen=True, slots=True)
class Move:
    """Shard ``shard`` at the plan's step goes from rank ``source`` to rank ``target`` (the same rank: from
    its own memory); ``from_own``: the source holds it as its own shard, else as a ward's copy."""

    source: int
    target: int
    shard: int
    from_own: bool


@dataclass(frozen=True, slots=True)
class RestorePlan:
    step: int
    moves: tuple[Move, ...]


@dataclass(frozen=True, slots=True)
class NoSnapshot:
    """No step has a copy of every shard; ``reason`` names the first shard without one."""

    reason: str


def _copies(holdings: Sequence[Holding]) -> dict[int, dict[int, list[tuple[int, bool]]]]:
    """shard -> step -> [(holder rank, held as own)]."""
    out: dict[int, dict[int, list[tuple[int, bool]]]] = {}
    for rank, h in enumerate(holdings):
        held = ([(h.own[0], h.own[1], True)] if h.own is not None else []) + [(s, st, False) for s, st in h.wards]
        for shard, steps, own in held:
            for step in steps:
                out.setdefault(shard, {}).setdefault(step, []).append((rank, own))
    return out


def plan_restore(holdings: Sequence[Holding]) -> RestorePlan | NoSnapshot:
    """Where every rank's shard comes from, at the newest step of which every shard has a copy (rank ``r``
    of the new world gets shard ``r``; ``holdings[r]`` is what it holds). A rank that holds its shard at that
    step keeps its own; otherwise the copy comes from the lowest rank holding it as its own shard (a
    survivor whose rank changed), else from the lowest rank keeping it for a ward."""
    world = len(holdings)
    if world == 0:
        raise ValueError("holdings: expected one entry per rank, got none")
    newest = newest_generation(holdings)
    stale = [rank for rank, h in enumerate(holdings) if h.holds and h.generation < newest]
    holdings = [Holding() if rank in stale else h for rank, h in enumerate(holdings)]
    sizes = sorted({h.world for h in holdings if h.world})
    if sizes and sizes != [world]:
        return NoSnapshot(f"the snapshots are of the state sharded over {' and '.join(map(str, sizes))} ranks, "
                          f"and this iteration has {world}: another sharding")
    copies = _copies(holdings)
    for shard in range(world):
        if shard not in copies:
            if stale:
                return NoSnapshot(f"shard {shard} has no copy of the current timeline: rank(s) "
                                  f"{', '.join(map(str, stale))} hold copies from before a restore they missed")
            return NoSnapshot(f"shard {shard} has no copy on any rank: its rank and its buddy were both lost")
    common = set.intersection(*(set(copies[shard]) for shard in range(world)))
    if not common:
        return NoSnapshot("no snapshot step has a copy of every shard (the newest ones were in flight when "
                          "the ranks that held the others were lost)")
    step = max(common)
    moves = []
    for target in range(world):
        holders = copies[target][step]
        mine = [(rank, own) for rank, own in holders if rank == target]
        source, own = mine[0] if mine else min(holders, key=lambda h: (not h[1], h[0]))
        moves.append(Move(source, target, target, own))
    return RestorePlan(step, tuple(moves))


#: A holding on the wire: int64 values, no pickle.
#: [world, generation, own shard or -1, n, steps..., wards, (shard, n, steps...)...]
def encode_holding(h: Holding) -> list[int]:
    out = [h.world, h.generation] + ([-1, 0] if h.own is None else [h.own[0], len(h.own[1]), *h.own[1]])
    out.append(len(h.wards))
    for shard, steps in h.wards:
        out += [shard, len(steps), *steps]
    return out


def decode_holdings(rows: Sequence[Sequence[int]]) -> list[Holding]:
    """The holdings of every rank from their encodings (each row may be padded at its end)."""
    return [_decode([int(v) for v in row]) for row in rows]


def _decode(row: list[int]) -> Holding:
    at = 0

    def take(n: int) -> list[int]:
        nonlocal at
        if n < 0 or at + n > len(row):
            raise ValueError(f"a holding's encoding ends early or is malformed: {row}")
        part = row[at:at + n]
        at += n
        return part

    world, generation, own_shard, n = take(4)
    steps = tuple(take(n))
    own = None if own_shard < 0 else (own_shard, steps)
    (count,) = take(1)
    wards = []
    for _ in range(count):
        shard, n = take(2)
        wards.append((shard, tuple(take(n))))
    return Holding(own, tuple(wards), world, generation)
