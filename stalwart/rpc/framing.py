"""The records of one RPC connection, and the connection that reads and writes them (both halves use it).

Every record after the handshake (:mod:`.handshake`), both ways, is ``u32 prefix (big-endian) | body``:
the prefix's top two bits give the record's kind and the other 30 its body's length. Kind 0 is a frame (a
length above ``max_frame_bytes`` closes the connection before the body is read); kind 1 is a frame's place
in the sender's shared-memory arena and kind 2 a control record that sets such an arena up or releases part
of it (:mod:`.shm`: between processes on one host, large frames skip the TCP stack).

Outgoing frames are lists of buffers handed to one ``sendmsg`` call (tensors are sent from their own
memory); an incoming frame of :data:`OWN_BUFFER_FROM` bytes or more is received into a buffer of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import socket
import struct
from collections.abc import Callable

from stalwart.rpc.errors import TransportError
from stalwart.rpc.shm import ArenaError, ArenaReader, ArenaWriter, Budget, Descriptor, Offer
from stalwart.rpc.transport import Buffer, OutFrame

log = logging.getLogger(__name__)

#: Seconds a connection being closed gracefully waits for its peer to close its end.
CLOSE_LINGER = 5.0
#: A sender waits once this many bytes are queued on a connection, until fewer than LOW_WATER are.
HIGH_WATER = 8 * 1024 * 1024
LOW_WATER = 2 * 1024 * 1024
#: Frames of at least this many bytes are received into a buffer of their own (lent to their tensors).
OWN_BUFFER_FROM = 64 * 1024
_READ_BUFFER = 256 * 1024
_READS_PER_WAKEUP = 16  # bounded, so one busy connection cannot starve the others on the loop
_IOV_MAX = 512  # buffers per sendmsg call (the kernel's limit is 1024)
_LEN = struct.Struct(">I")
# The top two bits of a length prefix say what follows: a frame, a frame's place in the sender's arena, or a
# transport control record (arena set-up and releases). The other 30 bits are the body's length.
_KIND_SHIFT = 30
_LEN_MASK = (1 << _KIND_SHIFT) - 1
_FRAME, _ARENA_FRAME, _CONTROL = 0, 1, 2
_MAX_RECORD = 256  # bodies of arena descriptors and control records
_OFFER, _ACCEPT, _REFUSE, _RELEASE = 1, 2, 3, 4
_U64 = struct.Struct(">Q")
_RELEASE_DELAY = 0.002  # seconds a receiver may sit on a release, to send one record for several frames
#: The largest body length a prefix can carry.
MAX_BODY = _LEN_MASK


def _prefix(kind: int, n: int) -> bytes:
    return _LEN.pack(kind << _KIND_SHIFT | n)


def _bytes_view(b: Buffer) -> memoryview:
    v = memoryview(b)
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")


#: Called with the preamble's bytes (the handshake); returns how many bytes the next step of it needs, 0
#: when it is complete (frames follow), or -1 to close the connection.
PreambleHandler = Callable[[bytes], int]
#: Called with each complete frame: ``bytes`` when small, a ``bytearray`` of its own when large.
FrameHandler = Callable[[bytes | bytearray], None]
#: Called once when the connection closes, with why (None: the peer ended it cleanly, or we closed it).
CloseHandler = Callable[[BaseException | None], None]


class Connection:
    """One TCP connection on a non-blocking socket, driven by the loop's reader and writer callbacks.

    It first reads ``preamble`` raw bytes and gives them to ``on_preamble``, as many times as that asks;
    only once it says the handshake is complete does it parse frames. Everything runs on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str, limit: int, *,
                 preamble: int, on_preamble: PreambleHandler, on_frame: FrameHandler,
                 on_close: CloseHandler, arena_bytes: int = 0, budget: Budget | None = None,
                 stats: collections.Counter[str] | None = None) -> None:
        self.peer = peer
        self.closed = False
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._limit = limit
        self._preamble = preamble
        self._on_preamble = on_preamble
        self._on_frame = on_frame
        self._on_close = on_close
        self._buf = bytearray(_READ_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._big: bytearray | None = None  # the large frame being received into its own buffer
        self._big_view: memoryview | None = None
        self._big_got = 0
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0
        self._writing = False
        self._closing = False  # close_when_flushed() was called: reads are discarded, writes refused
        self._linger: asyncio.TimerHandle | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._arena_bytes = arena_bytes
        self._budget = budget if budget is not None else Budget(arena_bytes)
        self._arena_out: ArenaWriter | None = None  # ours, once offered
        self._arena_in: ArenaReader | None = None  # the peer's, once accepted
        self._release_end = 0
        self._release_bytes = 0
        self._release_timer: asyncio.TimerHandle | None = None
        self.stats = stats if stats is not None else collections.Counter()
        loop.add_reader(self._fd, self._readable)

    # -- writing ------------------------------------------------------------------------------------------

    def write_raw(self, parts: list[Buffer]) -> None:
        """Queue ``parts`` for the peer, sending at once what the socket takes. Raises TransportError."""
        if self.closed or self._closing:
            raise TransportError(f"connection to {self.peer} is closed")
        if self._queue:
            for p in parts:
                v = _bytes_view(p)
                if v.nbytes:
                    self._queue.append(v)
                    self._queued += v.nbytes
            return
        total = 0
        for p in parts:
            total += len(p) if isinstance(p, bytes | bytearray) else memoryview(p).nbytes
        try:
            sent = self._sock.sendmsg(parts) if len(parts) <= _IOV_MAX else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            self.abort(e)
            raise TransportError(f"cannot send to {self.peer}: {e}") from None
        if sent == total:
            return
        for p in parts:
            v = _bytes_view(p)
            if sent >= v.nbytes:
                sent -= v.nbytes
                continue
            self._queue.append(v[sent:] if sent else v)
            self._queued += v.nbytes - sent
            sent = 0
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)

    def write_frame(self, frame: OutFrame) -> None:
        """Queue one frame with its length prefix (or, when large and the peer shares our arena, its place
        in the arena). Raises TransportError when the connection is closed."""
        parts: list[Buffer] = [frame] if isinstance(frame, bytes | bytearray | memoryview) else frame
        n = 0
        for p in parts:
            n += len(p) if isinstance(p, bytes) else memoryview(p).nbytes
        arena = self._arena_out
        if n >= OWN_BUFFER_FROM and arena is not None and arena.accepted and not self.closed:
            where = arena.put(parts, n)
            if where is not None:
                self.stats["arena_frames_out"] += 1
                record = where.encode()
                self.write_raw([_prefix(_ARENA_FRAME, len(record)), record])
                return
        self.write_raw([_prefix(_FRAME, n), *parts])

    def _control(self, op: int, data: bytes = b"") -> None:
        self.write_raw([_prefix(_CONTROL, 1 + len(data)), bytes((op,)) + data])

    def _offer_arena(self) -> None:
        if not self._budget.take(self._arena_bytes):
            log.debug("no shared-memory arena for %s: this process's arena budget is spent", self.peer)
            return
        try:
            self._arena_out = ArenaWriter(self._arena_bytes)
        except (OSError, ValueError) as e:  # no /dev/shm, or not enough of it: frames go inline
            self._budget.give(self._arena_bytes)
            log.debug("no shared-memory arena for %s: %s", self.peer, e)
            return
        self._control(_OFFER, self._arena_out.offer.encode())

    def _drop_arena(self) -> None:
        if self._arena_out is not None:
            self._arena_out.close()
            self._arena_out = None
            self._budget.give(self._arena_bytes)

    def _on_control(self, body: bytes) -> None:
        op, data = body[0], body[1:]
        arena = self._arena_out
        if op == _OFFER:
            try:
                self._arena_in = ArenaReader(Offer.decode(data))
            except ArenaError as e:
                log.debug("arena of %s not used: %s", self.peer, e)
                self._control(_REFUSE)
                return
            self._control(_ACCEPT)
        elif op == _ACCEPT and arena is not None:
            arena.accepted = True
            arena.unlink()  # both sides have it mapped: nothing may outlive the processes
        elif op == _REFUSE and arena is not None:
            self._drop_arena()
        elif op == _RELEASE and arena is not None and len(data) == _U64.size:
            arena.ring.release(_U64.unpack(data)[0])
        else:
            raise TransportError(f"{self.peer} sent an unexpected control record {op}")

    def _on_arena_frame(self, body: bytes) -> None:
        if self._arena_in is None:
            raise TransportError(f"{self.peer} sent an arena frame without an accepted arena")
        try:
            where = Descriptor.decode(body)
            frame = self._arena_in.take(where)
        except ArenaError as e:
            raise TransportError(f"{self.peer}: {e}") from None
        self.stats["arena_frames_in"] += 1
        self._release_end = where.end
        self._release_bytes += where.length
        if self._release_bytes >= self._arena_in.size // 4:
            self._send_release()
        elif self._release_timer is None:
            self._release_timer = self._loop.call_later(_RELEASE_DELAY, self._send_release)
        self._on_frame(frame)

    def _send_release(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        if self._release_bytes and not self.closed:
            self._release_bytes = 0
            with contextlib.suppress(TransportError):
                self._control(_RELEASE, _U64.pack(self._release_end))

    async def drain(self) -> None:
        """Wait while more than HIGH_WATER bytes are queued. Raises TransportError if the connection closes."""
        if self._queued <= HIGH_WATER:
            if self.closed:
                raise TransportError(f"connection to {self.peer} is closed")
            return
        fut = self._loop.create_future()
        self._waiters.append(fut)
        await fut

    def _writable(self) -> None:
        queue = self._queue
        try:
            sent = self._sock.sendmsg(list(itertools.islice(queue, _IOV_MAX)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.abort(e)
            return
        self._queued -= sent
        while sent:
            v = queue[0]
            if v.nbytes <= sent:
                sent -= v.nbytes
                queue.popleft()
            else:
                queue[0] = v[sent:]
                sent = 0
        if not queue:
            self._writing = False
            self._loop.remove_writer(self._fd)
            if self._closing:
                self._end_writes()
        if self._queued <= LOW_WATER:
            self._wake(None)

    @property
    def congested(self) -> bool:
        """More than HIGH_WATER bytes wait to be sent: a sender should wait (:meth:`drain`)."""
        return self._queued > HIGH_WATER

    def _wake(self, exc: BaseException | None) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    # -- reading ------------------------------------------------------------------------------------------

    def _readable(self) -> None:
        if self._closing:
            self._discard()
            return
        for _ in range(_READS_PER_WAKEUP):
            big_view = self._big_view
            try:
                if big_view is not None:
                    n = self._sock.recv_into(big_view[self._big_got:])
                else:
                    if self._end == len(self._buf):
                        self._compact()
                    n = self._sock.recv_into(self._view[self._end:])
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.abort(e)
                return
            if n == 0:
                inside = self._big is not None or self._end > self._start
                self.abort(TransportError(f"{self.peer} ended the stream inside a frame") if inside else None)
                return
            if big_view is not None:
                self._big_got += n
                if self._big_got == big_view.nbytes:
                    frame = self._big
                    assert frame is not None
                    big_view.release()
                    self._big = self._big_view = None
                    self._on_frame(frame)
            else:
                self._end += n
                self._parse()
            if self.closed or self._closing:
                return
            if n < 4096 and self._big is None:
                return  # the socket is most likely empty: save a recv that would only say so

    def _parse(self) -> None:
        view = self._view
        start, end = self._start, self._end
        while not (self.closed or self._closing):
            avail = end - start
            if self._preamble:
                if avail < self._preamble:
                    break
                data = bytes(view[start:start + self._preamble])
                start += self._preamble
                self._start = start
                self._preamble = self._on_preamble(data)
                if self._preamble < 0:
                    self._preamble = 0
                    self.close_when_flushed()
                    return
                if not self._preamble and self._arena_bytes:
                    self._offer_arena()
                continue
            if avail < _LEN.size:
                break
            (word,) = _LEN.unpack_from(self._buf, start)
            kind, n = word >> _KIND_SHIFT, word & _LEN_MASK
            if kind != _FRAME:
                if kind > _CONTROL or n > _MAX_RECORD or n < 1:
                    self.abort(TransportError(f"{self.peer} sent a record of kind {kind}, {n} bytes"))
                    return
                if avail < _LEN.size + n:
                    break
                body = bytes(view[start + _LEN.size:start + _LEN.size + n])
                start += _LEN.size + n
                self._start = start
                try:
                    (self._on_control if kind == _CONTROL else self._on_arena_frame)(body)
                except TransportError as e:
                    self.abort(e)
                    return
                continue
            if n > self._limit:
                self.abort(TransportError(f"{self.peer} sent a frame of {n} bytes; the limit is {self._limit}"))
                return
            if avail >= _LEN.size + n:
                inline = view[start + _LEN.size:start + _LEN.size + n]
                frame: bytes | bytearray = bytearray(inline) if n >= OWN_BUFFER_FROM else bytes(inline)
                start += _LEN.size + n
                self._start = start
                self._on_frame(frame)
                continue
            if n >= OWN_BUFFER_FROM or _LEN.size + n > len(self._buf):
                big = bytearray(n)
                have = avail - _LEN.size
                big[:have] = view[start + _LEN.size:end]
                self._big, self._big_view, self._big_got = big, memoryview(big), have
                start = end = 0
            break
        self._start, self._end = start, end
        if start == end:
            self._start = self._end = 0
        elif start > len(self._buf) // 2:
            self._compact()

    def _compact(self) -> None:
        avail = self._end - self._start
        self._buf[:avail] = self._view[self._start:self._end]
        self._start, self._end = 0, avail

    # -- closing ------------------------------------------------------------------------------------------

    def close_when_flushed(self) -> None:
        """Close gracefully: send what is queued, then end our direction (FIN) and read (discarding) until
        the peer ends its own, or CLOSE_LINGER seconds pass. Closing a socket that still has unread bytes
        makes the kernel answer with a reset, which can destroy data the peer has not read yet (a reply)."""
        if self.closed or self._closing:
            return
        self._closing = True
        self._linger = self._loop.call_later(CLOSE_LINGER, self.abort, None)
        if not self._queue:
            self._end_writes()

    def _end_writes(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.abort(None)

    def _discard(self) -> None:
        try:
            while True:
                if not self._sock.recv_into(self._view):
                    self.abort(None)
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort(None)

    def abort(self, exc: BaseException | None) -> None:
        """Close now, dropping what is queued; ``on_close`` learns why."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        if self._writing:
            with contextlib.suppress(Exception):
                self._loop.remove_writer(self._fd)
        self._queue.clear()
        self._queued = 0
        self._sock.close()
        if self._release_timer is not None:
            self._release_timer.cancel()
        if self._linger is not None:
            self._linger.cancel()
        self._drop_arena()
        if self._arena_in is not None:
            self._arena_in.close()
        self._wake(TransportError(f"connection to {self.peer} closed"))
        self._on_close(exc)
