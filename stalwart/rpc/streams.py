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
a new one; a sender whose queue holds more than :data:`~.framing.HIGH_WATER` bytes waits until the peer has taken
them, so a slow peer pushes back on its sender.

Why raw non-blocking sockets under the event loop's reader/writer callbacks rather than asyncio streams.
Streams copy a large message four times on its way (joined with its prefix, into the write buffer, into
the read buffer, out of it by ``readexactly``). Here an outgoing frame is a list of buffers (the header,
then each tensor's own memory) handed to one ``sendmsg`` call, so the kernel copies tensors straight from
where they live; an incoming frame of :data:`~.framing.OWN_BUFFER_FROM` bytes or more is received with
``recv_into`` directly into a buffer of its own, which the codec then lends to the tensors it decodes.
Smaller frames are read in bulk into one reusable buffer and cut out of it.

The handshake is in :mod:`.handshake`, the records a connection carries in :mod:`.framing`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import secrets
import socket
from typing import Any

from stalwart.rpc.errors import TransportError
from stalwart.rpc.framing import MAX_BODY, Connection
from stalwart.rpc.handshake import (
    ACCEPTED,
    HELLO_TIMEOUT,
    MAGIC,
    NONCE_BYTES,
    PROOF_BYTES,
    REFUSED,
    callee_proof,
    caller_proof,
)
from stalwart.rpc.shm import DEFAULT_ARENA_BUDGET, DEFAULT_ARENA_BYTES, MIN_ARENA_BYTES, Budget
from stalwart.rpc.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    LinkDownHandler,
    OutFrame,
    ReplyChannel,
    ReplyHandler,
    RequestHandler,
    check_token,
)

__all__ = ["ACCEPTED", "MAGIC", "REFUSED", "StreamTransport", "callee_proof", "caller_proof"]

log = logging.getLogger(__name__)

#: Seconds to open a connection to a peer.
CONNECT_TIMEOUT = 10.0


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


class _ServerSide:
    """The callee's end of one connection: where replies to its requests go."""

    def __init__(self, transport: StreamTransport, peer: str) -> None:
        self._transport = transport
        self.peer = peer
        self.open = True
        self.conn: Connection | None = None
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
        self.conn: Connection | None = None
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
        if max_frame_bytes < 1 or max_frame_bytes > MAX_BODY:
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
            peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
            side = _ServerSide(self, peer)
            side.conn = self._connection(loop, sock, peer, len(MAGIC) + NONCE_BYTES, side)
            side.hello_timer = loop.call_later(HELLO_TIMEOUT, side.hello_overdue)
            self._servers.add(side)

    def _connection(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str, preamble: int,
                    side: _ServerSide | _ClientSide) -> Connection:
        """The connection of either half: ``side`` does its part of the handshake and takes its frames."""
        _nodelay(sock)
        return Connection(loop, sock, peer, self.max_frame_bytes, preamble=preamble, on_preamble=side.handshake,
                          on_frame=side.on_frame, on_close=side.on_close, arena_bytes=self.arena_bytes,
                          budget=self.arena_budget, stats=self.stats)

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
            client = _ClientSide(self, address)
            client.conn = self._connection(loop, sock, address, NONCE_BYTES + PROOF_BYTES, client)
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
