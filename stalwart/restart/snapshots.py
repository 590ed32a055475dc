"""Peer snapshots: every rank's shard of the state kept in a rank's memory on another pod, so that a lost pod
costs at most the step in flight, not a reload of the last checkpoint and every step since.

Inside the training function (which stalwart runs again in the same process after a fault)::

    snapshots = stalwart.restart.PeerSnapshots(model, optimizer, every=1)
    start = snapshots.restore()          # the step the state is at after a fault (None: fresh, or the checkpoint)
    for step in range(0 if start is None else start + 1, steps):
        train_step(step)
        snapshots.commit(step)

:meth:`PeerSnapshots.commit` copies this rank's *local* state (a DTensor's local shard, or a plain tensor: the
model's parameters and buffers and the optimizer's state) into its own memory and sends it to its buddy, a rank
on another pod (:func:`~stalwart.restart.snapshot_plan.buddies`), in the background while the next step runs.
It also finishes the copy the previous commit started; a snapshot counts for a step only where its copy has
landed, and :meth:`PeerSnapshots.restore` uses the newest step of which *every* shard has a copy that landed
(:func:`~stalwart.restart.snapshot_plan.plan_restore`): a torn snapshot is never used. Each rank keeps, of its
own shard and of its wards', the two newest snapshot steps.

The copies are held by :mod:`~stalwart.restart.snapshot_held`, for the life of the process: they outlive the
training function's iterations and rounds, which is what lets a surviving rank give a lost rank's shard to the
spare that takes its place; a process about to be lost to a hang writes them out for the one that takes its
slot (:mod:`~stalwart.restart.snapshot_spill`). Nothing is pickled: tensors move over a process group of their
own (gloo, CPU memory), layouts as JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalwart.api import pod_env
from stalwart.api.pod_env import PodEnvError, SnapshotEnvironment
from stalwart.restart import snapshot_spill
from stalwart.restart.errors import NonRetryable
from stalwart.restart.peers import StateMismatch, TensorSpec, elements_by_dtype, first_difference
from stalwart.restart.snapshot_held import HELD, KEEP, Copy, Published, forget, published, spill, unspill
from stalwart.restart.snapshot_plan import (
    Holding,
    NoSnapshot,
    RestorePlan,
    buddies,
    decode_holdings,
    encode_holding,
    newest_generation,
    plan_restore,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

__all__ = ["PeerSnapshots", "Published", "ensure_optimizer_state", "forget", "published", "spill"]

#: How long the copies of an iteration that ended may take to settle. Its connections were shut down when it
#: was interrupted, so nothing of them progresses any more: a copy that had landed reports so at once, and one
#: that had not fails or never reports at all (gloo leaves a send that waits for its receiver pending after
#: its connection is shut down, and forever once the group is destroyed).
SETTLE_SECONDS = 2.0



#: The job's setting a memory limit comes from, as its users name it.
_LIMIT_SETTING = "restartPolicy.inProcess.peerSnapshots.memoryLimit"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writing into it writes the parameter); a plain tensor itself."""
    to_local = getattr(t, "to_local", None)
    return t if to_local is None else to_local()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[TensorSpec, torch.Tensor]]:
    """This rank's local state, in a fixed order: the model's entries, then the optimizer's."""
    import torch

    out = []
    for k, t in model.state_dict(keep_vars=True).items():
        local = _local(t)
        out.append((TensorSpec(f"model.{k}", tuple(local.shape), _dtype_name(local)), local))
    if optimizer is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    local = _local(value)
                    out.append((TensorSpec(f"optimizer.{i}.{key}", tuple(local.shape), _dtype_name(local)), local))
    return out


def ensure_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Give every parameter its optimizer state (a new process has none before its first step), by one step on
    zero gradients; what it sets is overwritten by the restore."""
    import torch

    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = {p: p.detach().clone() for p in params}
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in params:
            p.copy_(saved[p])


def _flatten(entries: list[tuple[TensorSpec, torch.Tensor]], step: int) -> Copy:
    import torch

    by_dtype: dict[str, list[torch.Tensor]] = {}
    for spec, t in entries:
        by_dtype.setdefault(spec.dtype, []).append(t.detach().reshape(-1))
    flats = {}
    with torch.no_grad():
        for d, ts in sorted(by_dtype.items()):
            out = HELD.buffer(d, sum(t.numel() for t in ts))
            torch.cat([t.cpu() for t in ts], out=out)
            flats[d] = out
    return Copy(step, [s for s, _ in entries], flats)


def _layout_json(layout: list[TensorSpec]) -> bytes:
    return json.dumps([[s.name, list(s.shape), s.dtype] for s in layout]).encode()


def _layout_from(data: bytes) -> list[TensorSpec]:
    return [TensorSpec(str(n), tuple(int(x) for x in shape), str(d)) for n, shape, d in json.loads(data)]


def _itemsize(dtype: str) -> int:
    import torch

    return int(torch.empty((), dtype=getattr(torch, dtype)).element_size())


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _wait_one(work: Any) -> None:
    work.wait()


def _settling_wait(deadline: float) -> Callable[[Any], None]:
    """A wait for each of an ended iteration's copies, all within one deadline (RuntimeError past it)."""
    def wait(work: Any) -> None:
        # A work that completed returns at once even with no time left; gloo reads a zero timeout as none.
        work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    return wait


def _pod_key(pod: str) -> int:
    return int.from_bytes(hashlib.sha256(pod.encode()).digest()[:7], "big")


class PeerSnapshots:
    """This rank's shard of ``model`` and ``optimizer``, snapshotted every ``every`` steps into a buddy's memory
    on another pod. Construct it inside the training function, in every iteration (all ranks of the default
    process group take part); ``pod`` names this rank's pod (default: the pod stalwart runs it in)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 every: int | None = None, memory_limit: int | None = None, pod: str | None = None,
                 timeout: float = 300.0) -> None:
        import torch
        import torch.distributed as dist

        if every is not None and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every: expected a whole number of steps >= 1, got {every!r}")
        if memory_limit is not None and (not isinstance(memory_limit, int) or memory_limit < 1):
            raise ValueError(f"memory_limit: expected a number of bytes >= 1, got {memory_limit!r}")
        try:
            policy = SnapshotEnvironment.from_env()
        except PodEnvError as e:
            raise ValueError(f"PeerSnapshots: {e}") from None
        self.model, self.optimizer = model, optimizer
        self.every = every if every is not None else policy.every or 1
        #: The tightest limit, and who set it (the argument, or the job).
        self._limit = min(((b, n) for b, n in ((memory_limit, "the memory_limit argument"),
                                               (policy.memory_limit, _LIMIT_SETTING)) if b is not None),
                          default=None)
        self.enabled = policy.enabled
        #: Why the last restore found no snapshot to use (None: it used one, or none was ever taken).
        self.fallback_reason: str | None = None
        if not self.enabled:
            # The job turned them off: no group, no copies; restore() leaves the state to the checkpoint.
            return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        status_file = os.environ.get(pod_env.STATUS_FILE)
        if status_file:
            unspill(snapshot_spill.directory_for(status_file))
        pod = pod if pod is not None else os.environ.get(pod_env.NODE_ID) or os.uname().nodename
        keys = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(keys, torch.tensor([_pod_key(pod)], dtype=torch.int64))
        try:
            self.buddies = buddies([str(int(k.item())) for k in keys])
        except ValueError as e:
            raise ValueError(f"PeerSnapshots: {e}") from None
        self.buddy = self.buddies[self.rank]
        self.wards = [r for r, b in enumerate(self.buddies) if b == self.rank]
        # Snapshot traffic on a group of its own: it never interleaves with the training's collectives.
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._sent_layout: bytes = b""
        self._ward_layouts: dict[int, bytes] = {}
        self._limit_checked = False

    # -- commit ---------------------------------------------------------------------------------------------

    def commit(self, step: int) -> None:
        """The state now is that after ``step``: snapshot it (every ``every`` steps; a no-op otherwise)."""
        if step < 0:
            raise ValueError(f"step: expected >= 0, got {step}")
        if not self.enabled or step % self.every:
            return
        self._land()
        mine = _flatten(_state(self.model, self.optimizer), step)
        if HELD.own_shard != self.rank or HELD.world != self.world:
            HELD.own.clear()
        if HELD.world != self.world:
            HELD.wards.clear()
        HELD.own_shard, HELD.world = self.rank, self.world
        HELD.own[step] = mine
        HELD.prune()
        self._send(mine)

    def _land(self) -> None:
        """Wait for the copies the last commit started (in this iteration or the one a fault ended); a ward's
        copy whose every part arrived becomes a snapshot held for it. One that failed (its sender went with
        its pod, or the group was aborted under it) never landed; nor did one of an ended iteration that has
        not settled within :data:`SETTLE_SECONDS`."""
        settle = HELD.group is not None and HELD.group is not self._group
        wait = _settling_wait(time.monotonic() + SETTLE_SECONDS) if settle else _wait_one
        sent = bool(HELD.sending)
        for work in HELD.sending:
            try:
                wait(work)
            except RuntimeError as e:
                log.info("rank %d: a snapshot copy sent to the buddy was lost: %s", self.rank, e)
                sent = False
        if sent and HELD.sending_step is not None:
            HELD.landed = Published(HELD.sending_step, time.time(), HELD.landed.fallback)
        for shard, copy, works in HELD.receiving:
            try:
                for work in works:
                    wait(work)
            except RuntimeError as e:
                log.info("rank %d: the snapshot of step %d from rank %d did not land: %s", self.rank, copy.step,
                         shard, e)
                continue
            HELD.wards.setdefault(shard, {})[copy.step] = copy
        HELD.sending, HELD.receiving, HELD.group = [], [], None
        HELD.prune()

    def _send(self, mine: Copy) -> None:
        """Exchange the step and layouts with buddy and wards (small, at once), then start the data (in the
        background)."""
        import torch
        import torch.distributed as dist

        layout = _layout_json(mine.layout)
        header = torch.tensor([mine.step, len(layout) if layout != self._sent_layout else 0], dtype=torch.int64)
        heads = {w: torch.zeros(2, dtype=torch.int64) for w in self.wards}
        works: list[Any] = [dist.isend(header, self.buddy, group=self._group)]
        works += [dist.irecv(heads[w], w, group=self._group) for w in self.wards]
        _wait(works)
        works = []
        if header[1]:
            works.append(dist.isend(torch.frombuffer(bytearray(layout), dtype=torch.uint8), self.buddy,
                                    group=self._group))
            self._sent_layout = layout
        bufs = {w: torch.empty(int(heads[w][1]), dtype=torch.uint8) for w in self.wards if heads[w][1]}
        works += [dist.irecv(b, w, group=self._group) for w, b in bufs.items()]
        _wait(works)
        for w, b in bufs.items():
            self._ward_layouts[w] = bytes(b.numpy().tobytes())
        if not self._limit_checked:
            self._check_limit(mine)
        HELD.sending = [dist.isend(mine.flats[d], self.buddy, group=self._group) for d in sorted(mine.flats)]
        HELD.sending_step, HELD.group = mine.step, self._group
        for w in self.wards:
            ward_layout = _layout_from(self._ward_layouts[w])
            copy = Copy(int(heads[w][0]), ward_layout,
                         {d: HELD.buffer(d, n) for d, n in sorted(elements_by_dtype(ward_layout).items())})
            HELD.receiving.append((w, copy, [dist.irecv(copy.flats[d], w, group=self._group)
                                              for d in sorted(copy.flats)]))

    def _check_limit(self, mine: Copy) -> None:
        """At the first snapshot, when its size is known: what a rank will hold (the two newest of its own
        shard and of each ward's) against the limit, agreed by every rank, so that all fail together."""
        import torch
        import torch.distributed as dist

        self._limit_checked = True
        if self._limit is None:
            return
        limit, setting = self._limit
        layouts = [_layout_from(self._ward_layouts[w]) for w in self.wards]
        wards = sum(n * _itemsize(d) for layout in layouts for d, n in elements_by_dtype(layout).items())
        need = torch.tensor([KEEP * (mine.nbytes() + wards)], dtype=torch.int64)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self._group)
        if int(need.item()) > limit:
            raise NonRetryable(f"peer snapshots need {int(need.item()):,} bytes on a rank (the two newest of its "
                               f"own shard and of each shard it keeps for another rank), above {setting} "
                               f"({limit:,} bytes)")

    # -- restore --------------------------------------------------------------------------------------------

    def restore(self) -> int | None:
        """Bring back every rank's shard from the snapshots: the step the state is now at (training goes on
        at the next), the same on every rank; ``None`` when no snapshot covers every shard (the job's first
        iteration, or both a rank and its buddy lost: :attr:`fallback_reason` says which; load the checkpoint
        then). Raises :class:`~stalwart.restart.peers.StateMismatch` on every rank, before anything is
        restored, when a shard's layout differs from the model here (another world size or sharding)."""
        import torch
        import torch.distributed as dist

        if not self.enabled:
            self.fallback_reason = "peer snapshots are off (restartPolicy.inProcess.peerSnapshots.enabled: false)"
            return None
        self._land()
        holdings = self._gather(HELD.holding())
        plan = plan_restore(holdings)
        # Whatever comes of it, the state from here on is a new timeline, the same on every rank.
        HELD.generation = newest_generation(holdings) + 1
        if isinstance(plan, NoSnapshot):
            anything = any(h.own is not None or h.wards for h in holdings)
            self.fallback_reason = plan.reason if anything else None
            HELD.landed = Published(None, None, self.fallback_reason)
            if anything:
                log.warning("rank %d: no peer snapshot to restore from: %s", self.rank, plan.reason)
            return None
        self.fallback_reason = None
        HELD.landed = Published(plan.step, time.time(), None)
        ensure_optimizer_state(self.model, self.optimizer)
        entries = _state(self.model, self.optimizer)
        incoming = self._exchange(plan, entries)
        with torch.no_grad():
            for copy in incoming:
                offsets = dict.fromkeys(copy.flats, 0)
                for spec, t in zip(copy.layout, (t for _, t in entries), strict=True):
                    n = t.numel()
                    t.copy_(copy.flats[spec.dtype][offsets[spec.dtype]:offsets[spec.dtype] + n].view_as(t))
                    offsets[spec.dtype] += n
        restored = incoming[0] if incoming else None
        if restored is not None:
            if HELD.own_shard != self.rank:
                HELD.own.clear()
            HELD.own_shard, HELD.world = self.rank, self.world
            HELD.own = {s: c for s, c in HELD.own.items() if s <= plan.step} | {plan.step: restored}
        # Steps after the restored one are recomputed: copies of them are of a timeline that no longer is.
        for copies in HELD.wards.values():
            for step in [s for s in copies if s > plan.step]:
                del copies[step]
        dist.barrier(group=self._group)
        return plan.step

    def _gather(self, mine: Holding) -> list[Holding]:
        import torch
        import torch.distributed as dist

        row = encode_holding(mine)
        longest = torch.tensor([len(row)], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self._group)
        padded = torch.tensor(row + [0] * (int(longest.item()) - len(row)), dtype=torch.int64)
        rows = [torch.zeros_like(padded) for _ in range(self.world)]
        dist.all_gather(rows, padded, group=self._group)
        return decode_holdings([r.tolist() for r in rows])

    def _exchange(self, plan: RestorePlan, entries: list[tuple[TensorSpec, torch.Tensor]]) -> list[Copy]:
        """Send and receive the shards the plan moves; check every layout before any tensor is written.
        Returns this rank's incoming copy (one, or none when the plan moves nothing here)."""
        import torch
        import torch.distributed as dist

        layouts: dict[int, bytes] = {}
        works: list[Any] = []
        for m in plan.moves:
            if m.source == self.rank and m.target != self.rank:
                data = _layout_json(HELD.find(m.shard, plan.step, m.from_own).layout)
                works.append(dist.isend(torch.tensor([len(data)], dtype=torch.int64), m.target, group=self._group))
                works.append(dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), m.target,
                                        group=self._group))
        mine = plan.moves[self.rank]
        if mine.source != self.rank:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, mine.source, group=self._group)
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(buf, mine.source, group=self._group)
            layouts[self.rank] = bytes(buf.numpy().tobytes())
        _wait(works)
        theirs = _layout_from(layouts[self.rank]) if mine.source != self.rank else \
            HELD.find(mine.shard, plan.step, mine.from_own).layout
        here = [s for s, _ in entries]
        problem = first_difference(here, theirs) or (first_difference(theirs, here) if len(here) != len(theirs)
                                                     else None)
        names = [s.name for s in theirs]
        index = len(names) + 1 if problem is None else (names.index(problem[0]) if problem[0] in names else len(names))
        worst = torch.tensor([index], dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MIN, group=self._group)
        if int(worst.item()) <= len(names):
            if problem is not None:
                raise StateMismatch(*problem)
            raise StateMismatch("a tensor of another rank's shard", "another rank's snapshot differs from its model")
        works = []
        for m in plan.moves:
            if m.source == self.rank and m.target != self.rank:
                copy = HELD.find(m.shard, plan.step, m.from_own)
                works += [dist.isend(copy.flats[d], m.target, group=self._group) for d in sorted(copy.flats)]
        if mine.source == self.rank:
            incoming = HELD.find(mine.shard, plan.step, mine.from_own)
        else:
            incoming = Copy(plan.step, theirs, {d: torch.empty(n, dtype=getattr(torch, d))
                                                 for d, n in sorted(elements_by_dtype(theirs).items())})
            for d in sorted(incoming.flats):
                dist.recv(incoming.flats[d], mine.source, group=self._group)
        _wait(works)
        return [incoming]

    def close(self) -> None:
        """Finish the copies in flight and end this iteration's snapshot group."""
        import torch.distributed as dist

        if not self.enabled:
            return
        self._land()
        dist.destroy_process_group(self._group)

    def held_bytes(self) -> int:
        """Bytes of snapshots this process holds (its own shard's and its wards')."""
        return sum(c.nbytes() for c in HELD.own.values()) + sum(
            c.nbytes() for copies in HELD.wards.values() for c in copies.values())
