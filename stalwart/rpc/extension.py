"""How a protocol is layered on the RPC agent: the agent's public interface for it, and the hooks it serves.

The RRef runtime (:mod:`stalwart.rref`) is such a layer; RPC itself knows no layer by name. A layer:

* registers a factory with :func:`register_extension` (at its import); every agent created afterwards makes
  one instance of it, with the agent's :class:`RpcHost`;
* serves the request types it names in :attr:`RpcExtension.kinds` (:meth:`RpcExtension.on_request`);
* encodes the objects of its own that appear in payloads (``$r`` in :mod:`.codec`) and decodes them on
  arrival;
* hears of dead workers, and takes part in the agent's shutdown and leak report.

Every hook runs on the agent's loop thread. What a layer may call is :class:`RpcHost` and nothing else of
the agent: it is the only coupling between RPC and the layers above it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stalwart.api.rpc import Envelope, ErrorKind, MessageType, RRefWire
from stalwart.rpc.codec import Frame
from stalwart.rpc.membership import Worker, WorkerInfo
from stalwart.rpc.retry import RetryOptions
from stalwart.rpc.transport import ReplyChannel

if TYPE_CHECKING:
    from stalwart.rpc.shutdown import ShutdownReport

#: Completion of a request whose reply carries a value: ``(value, None)`` or ``(None, error)``.
OnResult = Callable[[Any, BaseException | None], None]
#: Completion of a control message: ``None`` once acknowledged, else why it failed.
OnAck = Callable[[BaseException | None], None]


@dataclass(frozen=True, slots=True)
class Incoming:
    """A received request handed to a layer; answer it exactly once through :class:`RpcHost`'s replies."""

    header: Envelope
    frame: Frame
    channel: ReplyChannel


@dataclass(frozen=True, slots=True)
class CallRequest:
    """A call that user code made (sent in the epoch it was made in, retried only when ``retry`` is set)."""

    mtype: MessageType
    worker: Worker
    fn: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float
    retry: RetryOptions | None
    rref: str | None = None
    fork: str | None = None


class RpcHost(Protocol):
    """What the agent offers the layers above it. Blocking methods are for user threads; the others for
    the agent's loop thread unless they say otherwise."""

    name: str
    incarnation: str
    default_timeout: float
    #: How the layers' messages are retried (the agent's ``control_retry``).
    control_retry: RetryOptions

    @property
    def stopped(self) -> bool:
        """From any thread: the agent has finished its graceful part and is being torn down."""

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run ``fn(*args)`` on the loop (nothing once the agent has stopped)."""

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """From a user thread: run ``coro`` on the loop and wait for its result."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` as a task of the agent (cancelled at shutdown)."""

    def poke(self) -> None:
        """Tell the agent's waits (shutdown) that something changed."""

    def check_call(self, timeout: float | None, retry: RetryOptions | None,
                   idempotent: bool) -> tuple[float, RetryOptions | None]:
        """From a user thread: validate a call's options; the timeout to use and the retry policy."""

    def function_name(self, fn: Callable[..., Any] | str) -> str:
        """The registered name of ``fn`` (UnknownFunction if it is not registered)."""

    def resolve(self, to: str | int | WorkerInfo) -> Worker:
        """The worker named or ranked ``to`` (UnknownWorker, or WorkerDied when it is known dead)."""

    def worker(self, name: str) -> Worker | None:
        """The worker ``name`` of the current view, if any."""

    def is_dead(self, name: str) -> bool: ...

    def worker_info(self, name: str) -> WorkerInfo:
        """From any thread: ``name``'s name and rank (rank -1 when it is not in the view)."""

    def start_call(self, request: CallRequest, on_done: OnResult) -> None:
        """Send a user call; ``on_done`` gets the decoded result or the error."""

    def send_request(self, worker: Worker, mtype: MessageType, *, timeout: float, retry: RetryOptions,
                     rref: str | None = None, fork: str | None = None, payload: Any = None,
                     on_done: OnResult) -> None:
        """Send a protocol request, stamped with the current epoch on every attempt and retried within
        ``retry``; ``on_done`` gets the decoded reply payload or the error."""

    def send_control(self, dst: str, kind: MessageType, rref: str, fork: str, on_done: OnAck | None = None) -> None:
        """Send a control message to ``dst`` (retried within the agent's ``control_retry``; waits a while
        for a worker missing from the view, then fails with WorkerDied)."""

    async def invoke(self, fn: str, args: Any, kwargs: Any) -> Any:
        """Run the registered function ``fn`` as a call would (on a worker thread unless it is async or
        inline)."""

    def decode_call(self, request: Incoming) -> tuple[str, list[Any], dict[str, Any]] | None:
        """The function name and arguments of a call-like request; None when it was answered with an error."""

    def reply_value(self, request: Incoming, value: Any) -> None: ...

    def reply_ok(self, request: Incoming) -> None: ...

    def reply_error(self, request: Incoming, kind: ErrorKind, message: str, type_name: str = "") -> None: ...


class RpcExtension(ABC):
    """A protocol layered on the agent. Hooks run on the agent's loop thread."""

    #: The request types this layer serves.
    kinds: frozenset[str] = frozenset()

    @abstractmethod
    def encode_ref(self, value: Any, dst: str, created: list[str]) -> RRefWire:
        """``value`` (one of this layer's objects) goes to ``dst`` in a payload: its wire form. Append to
        ``created`` what must be undone if the payload is never delivered (:meth:`undelivered`)."""

    @abstractmethod
    def decode_ref(self, wire: RRefWire) -> Any:
        """An object of this layer arrived in a payload: the receiver's object for it."""

    @abstractmethod
    def undelivered(self, created: list[str]) -> None:
        """A payload that encoded objects (``created``) was certainly not delivered."""

    @abstractmethod
    def on_request(self, request: Incoming) -> None:
        """Serve a request of one of :attr:`kinds`."""

    @abstractmethod
    def worker_gone(self, name: str, replaced: bool) -> None:
        """``name`` died (``replaced``: a newer incarnation of the name lives on)."""

    @abstractmethod
    def worker_back(self, name: str) -> None:
        """A new incarnation of ``name``, once dead, joined."""

    @abstractmethod
    def flush(self) -> None:
        """Take in the work other threads queued (called while the agent waits at shutdown)."""

    @abstractmethod
    def release_all(self, report: ShutdownReport) -> None:
        """Graceful shutdown, before the barrier: release what user code still holds, reporting it."""

    @abstractmethod
    def report(self, report: ShutdownReport) -> None:
        """The agent stops: put what is left (leaks) in ``report``."""

    @abstractmethod
    def close(self) -> None:
        """The agent stops (its pending calls have failed): wake every waiter."""

    @abstractmethod
    def summary(self) -> dict[str, Any]:
        """Plain-data state for ``debug_state``."""


ExtensionFactory = Callable[[RpcHost], RpcExtension]
_factories: list[ExtensionFactory] = []


def register_extension(factory: ExtensionFactory) -> None:
    """Make every agent created from now on host a layer built by ``factory`` (idempotent)."""
    if factory not in _factories:
        _factories.append(factory)


def extension_factories() -> list[ExtensionFactory]:
    return list(_factories)
