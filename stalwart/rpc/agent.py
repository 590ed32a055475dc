"""The RPC agent: one per worker process. The imperative shell around the pure parts.

Threads: the agent runs one asyncio event loop on its own thread (``stalwart-rpc-<name>``); every piece of
state (pending calls, completion records, the RRef book, the timer heap) is touched only there. User threads
enter through ``call_soon_threadsafe`` and wait on :class:`RpcFuture`. Plain registered functions run on a
bounded pool of worker threads (``stalwart-rpc-<name>-worker``), coroutine functions and ``inline`` ones on
the loop. :meth:`RpcAgent.shutdown` stops all of them.

Retries and timeouts: every pending call has its deadline, and every call that may be retried its
per-attempt timeout and next-attempt time, as entries of ONE :class:`~.timers.TimerHeap`, served by one
loop callback armed for the earliest entry. User calls are retried only when the caller says they are
idempotent; the RRef protocol's control messages always are (``CONTROL_RETRY``). A reply that finds no pending
call (it came after its call's deadline, or is a duplicate) is dropped.

Fencing: each message carries the sender's round epoch; a request from another epoch is answered
``stale_epoch``/``epoch_ahead`` and never run. Control messages are stamped with the current epoch on every
attempt (they stay valid across rounds between surviving workers); a user call keeps the epoch it was made in.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import random
import secrets
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stalwart.api.rpc import Envelope, ErrorInfo, ErrorKind, MessageType, RRefWire, check_worker_name
from stalwart.rpc import errors as E
from stalwart.rpc.codec import (
    Blobs,
    Frame,
    decode_frame,
    decode_payload,
    encode_frame,
    encode_payload,
    header_json,
)
from stalwart.rpc.dedup import CompletionTable, Verdict
from stalwart.rpc.membership import (
    Membership,
    MembershipEvent,
    MembershipView,
    ViewChanged,
    Worker,
    WorkerInfo,
    WorkerLeft,
)
from stalwart.rpc.registry import REGISTRY, Registered, Registry
from stalwart.rpc.retry import CONTROL_RETRY, RetryOptions, backoff_delay
from stalwart.rpc.streams import StreamTransport
from stalwart.rpc.timers import Timer, TimerHeap
from stalwart.rpc.transport import OutFrame, ReplyChannel, Transport, joined
from stalwart.rref.book import Control, RRefBook
from stalwart.rref.handle import OwnerRRef, RRef, UserRRef

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0
#: Where the job's RPC token comes from (the job's Secret, through the pod's environment).
TOKEN_ENV = "STALWART_RPC_TOKEN"


class RpcFuture(concurrent.futures.Future[T]):
    """The result of :meth:`RpcAgent.rpc_async`; ``wait()`` is ``result()`` (as in torch)."""

    def wait(self, timeout: float | None = None) -> T:
        return self.result(timeout)


@dataclass(eq=False, slots=True)
class _Call:
    """One outgoing request while it is pending (retries included)."""

    id: int
    dst: str
    address: str
    mtype: MessageType
    deadline: float
    retry: RetryOptions | None
    restamp: bool  # stamp the current epoch on every attempt (control messages)
    epoch: int
    on_done: Callable[[Frame | None, BaseException | None], None]
    fn: str | None = None
    rref: str | None = None
    fork: str | None = None
    payload: Any = None
    blobs: Blobs | None = None
    user: bool = False
    attempt: int = 0
    finished: bool = False
    last_error: BaseException | None = None
    deadline_timer: Timer | None = None
    attempt_timer: Timer | None = None
    retry_timer: Timer | None = None
    forks_created: list[str] = field(default_factory=list)
    started: float = 0.0
    inc: str = ""  # the incarnation of ``dst`` it was sent to


@dataclass(frozen=True, slots=True)
class _UserRequest:
    mtype: MessageType
    member: Worker
    fn: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float
    retry: RetryOptions | None
    fut: RpcFuture[Any]
    handle: RRef[Any] | None


@dataclass
class ShutdownReport:
    """What :meth:`RpcAgent.shutdown` found. ``clean`` when nothing leaked and every step finished in time."""

    graceful: bool
    timed_out: list[str] = field(default_factory=list)  # the drain steps that ran out of time
    pending_calls: list[str] = field(default_factory=list)  # calls still pending when the agent stopped
    leaked_user_rrefs: list[str] = field(default_factory=list)  # handles user code still held
    leaked_owner_rrefs: dict[str, list[str]] = field(default_factory=dict)  # values still referenced
    parked_deletes: dict[str, list[str]] = field(default_factory=dict)
    pending_children: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.timed_out or self.pending_calls or self.leaked_user_rrefs or self.leaked_owner_rrefs
                    or self.parked_deletes or self.pending_children)


class RpcAgent:
    """An RPC endpoint named ``name`` in a job. Create, :meth:`start`, :meth:`join` a membership, then call.

    ``token`` defaults to ``$STALWART_RPC_TOKEN``. ``transport`` lets tests wrap the real one (fault
    injection). ``control_retry`` governs the RRef protocol's messages.
    """

    def __init__(self, name: str, rank: int, *, token: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, registry: Registry = REGISTRY, num_worker_threads: int = 8,
                 default_timeout: float = DEFAULT_TIMEOUT, control_retry: RetryOptions = CONTROL_RETRY,
                 transport: Transport | None = None, seed: int | None = None) -> None:
        check_worker_name(name)
        if rank < 0:
            raise ValueError(f"rank: must be >= 0, got {rank}")
        if num_worker_threads < 1:
            raise ValueError(f"num_worker_threads: must be >= 1, got {num_worker_threads}")
        if not default_timeout > 0:
            raise ValueError(f"default_timeout: must be > 0, got {default_timeout}")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if transport is None:
            if not token:
                raise ValueError(f"token: no RPC token given and ${TOKEN_ENV} is not set")
            transport = StreamTransport(token)
        self.name = name
        self.rank = rank
        self.incarnation = secrets.token_hex(8)
        self.address = ""
        self._host, self._port = host, port
        self._registry = registry
        self._default_timeout = default_timeout
        self._control_retry = control_retry
        self._transport = transport
        self._rng = random.Random(seed)
        self._next_id = 1
        self._rref_seq = 0
        self._id_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"stalwart-rpc-{name}", daemon=True)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_worker_threads, thread_name_prefix=f"stalwart-rpc-{name}-worker")
        # loop-thread state
        self._pending: dict[int, _Call] = {}
        self._timers = TimerHeap()
        self._armed: asyncio.TimerHandle | None = None
        self._armed_at: float | None = None
        self._dedup: CompletionTable[bytes] = CompletionTable()
        self._dup_waiters: dict[tuple[str, str, int], list[ReplyChannel]] = {}
        self._book = RRefBook(name)
        self._value_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._releases: collections.deque[RRef[Any]] = collections.deque()
        self._fork_parents: dict[str, str] = {}  # fork id -> parent, for forks awaiting the owner's ack
        self._creation_errors: dict[str, BaseException] = {}  # fork id -> why its remote() failed
        self._done_from: set[str] = set()
        self._progress: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._incoming = 0
        self._view = MembershipView(0)
        self._epoch = 0
        self._dead: dict[str, str] = {}  # name -> incarnation it died in ("" when unknown)
        self._membership: Membership | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._accepting = False
        self._started = False
        self._stopped = False

    # -- lifecycle --------------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop from a user thread and wait for it."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("blocking RPC API called on the agent's own event loop; use rpc_async from "
                               "coroutine functions")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> str:
        """Start the loop and listen; returns the ``host:port`` address to publish."""
        if self._started:
            raise RuntimeError("agent already started")
        self._started = True
        self._thread.start()

        async def boot() -> str:
            self._progress = asyncio.Event()
            self._transport.set_handlers(self._on_request, self._on_reply, self._on_link_down)
            return await self._transport.start(self._host, self._port)

        self.address = self._run(boot(), timeout=30)
        return self.address

    @property
    def member(self) -> Worker:
        """This worker as a membership entry (after :meth:`start`)."""
        return Worker(self.name, self.rank, self.address, self.incarnation)

    def join(self, membership: Membership) -> None:
        """Follow ``membership`` (view, epochs, deaths) and start taking calls."""
        if not self.address:
            raise RuntimeError("start() the agent before join()")
        self._membership = membership
        # subscribe first: a change between reading the view and subscribing would otherwise be missed
        self._unsubscribe = membership.subscribe(self._membership_event)
        self._loop.call_soon_threadsafe(self._apply_event, ViewChanged(membership.view()))
        self._accepting = True
        self._run(self._noop())

    def _membership_event(self, event: MembershipEvent) -> None:
        """From the membership's thread: hand the event to the loop."""
        if not self._stopped:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._apply_event, event)

    async def _noop(self) -> None:
        return None

    # -- public API -------------------------------------------------------------------------------------

    def worker_info(self, to: str | int | WorkerInfo | None = None) -> WorkerInfo:
        """This worker's info, or that of the worker named/ranked ``to``."""
        if to is None:
            return WorkerInfo(self.name, self.rank)
        return self._resolve(to).info

    def _worker_info(self, name: str) -> WorkerInfo:
        m = self._view.members.get(name)
        if m is not None:
            return m.info
        if name == self.name:
            return WorkerInfo(self.name, self.rank)
        return WorkerInfo(name, -1)

    def _resolve(self, to: str | int | WorkerInfo) -> Worker:
        view = self._view
        if isinstance(to, WorkerInfo):
            to = to.name
        if isinstance(to, int):
            m = view.by_rank(to)
            if m is None:
                raise E.UnknownWorker(f"to: no worker of rank {to} in round {view.epoch}")
            return m
        m = view.members.get(to)
        if m is None and self._membership is not None:
            m = self._membership.view().members.get(to)  # newer than ours until the loop applies it
        if m is None:
            if to in self._dead:
                raise E.WorkerDied(to)
            raise E.UnknownWorker(f"to: no worker named {to!r} in round {view.epoch}: {sorted(view.members)}")
        return m

    def _check_call(self, timeout: float | None, retry: RetryOptions | None, idempotent: bool) -> float:
        if not self._accepting:
            raise E.RpcShutdown(f"agent {self.name} is not running (not joined, or shut down)")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        if retry is not None and not idempotent:
            raise ValueError("retry: user calls are retried only when marked idempotent=True")
        if retry is not None and not isinstance(retry, RetryOptions):
            raise TypeError(f"retry: expected RetryOptions, got {type(retry).__name__}")
        return timeout if timeout is not None else self._default_timeout

    def rpc_async(self, to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
                  idempotent: bool = False, retry: RetryOptions | None = None) -> RpcFuture[Any]:
        """Call the registered function ``fn`` on worker ``to``; a future of its result.

        ``idempotent=True`` allows retries (``retry``, default :class:`RetryOptions` ()); without it a call
        is sent once and fails with the first transport error. Errors: :class:`~.errors.RemoteError` (the
        function raised), :class:`~.errors.RpcTimeout`, :class:`~.errors.WorkerDied`,
        :class:`~.errors.StaleEpoch`, :class:`~.errors.UnknownFunction`, :class:`~.errors.PayloadError`.

        Tensors in ``args`` are sent from their own memory, not copied first (a retry sends them again): do
        not change them in place until the future is done. On the receiving side, a tensor of 64 KiB or more
        is a view of its message's buffer (which stays alive with it), not a copy.
        """
        t = self._check_call(timeout, retry, idempotent)
        if idempotent and retry is None:
            retry = RetryOptions()
        name = self._registry.name_of(fn)
        member = self._resolve(to)
        fut: RpcFuture[Any] = RpcFuture()
        self._loop.call_soon_threadsafe(self._start_user_call, _UserRequest(
            "call", member, name, args, kwargs or {}, t, retry, fut, None))
        return fut

    def rpc_sync(self, to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
                 idempotent: bool = False, retry: RetryOptions | None = None) -> Any:
        """:meth:`rpc_async` and wait for the result."""
        return self.rpc_async(to, fn, args, kwargs, timeout=timeout, idempotent=idempotent,
                              retry=retry).result()

    def remote(self, to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
               idempotent: bool = False, retry: RetryOptions | None = None) -> RRef[Any]:
        """Run ``fn`` on ``to`` and keep the result there; returns an RRef to it at once.

        The creation request is a user call (retried only if ``idempotent``); a failure of the call or of the
        function surfaces from ``to_here`` as :class:`~.errors.RRefCreationFailed`.
        """
        t = self._check_call(timeout, retry, idempotent)
        if idempotent and retry is None:
            retry = RetryOptions()
        name = self._registry.name_of(fn)
        member = self._resolve(to)
        rref_id = self._new_id()
        if member.name == self.name:
            handle: RRef[Any] = OwnerRRef(self, rref_id, None, self.name)
        else:
            handle = UserRRef(self, rref_id, self._new_id(), member.name)
        fut: RpcFuture[Any] = RpcFuture()
        self._loop.call_soon_threadsafe(self._start_user_call, _UserRequest(
            "remote", member, name, args, kwargs or {}, t, retry, fut, handle))
        return handle

    def _new_id(self) -> str:
        with self._id_lock:  # user threads (remote) and the loop (forks) both allocate
            self._rref_seq += 1
            return f"{self.name}:{self.incarnation}:{self._rref_seq}"

    # -- the timer heap -----------------------------------------------------------------------------------

    def _schedule(self, due: float, action: Callable[[], Any]) -> Timer:
        timer = self._timers.schedule(due, action)
        if self._armed_at is None or due < self._armed_at:
            if self._armed is not None:
                self._armed.cancel()
            self._armed_at = due
            self._armed = self._loop.call_at(due, self._fire)
        return timer

    def _fire(self) -> None:
        self._armed, self._armed_at = None, None
        for action in self._timers.pop_due(self._loop.time()):
            try:
                action()
            except Exception:
                log.exception("%s: scheduled action failed", self.name)
        due = self._timers.next_due()
        if due is not None and self._armed is None:
            self._armed_at = due
            self._armed = self._loop.call_at(due, self._fire)

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` as a task of ours (shutdown cancels what is left of them, and only them)."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _cancel(self, timer: Timer | None) -> None:
        if timer is not None:
            self._timers.cancel(timer)

    # -- outgoing calls (loop thread) -------------------------------------------------------------------

    def _rref_encoder(self, dst: str, created: list[str]) -> Callable[[Any], RRefWire]:
        def encode(handle: Any) -> RRefWire:
            if not isinstance(handle, RRef) or handle._agent is not self:
                raise E.PayloadError("an RRef of another agent cannot be sent")
            if handle.released:
                raise E.RRefDeleted(f"RRef {handle.rref_id} was released; it cannot be sent")
            fork = self._new_id()
            parent = self._book.fork_for(dst, handle.rref_id, handle.owner_name, fork, handle,
                                         own_fork=None if handle.owner_name == self.name else handle.fork_id)
            created.append(fork)
            return RRefWire(owner=handle.owner_name, rref=handle.rref_id, fork=fork, parent=parent)

        return encode

    def _start_user_call(self, req: _UserRequest) -> None:
        mtype, member, fn, args, kwargs = req.mtype, req.member, req.fn, req.args, req.kwargs
        timeout, retry, fut, handle = req.timeout, req.retry, req.fut, req.handle
        now = self._loop.time()
        if handle is not None and member.name == self.name:
            self._create_local(handle, fn, args, kwargs)
            return
        created: list[str] = []

        def done(frame: Frame | None, exc: BaseException | None) -> None:
            if exc is not None:
                if handle is not None:
                    self._creation_failed(handle, exc)
                if isinstance(exc, E.TransportError | E.PayloadError) and call.attempt <= 1:
                    for fork in created:
                        controls, freed = self._book.fork_abandoned(fork)
                        self._send_controls(controls)
                        self._wake_values(freed)
                if not fut.done():
                    fut.set_exception(exc)
                return
            assert frame is not None
            try:
                value = decode_payload(frame.header.payload, frame, self._rref_decoder)
            except E.RpcError as e:
                fut.set_exception(e)
                return
            if handle is not None and handle.fork_id is not None:
                rec = self._book.users.get(handle.fork_id)
                if rec is not None:
                    rec.confirmed = True
            fut.set_result(value)

        call = _Call(id=self._alloc_id(), dst=member.name, address=member.address, mtype=mtype,
                     deadline=now + timeout, retry=retry, restamp=False, epoch=self._epoch, on_done=done,
                     fn=fn, user=True, started=now, inc=member.incarnation)
        if handle is not None:
            call.rref, call.fork = handle.rref_id, handle.fork_id
            assert handle.fork_id is not None
            self._book.new_user(handle.fork_id, handle.rref_id, member.name, self.name, confirmed=False)
        if member.name in self._dead:
            done(None, E.WorkerDied(member.name))
            return
        try:
            blobs = Blobs()
            encoder = self._rref_encoder(member.name, created)
            call.payload = {"a": encode_payload(list(args), blobs, encoder, "args"),
                            "k": encode_payload(kwargs, blobs, encoder, "kwargs")}
            call.blobs = blobs
        except E.RpcError as e:
            done(None, e)
            return
        except Exception as e:
            done(None, E.PayloadError(f"cannot encode the arguments: {e}"))
            return
        call.forks_created = created
        self._launch(call)

    def _launch(self, call: _Call) -> None:
        self._pending[call.id] = call
        call.deadline_timer = self._schedule(call.deadline, lambda: self._expire(call))
        self._attempt(call)

    def _alloc_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _low_water(self) -> int:
        """Every request id below this is finished here (pending ids are in increasing insertion order)."""
        for cid in self._pending:
            return cid
        return self._next_id

    def _attempt(self, call: _Call) -> None:
        if call.finished:
            return
        call.attempt += 1
        n = call.attempt
        call.retry_timer = None
        header = header_json(
            kind="req", type=call.mtype, id=call.id, src=self.name, inc=self.incarnation,
            epoch=self._epoch if call.restamp else call.epoch, ack=self._low_water(), fn=call.fn,
            rref=call.rref, fork=call.fork, payload=call.payload,
            blobs=call.blobs.meta if call.blobs is not None else None)
        try:
            frame = encode_frame(header, call.blobs)
        except E.RpcError as e:
            self._finish(call, None, e)
            return
        if call.retry is not None and call.retry.attempt_timeout is not None:
            call.attempt_timer = self._schedule(
                self._loop.time() + call.retry.attempt_timeout,
                lambda: self._attempt_failed(call, n, E.RpcTimeout(
                    f"no reply from {call.dst} within attempt_timeout={call.retry.attempt_timeout}s"
                    if call.retry else "no reply")))
        try:
            if self._transport.send_request_nowait(call.address, frame):
                return
        except E.RpcError as e:
            self._attempt_failed(call, n, e)
            return
        self._spawn(self._send(call, n, frame))

    async def _send(self, call: _Call, n: int, frame: OutFrame) -> None:
        try:
            await self._transport.send_request(call.address, frame, call.mtype)
        except E.RpcError as e:
            self._attempt_failed(call, n, e)
        except Exception as e:
            log.exception("%s: sending to %s failed", self.name, call.dst)
            self._attempt_failed(call, n, E.TransportError(str(e)))

    def _attempt_failed(self, call: _Call, n: int, err: BaseException) -> None:
        if call.finished or n != call.attempt or call.retry_timer is not None:
            return
        self._cancel(call.attempt_timer)
        call.attempt_timer = None
        call.last_error = err
        retry = call.retry
        if retry is not None and call.attempt <= retry.max_retries:
            now = self._loop.time()
            due = now + backoff_delay(retry, call.attempt, self._rng)
            if due < call.deadline and due < call.started + retry.deadline:
                call.retry_timer = self._schedule(due, lambda: self._attempt(call))
                return
        self._finish(call, None, err)

    def _expire(self, call: _Call) -> None:
        if call.finished:
            return
        waited = self._loop.time() - call.started
        last = f"; last error: {call.last_error}" if call.last_error else ""
        self._finish(call, None, E.RpcTimeout(
            f"{call.mtype} {call.fn or call.rref or ''} to {call.dst} timed out after {waited:.3g}s "
            f"({call.attempt} attempt(s){last})"))

    def _finish(self, call: _Call, frame: Frame | None, exc: BaseException | None) -> None:
        if call.finished:
            return
        call.finished = True
        self._pending.pop(call.id, None)
        self._cancel(call.deadline_timer)
        self._cancel(call.attempt_timer)
        self._cancel(call.retry_timer)
        call.blobs = None
        try:
            call.on_done(frame, exc)
        except Exception:
            log.exception("%s: completion of %s to %s failed", self.name, call.mtype, call.dst)
        self._poke()

    def _poke(self) -> None:
        if self._progress is not None:
            self._progress.set()

    def _on_link_down(self, address: str) -> None:
        for call in list(self._pending.values()):
            if call.address == address and call.retry_timer is None and not call.finished:
                self._attempt_failed(call, call.attempt, E.TransportError(f"stream to {call.dst} broke"))

    def _on_reply(self, data: bytes | bytearray) -> None:
        try:
            frame = decode_frame(data)
        except E.PayloadError as e:
            log.warning("%s: dropped a malformed reply: %s", self.name, e)
            return
        h = frame.header
        call = self._pending.get(h.id)
        if h.kind != "rep" or call is None or call.dst != h.src or call.mtype != h.type:
            log.debug("%s: dropped a late or unmatched reply %s/%s from %s", self.name, h.type, h.id, h.src)
            return
        if h.err is not None:
            kind = h.err.kind
            if kind == "expired":
                return
            retryable = call.retry is not None and (kind == "epoch_ahead" or (kind == "stale_epoch"
                                                                               and call.restamp))
            err = E.error_from_info(call.dst, h.err)
            if retryable:
                self._attempt_failed(call, call.attempt, err)
            else:
                self._finish(call, None, err)
            return
        self._finish(call, frame, None)

    # -- control messages (the RRef protocol) -------------------------------------------------------------

    def _send_control(self, c: Control, waited: tuple[float, int] | None = None) -> None:
        """Send one RRef control message (retried within ``control_retry``). ``waited``: when and how often
        it already found ``c.dst`` missing from the view."""
        member = self._view.members.get(c.dst)
        if member is None and c.dst not in self._dead and self._membership is not None:
            member = self._membership.view().members.get(c.dst)  # newer than ours until the loop applies it

        def done(frame: Frame | None, exc: BaseException | None) -> None:
            if exc is None:
                if c.kind == "fork":
                    rec = self._book.users.get(c.fork)
                    parent = rec.parent if rec is not None else self._fork_parents.pop(c.fork, "")
                    self._fork_parents.pop(c.fork, None)
                    for follow in self._book.fork_confirmed(c.fork, c.rref, parent):
                        self._send_control(follow)
                return
            if not isinstance(exc, E.WorkerDied):
                log.warning("%s: RRef %s %s of %s to %s failed: %s", self.name, c.kind, c.fork, c.rref, c.dst,
                            exc)
            if c.kind == "fork":  # never confirmed: the parent must not wait for it forever
                parent = self._fork_parents.pop(c.fork, "")
                if parent:
                    self._send_controls(self._book.accepted_by_child(c.fork, parent, c.rref))

        if c.dst in self._dead:
            return
        if member is None:
            # Missing from the view: the view may be mid-update (a round change), or the worker is gone and
            # its WorkerLeft has not arrived. Neither may lose the message (a parent would wait for this
            # fork's confirmation forever): try again with backoff, and fail it once the retry deadline passed.
            now = self._loop.time()
            first, tries = waited if waited is not None else (now, 0)
            retry = self._control_retry
            due = now + backoff_delay(retry, tries + 1, self._rng)
            if due < first + retry.deadline:
                self._schedule(due, lambda: self._send_control(c, (first, tries + 1)))
                return
            log.warning("%s: cannot send %s to %s: not in the current round", self.name, c.kind, c.dst)
            done(None, E.WorkerDied(c.dst, "not in the current round"))
            return
        now = self._loop.time()
        retry = self._control_retry
        call = _Call(id=self._alloc_id(), dst=c.dst, address=member.address, mtype=c.kind,
                     deadline=now + retry.deadline, retry=retry, restamp=True, epoch=self._epoch, on_done=done,
                     rref=c.rref, fork=c.fork, started=now, inc=member.incarnation)
        self._launch(call)

    def _send_controls(self, controls: list[Control]) -> None:
        for c in controls:
            self._send_control(c)

    def _rref_decoder(self, wire: RRefWire) -> RRef[Any]:
        rec, controls = self._book.received(wire.rref, wire.fork, wire.owner, wire.parent)
        if rec is not None:
            # remembered in case the handle is released before the owner confirms the fork
            self._fork_parents[wire.fork] = wire.parent
        self._send_controls(controls)
        if wire.owner == self.name:
            return OwnerRRef(self, wire.rref, None, self.name)
        return UserRRef(self, wire.rref, wire.fork, wire.owner)

    def _rref_release(self, handle: RRef[Any]) -> None:
        """From any thread (also a finalizer): queue the release for the loop."""
        if self._stopped or handle._agent is not self:
            return
        self._releases.append(handle)
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(self._drain_releases)

    def _drain_releases(self) -> None:
        while self._releases:
            handle = self._releases.popleft()
            if handle.owner_name == self.name:
                freed = self._book.handle_dropped(handle.rref_id)
                self._wake_values(freed)
            elif handle.fork_id is not None:
                self._send_controls(self._book.released(handle.fork_id))
        self._poke()

    def _rref_confirmed(self, handle: RRef[Any]) -> bool:
        if handle.owner_name == self.name or handle.fork_id is None:
            return True
        rec = self._book.users.get(handle.fork_id)
        return bool(rec is not None and rec.confirmed)

    def _creation_failed(self, handle: RRef[Any], exc: BaseException) -> None:
        if handle.fork_id is None:
            return
        self._creation_errors[handle.fork_id] = exc
        never_ran = isinstance(exc, E.TransportError | E.PayloadError | E.UnknownFunction | E.StaleEpoch
                               | E.EpochAhead | E.RpcShutdown)
        if never_ran:
            # the owner never counted this fork: releasing the handle must not send a delete
            self._book.users.pop(handle.fork_id, None)

    def _create_local(self, handle: RRef[Any], fn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._book.handle_added(handle.rref_id)
        self._book.create(handle.rref_id, None, self.name)
        self._spawn(self._compute(handle.rref_id, fn, args, kwargs))

    async def _compute(self, rref: str, fn: str, args: Any, kwargs: Any) -> None:
        try:
            value = await self._invoke(fn, args, kwargs)
        except BaseException as e:
            self._book.set_error(rref, "rref_failed", f"{type(e).__name__}: {e}")
        else:
            self._book.set_value(rref, value)
        self._wake_values([rref])

    def _wake_values(self, rrefs: list[str]) -> None:
        for r in rrefs:
            for fut in self._value_waiters.pop(r, []):
                if not fut.done():
                    fut.set_result(None)

    async def _await_value(self, rref: str, limit: float) -> Any:
        """The owner's value of ``rref`` once computed; raises the typed error otherwise."""
        deadline = self._loop.time() + limit
        while True:
            rec = self._book.owners.get(rref)
            if rec is None and rref in self._book.freed:
                raise E.RRefDeleted(f"RRef {rref} was deleted on its owner {self.name}")
            if rec is not None and rec.state == "ready":
                return rec.value
            if rec is not None and rec.state == "failed":
                assert rec.error is not None
                raise E.RRefCreationFailed(f"RRef {rref} on {self.name}: {rec.error[1]}")
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                raise E.RpcTimeout(f"RRef {rref}: value not ready on {self.name} within {limit}s")
            fut: asyncio.Future[None] = self._loop.create_future()
            self._value_waiters.setdefault(rref, []).append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)

    def _rref_to_here(self, handle: RRef[Any], timeout: float | None) -> Any:
        t = timeout if timeout is not None else self._default_timeout
        if handle.owner_name == self.name:
            return self._run(self._await_value(handle.rref_id, t))
        fut: RpcFuture[Any] = RpcFuture()
        self._loop.call_soon_threadsafe(self._start_fetch, handle, t, fut)
        return fut.result()

    def _start_fetch(self, handle: RRef[Any], timeout: float, fut: RpcFuture[Any]) -> None:
        assert handle.fork_id is not None
        err = self._creation_errors.get(handle.fork_id)
        if err is not None:
            fut.set_exception(E.RRefCreationFailed(f"creating RRef {handle.rref_id} failed: {err}"))
            return
        rec = self._book.users.get(handle.fork_id)
        if handle.owner_name in self._dead or (rec is not None and rec.owner_dead):
            fut.set_exception(E.OwnerDied(handle.owner_name, f"it owned RRef {handle.rref_id}"))
            return
        member = self._view.members.get(handle.owner_name)
        if member is None:
            fut.set_exception(E.OwnerDied(handle.owner_name, "not in the current round"))
            return

        def done(frame: Frame | None, exc: BaseException | None) -> None:
            if exc is not None:
                if isinstance(exc, E.WorkerDied) and not isinstance(exc, E.OwnerDied):
                    exc = E.OwnerDied(handle.owner_name, f"it owned RRef {handle.rref_id}")
                fut.set_exception(exc)
                return
            assert frame is not None
            try:
                fut.set_result(decode_payload(frame.header.payload, frame, self._rref_decoder))
            except E.RpcError as e:
                fut.set_exception(e)

        now = self._loop.time()
        retry = self._control_retry.model_copy(update={"deadline": max(timeout, 0.001),
                                                       "attempt_timeout": None})
        call = _Call(id=self._alloc_id(), dst=member.name, address=member.address, mtype="fetch",
                     deadline=now + timeout, retry=retry, restamp=True, epoch=self._epoch, on_done=done,
                     rref=handle.rref_id, fork=handle.fork_id, payload={"timeout": timeout}, started=now,
                     inc=member.incarnation)
        self._launch(call)

    # -- incoming requests (loop thread) ----------------------------------------------------------------

    def _on_request(self, data: bytes | bytearray, channel: ReplyChannel) -> None:
        try:
            frame = decode_frame(data)
        except E.PayloadError as e:
            log.warning("%s: dropped a malformed request from %s: %s", self.name, channel.peer, e)
            return
        h = frame.header
        if h.kind != "req":
            return
        if h.epoch != self._epoch:
            kind: ErrorKind = "stale_epoch" if h.epoch < self._epoch else "epoch_ahead"
            self._send_reply(h, channel, ErrorInfo(
                kind=kind, message=f"message of epoch {h.epoch}, {self.name} is in epoch {self._epoch}"), record=False)
            return
        if h.src in self._dead and self._dead[h.src] in ("", h.inc):
            self._send_reply(h, channel, ErrorInfo(
                kind="stale_epoch", message=f"{h.src} is dead to {self.name}"), record=False)
            return
        sender = (h.src, h.inc)
        verdict, stored = self._dedup.admit(sender, h.id, h.ack)
        if verdict == Verdict.NEW:
            self._incoming += 1
            try:
                self._dispatch(frame, channel)
            except Exception as e:
                log.exception("%s: handling %s from %s failed", self.name, h.type, h.src)
                self._reply_error(h, channel, "bad_request", str(e))
        elif verdict == Verdict.RUNNING:
            self._dup_waiters.setdefault((h.src, h.inc, h.id), []).append(channel)
        elif verdict == Verdict.DONE:
            assert stored is not None
            self._reply(channel, stored, h.type)
        else:
            self._send_reply(h, channel, ErrorInfo(kind="expired", message="duplicate of a finished "
                                                         "request"), record=False)

    def _reply_error(self, h: Envelope, channel: ReplyChannel, kind: ErrorKind, message: str, *,
                     tb: str = "", type_name: str = "") -> None:
        self._send_reply(h, channel, ErrorInfo(kind=kind, message=message[:60000], traceback=tb[:250000],
                                               type=type_name[:250]), record=True)

    def _send_reply(self, h: Envelope, channel: ReplyChannel, err: ErrorInfo | None, *,
                    record: bool, blobs: Blobs | None = None, payload: Any = None) -> None:
        header = header_json(
            kind="rep", type=h.type, id=h.id, src=self.name, inc=self.incarnation, epoch=self._epoch, err=err,
            payload=payload, blobs=blobs.meta if blobs is not None else None)
        frame: OutFrame = encode_frame(header, blobs)
        if record:
            frame = joined(frame)  # the completion record must not follow later changes of a result tensor
            self._incoming -= 1
            self._dedup.complete((h.src, h.inc), h.id, frame)
            waiters = self._dup_waiters.pop((h.src, h.inc, h.id), [])
            self._poke()
        else:
            waiters = []
        for ch in [channel, *waiters]:
            self._reply(ch, frame, h.type)

    def _reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None:
        if not self._transport.send_reply_nowait(channel, frame):
            self._spawn(self._transport.send_reply(channel, frame, mtype))

    def _reply_value(self, h: Envelope, channel: ReplyChannel, value: Any) -> None:
        blobs = Blobs()
        try:
            payload = encode_payload(value, blobs, self._rref_encoder(h.src, []), "result")
        except E.RpcError as e:
            self._reply_error(h, channel, "remote", str(e), type_name=type(e).__name__)
            return
        except Exception as e:
            self._reply_error(h, channel, "remote", f"cannot encode the result: {e}", type_name="PayloadError")
            return
        self._send_reply(h, channel, None, record=True, blobs=blobs, payload=payload)

    def _dispatch(self, frame: Frame, channel: ReplyChannel) -> None:
        h = frame.header
        match h.type:
            case "call" | "remote":
                try:
                    entry = self._registry.lookup(h.fn or "")
                except E.UnknownFunction as e:
                    self._reply_error(h, channel, "unknown_function", str(e))
                    return
                try:
                    payload = decode_payload(h.payload, frame, self._rref_decoder, "args")
                    if not (isinstance(payload, dict) and isinstance(payload.get("a"), list)
                            and isinstance(payload.get("k"), dict)):
                        raise E.PayloadError("args: expected {'a': [...], 'k': {...}}")
                except E.PayloadError as e:
                    self._reply_error(h, channel, "bad_request", str(e))
                    return
                if h.type == "call":
                    self._start_call(h, channel, entry, payload["a"], payload["k"])
                    return
                if h.rref is None or h.fork is None:
                    self._reply_error(h, channel, "bad_request", "remote needs rref and fork")
                    return
                if self._book.create(h.rref, h.fork, h.src):
                    self._wake_values([h.rref])  # its creator already let go of it: nothing to compute
                else:
                    self._spawn(self._compute(h.rref, entry.name, payload["a"], payload["k"]))
                self._send_reply(h, channel, None, record=True)
            case "fetch":
                timeout = h.payload.get("timeout") if isinstance(h.payload, dict) else None
                if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
                    self._reply_error(h, channel, "bad_request", "fetch: payload.timeout must be in (0, 86400]")
                    return
                self._spawn(self._run_fetch(h, channel, h.rref or "", float(timeout)))
            case "fork":
                ok = self._book.fork_request(h.rref or "", h.fork or "", h.src)
                if ok:
                    self._send_reply(h, channel, None, record=True)
                else:
                    self._reply_error(h, channel, "rref_deleted", f"RRef {h.rref} is already deleted")
            case "accept":
                controls, freed = self._book.child_accepted(h.fork or "")
                self._send_controls(controls)
                self._wake_values(freed)
                self._send_reply(h, channel, None, record=True)
            case "delete":
                self._wake_values(self._book.delete_request(h.rref or "", h.fork or "", h.src))
                self._send_reply(h, channel, None, record=True)
            case "done":
                self._done_from.add(h.src)
                self._send_reply(h, channel, None, record=True)

    async def _invoke(self, fn: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        entry = self._registry.lookup(fn)
        if entry.is_async:
            return await entry.fn(*args, **kwargs)
        if entry.inline:
            return entry.fn(*args, **kwargs)
        return await self._loop.run_in_executor(self._executor, lambda: entry.fn(*args, **kwargs))

    def _start_call(self, h: Envelope, channel: ReplyChannel, entry: Registered, args: list[Any],
                    kwargs: dict[str, Any]) -> None:
        """Run a called function: a coroutine function as a task, an inline one now, any other on a worker
        thread whose completion comes back to the loop as one callback (no task, no asyncio future)."""
        if entry.is_async:
            self._spawn(self._run_call(h, channel, entry.name, args, kwargs))
            return
        if entry.inline:
            try:
                value = entry.fn(*args, **kwargs)
            except Exception as e:
                self._reply_error(h, channel, "remote", f"{e}", tb=traceback.format_exc(),
                                  type_name=type(e).__name__)
                return
            del args, kwargs
            self._reply_value(h, channel, value)
            return
        fn = entry.fn

        def work() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:  # release argument handles before the reply (their deletes may go out first)
                args.clear()
                kwargs.clear()

        def finished(f: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the agent is gone
                self._loop.call_soon_threadsafe(self._call_finished, h, channel, f)

        try:
            self._executor.submit(work).add_done_callback(finished)
        except RuntimeError as e:  # the worker threads are shut down
            self._reply_error(h, channel, "remote", f"{e}", type_name="RpcShutdown")

    def _call_finished(self, h: Envelope, channel: ReplyChannel, f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            self._reply_error(h, channel, "remote", "the call was cancelled by shutdown", type_name="RpcShutdown")
            return
        e = f.exception()
        if e is not None:
            self._reply_error(h, channel, "remote", f"{e}", tb="".join(traceback.format_exception(e)),
                              type_name=type(e).__name__)
            return
        self._reply_value(h, channel, f.result())

    async def _run_call(self, h: Envelope, channel: ReplyChannel, fn: str, args: list[Any],
                        kwargs: dict[str, Any]) -> None:
        try:
            value = await self._invoke(fn, args, kwargs)
        except Exception as e:
            self._reply_error(h, channel, "remote", f"{e}", tb=traceback.format_exc(), type_name=type(e).__name__)
            return
        del args, kwargs  # release argument handles before the reply (their deletes may go out first)
        self._reply_value(h, channel, value)

    async def _run_fetch(self, h: Envelope, channel: ReplyChannel, rref: str, limit: float) -> None:
        try:
            value = await self._await_value(rref, limit)
        except E.RRefDeleted as e:
            self._reply_error(h, channel, "rref_deleted", str(e))
            return
        except E.RRefCreationFailed as e:
            self._reply_error(h, channel, "rref_failed", str(e))
            return
        except E.RpcTimeout as e:
            self._reply_error(h, channel, "remote", str(e), type_name="RpcTimeout")
            return
        self._reply_value(h, channel, value)

    # -- membership (loop thread) -----------------------------------------------------------------------

    def _apply_event(self, event: MembershipEvent) -> None:
        if isinstance(event, WorkerLeft):
            self._worker_left(event.name, event.reason, event.incarnation)
            return
        # the latest view, not the event's snapshot: events from several threads may arrive out of order
        view = self._membership.view() if self._membership is not None else event.view
        if view.epoch < self._epoch:
            return
        for name, m in view.members.items():
            died_as = self._dead.get(name)
            if died_as is not None and m.incarnation and m.incarnation != died_as:
                del self._dead[name]  # a new incarnation of that name joined
                self._book.dead.discard(name)
        if view.epoch > self._epoch:
            log.info("%s: RPC epoch %d -> %d", self.name, self._epoch, view.epoch)
        self._view, self._epoch = view, view.epoch
        self._poke()

    def _worker_left(self, name: str, reason: str, incarnation: str = "") -> None:
        """``name``'s incarnation ``incarnation`` (``""``: whichever it was) is gone: its calls fail, its values
        and the references it held go with it. When a newer incarnation of the name is in the membership
        already (events from several threads may come late), the name stays reachable: only what belonged to
        the one that went is given up."""
        if name == self.name:
            return
        latest = self._membership.view().members.get(name) if self._membership is not None else None
        replaced = bool(incarnation) and latest is not None and latest.incarnation not in ("", incarnation)
        if not replaced and name in self._dead and self._dead[name] in ("", incarnation):
            return
        member = self._view.members.get(name)
        gone = incarnation or (member.incarnation if member is not None else "")
        log.warning("%s: worker %s%s is gone (%s); failing its calls and dropping its references", self.name,
                    name, f" (incarnation {gone})" if gone else "", reason)
        if not replaced:
            self._dead[name] = gone
        self._wake_values(self._book.worker_died(name))
        self._send_controls(self._book.after_death)
        self._book.after_death = []
        if replaced:
            self._book.dead.discard(name)  # the name lives on in its new incarnation
        for call in [c for c in self._pending.values() if c.dst == name and (not replaced or c.inc == gone)]:
            self._finish(call, None, E.OwnerDied(name, reason) if call.mtype == "fetch"
                         else E.WorkerDied(name, reason))
        if replaced:
            self._dedup.forget_sender((name, gone))
        else:
            self._dedup.forget_worker(name)
            for key in [k for k in self._dup_waiters if k[0] == name]:
                del self._dup_waiters[key]
            self._done_from.add(name)
        if member is not None and member.incarnation == gone:
            self._spawn(self._transport.disconnect(member.address))
        self._poke()

    # -- introspection ------------------------------------------------------------------------------------

    def debug_state(self) -> dict[str, Any]:
        """Plain-data snapshot: RRef book, pending calls, completion records (for tests and leak reports)."""

        async def snap() -> dict[str, Any]:
            self._drain_releases()
            state = self._book.summary()
            state["pending"] = sorted(f"{c.mtype}:{c.dst}:{c.id}" for c in self._pending.values())
            state["records"] = len(self._dedup)
            state["timers"] = len(self._timers)
            state["epoch"] = self._epoch
            state["dead"] = sorted(self._dead)
            state["freed_log"] = list(self._book.freed_log or [])
            return state

        return self._run(snap(), timeout=30)  # type: ignore[no-any-return]

    @property
    def book(self) -> RRefBook:
        """The RRef bookkeeping; read it only through :meth:`debug_state` from other threads."""
        return self._book

    # -- shutdown -----------------------------------------------------------------------------------------

    async def _wait_until(self, pred: Callable[[], bool], deadline: float) -> bool:
        assert self._progress is not None
        while not pred():
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            self._progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._progress.wait(), min(remaining, 0.5))
            self._drain_releases()
        return True

    async def _drain(self, limit: float, report: ShutdownReport) -> None:
        deadline = self._loop.time() + limit
        step = limit / 3

        def user_calls_done() -> bool:
            return not any(c.user for c in self._pending.values())

        if not await self._wait_until(user_calls_done, self._loop.time() + step):
            report.timed_out.append("outgoing calls")
        self._drain_releases()
        report.leaked_user_rrefs = sorted(f"{r.rref}@{r.owner} (fork {f})" for f, r in self._book.users.items())
        for fork in list(self._book.users):
            self._send_controls(self._book.released(fork))
        if not await self._wait_until(lambda: not self._pending, self._loop.time() + step):
            report.timed_out.append("RRef control messages")
        peers = [m for m in self._view.members.values() if m.name != self.name and m.name not in self._dead]
        for m in peers:
            self._send_control(Control(m.name, "done", "", ""))

        def everyone_done() -> bool:
            return (all(m.name in self._done_from or m.name in self._dead for m in peers)
                    and not self._pending and self._incoming <= 0)

        if not await self._wait_until(everyone_done, deadline):
            missing = sorted(m.name for m in peers if m.name not in self._done_from and m.name not in self._dead)
            report.timed_out.append(f"shutdown barrier (waiting for {missing or 'in-flight requests'})")

    async def _teardown(self, report: ShutdownReport, grace: float) -> None:
        book = self._book
        report.leaked_owner_rrefs = {r: sorted(rec.forks.values()) + ["<local handle>"] * rec.handles
                                     for r, rec in book.owners.items()}
        report.parked_deletes = {r: sorted(f) for r, f in book.parked.items()}
        report.pending_children = sorted(book.children)
        report.pending_calls = sorted(f"{c.mtype} to {c.dst}" for c in self._pending.values())
        for call in list(self._pending.values()):
            self._finish(call, None, E.RpcShutdown(f"agent {self.name} shut down"))
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        self._wake_values(list(self._value_waiters))
        await self._transport.stop(grace)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in self._tasks]
        if others:  # gRPC's own stream tasks wind down after the server stopped
            await asyncio.wait(others, timeout=2.0)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # name lookups ran on the loop's default executor
            await asyncio.wait_for(self._loop.shutdown_default_executor(), 5.0)

    def shutdown(self, graceful: bool = True, timeout: float = 30.0) -> ShutdownReport:
        """Stop the agent. Returns what leaked; logs a warning when it is not clean.

        ``graceful``: stop taking new calls, wait for our outgoing calls, release the RRefs user code still
        holds (reported as leaks), wait for the RRef messages to be acknowledged, then wait until every live
        peer has said it is done too (a barrier, as torch's graceful shutdown) -- all within ``timeout``
        seconds in total. Otherwise pending calls fail with :class:`~.errors.RpcShutdown` at once. Either way
        the server, the streams, the worker threads and the loop thread are stopped before this returns.
        """
        if self._stopped:
            return ShutdownReport(graceful)
        report = ShutdownReport(graceful)
        self._accepting = False
        if self._started and self._thread.is_alive():
            if graceful:
                try:
                    self._run(self._drain(timeout, report), timeout=timeout + 30)
                except concurrent.futures.TimeoutError:
                    report.timed_out.append("drain")
            if self._unsubscribe is not None:
                self._unsubscribe()
            self._stopped = True
            try:
                self._run(self._teardown(report, 1.0 if graceful else 0.0), timeout=60)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=30)
        self._stopped = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if not self._loop.is_running():
            self._loop.close()
        if not report.clean:
            log.warning("%s: RPC shutdown was not clean: %s", self.name, report)
        return report
