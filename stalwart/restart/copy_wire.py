"""The state copy's I/O: buckets sent while the next is prepared, received into the receiving tensors.

The plan (:mod:`.copy_plan`) is the same on every rank; this module carries it out over one of two gloo
transports, both point to point (a bucket goes from its one source to each receiver, tagged with its index):

* ``"group"``: the iteration's process group (one TCP connection per pair of ranks);
* ``"streams"``: a gloo group of its own, built for the copy from the job's store, with ``streams`` devices:
  gloo picks a point-to-point message's connection by its tag, so consecutive buckets travel on different
  connections and different gloo I/O threads. It is closed when the copy ends.

A sender keeps up to ``window`` buckets in flight; a packed bucket is flattened into one of ``window`` staging
buffers (a bucket of one piece is sent from the tensor's memory). A receiver posts up to ``window`` receives
ahead and unpacks a staged bucket while the next ones arrive. Where the bytes land is the caller's choice
(:class:`Landing`): the receiving tensor itself, or a buffer of its own committed later.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from stalwart.restart.copy_plan import Bucket

if TYPE_CHECKING:
    import torch

__all__ = ["TRANSPORTS", "Landing", "WireError", "byte_view", "open_wire", "receive", "send"]

TRANSPORTS = ("group", "streams")

#: Called by a sender after it posted each bucket (its index): a fault injected between buckets in tests.
after_bucket: Callable[[int], None] | None = None


class WireError(RuntimeError):
    """A bucket could not be sent or received (a peer died, a connection broke, a wait ran out)."""

    def __init__(self, bucket: int, peer: int, cause: BaseException) -> None:
        super().__init__(f"bucket {bucket} with rank {peer}: {cause}")
        self.bucket = bucket
        self.peer = peer


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's memory as one flat uint8 tensor (no copy)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True, slots=True)
class Landing:
    """Where one tensor's bytes arrive: ``buffer`` (flat uint8), the memory of ``target`` or a buffer to
    copy into ``target`` at the commit (``staged``)."""

    target: torch.Tensor
    buffer: torch.Tensor
    staged: bool


class Wire:
    """Point-to-point sends and receives on a gloo group, with ranks of the default group."""

    def __init__(self, kind: str, group: Any, members: Sequence[int], timeout: timedelta) -> None:
        self.kind = kind
        self.timeout = timeout
        self._group = group  # None: the default group's own ranks and calls
        self._index = {r: i for i, r in enumerate(members)}

    def isend(self, buf: torch.Tensor, dst: int, tag: int) -> Any:
        import torch.distributed as dist

        if self._group is None:
            return dist.isend(buf, dst=dst, tag=tag)
        return self._group.send([buf], self._index[dst], tag)

    def irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        import torch.distributed as dist

        if self._group is None:
            return dist.irecv(buf, src=src, tag=tag)
        return self._group.recv([buf], self._index[src], tag)

    def wait(self, work: Any) -> None:
        work.wait(self.timeout)

    def close(self) -> None:
        # A group of our own is not registered with torch: dropping it closes its connections.
        self._group = None


def open_wire(kind: str, members: Sequence[int], token: str, streams: int, timeout: timedelta) -> Wire:
    """The transport ``kind`` among ``members`` (ranks of the default group, this rank one of them)."""
    import torch.distributed as dist

    if kind == "group":
        return Wire(kind, None, members, timeout)
    if kind != "streams":
        raise ValueError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {kind!r}")
    from torch.distributed import ProcessGroupGloo
    from torch.distributed.distributed_c10d import PrefixStore

    store = PrefixStore(f"stalwart/copy/{token}", dist.distributed_c10d._get_default_store())
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    # The interfaces the iteration's group uses (GLOO_SOCKET_IFNAME, as torch reads it), each `streams` times.
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    devices = []
    for _ in range(streams):
        if names:
            devices += [ProcessGroupGloo.create_device(interface=n) for n in names]
        else:
            devices.append(ProcessGroupGloo.create_default_device())
    options._devices = devices
    options._threads = max(2, streams)
    options._timeout = timeout
    group = ProcessGroupGloo(store, members.index(dist.get_rank()), len(members), options)
    return Wire(kind, group, members, timeout)


def send(wire: Wire, buckets: Sequence[Bucket], senders: Sequence[int], sources: Sequence[torch.Tensor], *,
         me: int, receivers: Sequence[int], window: int, bucket_bytes: int) -> int:
    """Send this rank's buckets (``senders[b] == me``) to every receiver, from ``sources`` (each tensor's
    bytes, flat uint8). Returns the bytes sent to each receiver."""
    import torch

    staging: list[torch.Tensor] = []
    free: list[torch.Tensor] = []
    flight: deque[tuple[int, list[tuple[int, Any]], torch.Tensor | None]] = deque()
    sent = 0

    def settle() -> None:
        index, works, stage = flight.popleft()
        for peer, work in works:
            try:
                wire.wait(work)
            except RuntimeError as e:
                raise WireError(index, peer, e) from e
        if stage is not None:
            free.append(stage)

    for index, bucket in enumerate(buckets):
        if senders[index] != me:
            continue
        stage: torch.Tensor | None = None
        if bucket.direct:
            p = bucket.pieces[0]
            buf = sources[p.tensor][p.offset:p.offset + p.length]
        else:
            while not free and len(staging) >= window:
                settle()
            if not free:
                staging.append(torch.empty(bucket_bytes, dtype=torch.uint8))
                free.append(staging[-1])
            stage = free.pop()
            at = 0
            for p in bucket.pieces:
                stage[at:at + p.length].copy_(sources[p.tensor][p.offset:p.offset + p.length])
                at += p.length
            buf = stage[:at]
        works = []
        for r in receivers:
            try:
                works.append((r, wire.isend(buf, r, index)))
            except RuntimeError as e:
                raise WireError(index, r, e) from e
        flight.append((index, works, stage))
        sent += bucket.nbytes
        if after_bucket is not None:
            after_bucket(index)
        while len(flight) > window:
            settle()
    while flight:
        settle()
    return sent


def receive(wire: Wire, buckets: Sequence[Bucket], senders: Sequence[int], landings: Sequence[Landing], *,
            window: int, bucket_bytes: int) -> int:
    """Receive every bucket from its sender into ``landings``. Returns the bytes received."""
    import torch

    free = [torch.empty(bucket_bytes, dtype=torch.uint8)
            for _ in range(min(window, sum(1 for b in buckets if not b.direct)))]
    flight: deque[tuple[int, Any, torch.Tensor | None]] = deque()
    received = 0

    def settle() -> None:
        index, work, stage = flight.popleft()
        try:
            wire.wait(work)
        except RuntimeError as e:
            raise WireError(index, senders[index], e) from e
        if stage is not None:
            at = 0
            for p in buckets[index].pieces:
                landings[p.tensor].buffer[p.offset:p.offset + p.length].copy_(stage[at:at + p.length])
                at += p.length
            free.append(stage)

    for index, bucket in enumerate(buckets):
        stage: torch.Tensor | None = None
        if bucket.direct:
            p = bucket.pieces[0]
            buf = landings[p.tensor].buffer[p.offset:p.offset + p.length]
        else:
            while not free:
                settle()
            stage = free.pop()
            buf = stage[:bucket.nbytes]
        try:
            work = wire.irecv(buf, senders[index], index)
        except RuntimeError as e:
            raise WireError(index, senders[index], e) from e
        flight.append((index, work, stage))
        received += bucket.nbytes
        while len(flight) > window:
            settle()
    while flight:
        settle()
    return received
