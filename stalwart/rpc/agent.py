"""The RPC agent: one per worker process. The imperative shell that puts the parts together.

Parts, each on the agent's one event loop (:mod:`.reactor`): the calling side with its retries and
deadlines (:mod:`.calls`), the server with fencing and deduplication (:mod:`.server`), the use of the
membership (:mod:`.peers`), the shutdown (:mod:`.shutdown`), and the layers above RPC (the RRef runtime),
which see the agent only through :class:`~.extension.RpcHost` (:mod:`.host`). User threads enter through
the loop's ``call_soon_threadsafe`` and wait on :class:`RpcFuture`; plain registered functions run on a
bounded pool of worker threads (``stalwart-rpc-<name>-worker``). :meth:`RpcAgent.shutdown` stops all of them.

Fencing: each message carries the sender's round epoch; a request from another epoch is answered
``stale_epoch``/``epoch_ahead`` and never run (the caller raises :class:`~stalwart.etcd.fence.StaleEpoch`
or :class:`~.errors.EpochAhead`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import secrets
from collections.abc import Callable
from typing import Any, TypeVar

from stalwart.api import pod_env
from stalwart.api.rpc import RRefWire, check_worker_name
from stalwart.rpc import errors as E
from stalwart.rpc.calls import Caller, RefEncoder
from stalwart.rpc.extension import CallRequest, RpcExtension, extension_factories
from stalwart.rpc.host import AgentHost
from stalwart.rpc.membership import Membership, MembershipEvent, ViewChanged, Worker, WorkerInfo, WorkerLeft
from stalwart.rpc.peers import Peers
from stalwart.rpc.reactor import Reactor
from stalwart.rpc.registry import REGISTRY, Registry
from stalwart.rpc.retry import CONTROL_RETRY, RetryOptions
from stalwart.rpc.server import Server
from stalwart.rpc.shutdown import AgentParts, ShutdownReport, drain, teardown
from stalwart.rpc.streams import StreamTransport
from stalwart.rpc.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")
X = TypeVar("X", bound=RpcExtension)

DEFAULT_TIMEOUT = 60.0


class RpcFuture(concurrent.futures.Future[T]):
    """The result of :meth:`RpcAgent.rpc_async`; ``wait()`` is ``result()`` (as in torch)."""

    def wait(self, timeout: float | None = None) -> T:
        return self.result(timeout)


class RpcAgent:
    """An RPC endpoint named ``name`` in a job. Create, :meth:`start`, :meth:`join` a membership, then call.

    ``token`` defaults to ``$STALWART_RPC_TOKEN``. ``transport`` lets tests wrap the real one (fault
    injection). ``control_retry`` governs the messages of the layers above RPC (the RRef protocol).
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
        token = token if token is not None else os.environ.get(pod_env.RPC_TOKEN)
        if transport is None:
            if not token:
                raise ValueError(f"token: no RPC token given and ${pod_env.RPC_TOKEN} is not set")
            transport = StreamTransport(token)
        self.name = name
        self.rank = rank
        self.incarnation = secrets.token_hex(8)
        self.address = ""
        self._host, self._port = host, port
        self._transport = transport
        rng = random.Random(seed)
        self._reactor = reactor = Reactor(name)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_worker_threads, thread_name_prefix=f"stalwart-rpc-{name}-worker")
        self._peers = peers = Peers(name, rank)
        self._caller = Caller(name, self.incarnation, reactor, transport, epoch=lambda: peers.epoch,
                              encoder=self._ref_encoder, decoder=self._decode_ref, rng=rng)
        self._server = Server(name, self.incarnation, reactor, transport, registry, executor=self._executor,
                              epoch=lambda: peers.epoch, dead=peers.dead, encode=self._caller.encode,
                              decode=self._caller.decode)
        self._accepting = False
        self._started = False
        self._stopped = False
        self._unsubscribe: Callable[[], None] | None = None
        host_api = AgentHost(name, self.incarnation, default_timeout, control_retry, reactor=reactor, peers=peers,
                             caller=self._caller, server=self._server, registry=registry,
                             accepting=lambda: self._accepting, stopped=lambda: self._stopped,
                             undelivered=self._undelivered, rng=rng)
        self._host_api = host_api
        self._extensions = [factory(host_api) for factory in extension_factories()]
        for ext in self._extensions:
            for kind in ext.kinds:
                self._server.extensions[kind] = ext
        self._parts = AgentParts(reactor, self._caller, self._server, peers, transport, self._extensions,
                                 control_retry)

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> str:
        """Start the loop and listen; returns the ``host:port`` address to publish."""
        if self._started:
            raise RuntimeError("agent already started")
        self._started = True
        self._reactor.start()

        async def boot() -> str:
            self._transport.set_handlers(self._server.on_request, self._caller.on_reply, self._caller.on_link_down)
            return await self._transport.start(self._host, self._port)

        self.address = self._reactor.run(boot(), timeout=30)
        return self.address

    @property
    def member(self) -> Worker:
        """This worker as a membership entry (after :meth:`start`)."""
        return Worker(self.name, self.rank, self.address, self.incarnation)

    def join(self, membership: Membership) -> None:
        """Follow ``membership`` (view, epochs, deaths) and start taking calls."""
        if not self.address:
            raise RuntimeError("start() the agent before join()")
        self._peers.membership = membership
        # subscribe first: a change between reading the view and subscribing would otherwise be missed
        self._unsubscribe = membership.subscribe(self._membership_event)
        self._reactor.call_soon(self._apply_event, ViewChanged(membership.view()))
        self._accepting = True
        self._reactor.run(_noop())

    def _membership_event(self, event: MembershipEvent) -> None:
        """From the membership's thread: hand the event to the loop."""
        if not self._stopped:
            self._reactor.call_soon(self._apply_event, event)

    def extension(self, kind: type[X]) -> X:
        """The layer of type ``kind`` this agent hosts (LookupError if none: its package was not imported
        before the agent was created)."""
        for ext in self._extensions:
            if isinstance(ext, kind):
                return ext
        raise LookupError(f"agent {self.name} hosts no {kind.__name__} (import its package before creating "
                          "the agent)")

    # -- public API -------------------------------------------------------------------------------------

    def worker_info(self, to: str | int | WorkerInfo | None = None) -> WorkerInfo:
        """This worker's info, or that of the worker named/ranked ``to``."""
        if to is None:
            return WorkerInfo(self.name, self.rank)
        return self._peers.resolve(to).info

    def rpc_async(self, to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                  kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
                  idempotent: bool = False, retry: RetryOptions | None = None) -> RpcFuture[Any]:
        """Call the registered function ``fn`` on worker ``to``; a future of its result.

        ``idempotent=True`` allows retries (``retry``, default :class:`RetryOptions` ()); without it a call
        is sent once and fails with the first transport error. Errors: :class:`~.errors.RemoteError` (the
        function raised), :class:`~.errors.RpcTimeout`, :class:`~.errors.WorkerDied`,
        :class:`~stalwart.etcd.fence.StaleEpoch`, :class:`~.errors.UnknownFunction`,
        :class:`~.errors.PayloadError`.

        Tensors in ``args`` are sent from their own memory, not copied first (a retry sends them again): do
        not change them in place until the future is done. On the receiving side, a tensor of 64 KiB or more
        is a view of its message's buffer (which stays alive with it), not a copy.
        """
        t, retry = self._host_api.check_call(timeout, retry, idempotent)
        name = self._host_api.function_name(fn)
        request = CallRequest("call", self._peers.resolve(to), name, args, kwargs or {}, t, retry)
        fut: RpcFuture[Any] = RpcFuture()

        def done(value: Any, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        self._reactor.call_soon(self._host_api.start_call, request, done)
        return fut

    def rpc_sync(self, to: str | int | WorkerInfo, fn: Callable[..., Any] | str, args: tuple[Any, ...] = (),
                 kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
                 idempotent: bool = False, retry: RetryOptions | None = None) -> Any:
        """:meth:`rpc_async` and wait for the result."""
        return self.rpc_async(to, fn, args, kwargs, timeout=timeout, idempotent=idempotent,
                              retry=retry).result()

    # -- the layers' hooks (loop thread) ----------------------------------------------------------------

    def _ref_encoder(self) -> RefEncoder | None:
        return self._extensions[0].encode_ref if self._extensions else None

    def _decode_ref(self, wire: RRefWire) -> Any:
        if not self._extensions:
            raise E.PayloadError(f"an RRef arrived, but {self.name} has no RRef runtime (import stalwart.rref "
                                 "before creating the agent)")
        return self._extensions[0].decode_ref(wire)

    def _undelivered(self, created: list[str]) -> None:
        for ext in self._extensions:
            ext.undelivered(created)

    # -- membership (loop thread) -----------------------------------------------------------------------

    def _apply_event(self, event: MembershipEvent) -> None:
        if isinstance(event, WorkerLeft):
            self._worker_left(event.name, event.reason, event.incarnation)
            return
        back = self._peers.apply_view(event.view)
        for name in back or []:
            for ext in self._extensions:
                ext.worker_back(name)
        if back is not None:
            self._reactor.poke()

    def _worker_left(self, name: str, reason: str, incarnation: str = "") -> None:
        """Carry out what :meth:`Peers.left` decided: the calls to the one that went fail, the layers drop
        what it owned or held, and our completion records of its requests go."""
        d = self._peers.left(name, reason, incarnation)
        if d is None:
            return
        for ext in self._extensions:
            ext.worker_gone(name, d.replaced)
        self._caller.fail_calls_to(name, d.gone if d.replaced else None, reason)
        self._server.forget(name, d.gone, d.replaced)
        if d.worker is not None and d.worker.incarnation == d.gone:
            self._reactor.spawn(self._transport.disconnect(d.worker.address))
        self._reactor.poke()

    # -- introspection ------------------------------------------------------------------------------------

    def debug_state(self) -> dict[str, Any]:
        """Plain-data snapshot: the layers' state, pending calls, completion records (for tests and leak
        reports)."""

        async def snap() -> dict[str, Any]:
            state: dict[str, Any] = {}
            for ext in self._extensions:
                ext.flush()
                state.update(ext.summary())
            state["pending"] = sorted(f"{c.mtype}:{c.dst}:{c.id}" for c in self._caller.pending.values())
            state["records"] = len(self._server.dedup)
            state["timers"] = len(self._reactor.timers)
            state["epoch"] = self._peers.epoch
            state["dead"] = sorted(self._peers.dead)
            return state

        return self._reactor.run(snap(), timeout=30)  # type: ignore[no-any-return]

    # -- shutdown -----------------------------------------------------------------------------------------

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
        reactor = self._reactor
        if self._started and reactor.thread.is_alive():
            if graceful:
                try:
                    reactor.run(drain(self._parts, timeout, report), timeout=timeout + 30)
                except concurrent.futures.TimeoutError:
                    report.timed_out.append("drain")
            if self._unsubscribe is not None:
                self._unsubscribe()
            self._stopped = True
            try:
                reactor.run(teardown(self._parts, self.name, report, 1.0 if graceful else 0.0), timeout=60)
            finally:
                reactor.loop.call_soon_threadsafe(reactor.loop.stop)
                reactor.thread.join(timeout=30)
        self._stopped = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if not reactor.loop.is_running():
            reactor.loop.close()
        if not report.clean:
            log.warning("%s: RPC shutdown was not clean: %s", self.name, report)
        return report


async def _noop() -> None:
    return None
