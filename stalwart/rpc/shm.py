"""Shared-memory arenas: how a large frame skips the TCP stack between two processes on one host.

Between processes that share ``/dev/shm`` (ranks of one pod, or workers on one machine), copying a 1 MiB
tensor through loopback TCP costs several hundred microseconds of kernel work. Instead, each sender owns
one arena per connection: a file in ``/dev/shm`` that both processes map. The sender copies a large frame
into the arena and sends only a small descriptor on the connection; the receiver copies the frame out
into a buffer of its own and, from time to time, tells the sender up to where it has read, which frees
that part of the ring. A frame that does not fit (the ring is full, or it is larger than the ring) simply
goes through the connection as usual, so the arena is an optimisation, never a point of failure.

Set-up, per direction: after the token check, the sender offers ``(name, size, cookie)``; the receiver
opens ``/dev/shm/<name>`` only if the name has the exact form :data:`NAME_PATTERN`, checks the size and
that the file starts with the 16 random bytes of the cookie (a process on another host, or in another
pod's IPC namespace, finds no such file, or not that one), maps it read-only and accepts. The sender then
unlinks the file: the mapping stays, and no file outlives the processes even if they are killed. The
arena is reserved with ``posix_fallocate`` when it is created, so a full ``/dev/shm`` means no arena
(offer not made) rather than a ``SIGBUS`` later. /dev/shm is shared with NCCL and data loaders, so a
process holds at most :data:`DEFAULT_ARENA_BUDGET` bytes of arenas (further connections go without) and
creates none while /dev/shm has less than :data:`FREE_FACTOR` times an arena free.

Everything read from an arena is a frame like any other: the codec checks it in full. Descriptors are
bounds-checked against the arena before any byte is read.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import struct
from dataclasses import dataclass

from stalwart.rpc.transport import Buffer

SHM_DIR = "/dev/shm"
NAME_PATTERN = re.compile(r"stalwart-rpc-[0-9a-f]{32}")
COOKIE_BYTES = 16
HEADER_BYTES = 64  # the cookie, padded: the ring starts after it
#: Default arena size per direction of a connection (reserved in /dev/shm while the connection lives).
DEFAULT_ARENA_BYTES = 16 * 1024 * 1024
#: Smallest arena: below this the ring would not hold the frames worth sending this way.
MIN_ARENA_BYTES = 1024 * 1024
#: Default cap on the arenas one process creates in all (its share of /dev/shm, which NCCL and data loaders
#: need too: a container's /dev/shm is often only 64 MiB).
DEFAULT_ARENA_BUDGET = 64 * 1024 * 1024
#: An arena is only created while /dev/shm has this many times its size free.
FREE_FACTOR = 4

_OFFER = struct.Struct(">Q16s")  # size, cookie; the name follows
_DESCRIPTOR = struct.Struct(">QQI")  # end counter, offset in the arena, length


class ArenaError(Exception):
    """An arena offer or descriptor that cannot be honoured (the message says why)."""


@dataclass(frozen=True, slots=True)
class Offer:
    """What a sender tells its peer about its arena."""

    name: str
    size: int
    cookie: bytes

    def encode(self) -> bytes:
        return _OFFER.pack(self.size, self.cookie) + self.name.encode()

    @staticmethod
    def decode(data: bytes) -> Offer:
        if len(data) < _OFFER.size or len(data) > _OFFER.size + 64:
            raise ArenaError(f"arena offer of {len(data)} bytes")
        size, cookie = _OFFER.unpack_from(data)
        name = data[_OFFER.size:].decode("ascii", "replace")
        if not NAME_PATTERN.fullmatch(name):
            raise ArenaError(f"arena name {name!r} is not of the form {NAME_PATTERN.pattern}")
        if not MIN_ARENA_BYTES <= size <= 1 << 40:
            raise ArenaError(f"arena size {size} out of range")
        return Offer(name, size, cookie)


@dataclass(frozen=True, slots=True)
class Descriptor:
    """Where one frame lies in the sender's arena; ``end`` is the ring position just after it."""

    end: int
    offset: int
    length: int

    def encode(self) -> bytes:
        return _DESCRIPTOR.pack(self.end, self.offset, self.length)

    @staticmethod
    def decode(data: bytes) -> Descriptor:
        if len(data) != _DESCRIPTOR.size:
            raise ArenaError(f"arena descriptor of {len(data)} bytes")
        return Descriptor(*_DESCRIPTOR.unpack(data))


class Ring:
    """The sender's bookkeeping of its arena: a ring of ``capacity`` bytes, allocated in order and
    released in order up to a position (positions only grow; a frame never wraps: the rest of the ring
    is skipped instead). Pure: no memory is touched here."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.capacity = capacity
        self.head = 0  # position after the last allocation
        self.tail = 0  # position up to which the receiver has read

    def alloc(self, n: int) -> tuple[int, int] | None:
        """``(start within the ring, end position)`` for ``n`` bytes, or None when they do not fit now."""
        if n > self.capacity or n < 1:
            return None
        pos = self.head % self.capacity
        skip = self.capacity - pos if pos + n > self.capacity else 0
        if self.head + skip + n - self.tail > self.capacity:
            return None
        start = (self.head + skip) % self.capacity
        self.head += skip + n
        return start, self.head

    def release(self, end: int) -> None:
        """The receiver has read everything before position ``end``."""
        if self.tail < end <= self.head:
            self.tail = end

    @property
    def used(self) -> int:
        return self.head - self.tail


class ArenaWriter:
    """The sender's arena: created (and reserved) in /dev/shm, mapped read-write, unlinked once the peer has
    answered its offer or the connection ends."""

    def __init__(self, size: int = DEFAULT_ARENA_BYTES) -> None:
        if size < MIN_ARENA_BYTES:
            raise ValueError(f"size: an arena needs at least {MIN_ARENA_BYTES} bytes, got {size}")
        self.name = f"stalwart-rpc-{secrets.token_hex(16)}"
        self.cookie = secrets.token_bytes(COOKIE_BYTES)
        self.size = size
        self.path = os.path.join(SHM_DIR, self.name)
        fs = os.statvfs(SHM_DIR)
        if fs.f_bavail * fs.f_frsize < FREE_FACTOR * size:
            raise OSError(errno.ENOSPC, f"{SHM_DIR} has less than {FREE_FACTOR} x {size} bytes free")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self._map[:COOKIE_BYTES] = self.cookie
        self._view = memoryview(self._map)
        self.ring = Ring(size - HEADER_BYTES)
        self.accepted = False

    @property
    def offer(self) -> Offer:
        return Offer(self.name, self.size, self.cookie)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def put(self, parts: list[Buffer], length: int) -> Descriptor | None:
        """Copy the frame made of ``parts`` (``length`` bytes in all) into the ring; None if it does not fit."""
        got = self.ring.alloc(length)
        if got is None:
            return None
        start, end = got
        offset = HEADER_BYTES + start
        at = offset
        view = self._view
        for p in parts:
            v = p if isinstance(p, memoryview) else memoryview(p)
            n = v.nbytes
            view[at:at + n] = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            at += n
        return Descriptor(end, offset, length)

    def close(self) -> None:
        self.unlink()
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()


class Budget:
    """How many arena bytes one process may hold at once (all its connections together)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit: must be >= 0, got {limit}")
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used = max(0, self.used - n)


class ArenaReader:
    """The receiver's read-only mapping of its peer's arena."""

    def __init__(self, offer: Offer) -> None:
        path = os.path.join(SHM_DIR, offer.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise ArenaError(f"no arena {offer.name} here ({e.strerror}): not the same host") from None
        try:
            size = os.fstat(fd).st_size
            if size != offer.size:
                raise ArenaError(f"arena {offer.name} is {size} bytes, the offer says {offer.size}")
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        if self._view[:COOKIE_BYTES] != offer.cookie:
            self.close()
            raise ArenaError(f"arena {offer.name} does not carry the offered cookie")
        self.size = size

    def take(self, d: Descriptor) -> bytearray:
        """A copy of the frame ``d`` describes, in a buffer of its own. Raises ArenaError if out of bounds."""
        if d.offset < HEADER_BYTES or d.length < 1 or d.offset + d.length > self.size:
            raise ArenaError(f"descriptor {d} lies outside the arena of {self.size} bytes")
        frame = bytearray(d.length)
        memoryview(frame)[:] = self._view[d.offset:d.offset + d.length]
        return frame

    def close(self) -> None:
        self._view.release()
        with contextlib.suppress(BufferError):
            self._map.close()
