"""State from peers: after a rank was replaced, the ranks that hold the newest state hand it to the others.

:func:`sync_from_peers`, called at the top of a training function (inside the iteration's process group):

1. every rank says which step its state is at (``None``: it has none, e.g. a spare just promoted);
2. the most advanced replica is chosen (the highest step; ties: the lowest rank) (:func:`plan_sync`);
3. the ranks that are behind get the source's *layout* (names, shapes and dtypes of the model's and the
   optimizer's tensors, as JSON: nothing is unpickled) and check it against their own model
   (:func:`first_difference`); if any rank's model differs, every rank raises :class:`StateMismatch` naming
   the first differing tensor, *before* any tensor moves;
4. the tensors are broadcast, one flat buffer per dtype, into fresh buffers, and copied into the model and
   optimizer only once all arrived: no rank keeps a half-copied state.

Ranks already at the newest step (other than the source) send and receive nothing: the transfer runs on a
group of the source and the ranks behind. Limits: this is for replicas (pure data parallelism: every rank
holds the whole model); sharded state (FSDP, tensor or pipeline parallelism) needs a replica of each shard
and is not handled here. Checkpoint loading stays the fallback when no rank holds any state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["StateMismatch", "SyncPlan", "SyncResult", "TensorSpec", "elements_by_dtype", "first_difference",
           "plan_sync", "sync_from_peers"]

NO_STATE = -1


class StateMismatch(ValueError):
    """The ranks' models (or optimizers) differ in layout; ``name`` is the first differing tensor."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"sync_from_peers: tensor {name!r} differs between ranks: {detail}")
        self.name = name


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the state: its name (``model.<key>`` or ``optimizer.<param>.<key>``), shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


def elements_by_dtype(layout: Sequence[TensorSpec]) -> dict[str, int]:
    """How many elements of each dtype the tensors of ``layout`` have together (one flat buffer each)."""
    sizes: dict[str, int] = {}
    for spec in layout:
        n = 1
        for d in spec.shape:
            n *= d
        sizes[spec.dtype] = sizes.get(spec.dtype, 0) + n
    return sizes


@dataclass(frozen=True, slots=True)
class SyncPlan:
    """Who sends (``source``, its ``step``) and who receives (``receivers``, the ranks behind)."""

    source: int
    step: int | None
    receivers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What :func:`sync_from_peers` did: the step every rank now holds, where the state came from, and
    whether this rank received it (and how many bytes)."""

    step: int | None
    source: int
    received: bool
    bytes: int


def plan_sync(steps: Sequence[int | None]) -> SyncPlan:
    """The most advanced replica (highest step, ties: lowest rank) and the ranks behind it. Pure."""
    if not steps:
        raise ValueError("steps: expected one entry per rank, got none")
    values = [NO_STATE if s is None else s for s in steps]
    for rank, s in enumerate(values):
        if s < NO_STATE:
            raise ValueError(f"step of rank {rank}: expected >= 0 or None, got {s}")
    best = max(values)
    source = values.index(best)
    if best == NO_STATE:
        return SyncPlan(source, None, ())
    return SyncPlan(source, best, tuple(r for r, s in enumerate(values) if s != best))


def first_difference(mine: Sequence[TensorSpec], theirs: Sequence[TensorSpec]) -> tuple[str, str] | None:
    """The first tensor of ``theirs`` (the source's layout) that ``mine`` lacks or holds differently, as
    (name, what differs); ``None`` when the layouts agree. Pure."""
    by_name = {s.name: s for s in mine}
    for s in theirs:
        m = by_name.get(s.name)
        if m is None:
            return s.name, "missing on this rank"
        if m.shape != s.shape:
            return s.name, f"shape {list(m.shape)} here, {list(s.shape)} on the sending rank"
        if m.dtype != s.dtype:
            return s.name, f"dtype {m.dtype} here, {s.dtype} on the sending rank"
    extra = [s.name for s in mine if s.name.startswith("model.") and s.name not in {t.name for t in theirs}]
    if extra:
        return extra[0], "present here, missing on the sending rank"
    return None


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None,
             layout: Sequence[TensorSpec] | None = None) -> list[tuple[TensorSpec, torch.Tensor]]:
    """The state's tensors in a fixed order. With ``layout`` (the source's), the optimizer's entries are
    those of the layout, created here where this rank has none yet (e.g. momentum before the first step)."""
    import torch

    out = [(TensorSpec(f"model.{k}", tuple(t.shape), str(t.dtype).removeprefix("torch.")), t)
           for k, t in model.state_dict(keep_vars=True).items()]
    if optimizer is None:
        return out
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if layout is None:
        for i, p in enumerate(params):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((TensorSpec(f"optimizer.{i}.{key}", tuple(value.shape),
                                           str(value.dtype).removeprefix("torch.")), value))
        return out
    for spec in layout:
        if spec.name.startswith("optimizer."):
            _, index, key = spec.name.split(".", 2)
            i = int(index)
            if i >= len(params):
                raise StateMismatch(spec.name, f"the optimizer here has {len(params)} parameters")
            dtype = getattr(torch, spec.dtype)
            existing = optimizer.state.get(params[i], {}).get(key)
            if not isinstance(existing, torch.Tensor) or tuple(existing.shape) != spec.shape:
                existing = torch.empty(spec.shape, dtype=dtype, device=params[i].device)
            out.append((TensorSpec(spec.name, tuple(existing.shape), str(existing.dtype).removeprefix("torch.")),
                        existing))
    return out


def _broadcast_bytes(data: bytes, src: int, group: Any) -> bytes:
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return bytes(buf.numpy().tobytes())


def sync_from_peers(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int | None) -> SyncResult:
    """Make every rank of the default process group hold the most advanced replica of ``model`` (and of
    ``optimizer``'s state); ``step`` is this rank's (``None``: it holds no state). Returns the agreed step.

    Raises :class:`StateMismatch` on every rank, before anything is copied, when a rank's layout differs
    from the source's (keys, shapes or dtypes), naming the first differing tensor.
    """
    import torch
    import torch.distributed as dist

    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"step: expected an int >= 0 or None, got {step!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([NO_STATE if step is None else step], dtype=torch.int64))
    plan = plan_sync([None if int(t.item()) == NO_STATE else int(t.item()) for t in gathered])
    if not plan.receivers:
        return SyncResult(plan.step, plan.source, False, 0)
    members = sorted({plan.source, *plan.receivers})
    # Every rank takes part in creating the group; only its members in what follows.
    group = dist.new_group(members) if len(members) < world else None
    if rank not in members:
        return SyncResult(plan.step, plan.source, False, 0)
    src = plan.source
    if rank == src:
        entries = _entries(model, optimizer)
        layout = [s for s, _ in entries]
        _broadcast_bytes(json.dumps([[s.name, list(s.shape), s.dtype] for s in layout]).encode(), src, group)
    else:
        raw = json.loads(_broadcast_bytes(b"", src, group))
        layout = [TensorSpec(str(n), tuple(int(x) for x in shape), str(d)) for n, shape, d in raw]
    # Agree on the first difference any rank finds (an index into the source's layout) before moving data.
    problem: tuple[str, str] | None = None
    if rank != src:
        try:
            problem = first_difference([s for s, _ in _entries(model, None)],
                                       [s for s in layout if s.name.startswith("model.")])
            entries = _entries(model, optimizer, layout) if problem is None else []
        except StateMismatch as e:
            problem = (e.name, str(e))
            entries = []
    names = [s.name for s in layout]
    index = len(names) if problem is None else (names.index(problem[0]) if problem[0] in names else len(names) + 1)
    worst = torch.tensor([index], dtype=torch.int64)
    dist.all_reduce(worst, op=dist.ReduceOp.MIN, group=group)
    at = int(worst.item())
    if at != len(names):
        if problem is not None:
            raise StateMismatch(*problem)
        name = names[at] if at < len(names) else "a tensor of another rank's model"
        raise StateMismatch(name, "another rank's model differs from the sending rank's")
    by_dtype: dict[str, list[torch.Tensor]] = {}
    for s, t in entries:
        by_dtype.setdefault(s.dtype, []).append(t)
    received: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    total = 0
    with torch.no_grad():
        for dtype in sorted(by_dtype):
            tensors = by_dtype[dtype]
            if rank == src:
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            else:
                flat = torch.empty(sum(t.numel() for t in tensors), dtype=getattr(torch, dtype))
            dist.broadcast(flat, src=src, group=group)
            total += flat.numel() * flat.element_size()
            received.append((tensors, flat))
        if rank != src:
            # Everything arrived: only now is this rank's state replaced.
            for tensors, flat in received:
                offset = 0
                for t in tensors:
                    n = t.numel()
                    t.copy_(flat[offset:offset + n].view_as(t))
                    offset += n
            if optimizer is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                for s, t in entries:
                    if s.name.startswith("optimizer."):
                        _, index_s, key = s.name.split(".", 2)
                        optimizer.state[params[int(index_s)]][key] = t
    if group is not None:
        dist.destroy_process_group(group)
    return SyncResult(plan.step, src, rank != src, total if rank != src else 0)
