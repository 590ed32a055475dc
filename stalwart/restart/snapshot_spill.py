"""A rank's held snapshots written to its pod's disk when a hang is about to cost its process, and read back by
the process that takes its place.

gloo frees an operation blocked on a connection that is shut down, except one whose message was already in
transit: a receive whose payload had begun to arrive, or a send whose payload had begun to leave, is told of
nothing and waits for the group's timeout (30 minutes by default). A rank caught so in a collective of a large
model (an FSDP all-gather of tens of megabytes) is ended by its agent's hard timeout, and the copies it holds
would go with it: of its wards' shards, whose other holder may be the pod just lost, and of its own. So the
monitor thread, which still runs, writes them beside the rank's status file once an interrupt has not freed the
main thread (:func:`stalwart.restart.snapshots.spill`); the agent starts a new process in the slot, and its
:class:`~stalwart.restart.snapshots.PeerSnapshots` reads them back before its first restore. The directory goes
with the agent's run directory when the agent ends.

One directory per copy, ``<kind>-<shard>-<step>``, written under a temporary name and renamed once whole:
``layout.json`` (kind, shard, step, world size, the timeline's generation, each tensor's name, shape and dtype) and
the raw bytes of each dtype's flat buffer, ``<dtype>.bin``. Nothing is pickled; a directory that does not match its
layout is skipped.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from stalwart.restart.peers import TensorSpec, elements_by_dtype

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["SpilledCopy", "clear", "directory_for", "read", "write"]

Kind = Literal["own", "ward"]
_LAYOUT = "layout.json"
_PARTIAL = ".partial-"


def directory_for(status_file: str | Path) -> Path:
    """Where the rank whose status file is ``status_file`` spills: beside it, kept when the agent starts a new
    process in the slot (which removes only the status file) and removed with the agent's run directory."""
    path = Path(status_file)
    return path.with_name(f"{path.stem}.snapshots")


@dataclass(frozen=True, slots=True)
class SpilledCopy:
    """One held copy: this rank's own shard (``own``) or a ward's, at one snapshot step."""

    kind: Kind
    shard: int
    step: int
    world: int
    #: The timeline's generation (:mod:`~stalwart.restart.snapshot_plan`): the copies of a process that missed a
    #: restore since are of a timeline that no longer is.
    generation: int
    layout: list[TensorSpec]
    flats: dict[str, torch.Tensor]

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.shard}-{self.step}"


class _TensorEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: list[int] = Field(description="each dimension, >= 0")
    dtype: str = Field(pattern=r"^[a-z0-9_]+$")


class _Layout(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Kind
    shard: int = Field(ge=0)
    step: int = Field(ge=0)
    world: int = Field(ge=1)
    generation: int = Field(ge=0)
    tensors: list[_TensorEntry]


def write(directory: Path, copies: Iterable[SpilledCopy]) -> int:
    """Write each copy not yet there (a copy is never changed once held); returns the bytes written."""
    import torch

    written = 0
    for copy in copies:
        directory.mkdir(parents=True, exist_ok=True)
        final = directory / copy.name
        if final.exists():
            continue
        tmp = directory / f"{_PARTIAL}{copy.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for dtype, flat in sorted(copy.flats.items()):
            raw = flat.detach().contiguous().view(torch.uint8)
            raw.numpy().tofile(tmp / f"{dtype}.bin")
            written += raw.numel()
        layout = _Layout(kind=copy.kind, shard=copy.shard, step=copy.step, world=copy.world, generation=copy.generation,
                         tensors=[_TensorEntry(name=s.name, shape=list(s.shape), dtype=s.dtype)
                                  for s in copy.layout])
        (tmp / _LAYOUT).write_text(layout.model_dump_json())
        tmp.rename(final)
    return written


def read(directory: Path) -> list[SpilledCopy]:
    """Every whole copy in ``directory`` (none when it does not exist); a part-written or inconsistent one is
    skipped with a warning."""
    import torch

    if not directory.is_dir():
        return []
    out = []
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(_PARTIAL) or not entry.is_dir():
            continue
        try:
            layout = _Layout.model_validate_json((entry / _LAYOUT).read_bytes())
            specs = [TensorSpec(t.name, tuple(t.shape), t.dtype) for t in layout.tensors]
            flats = {}
            for dtype, n in sorted(elements_by_dtype(specs).items()):
                kind = getattr(torch, dtype, None)
                if not isinstance(kind, torch.dtype):
                    raise ValueError(f"{dtype!r} is not a torch dtype")
                path = entry / f"{dtype}.bin"
                size, need = path.stat().st_size, n * torch.empty((), dtype=kind).element_size()
                if size != need:
                    raise ValueError(f"{path.name} has {size} bytes, its layout says {need}")
                # Mapped privately: the pages come in as they are read, and stay the tensor's once the
                # directory is removed.
                flats[dtype] = torch.from_file(str(path), shared=False, size=n, dtype=kind) if n else \
                    torch.empty(0, dtype=kind)
        except (OSError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            log.warning("spilled snapshot %s skipped: %s", entry, e)
            continue
        out.append(SpilledCopy(layout.kind, layout.shard, layout.step, layout.world, layout.generation, specs,
                               flats))
    return out


def clear(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
