"""What a rank process holds of the peer snapshots, for its life: its own shard's copies and its wards', the copies
on their way, and what it tells its agent; written out for the process that replaces it when a hang is about to
end it (:func:`spill`, :mod:`~stalwart.restart.snapshot_spill`). :mod:`~stalwart.restart.snapshots` takes and
restores the copies."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.restart import snapshot_spill
from stalwart.restart.peers import TensorSpec
from stalwart.restart.snapshot_plan import Holding

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["HELD", "KEEP", "Copy", "Held", "Published", "forget", "published", "spill", "unspill"]

#: Snapshot steps kept per shard: the newest, and the one before it (in use while the newest is in flight).
KEEP = 2


@dataclass(slots=True)
class Copy:
    """One shard at one step: its layout and one flat CPU buffer per dtype (in layout order within it)."""

    step: int
    layout: list[TensorSpec]
    flats: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())


@dataclass(frozen=True, slots=True)
class Published:
    """What a rank tells its agent of its snapshots (through its status file): the newest step of its own
    shard that landed on its buddy, when, and why its last restore found none to use."""

    step: int | None = None
    time: float | None = None
    fallback: str | None = None


@dataclass(slots=True)
class Held:
    """What this process holds, across the training function's iterations and rounds."""

    own_shard: int | None = None
    world: int = 0
    #: The generation of the timeline its copies are of: one more than the newest at the last restore it took
    #: part in (:mod:`~stalwart.restart.snapshot_plan`).
    generation: int = 0
    own: dict[int, Copy] = field(default_factory=dict)
    wards: dict[int, dict[int, Copy]] = field(default_factory=dict)
    #: Copies on their way, from the last commit (of whichever iteration): sends, and receives per ward.
    sending: list[Any] = field(default_factory=list)
    receiving: list[tuple[int, Copy, list[Any]]] = field(default_factory=list)
    #: The step of the copy being sent, and what this rank tells its agent (:func:`published`).
    sending_step: int | None = None
    #: The snapshot group those copies travel on (an earlier iteration's, once a fault ended it).
    group: Any = None
    landed: Published = field(default_factory=Published)

    def holding(self) -> Holding:
        own = None if self.own_shard is None or not self.own else (self.own_shard, tuple(sorted(self.own)))
        wards = tuple((s, tuple(sorted(c))) for s, c in sorted(self.wards.items()) if c)
        return Holding(own, wards, self.world if own is not None or wards else 0, self.generation)

    #: Buffers of dropped copies, by (dtype, elements), for the next copies: a snapshot every step would
    #: otherwise allocate (and the kernel zero) the whole shard's memory twice a step.
    free: dict[tuple[str, int], list[torch.Tensor]] = field(default_factory=dict)

    def prune(self) -> None:
        for copies in (self.own, *self.wards.values()):
            for step in sorted(copies)[:-KEEP]:
                for dtype, flat in copies.pop(step).flats.items():
                    pool = self.free.setdefault((dtype, flat.numel()), [])
                    if len(pool) < KEEP:
                        pool.append(flat)

    def buffer(self, dtype: str, n: int) -> torch.Tensor:
        """An uninitialised CPU buffer of ``n`` elements: a dropped copy's, else new."""
        import torch

        pool = self.free.get((dtype, n))
        return pool.pop() if pool else torch.empty(n, dtype=getattr(torch, dtype))

    def find(self, shard: int, step: int, from_own: bool) -> Copy:
        return self.own[step] if from_own else self.wards[shard][step]


#: This process's holdings (one per process: they outlive the training function's iterations and rounds).
HELD = Held()


def spill(directory: Path) -> int:
    """Write every copy this process holds that is whole (its own shard's and its wards' that landed) to
    ``directory``, for the process that takes this one's place (see :mod:`~stalwart.restart.snapshot_spill`).
    Called from the monitor thread while the main thread is stuck; returns the bytes written."""
    held = HELD
    g = held.generation
    copies = [snapshot_spill.SpilledCopy("own", held.own_shard, step, held.world, g, c.layout, c.flats)
              for step, c in list(held.own.items())] if held.own_shard is not None else []
    copies += [snapshot_spill.SpilledCopy("ward", shard, step, held.world, g, c.layout, c.flats)
               for shard, by_step in list(held.wards.items()) for step, c in list(by_step.items())]
    return snapshot_spill.write(directory, copies)


def unspill(directory: Path) -> None:
    """A process that holds nothing takes what the one before it in its slot spilled. Either way the directory
    goes: a spill of this very process (its main thread came free after all) would be stale by the next commit,
    which reuses the buffers it was written from."""
    if HELD.own or HELD.wards:
        snapshot_spill.clear(directory)
        return
    copies = snapshot_spill.read(directory)
    for c in copies:
        if c.kind == "own":
            HELD.own_shard = c.shard
            HELD.own[c.step] = Copy(c.step, c.layout, c.flats)
        else:
            HELD.wards.setdefault(c.shard, {})[c.step] = Copy(c.step, c.layout, c.flats)
        HELD.world, HELD.generation = c.world, c.generation
    if copies:
        log.info("took %d snapshot cop%s the process before this one spilled (steps %s)", len(copies),
                 "y" if len(copies) == 1 else "ies", sorted({c.step for c in copies}))
        HELD.prune()
    snapshot_spill.clear(directory)


def published() -> Published:
    """What this process's rank tells its agent of its snapshots (none taken: all None)."""
    return HELD.landed


def forget() -> None:
    """Drop every snapshot this process holds (for a process that must start clean, and for tests)."""
    HELD.__init__()  # type: ignore[misc]  # in place: the modules that took HELD keep the one object
