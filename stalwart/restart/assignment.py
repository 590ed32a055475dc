"""Rank assignment: which present process runs which rank in the next iteration. Pure functions.

A *slot* is a rank process's fixed identity within a rendezvous round (the agent gives it; a respawned
process keeps its slot). Slots ``0..target_world-1`` start active with rank == slot; higher slots are
spares. After a fault, the processes that arrive at the iteration barrier are the candidates; the policy
maps them onto ranks ``0..world-1``:

* ``"fill"`` (fill gaps): a surviving process keeps its rank; a missing rank is taken by a spare (or by a
  returning process that was inactive); when no spare is left, the highest ranks move down into the gaps,
  so the world shrinks from the top.
* ``"shift"`` (shift ranks): survivors keep their order and are renumbered ``0..k-1``; spares are appended.

Then the world is cut down to a multiple of ``divisible_by`` (the cut ranks wait as spares) and must be at
least ``min_world_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Assignment", "Candidate", "RankAssignment", "WorldTooSmall", "initial_ranks"]


class WorldTooSmall(Exception):
    """Fewer healthy processes are present than the minimum world size."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A process present at the barrier."""

    slot: int
    spare: bool = False
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Assignment:
    """The outcome: ``ranks`` maps slot -> rank (ranks are exactly ``0..world_size-1``)."""

    ranks: dict[int, int]
    inactive: list[int] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def initial_ranks(target_world: int) -> dict[int, int]:
    """The assignment before any fault: slot i runs rank i for i < target_world."""
    return {i: i for i in range(target_world)}


@dataclass(frozen=True, slots=True)
class RankAssignment:
    """The rank assignment policy, validated on construction.

    ``mode`` is ``"fill"`` or ``"shift"``; ``min_world_size`` >= 1; ``divisible_by`` >= 1 (1: no rule).
    """

    mode: Literal["fill", "shift"] = "fill"
    min_world_size: int = 1
    divisible_by: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("fill", "shift"):
            raise ValueError(f"RankAssignment.mode: expected 'fill' or 'shift', got {self.mode!r}")
        if not isinstance(self.min_world_size, int) or self.min_world_size < 1:
            raise ValueError(f"RankAssignment.min_world_size: expected an int >= 1, got {self.min_world_size!r}")
        if not isinstance(self.divisible_by, int) or self.divisible_by < 1:
            raise ValueError(f"RankAssignment.divisible_by: expected an int >= 1, got {self.divisible_by!r}")

    def at_least(self, min_world_size: int | None) -> RankAssignment:
        """This policy with ``min_world_size`` raised to ``min_world_size`` (the job's minimum; ``None``: none):
        a decorator may ask for a larger minimum than its job, never a smaller one."""
        if min_world_size is None or min_world_size <= self.min_world_size:
            return self
        return dataclasses.replace(self, min_world_size=min_world_size)

    def assign(self, candidates: Sequence[Candidate], previous: Mapping[int, int],
               target_world: int) -> Assignment:
        """Assign ranks to the healthy ``candidates``; ``previous`` is the last iteration's slot -> rank.

        At most ``target_world`` ranks are active. Raises :class:`WorldTooSmall` when the result would be
        smaller than ``min_world_size``. Deterministic: equal inputs give equal outputs on every process.
        """
        if target_world < 1:
            raise ValueError(f"target_world: expected >= 1, got {target_world}")
        healthy = sorted((c for c in candidates if c.healthy), key=lambda c: c.slot)
        survivors = sorted((c for c in healthy if c.slot in previous), key=lambda c: previous[c.slot])
        # Returning non-spares first (a respawned process), then spares, each in slot order.
        others = sorted((c for c in healthy if c.slot not in previous), key=lambda c: (c.spare, c.slot))
        ranks: dict[int, int] = {}
        if self.mode == "shift":
            order = [c.slot for c in survivors] + [c.slot for c in others]
            for rank, slot in enumerate(order[:target_world]):
                ranks[slot] = rank
        else:
            kept = {c.slot: previous[c.slot] for c in survivors if previous[c.slot] < target_world}
            taken = set(kept.values())
            gaps = [r for r in range(target_world) if r not in taken]
            pool = [c.slot for c in others] + [c.slot for c in survivors if c.slot not in kept]
            # The pool's processes take the lowest gaps, in the pool's order, as many as there are of both.
            kept.update(zip(pool, gaps, strict=False))
            # No one left to fill the gaps: the ranks above the new world size move down into them.
            n = len(kept)
            used = set(kept.values())
            low_gaps = [r for r in range(n) if r not in used]
            movers = sorted((s for s in kept if kept[s] >= n), key=lambda s: kept[s])
            for slot, rank in zip(movers, low_gaps, strict=True):
                kept[slot] = rank
            ranks = kept
        world = len(ranks) - len(ranks) % self.divisible_by
        if world < self.min_world_size or world == 0:
            raise WorldTooSmall(
                f"{len(ranks)} healthy process(es) present, world size {world} after divisible_by="
                f"{self.divisible_by}; min_world_size is {self.min_world_size}")
        active = {slot: rank for slot, rank in ranks.items() if rank < world}
        inactive = sorted(c.slot for c in healthy if c.slot not in active)
        return Assignment(active, inactive)
