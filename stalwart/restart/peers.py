"""State from peers: after a rank was replaced, the ranks that hold the newest state hand it to the others.

:func:`sync_from_peers`, called at the top of a training function (inside the iteration's process group):

1. every rank says which step its state is at (``None``: it has none, e.g. a spare just promoted);
2. the ranks at the highest step are the sources (up to ``max_sources``, lowest ranks first); the others
   receive (:func:`plan_sync`);
3. the first source sends its *layout* (names, shapes and dtypes of the model's and the optimizer's
   tensors, as JSON: nothing is unpickled); every other rank checks it against its own model
   (:func:`first_difference`); if any rank's model differs, every rank raises :class:`StateMismatch` naming
   the first differing tensor, *before* any tensor moves;
4. the tensors move in buckets (:mod:`.copy_plan`: at most ``bucket_bytes`` each, a large tensor's buckets
   straight from and into its memory, small ones packed through a staging buffer), each bucket from one
   source, the sources' parts disjoint and about equal, while the next bucket is prepared
   (:mod:`.copy_wire`). No rank builds a second full copy of the state.

What a receiver holds if the copy fails (a source dies mid-copy): a receiver with a state of its own (a
``step``) receives into buffers of its own and copies them in only once every bucket arrived, so it keeps its
old state or takes the new one, never a mix (this receiver alone holds a second copy, for the copy's length).
A receiver with none (``step=None``, the usual case: a promoted spare) receives straight into its parameters
and optimizer slots (slots it lacks are made and attached only once all arrived; slots a parked spare made
ahead with :func:`~.optimizer_slots.materialize_optimizer_state` are received into, and dropped by any call
that does not fill them); when the copy fails it
still holds no state: :class:`SyncInterrupted` says so, and the model is marked so that the next
:func:`sync_from_peers` treats this rank as holding none whatever ``step`` it is given.

Ranks at the newest step that are not sources send and receive nothing. Limits: this is for replicas (pure
data parallelism: every rank holds the whole model); sharded state (FSDP, tensor or pipeline parallelism)
needs a replica of each shard and is not handled here. Checkpoint loading stays the fallback when no rank
holds any state.
"""

from __future__ import annotations

import json
import secrets
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalwart.restart import copy_wire, optimizer_slots, phase_marks
from stalwart.restart.copy_plan import assign_sources, plan_buckets, tensor_bytes

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["StateMismatch", "SyncInterrupted", "SyncPlan", "SyncResult", "TensorSpec", "elements_by_dtype",
           "first_difference", "plan_sync", "sync_from_peers"]

NO_STATE = -1
#: The transport and bucket size the copy uses unless told otherwise (bench/state_copy.py, README "State copy"):
#: "streams" was no faster than the iteration's group beyond this machine's noise, and builds a group per copy.
TRANSPORT = "group"
#: 8 MB buckets, four in flight per side: over loopback into warm memory (800 MB, SGD with momentum) they moved
#: 2.62-2.70 GB/s where 32 MB buckets two in flight moved 2.36-2.41 (A and B interleaved, two runs of four) and
#: 128 MB ones 1.51; the staging buffers (packed buckets only) take 32 MB per side instead of 64.
BUCKET_BYTES = 8 << 20
#: Connections (gloo devices) of the "streams" transport, and buckets in flight per sender and receiver.
STREAMS = 2
WINDOW = 4

# Models whose copy failed while received in place: they hold no state until a copy succeeds.
_PARTIAL: weakref.WeakSet[Any] = weakref.WeakSet()


class StateMismatch(ValueError):
    """The ranks' models (or optimizers) differ in layout; ``name`` is the first differing tensor."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"sync_from_peers: tensor {name!r} differs between ranks: {detail}")
        self.name = name


class SyncInterrupted(RuntimeError):
    """The copy stopped part-way (a peer died, a connection broke, a wait ran out). ``kept_state``: this
    rank holds the state it had before the call (a source's is never touched); ``False``: it had none and
    still has none (the next :func:`sync_from_peers` treats it so). Recover by running the next iteration."""

    def __init__(self, bucket: int, peer: int, kept_state: bool, cause: BaseException) -> None:
        held = ("this rank keeps the state it had" if kept_state else
                "this rank holds no state (a partial copy, marked so: the next sync_from_peers treats it as "
                "step=None)")
        super().__init__(f"sync_from_peers: the copy stopped at bucket {bucket} (rank {peer}): {cause}; {held}")
        self.bucket = bucket
        self.peer = peer
        self.kept_state = kept_state


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
    """Who sends (``sources``, the first of them ``source``, which sends the layout; their ``step``) and who
    receives (``receivers``, the ranks behind)."""

    source: int
    step: int | None
    receivers: tuple[int, ...]
    sources: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SyncResult:
    """What :func:`sync_from_peers` did: the step every rank now holds, where the state came from, and
    whether this rank received it (and how many bytes)."""

    step: int | None
    source: int
    received: bool
    bytes: int
    sources: tuple[int, ...] = field(default=())
    transport: str = ""


def plan_sync(steps: Sequence[int | None], max_sources: int | None = None) -> SyncPlan:
    """The most advanced replicas (highest step; the lowest ranks of them, at most ``max_sources``) and the
    ranks behind them. Pure."""
    if not steps:
        raise ValueError("steps: expected one entry per rank, got none")
    if max_sources is not None and max_sources < 1:
        raise ValueError(f"max_sources: expected >= 1 or None, got {max_sources}")
    values = [NO_STATE if s is None else s for s in steps]
    for rank, s in enumerate(values):
        if s < NO_STATE:
            raise ValueError(f"step of rank {rank}: expected >= 0 or None, got {s}")
    best = max(values)
    source = values.index(best)
    if best == NO_STATE:
        return SyncPlan(source, None, (), ())
    sources = tuple(r for r, s in enumerate(values) if s == best)[:max_sources]
    return SyncPlan(source, best, tuple(r for r, s in enumerate(values) if s != best), sources)


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


def _receiving(model: nn.Module, optimizer: torch.optim.Optimizer | None,
               layout: Sequence[TensorSpec]) -> list[tuple[torch.Tensor, bool]]:
    """This rank's tensor for each entry of ``layout`` (the source's, checked against the model) and whether
    it is a new optimizer slot (made here, attached to the optimizer only at the commit)."""
    import torch

    model_tensors = dict(model.state_dict(keep_vars=True))
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    out: list[tuple[torch.Tensor, bool]] = []
    for spec in layout:
        if spec.name.startswith("model."):
            out.append((model_tensors[spec.name.removeprefix("model.")], False))
            continue
        if optimizer is None:
            raise StateMismatch(spec.name, "this rank was given no optimizer, the sending rank's has state")
        _, index, key = spec.name.split(".", 2)
        i = int(index)
        if i >= len(params):
            raise StateMismatch(spec.name, f"the optimizer here has {len(params)} parameters")
        existing = optimizer.state.get(params[i], {}).get(key)
        dtype = getattr(torch, spec.dtype)
        if isinstance(existing, torch.Tensor) and tuple(existing.shape) == spec.shape and existing.dtype == dtype:
            out.append((existing, False))
        else:
            out.append((torch.empty(spec.shape, dtype=dtype, device=params[i].device), True))
    return out


def _broadcast_bytes(data: bytes, src: int) -> bytes:
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src)
    if data:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buf, src=src)
    return bytes(buf.numpy().tobytes())


def _source_bytes(t: torch.Tensor) -> torch.Tensor:
    """A source tensor's bytes: its own memory where it is a contiguous CPU tensor, else a CPU copy of it."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().contiguous().cpu()
    return copy_wire.byte_view(t)


def _landing(target: torch.Tensor, in_place: bool) -> copy_wire.Landing:
    import torch

    if in_place and target.device.type == "cpu" and target.is_contiguous():
        return copy_wire.Landing(target, copy_wire.byte_view(target), staged=False)
    buffer = torch.empty(tuple(target.shape), dtype=target.dtype)
    return copy_wire.Landing(target, copy_wire.byte_view(buffer), staged=True)


def _check_arguments(*, step: int | None, transport: str, bucket_bytes: int, max_sources: int | None,
                     streams: int, timeout_s: float) -> None:
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step: expected an int >= 0 or None, got {step!r}")
    if transport not in copy_wire.TRANSPORTS:
        raise ValueError(f"transport: expected one of {', '.join(copy_wire.TRANSPORTS)}, got {transport!r}")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected an int >= 1, got {bucket_bytes!r}")
    if max_sources is not None and (isinstance(max_sources, bool) or not isinstance(max_sources, int)
                                    or max_sources < 1):
        raise ValueError(f"max_sources: expected an int >= 1 or None, got {max_sources!r}")
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise ValueError(f"streams: expected an int >= 1, got {streams!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")


def sync_from_peers(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int | None, transport: str = TRANSPORT, bucket_bytes: int = BUCKET_BYTES,
                    max_sources: int | None = None, streams: int = STREAMS,
                    timeout_s: float = 300.0) -> SyncResult:
    """Make every rank of the default process group hold the most advanced replica of ``model`` (and of
    ``optimizer``'s state); ``step`` is this rank's (``None``: it holds no state). Returns the agreed step.

    ``transport`` (``"group"``: the iteration's process group; ``"streams"``: a gloo group of ``streams``
    connections per pair, built for the copy), ``bucket_bytes`` and ``max_sources`` (every rank at the
    newest step sends a part unless limited) change only how the state travels; every bucket's wait is bounded
    by ``timeout_s``.

    Raises :class:`StateMismatch` on every rank, before anything is copied, when a rank's layout differs
    from the source's (keys, shapes or dtypes), naming the first differing tensor; :class:`SyncInterrupted`
    when the copy stops part-way (saying what this rank holds then).
    """
    import torch
    import torch.distributed as dist

    began = time.time()
    _check_arguments(step=step, transport=transport, bucket_bytes=bucket_bytes, max_sources=max_sources,
                     streams=streams, timeout_s=timeout_s)
    if model in _PARTIAL:
        step = None  # an interrupted copy landed in it: whatever the caller counts, it holds no state
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([NO_STATE if step is None else step], dtype=torch.int64))
    plan = plan_sync([None if int(t.item()) == NO_STATE else int(t.item()) for t in gathered], max_sources)
    if not plan.receivers:
        optimizer_slots.settle(optimizer, None)
        return SyncResult(plan.step, plan.source, False, 0, plan.sources, transport)
    src = plan.source
    if rank == src:
        entries = _entries(model, optimizer)
        layout = [s for s, _ in entries]
        token = secrets.token_hex(8)
        message = {"token": token, "layout": [[s.name, list(s.shape), s.dtype] for s in layout]}
        _broadcast_bytes(json.dumps(message).encode(), src)
    else:
        message = json.loads(_broadcast_bytes(b"", src))
        token = str(message["token"])
        layout = [TensorSpec(str(n), tuple(int(x) for x in shape), str(d)) for n, shape, d in message["layout"]]
    # Every rank checks its own tensors against the source's layout; all agree on the first difference any
    # rank found (an index into the layout) before anything moves.
    problem: tuple[str, str] | None = None
    tensors: list[torch.Tensor] = []
    new_slots: list[bool] = []
    if rank != src:
        try:
            if rank in plan.receivers:
                problem = first_difference([s for s, _ in _entries(model, None)],
                                           [s for s in layout if s.name.startswith("model.")])
                if problem is None:
                    found = _receiving(model, optimizer, layout)
                    tensors, new_slots = [t for t, _ in found], [n for _, n in found]
            else:
                mine = _entries(model, optimizer)
                problem = first_difference([s for s, _ in mine], layout)
                by_name = {s.name: t for s, t in mine}
                tensors = [by_name[s.name] for s in layout] if problem is None else []
        except StateMismatch as e:
            problem = (e.name, str(e))
    else:
        tensors = [t for _, t in entries]
    names = [s.name for s in layout]
    index = len(names) if problem is None else (names.index(problem[0]) if problem[0] in names else len(names) + 1)
    worst = torch.tensor([index], dtype=torch.int64)
    dist.all_reduce(worst, op=dist.ReduceOp.MIN)
    at = int(worst.item())
    if at != len(names):
        if problem is not None:
            raise StateMismatch(*problem)
        name = names[at] if at < len(names) else "a tensor of another rank's model"
        raise StateMismatch(name, "another rank's model differs from the sending rank's")
    buckets = plan_buckets([tensor_bytes(s.shape, s.dtype) for s in layout], bucket_bytes)
    senders = assign_sources([b.nbytes for b in buckets], plan.sources)
    members = sorted({*plan.sources, *plan.receivers})
    if rank not in members:
        optimizer_slots.settle(optimizer, None)
        return SyncResult(plan.step, src, False, 0, plan.sources, transport)
    wire = copy_wire.open_wire(transport, members, token, streams, timedelta(seconds=timeout_s))
    try:
        with torch.no_grad():
            if rank in plan.sources:
                try:
                    sent = copy_wire.send(wire, buckets, senders, [_source_bytes(t) for t in tensors], me=rank,
                                          receivers=plan.receivers, window=WINDOW, bucket_bytes=bucket_bytes)
                except copy_wire.WireError as e:
                    raise SyncInterrupted(e.bucket, e.peer, True, e) from e
                phase_marks.copied(began, time.time(), sent, "sent", len(plan.sources))
                optimizer_slots.settle(optimizer, None)
                return SyncResult(plan.step, src, False, 0, plan.sources, transport)
            in_place = step is None
            # A new optimizer slot is attached only at the commit: bytes may land in it whatever this rank holds.
            landings = [_landing(t, in_place or new) for t, new in zip(tensors, new_slots, strict=True)]
            # Marked before the first byte lands and unmarked once committed, so that any way out (a broken
            # connection, the restart wrapper's interrupt) leaves it marked.
            if in_place:
                _PARTIAL.add(model)
            try:
                total = copy_wire.receive(wire, buckets, senders, landings, window=WINDOW,
                                          bucket_bytes=bucket_bytes)
            except copy_wire.WireError as e:
                raise SyncInterrupted(e.bucket, e.peer, not in_place, e) from e
            # Everything arrived: only now does what was staged replace this rank's state.
            _PARTIAL.add(model)
            for landing in landings:
                if landing.staged:
                    landing.target.copy_(landing.buffer.view(landing.target.dtype).view(landing.target.shape))
            if optimizer is not None:
                params = [p for g in optimizer.param_groups for p in g["params"]]
                filled = []
                for spec, t, new in zip(layout, tensors, new_slots, strict=True):
                    if spec.name.startswith("optimizer."):
                        _, index_s, key = spec.name.split(".", 2)
                        filled.append((params[int(index_s)], key))
                        if new:
                            optimizer.state[params[int(index_s)]][key] = t
                # Slots made ahead (a parked spare's) that the copy filled are state now; any it did not, dropped.
                optimizer_slots.settle(optimizer, filled)
            _PARTIAL.discard(model)
    finally:
        wire.close()
    phase_marks.copied(began, time.time(), total, "received", len(plan.sources))
    return SyncResult(plan.step, src, True, total, plan.sources, transport)
