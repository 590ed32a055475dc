"""The Transport interface: what the agent needs from the network, and the types a transport speaks.

The one implementation is :class:`~.streams.StreamTransport` (length-prefixed frames over TCP; its
docstring says why not gRPC); fault injection (:mod:`.faults`) wraps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

#: Largest frame either side accepts (tensors bigger than this must be split). Just under 1 GiB: the stream
#: transport's length prefixes have 30 bits.
DEFAULT_MAX_FRAME_BYTES = 1023 * 1024 * 1024


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
    """What the agent needs from the network. :class:`~.streams.StreamTransport` is the real one; fault
    injection (:mod:`.faults`) wraps it."""

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
