"""The default network adapter: length-prefixed frames over plain asyncio TCP streams, authenticated per job.

Why not gRPC here (:class:`~.transport.GrpcTransport` stays available and is tested). Measured between two
processes on one node, a bare ``grpc.aio`` bidirectional-stream echo costs about 170 us per round trip and
moves a 1 MiB message at a few hundred MiB/s: the Python side of ``grpc.aio`` (a task and several loop
hops per message, a copy of every message into and out of its core) is the floor, and it puts stalwart's
``rpc_sync`` several times behind TensorPipe. stalwart already frames its own messages (:mod:`.codec`) and
needs none of HTTP/2's multiplexing (one long-lived connection per caller/callee pair carries everything),
so a plain TCP stream per pair with a 4-byte length prefix is all the transport must add. Keep-alive,
reconnection and flow control are what the agent and the kernel already give: a broken connection is
reported to the agent (``on_link_down``: it retries or fails the calls in flight) and the next send opens
a new one; writes wait on the socket's buffer (``drain``) so a slow peer pushes back on its sender.

Wire format. The caller opens a connection and first writes a fixed 40-byte hello: the magic
``b"STWRPC1\\n"`` and the SHA-256 digest of the job's token (``STALWART_RPC_TOKEN``). The callee reads
exactly those 40 bytes (within :data:`HELLO_TIMEOUT` seconds) and compares the digest to its own with
:func:`hmac.compare_digest` (constant time) *before it reads a single frame*; on a mismatch it answers one
refusal byte ``0x00`` and closes, so an unauthenticated peer gets nothing and none of its bytes is ever
parsed. On a match it answers ``0x01``. Every message after that, both ways, is ``u32 length (big-endian)
| frame``; a length above ``max_frame_bytes`` closes the connection before the body is read. As with the gRPC
adapter, the digest travels in clear text: it fences jobs from each other, it is not a secret against an
eavesdropper on the node network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import socket
import struct

from stalwart.agent.rpc.errors import TransportError
from stalwart.agent.rpc.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    LinkDownHandler,
    ReplyChannel,
    ReplyHandler,
    RequestHandler,
)

log = logging.getLogger(__name__)

MAGIC = b"STWRPC1\n"
HELLO_BYTES = len(MAGIC) + 32
#: Seconds a new connection has to present its hello before it is closed.
HELLO_TIMEOUT = 10.0
#: Seconds to open a connection to a peer.
CONNECT_TIMEOUT = 10.0
ACCEPTED = b"\x01"
REFUSED = b"\x00"
_LEN = struct.Struct(">I")
_STREAM_LIMIT = 8 * 1024 * 1024  # read buffer before the socket is paused
_JOIN_BELOW = 64 * 1024  # frames smaller than this are joined with their prefix (one send)


def hello(token: str) -> bytes:
    """The 40 bytes a caller sends first: magic and the token's SHA-256 digest."""
    return MAGIC + hashlib.sha256(token.encode()).digest()


def _write_frame(writer: asyncio.StreamWriter, frame: bytes) -> None:
    n = len(frame)
    if n < _JOIN_BELOW:
        writer.write(_LEN.pack(n) + frame)
    else:  # no copy of a large frame just to put four bytes in front of it
        writer.write(_LEN.pack(n))
        writer.write(frame)


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """The next frame, or None at a clean end of stream. Raises TransportError for an oversized length."""
    try:
        prefix = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise TransportError("stream ended inside a frame's length prefix") from None
        return None
    (n,) = _LEN.unpack(prefix)
    if n > limit:
        raise TransportError(f"frame of {n} bytes exceeds the limit of {limit}")
    return await reader.readexactly(n)


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _ServerSide:
    """The callee's end of one connection: where replies to its requests go."""

    def __init__(self, writer: asyncio.StreamWriter, peer: str) -> None:
        self._writer = writer
        self.peer = peer
        self.open = True

    async def send(self, frame: bytes) -> None:
        if not self.open or self._writer.is_closing():
            return  # the caller is gone; it resends what it still wants, and dedup replays the reply
        try:
            _write_frame(self._writer, frame)
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError) as e:
            self.open = False
            log.debug("reply to %s dropped: %s", self.peer, e)


class _ClientSide:
    """The caller's end of one connection to one address, with the task that reads its replies."""

    def __init__(self, transport: StreamTransport, address: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.address = address
        self._transport = transport
        self._reader_stream = reader
        self.writer = writer
        self.broken = False
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"rpc-read-{address}")

    async def _read(self) -> None:
        try:
            answer = await self._reader_stream.readexactly(1)
            if answer != ACCEPTED:
                log.error("peer %s refused our RPC token (STALWART_RPC_TOKEN differs?)", self.address)
                return
            on_reply = self._transport.on_reply
            limit = self._transport.max_frame_bytes
            while True:
                frame = await _read_frame(self._reader_stream, limit)
                if frame is None:
                    break
                on_reply(frame)
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TransportError) as e:
            log.debug("stream to %s ended: %s", self.address, e)
        except Exception:
            log.exception("stream to %s failed", self.address)
        finally:
            self.broken = True
            self.writer.close()
            self._transport.link_down(self)

    async def send(self, frame: bytes) -> None:
        if self.broken or self.writer.is_closing():
            raise TransportError(f"stream to {self.address} is closed")
        try:
            _write_frame(self.writer, frame)
            await self.writer.drain()
        except (ConnectionError, OSError, RuntimeError) as e:
            self.broken = True
            raise TransportError(f"cannot send to {self.address}: {e}") from None

    async def close(self) -> None:
        self.broken = True
        self.reader.cancel()
        with contextlib.suppress(BaseException):
            await self.reader
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)


class StreamTransport:
    """Frames over TCP streams with a per-job token. All methods run on the agent's loop."""

    def __init__(self, token: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if not isinstance(token, str) or len(token) < 16:
            raise ValueError("token: the RPC token must be a string of at least 16 characters "
                             "(STALWART_RPC_TOKEN from the job's Secret)")
        if max_frame_bytes < 1 or max_frame_bytes > 0xFFFFFFFF:
            raise ValueError(f"max_frame_bytes: must be in [1, 2**32 - 1], got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._hello = hello(token)
        self._server: asyncio.Server | None = None
        self._clients: dict[str, _ClientSide] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._server_writers: set[asyncio.StreamWriter] = set()
        self._on_request: RequestHandler | None = None
        self._on_reply: ReplyHandler | None = None
        self._on_link_down: LinkDownHandler | None = None
        self.address = ""

    def set_handlers(self, on_request: RequestHandler, on_reply: ReplyHandler,
                     on_link_down: LinkDownHandler) -> None:
        self._on_request, self._on_reply, self._on_link_down = on_request, on_reply, on_link_down

    def on_reply(self, frame: bytes) -> None:
        assert self._on_reply is not None
        self._on_reply(frame)

    def link_down(self, client: _ClientSide) -> None:
        if self._clients.get(client.address) is client:
            del self._clients[client.address]
        if self._on_link_down is not None:
            self._on_link_down(client.address)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        self._server_writers.add(writer)
        peername = writer.get_extra_info("peername")
        peer = f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else str(peername)
        side = _ServerSide(writer, peer)
        try:
            try:
                presented = await asyncio.wait_for(reader.readexactly(HELLO_BYTES), HELLO_TIMEOUT)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
                log.warning("refused an RPC connection from %s: no hello", peer)
                return
            if not hmac.compare_digest(presented, self._hello):
                log.warning("refused an unauthenticated RPC connection from %s", peer)
                writer.write(REFUSED)
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.drain()
                return
            _nodelay(writer)
            writer.write(ACCEPTED)
            on_request = self._on_request
            assert on_request is not None
            while True:
                frame = await _read_frame(reader, self.max_frame_bytes)
                if frame is None:
                    break
                on_request(frame, side)
        except asyncio.CancelledError:
            # stop() cancels us; ending normally keeps asyncio's stream callback from logging the cancel
            return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, TransportError) as e:
            log.debug("stream from %s ended: %s", peer, e)
        except Exception:
            log.exception("stream from %s failed", peer)
        finally:
            side.open = False
            writer.close()
            self._server_writers.discard(writer)
            self._serving.discard(task)

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: a free port); returns the ``host:port`` peers reach us at."""
        try:
            server = await asyncio.start_server(self._serve, host, port, limit=_STREAM_LIMIT)
        except OSError as e:
            raise TransportError(f"cannot listen on {host}:{port}: {e}") from None
        self._server = server
        bound = server.sockets[0].getsockname()[1]
        self.address = f"{host}:{bound}"
        return self.address

    async def _client(self, address: str) -> _ClientSide:
        client = self._clients.get(address)
        if client is not None and not client.broken:
            return client
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            client = self._clients.get(address)
            if client is not None and not client.broken:
                return client
            host, _, port = address.rpartition(":")
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host.strip("[]"), int(port), limit=_STREAM_LIMIT), CONNECT_TIMEOUT)
            except (TimeoutError, OSError, ValueError) as e:
                raise TransportError(f"cannot connect to {address}: {e}") from None
            _nodelay(writer)
            writer.write(self._hello)
            client = _ClientSide(self, address, reader, writer)
            self._clients[address] = client
            return client

    async def send_request(self, address: str, frame: bytes, mtype: str) -> None:
        """Send ``frame`` on the connection to ``address`` (opened on first use). Raises TransportError."""
        client = self._clients.get(address)
        if client is None or client.broken:
            client = await self._client(address)
        await client.send(frame)

    async def send_reply(self, channel: ReplyChannel, frame: bytes, mtype: str) -> None:
        await channel.send(frame)

    async def disconnect(self, address: str) -> None:
        """Close the connection to ``address`` (e.g. the peer died); the next send opens a new one."""
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()

    async def stop(self, grace: float) -> None:
        """Close every connection and the listener. Replies already written are flushed within ``grace``."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
        if self._server is not None:
            self._server.close()
        if grace > 0 and self._server_writers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(w.drain() for w in list(self._server_writers)),
                                                      return_exceptions=True), grace)
        tasks = list(self._serving)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in list(self._server_writers):
            w.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
