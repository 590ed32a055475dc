"""The Transport interface, and an adapter for it over gRPC bidirectional streams (``grpc.aio``).

The agent's default is :class:`~.streams.StreamTransport` (its docstring says why: gRPC's Python side was
the latency and throughput floor); this one stays a supported, tested alternative.

Why gRPC's asyncio API. It is already in stalwart's dependency tree (the etcd adapter speaks gRPC), it is
maintained by a large project and used in production everywhere, it gives HTTP/2 flow control, keep-alive,
reconnection and message-size limits for free, and its asyncio API lets one event loop per agent serve every
peer without a thread per connection. Messages are opaque bytes (identity serializers): stalwart's own frame
format (:mod:`.codec`) travels inside, so there is no generated code and no protobuf schema to keep in step.
One long-lived bidirectional stream per (caller, callee) pair carries the caller's requests and the callee's
replies; a stream costs one HTTP/2 stream for its whole life, so a call costs two messages instead of a new
HTTP/2 stream with headers, which halves the latency of unary gRPC calls.

Authentication: a stream is opened with the job's token (``STALWART_RPC_TOKEN``) in its metadata; the callee
compares SHA-256 digests of the presented and the expected token with :func:`hmac.compare_digest` (constant
time, length not leaked) before it reads a single message, and aborts the stream ``UNAUTHENTICATED``
otherwise: an unauthenticated peer gets nothing, and none of its bytes is ever parsed. The token travels in
clear text unless the pod network is encrypted; it fences jobs from each other, it is not a secret against
an eavesdropper on the node network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from stalwart.rpc.errors import TransportError

log = logging.getLogger(__name__)

_METHOD = "/stalwart.rpc.v1.Rpc/Stream"
_SERVICE = "stalwart.rpc.v1.Rpc"
_TOKEN_KEY = "x-stalwart-token"
#: Largest frame either side accepts (tensors bigger than this must be split). Just under 1 GiB: the stream
#: transport's length prefixes have 30 bits.
DEFAULT_MAX_FRAME_BYTES = 1023 * 1024 * 1024


def _identity(b: bytes) -> bytes:
    return b


#: Anything that exports contiguous bytes (a tensor's memory is sent as a memoryview of it).
Buffer = bytes | bytearray | memoryview
#: An outgoing frame: its bytes, or the buffers that make it up in order (sent without joining them).
OutFrame = bytes | list[Buffer]


def check_token(token: object) -> None:
    """Raise ValueError unless ``token`` can serve as a job's RPC token (a string of 16 characters or more)."""
    if not isinstance(token, str) or len(token) < 16:
        raise ValueError("token: the RPC token must be a string of at least 16 characters "
                         "(STALWART_RPC_TOKEN from the job's Secret)")


def joined(frame: OutFrame) -> bytes:
    """The frame as one ``bytes`` (a copy when it is made of parts)."""
    return frame if isinstance(frame, bytes) else b"".join(frame)


class ReplyChannel(Protocol):
    """Where the reply to one received request goes (the stream it came on)."""

    peer: str

    async def send(self, frame: OutFrame) -> None: ...


#: Called for each received request frame with the channel its reply must go back on. A large frame may
#: come as a ``bytearray`` of its own, which the handler may keep (tensors are decoded into it).
RequestHandler = Callable[[bytes | bytearray, ReplyChannel], None]
#: Called for each received reply frame (``bytes``, or a ``bytearray`` of its own as above).
ReplyHandler = Callable[[bytes | bytearray], None]
#: Called when the stream to an address broke: requests in flight on it will get no reply.
LinkDownHandler = Callable[[str], None]


class Transport(Protocol):
    """What the agent needs from the network. :class:`GrpcTransport` is the real one; fault injection
    (:mod:`.faults`) wraps it."""

    def set_handlers(self, on_request: RequestHandler, on_reply: ReplyHandler,
                     on_link_down: LinkDownHandler) -> None: ...

    async def start(self, host: str, port: int) -> str: ...

    async def send_request(self, address: str, frame: OutFrame, mtype: str) -> None: ...

    async def send_reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None: ...

    def send_request_nowait(self, address: str, frame: OutFrame) -> bool:
        """Send ``frame`` now if that needs no waiting (an open connection with room in its queue): True if
        it was sent (or queued), False if the caller must use :meth:`send_request`. Raises TransportError."""
        ...

    def send_reply_nowait(self, channel: ReplyChannel, frame: OutFrame) -> bool:
        """As :meth:`send_request_nowait`, for a reply (True also when the caller is gone: nothing to do)."""
        ...

    async def disconnect(self, address: str) -> None: ...

    async def stop(self, grace: float) -> None: ...


class _ServerSide:
    """The callee's end of one stream: replies are written one at a time."""

    def __init__(self, context: Any, peer: str) -> None:
        self._context = context
        self._lock = asyncio.Lock()
        self.peer = peer
        self.open = True

    async def send(self, frame: OutFrame) -> None:
        if not self.open:
            return  # the caller is gone; it resends what it still wants, and dedup replays the reply
        async with self._lock:
            try:
                await self._context.write(joined(frame))
            except Exception as e:  # the stream closed under us
                self.open = False
                log.debug("reply to %s dropped: %s", self.peer, e)


class _ClientSide:
    """The caller's end of one stream to one address, with the task that reads its replies."""

    def __init__(self, transport: GrpcTransport, address: str) -> None:
        self.address = address
        self._transport = transport
        self.channel = grpc.aio.insecure_channel(address, options=transport.channel_options)
        self.call = self.channel.stream_stream(
            _METHOD, request_serializer=_identity, response_deserializer=_identity,
        )(metadata=((_TOKEN_KEY, transport.token),))
        self._lock = asyncio.Lock()
        self.broken = False
        self.reader = asyncio.get_running_loop().create_task(self._read(), name=f"rpc-read-{address}")

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.call.read()
                if frame is grpc.aio.EOF:
                    break
                self._transport.on_reply(frame)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                log.error("peer %s refused our RPC token (STALWART_RPC_TOKEN differs?)", self.address)
            else:
                log.debug("stream to %s ended: %s", self.address, e.code())
        except Exception:
            log.exception("stream to %s failed", self.address)
        finally:
            self.broken = True
            self._transport.link_down(self)

    async def send(self, frame: OutFrame) -> None:
        async with self._lock:
            if self.broken:
                raise TransportError(f"stream to {self.address} is closed")
            try:
                await self.call.write(joined(frame))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as e:
                self.broken = True
                raise TransportError(f"cannot send to {self.address}: {e}") from None

    async def close(self) -> None:
        self.broken = True
        self.reader.cancel()
        with contextlib.suppress(BaseException):
            await self.reader
        await self.channel.close(grace=None)


class GrpcTransport:
    """Frames over gRPC bidirectional streams with a per-job token. All methods run on the agent's loop."""

    def __init__(self, token: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        check_token(token)
        self.token = token
        self._digest = hashlib.sha256(token.encode()).digest()
        opts = [("grpc.max_send_message_length", max_frame_bytes),
                ("grpc.max_receive_message_length", max_frame_bytes)]
        self.channel_options = [*opts, ("grpc.enable_retries", 0)]
        self._server_options = opts
        self._server: grpc.aio.Server | None = None
        self._clients: dict[str, _ClientSide] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._server_streams: set[_ServerSide] = set()
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

    def _authenticated(self, context: Any) -> bool:
        presented = ""
        for key, value in context.invocation_metadata() or ():
            if key == _TOKEN_KEY:
                presented = value if isinstance(value, str) else ""
        return hmac.compare_digest(hashlib.sha256(presented.encode()).digest(), self._digest)

    async def _serve(self, request_iterator: Any, context: Any) -> None:
        if not self._authenticated(context):
            log.warning("refused an unauthenticated RPC stream from %s", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated")
            return
        side = _ServerSide(context, context.peer())
        self._server_streams.add(side)
        assert self._on_request is not None
        try:
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    break
                self._on_request(frame, side)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("stream from %s ended: %s", side.peer, e)
        finally:
            side.open = False
            self._server_streams.discard(side)

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: a free port); returns the ``host:port`` peers reach us at."""
        server = grpc.aio.server(options=self._server_options)
        handler = grpc.stream_stream_rpc_method_handler(
            self._serve, request_deserializer=_identity, response_serializer=_identity)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, {"Stream": handler}),))
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise TransportError(f"cannot listen on {host}:{port}")
        await server.start()
        self._server = server
        self.address = f"{host}:{bound}"
        return self.address

    async def _client(self, address: str) -> _ClientSide:
        client = self._clients.get(address)
        if client is None or client.broken:
            client = _ClientSide(self, address)
            self._clients[address] = client
        return client

    async def send_request(self, address: str, frame: OutFrame, mtype: str) -> None:
        """Queue ``frame`` on the stream to ``address`` (opened on first use). Raises TransportError."""
        client = await self._client(address)
        await client.send(frame)

    async def send_reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None:
        await channel.send(frame)

    def send_request_nowait(self, address: str, frame: OutFrame) -> bool:
        return False  # every gRPC write is awaited

    def send_reply_nowait(self, channel: ReplyChannel, frame: OutFrame) -> bool:
        return False

    async def disconnect(self, address: str) -> None:
        """Close the stream to ``address`` (e.g. the peer died); the next send opens a new one."""
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()

    async def stop(self, grace: float) -> None:
        """Close every stream and the server (in-flight handlers get ``grace`` seconds)."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
