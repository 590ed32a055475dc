"""The state copy's plan, pure: which bytes of which tensor travel in which bucket, and which source sends it.

:func:`sync_from_peers` (:mod:`.peers`) moves a replica's state in buckets of at most ``bucket_bytes``
(:func:`plan_buckets`). A tensor of a bucket's size or more is cut into buckets of its own, each one
contiguous slice of it: sent from the tensor's memory and received into it, no staging. Smaller tensors, and
a large tensor's tail, are packed together into a bucket that each side flattens into (or out of) a staging
buffer of that size. Every byte of every tensor is in exactly one piece of one bucket; empty tensors are in
none. :func:`assign_sources` gives each bucket to one of the ranks that hold the newest state (disjoint
parts, balanced by bytes), so that two sources each send about half.

Sizes are in bytes throughout: a tensor is sent as its bytes, whatever its dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "Piece", "assign_sources", "dtype_size", "plan_buckets", "tensor_bytes"]

#: Bytes an element of each dtype the copy carries (torch's names, without ``torch.``).
DTYPE_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}


@dataclass(frozen=True, slots=True)
class Piece:
    """``length`` bytes of tensor ``tensor`` (an index into the layout), from byte ``offset`` of it."""

    tensor: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Bucket:
    """What one message carries: its pieces, in order. One piece: sent straight from (into) the tensor."""

    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def direct(self) -> bool:
        return len(self.pieces) == 1


def dtype_size(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (e.g. ``"float32"``: 4)."""
    size = DTYPE_SIZES.get(dtype)
    if size is None:
        raise ValueError(f"dtype: expected one of {', '.join(sorted(DTYPE_SIZES))}, got {dtype!r}")
    return size


def tensor_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = dtype_size(dtype)
    for d in shape:
        if d < 0:
            raise ValueError(f"shape: expected sizes >= 0, got {list(shape)}")
        n *= d
    return n


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> tuple[Bucket, ...]:
    """The buckets for tensors of ``sizes`` bytes (in the layout's order), each at most ``bucket_bytes``."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: expected >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    packed: list[Piece] = []
    room = bucket_bytes

    def close() -> None:
        nonlocal packed, room
        if packed:
            buckets.append(Bucket(tuple(packed)))
        packed, room = [], bucket_bytes

    for index, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"sizes[{index}]: expected >= 0 bytes, got {size}")
        offset = 0
        if size >= bucket_bytes:
            # Whole buckets straight from the tensor; what is left over is packed like a small tensor.
            close()
            while size - offset >= bucket_bytes:
                buckets.append(Bucket((Piece(index, offset, bucket_bytes),)))
                offset += bucket_bytes
        rest = size - offset
        if rest == 0:
            continue
        if rest > room:
            close()
        packed.append(Piece(index, offset, rest))
        room -= rest
    close()
    return tuple(buckets)


def assign_sources(sizes: Sequence[int], sources: Sequence[int]) -> tuple[int, ...]:
    """The source rank that sends each bucket (of ``sizes`` bytes): in the buckets' order, each to the source
    with the fewest bytes so far (ties: the first in ``sources``), so that the parts are disjoint and about
    equal in bytes."""
    if not sources:
        raise ValueError("sources: expected at least one rank")
    if len(set(sources)) != len(sources):
        raise ValueError(f"sources: expected distinct ranks, got {list(sources)}")
    load = [0] * len(sources)
    out = []
    for size in sizes:
        i = min(range(len(sources)), key=lambda k: (load[k], k))
        load[i] += size
        out.append(sources[i])
    return tuple(out)
