"""The default network adapter: length-prefixed frames over TCP, authenticated per job, without copies.

Why not gRPC. Measured between two
processes on one node, a bare ``grpc.aio`` bidirectional-stream echo costs about 170 us per round trip and
moves a 1 MiB message at a few hundred MiB/s: the Python side of ``grpc.aio`` (a task and several loop
hops per message, a copy of every message into and out of its core) is the floor, and it puts stalwart's
``rpc_sync`` several times behind TensorPipe. stalwart already frames its own messages (:mod:`.codec`) and
needs none of HTTP/2's multiplexing (one long-lived connection per caller/callee pair carries everything),
so a plain TCP connection per pair with a 4-byte length prefix is all the transport must add. Keep-alive,
reconnection and flow control are what the agent and the kernel already give: a broken connection is
reported to the agent (``on_link_down``: it retries or fails the calls in flight) and the next send opens
a new one; a sender whose queue holds more than :data:`HIGH_WATER` bytes waits until the peer has taken
them, so a slow peer pushes back on its sender.

Why raw non-blocking sockets under the event loop's reader/writer callbacks rather than asyncio streams.
Streams copy a large message four times on its way (joined with its prefix, into the write buffer, into
the read buffer, out of it by ``readexactly``). Here an outgoing frame is a list of buffers (the header,
then each tensor's own memory) handed to one ``sendmsg`` call, so the kernel copies tensors straight from
where they live; an incoming frame of :data:`OWN_BUFFER_FROM` bytes or more is received with
``recv_into`` directly into a buffer of its own, which the codec then lends to the tensors it decodes.
Smaller frames are read in bulk into one reusable buffer and cut out of it.

Wire format. Authentication is a challenge and response on the job's token (``STALWART_RPC_TOKEN``), both
ways, before a single frame is parsed; the token itself never travels, and a recorded handshake is
worth nothing later (every connection has fresh nonces):

1. the caller writes the magic ``b"STWRPC2\n"`` and a random 16-byte nonce ``cn``;
2. the callee answers with its own random nonce ``sn`` and ``HMAC-SHA256(token, "callee" | cn | sn)``, which
   proves it holds the token (so a caller never sends its frames to an impostor);
3. the caller checks that proof (in constant time) and writes ``HMAC-SHA256(token, "caller" | sn | cn)``,
   then its frames;
4. the callee checks the caller's proof with :func:`hmac.compare_digest` before it reads anything more:
   on a mismatch it answers one refusal byte ``0x00`` and closes, so an unauthenticated peer gets nothing
   and none of its bytes is ever parsed; on a match it answers ``0x01``.

A peer that does not complete its part within :data:`HELLO_TIMEOUT` seconds is disconnected. The handshake
authenticates; it does not encrypt (frames travel in clear text on the pod network). Every record after it,
both ways, is ``u32 prefix (big-endian) | body``: the prefix's top two bits give the record's kind and the
other 30 its body's length. Kind 0 is a frame (a length above ``max_frame_bytes`` closes the connection
before the body is read); kind 1 is a frame's place in the sender's shared-memory arena and kind 2 a control
record that sets such an arena up or releases part of it (:mod:`.shm`: between processes on one host, large
frames skip the TCP stack).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

from stalwart.rpc.errors import TransportError
from stalwart.rpc.shm import (
    DEFAULT_ARENA_BUDGET,
    DEFAULT_ARENA_BYTES,
    MIN_ARENA_BYTES,
    ArenaError,
    ArenaReader,
    ArenaWriter,
    Budget,
    Descriptor,
    Offer,
)
from stalwart.rpc.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    Buffer,
    LinkDownHandler,
    OutFrame,
    ReplyChannel,
    ReplyHandler,
    RequestHandler,
    check_token,
)

log = logging.getLogger(__name__)

MAGIC = b"STWRPC2\n"
NONCE_BYTES = 16
PROOF_BYTES = 32
#: Seconds each side of a new connection has to do its part of the handshake before it is closed.
HELLO_TIMEOUT = 10.0
#: Seconds to open a connection to a peer.
CONNECT_TIMEOUT = 10.0
#: Seconds a connection being closed gracefully waits for its peer to close its end.
CLOSE_LINGER = 5.0
ACCEPTED = b"\x01"
REFUSED = b"\x00"
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


def _prefix(kind: int, n: int) -> bytes:
    return _LEN.pack(kind << _KIND_SHIFT | n)


def proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    """``HMAC-SHA256(token, role | first | second)``: what each side of the handshake shows."""
    return hmac.new(token.encode(), role + first + second, hashlib.sha256).digest()


def callee_proof(token: str, caller_nonce: bytes, callee_nonce: bytes) -> bytes:
    return proof(token, b"callee", caller_nonce, callee_nonce)


def caller_proof(token: str, caller_nonce: bytes, callee_nonce: bytes) -> bytes:
    return proof(token, b"caller", callee_nonce, caller_nonce)


def _nodelay(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _resolve(loop: asyncio.AbstractEventLoop, host: str, port: int, passive: bool = False) -> Any:
    """The first socket address for ``host:port``; an IP address is taken as it is (no lookup thread)."""
    host = host.strip("[]")
    flags = socket.AI_PASSIVE if passive else 0
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags | socket.AI_NUMERICHOST)
    except socket.gaierror:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags),
                                       CONNECT_TIMEOUT)
    return infos[0]


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


class _Connection:
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


class _ServerSide:
    """The callee's end of one connection: where replies to its requests go."""

    def __init__(self, transport: StreamTransport, peer: str) -> None:
        self._transport = transport
        self.peer = peer
        self.open = True
        self.conn: _Connection | None = None
        self.hello_timer: asyncio.TimerHandle | None = None
        self.caller_nonce: bytes | None = None
        self.nonce = b""

    def handshake(self, data: bytes) -> int:
        """The callee's steps: the caller's magic and nonce, then its proof."""
        assert self.conn is not None
        token = self._transport.token
        if self.caller_nonce is None:
            if data[:len(MAGIC)] != MAGIC:
                log.warning("refused an RPC connection from %s: not a stalwart RPC hello", self.peer)
                self.conn.write_raw([REFUSED])
                return -1
            self.caller_nonce = data[len(MAGIC):]
            self.nonce = secrets.token_bytes(NONCE_BYTES)
            self.conn.write_raw([self.nonce, callee_proof(token, self.caller_nonce, self.nonce)])
            return PROOF_BYTES
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if not hmac.compare_digest(data, caller_proof(token, self.caller_nonce, self.nonce)):
            log.warning("refused an unauthenticated RPC connection from %s", self.peer)
            self.conn.write_raw([REFUSED])
            return -1
        self.conn.write_raw([ACCEPTED])
        return 0

    def on_frame(self, frame: bytes | bytearray) -> None:
        self._transport.on_request(frame, self)

    def on_close(self, exc: BaseException | None) -> None:
        self.open = False
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if exc is not None:
            log.debug("stream from %s ended: %s", self.peer, exc)
        self._transport.server_closed(self)

    def hello_overdue(self) -> None:
        if self.conn is not None and not self.conn.closed:
            log.warning("refused an RPC connection from %s: no handshake within %ss", self.peer, HELLO_TIMEOUT)
            self.conn.abort(None)

    def send_now(self, frame: OutFrame) -> bool:
        """Write ``frame`` unless the connection is congested (False). A reply to a caller that is gone is
        dropped (True): it resends what it still wants, and dedup replays the reply."""
        conn = self.conn
        if not self.open or conn is None or conn.closed:
            return True
        if conn.congested:
            return False
        try:
            conn.write_frame(frame)
        except TransportError as e:
            self.open = False
            log.debug("reply to %s dropped: %s", self.peer, e)
        return True

    async def send(self, frame: OutFrame) -> None:
        conn = self.conn
        while not self.send_now(frame):
            assert conn is not None
            try:
                await conn.drain()
            except TransportError:
                return  # closed while we waited: the caller is gone


class _ClientSide:
    """The caller's end of one connection to one address."""

    def __init__(self, transport: StreamTransport, address: str) -> None:
        self.address = address
        self._transport = transport
        self.broken = False
        self.conn: _Connection | None = None
        self.token = transport.token
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def handshake(self, data: bytes) -> int:
        """The caller's steps: the callee's nonce and proof, then its verdict on ours."""
        assert self.conn is not None
        if not self.ready.done():
            callee_nonce, shown = data[:NONCE_BYTES], data[NONCE_BYTES:]
            if not hmac.compare_digest(shown, callee_proof(self.token, self.nonce, callee_nonce)):
                log.error("peer %s does not hold our RPC token (STALWART_RPC_TOKEN differs?)", self.address)
                self.ready.set_exception(TransportError(f"{self.address} failed the RPC handshake"))
                return -1
            self.conn.write_raw([caller_proof(self.token, self.nonce, callee_nonce)])
            self.ready.set_result(None)  # frames may follow our proof at once
            return len(ACCEPTED)
        if data != ACCEPTED:
            log.error("peer %s refused our RPC token (STALWART_RPC_TOKEN differs?)", self.address)
            return -1
        return 0

    def on_frame(self, frame: bytes | bytearray) -> None:
        self._transport.on_reply(frame)

    def on_close(self, exc: BaseException | None) -> None:
        self.broken = True
        if not self.ready.done():
            self.ready.set_exception(TransportError(f"{self.address} closed the connection in the handshake"))
        if exc is not None:
            log.debug("stream to %s ended: %s", self.address, exc)
        self._transport.link_down(self)

    async def send(self, frame: OutFrame) -> None:
        conn = self.conn
        if self.broken or conn is None:
            raise TransportError(f"stream to {self.address} is closed")
        conn.write_frame(frame)
        await conn.drain()

    def close(self) -> None:
        self.broken = True
        if self.conn is not None:
            self.conn.abort(None)


class StreamTransport:
    """Frames over TCP with a per-job token. All methods run on the agent's loop."""

    def __init__(self, token: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 arena_bytes: int = DEFAULT_ARENA_BYTES, arena_budget: int = DEFAULT_ARENA_BUDGET) -> None:
        check_token(token)
        if max_frame_bytes < 1 or max_frame_bytes > _LEN_MASK:
            raise ValueError(f"max_frame_bytes: must be in [1, 2**30 - 1], got {max_frame_bytes}")
        if arena_bytes != 0 and arena_bytes < MIN_ARENA_BYTES:
            raise ValueError(f"arena_bytes: 0 (no shared-memory arena) or at least {MIN_ARENA_BYTES}, "
                             f"got {arena_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.arena_bytes = arena_bytes
        if arena_budget < 0:
            raise ValueError(f"arena_budget: the bytes of /dev/shm this process's arenas may hold, >= 0, "
                             f"got {arena_budget}")
        self.arena_budget = Budget(arena_budget)
        #: Frames that went through shared memory, by direction (``arena_frames_out``/``_in``).
        self.stats: collections.Counter[str] = collections.Counter()
        self.token = token
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, _ClientSide] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._servers: set[_ServerSide] = set()
        self._all_closed: asyncio.Event | None = None  # set by stop(): the last server-side connection closed
        self._on_request: RequestHandler | None = None
        self._on_reply: ReplyHandler | None = None
        self._on_link_down: LinkDownHandler | None = None
        self.address = ""

    def set_handlers(self, on_request: RequestHandler, on_reply: ReplyHandler,
                     on_link_down: LinkDownHandler) -> None:
        self._on_request, self._on_reply, self._on_link_down = on_request, on_reply, on_link_down

    def on_request(self, frame: bytes | bytearray, side: _ServerSide) -> None:
        assert self._on_request is not None
        self._on_request(frame, side)

    def on_reply(self, frame: bytes | bytearray) -> None:
        assert self._on_reply is not None
        self._on_reply(frame)

    def link_down(self, client: _ClientSide) -> None:
        if self._clients.get(client.address) is client:
            del self._clients[client.address]
        if self._on_link_down is not None:
            self._on_link_down(client.address)

    def server_closed(self, side: _ServerSide) -> None:
        self._servers.discard(side)
        if not self._servers and self._all_closed is not None:
            self._all_closed.set()

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: a free port); returns the ``host:port`` peers reach us at."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            family, _, _, _, addr = await _resolve(loop, host, port, passive=True)
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(1024)
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
        except OSError as e:
            raise TransportError(f"cannot listen on {host}:{port}: {e}") from None
        self._listener = sock
        loop.add_reader(sock.fileno(), self._accept)
        bound = sock.getsockname()[1]
        self.address = f"{host}:{bound}"
        return self.address

    def _accept(self) -> None:
        listener, loop = self._listener, self._loop
        assert listener is not None and loop is not None
        for _ in range(64):
            try:
                sock, peername = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the next wakeup tries again
                log.warning("accepting an RPC connection failed: %s", e)
                return
            sock.setblocking(False)
            _nodelay(sock)
            peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
            side = _ServerSide(self, peer)
            side.conn = _Connection(loop, sock, peer, self.max_frame_bytes, preamble=len(MAGIC) + NONCE_BYTES,
                                    on_preamble=side.handshake, on_frame=side.on_frame,
                                    on_close=side.on_close, arena_bytes=self.arena_bytes,
                                    budget=self.arena_budget, stats=self.stats)
            side.hello_timer = loop.call_later(HELLO_TIMEOUT, side.hello_overdue)
            self._servers.add(side)

    async def _client(self, address: str) -> _ClientSide:
        client = self._clients.get(address)
        if client is not None and not client.broken:
            return client
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            client = self._clients.get(address)
            if client is not None and not client.broken:
                return client
            loop = asyncio.get_running_loop()
            host, _, port = address.rpartition(":")
            sock: socket.socket | None = None
            try:
                family, _, _, _, addr = await _resolve(loop, host, int(port))
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                await asyncio.wait_for(loop.sock_connect(sock, addr), CONNECT_TIMEOUT)
            except (TimeoutError, OSError, ValueError) as e:
                if sock is not None:
                    sock.close()
                raise TransportError(f"cannot connect to {address}: {e}") from None
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            _nodelay(sock)
            client = _ClientSide(self, address)
            client.conn = _Connection(loop, sock, address, self.max_frame_bytes, preamble=NONCE_BYTES + PROOF_BYTES,
                                      on_preamble=client.handshake, on_frame=client.on_frame,
                                      on_close=client.on_close, arena_bytes=self.arena_bytes,
                                      budget=self.arena_budget, stats=self.stats)
            client.conn.write_raw([MAGIC, client.nonce])
            try:
                await asyncio.wait_for(asyncio.shield(client.ready), HELLO_TIMEOUT)
            except TimeoutError:
                client.close()
                raise TransportError(f"{address} did not answer the RPC handshake within {HELLO_TIMEOUT}s") from None
            except TransportError:
                client.close()
                raise
            self._clients[address] = client
            return client

    async def send_request(self, address: str, frame: OutFrame, mtype: str) -> None:
        """Send ``frame`` on the connection to ``address`` (opened on first use). Raises TransportError."""
        client = self._clients.get(address)
        if client is None or client.broken:
            client = await self._client(address)
        await client.send(frame)

    async def send_reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None:
        await channel.send(frame)

    def send_request_nowait(self, address: str, frame: OutFrame) -> bool:
        """Write ``frame`` on an open connection to ``address`` that has room; False when there is none."""
        client = self._clients.get(address)
        if client is None or client.broken or client.conn is None or client.conn.congested:
            return False
        client.conn.write_frame(frame)
        return True

    def send_reply_nowait(self, channel: ReplyChannel, frame: OutFrame) -> bool:
        return isinstance(channel, _ServerSide) and channel.send_now(frame)

    async def disconnect(self, address: str) -> None:
        """Close the connection to ``address`` (e.g. the peer died); the next send opens a new one."""
        client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    async def stop(self, grace: float) -> None:
        """Close every connection and the listener. Replies already queued are flushed within ``grace``."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        if self._listener is not None and self._loop is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        servers = list(self._servers)
        self._all_closed = asyncio.Event()
        for side in servers:
            if side.conn is not None:
                side.conn.close_when_flushed()
        if self._servers and grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace)
        for side in servers:
            if side.conn is not None:
                side.conn.abort(None)
        self._servers.clear()
