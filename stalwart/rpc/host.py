"""The agent as the layers above it see it: the :class:`~.extension.RpcHost` of one agent."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from stalwart.api.rpc import ErrorKind, MessageType
from stalwart.rpc import errors as E
from stalwart.rpc.calls import Caller
from stalwart.rpc.extension import CallRequest, Incoming, OnAck, OnResult
from stalwart.rpc.membership import Worker, WorkerInfo
from stalwart.rpc.peers import Peers
from stalwart.rpc.reactor import Reactor
from stalwart.rpc.registry import Registry
from stalwart.rpc.retry import RetryOptions, backoff_delay
from stalwart.rpc.server import Server

log = logging.getLogger(__name__)


class AgentHost:
    """Implements :class:`~.extension.RpcHost` over one agent's parts. ``accepting`` says whether the agent
    takes calls (joined and not shutting down)."""

    def __init__(self, name: str, incarnation: str, default_timeout: float, control_retry: RetryOptions, *,
                 reactor: Reactor, peers: Peers, caller: Caller, server: Server, registry: Registry,
                 accepting: Callable[[], bool], stopped: Callable[[], bool],
                 undelivered: Callable[[list[str]], None], rng: Any) -> None:
        self.name = name
        self.incarnation = incarnation
        self.default_timeout = default_timeout
        self.control_retry = control_retry
        self._reactor = reactor
        self._peers = peers
        self._caller = caller
        self._server = server
        self._registry = registry
        self._accepting = accepting
        self._stopped = stopped
        self._undelivered = undelivered
        self._rng = rng

    @property
    def stopped(self) -> bool:
        return self._stopped()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self._reactor.call_soon(fn, *args)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return self._reactor.run(coro, timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._reactor.spawn(coro)

    def poke(self) -> None:
        self._reactor.poke()

    def check_call(self, timeout: float | None, retry: RetryOptions | None,
                   idempotent: bool) -> tuple[float, RetryOptions | None]:
        if not self._accepting():
            raise E.RpcShutdown(f"agent {self.name} is not running (not joined, or shut down)")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        if retry is not None and not idempotent:
            raise ValueError("retry: user calls are retried only when marked idempotent=True")
        if retry is not None and not isinstance(retry, RetryOptions):
            raise TypeError(f"retry: expected RetryOptions, got {type(retry).__name__}")
        if idempotent and retry is None:
            retry = RetryOptions()
        return (timeout if timeout is not None else self.default_timeout), retry

    def function_name(self, fn: Callable[..., Any] | str) -> str:
        return self._registry.name_of(fn)

    def resolve(self, to: str | int | WorkerInfo) -> Worker:
        return self._peers.resolve(to)

    def worker(self, name: str) -> Worker | None:
        return self._peers.view.members.get(name)

    def is_dead(self, name: str) -> bool:
        return name in self._peers.dead

    def worker_info(self, name: str) -> WorkerInfo:
        return self._peers.info(name)

    def start_call(self, request: CallRequest, on_done: OnResult) -> None:
        self._caller.start_user(request, request.worker.name in self._peers.dead, on_done, self._undelivered)

    def send_request(self, worker: Worker, mtype: MessageType, *, timeout: float, retry: RetryOptions,
                     rref: str | None = None, fork: str | None = None, payload: Any = None,
                     on_done: OnResult) -> None:
        self._caller.request(worker, mtype, timeout=timeout, retry=retry, rref=rref, fork=fork, payload=payload,
                             on_done=on_done)

    def send_control(self, dst: str, kind: MessageType, rref: str, fork: str, on_done: OnAck | None = None, *,
                     waited: tuple[float, int] | None = None) -> None:
        """``waited``: when and how often it already found ``dst`` missing from the view."""
        done: OnAck = on_done or (lambda _exc: None)
        if dst in self._peers.dead:
            return
        worker = self._peers.reachable(dst)
        if worker is None:
            # Missing from the view: the view may be mid-update (a round change), or the worker is gone and
            # its WorkerLeft has not arrived. Neither may lose the message (a parent would wait for a
            # fork's confirmation forever): try again with backoff, and fail it once the retry deadline passed.
            now = self._reactor.time()
            first, tries = waited if waited is not None else (now, 0)
            retry = self.control_retry
            due = now + backoff_delay(retry, tries + 1, self._rng)
            if due < first + retry.deadline:
                self._reactor.schedule(due, lambda: self.send_control(dst, kind, rref, fork, on_done,
                                                                      waited=(first, tries + 1)))
                return
            log.warning("%s: cannot send %s to %s: not in the current round", self.name, kind, dst)
            done(E.WorkerDied(dst, "not in the current round"))
            return
        self._caller.control(worker, kind, rref, fork, retry=self.control_retry, on_done=done)

    async def invoke(self, fn: str, args: Any, kwargs: Any) -> Any:
        return await self._server.invoke(fn, args, kwargs)

    def decode_call(self, request: Incoming) -> tuple[str, list[Any], dict[str, Any]] | None:
        return self._server.decode_call(request)

    def reply_value(self, request: Incoming, value: Any) -> None:
        self._server.reply_value(request, value)

    def reply_ok(self, request: Incoming) -> None:
        self._server.reply_ok(request)

    def reply_error(self, request: Incoming, kind: ErrorKind, message: str, type_name: str = "") -> None:
        self._server.reply_error(request, kind, message, type_name=type_name)
