"""The RRef runtime of one RPC agent: the protocol of :mod:`.book` carried over the agent's messages.

It is a layer on RPC (:class:`~stalwart.rpc.extension.RpcExtension`): importing :mod:`stalwart.rref`
registers it, and every agent created afterwards hosts one (:meth:`RRefRuntime.of`). It uses the agent only
through :class:`~stalwart.rpc.extension.RpcHost`. Control messages (``fork``, ``accept``, ``delete``) are
retried within the agent's ``control_retry`` and stamped with the current epoch on every attempt; every
method but those marked for user threads runs on the agent's loop thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

from stalwart.api.rpc import RRefWire
from stalwart.rpc import errors as E
from stalwart.rpc.extension import CallRequest, Incoming, OnResult, RpcExtension, RpcHost
from stalwart.rpc.membership import Worker, WorkerInfo
from stalwart.rpc.retry import RetryOptions
from stalwart.rref.book import Control, RRefBook
from stalwart.rref.handle import OwnerRRef, RRef, UserRRef
from stalwart.rref.owner import Values

if TYPE_CHECKING:
    from stalwart.rpc.agent import RpcAgent
    from stalwart.rpc.shutdown import ShutdownReport

log = logging.getLogger(__name__)

_FETCH_MARGIN = 5.0

#: Errors after which the owner never counted a new reference (releasing it must send no delete).
_NEVER_RAN = (E.TransportError, E.PayloadError, E.UnknownFunction, E.StaleEpoch, E.EpochAhead, E.RpcShutdown)


class RRefRuntime(RpcExtension):
    """The RRefs of the worker ``host.name``."""

    kinds = frozenset({"remote", "fetch", "fork", "accept", "delete"})

    def __init__(self, host: RpcHost) -> None:
        self.host = host
        self.name = host.name
        self.book = RRefBook(host.name)  # read it only through the agent's debug_state from other threads
        self.values = Values(host, self.book, self._send_controls)
        self._releases: collections.deque[RRef[Any]] = collections.deque()
        self._fork_parents: dict[str, str] = {}  # fork id -> parent, for forks awaiting the owner's ack
        self._creation_errors: dict[str, BaseException] = {}  # fork id -> why its remote() failed
        self._seq = 0
        self._id_lock = threading.Lock()
        self._closed = False

    @staticmethod
    def of(agent: RpcAgent) -> RRefRuntime:
        """The runtime ``agent`` hosts."""
        return agent.extension(RRefRuntime)

    def _new_id(self) -> str:
        with self._id_lock:  # user threads (remote) and the loop (forks) both allocate
            self._seq += 1
            return f"{self.name}:{self.host.incarnation}:{self._seq}"

    # -- user threads -----------------------------------------------------------------------------------

    def remote(self, to: str | int | WorkerInfo, fn: Any, args: tuple[Any, ...] = (),
               kwargs: dict[str, Any] | None = None, *, timeout: float | None = None,
               idempotent: bool = False, retry: RetryOptions | None = None) -> RRef[Any]:
        """See :func:`stalwart.rref.remote`."""
        t, retry = self.host.check_call(timeout, retry, idempotent)
        fn_name = self.host.function_name(fn)
        worker = self.host.resolve(to)
        rref_id = self._new_id()
        if worker.name == self.name:
            handle: RRef[Any] = OwnerRRef(self, rref_id, None, self.name)
        else:
            handle = UserRRef(self, rref_id, self._new_id(), worker.name)
        request = CallRequest("remote", worker, fn_name, args, kwargs or {}, t, retry, rref=rref_id,
                              fork=handle.fork_id)
        self.host.call_soon(self._start_remote, handle, request)
        return handle

    def worker_info(self, name: str) -> WorkerInfo:
        return self.host.worker_info(name)

    def confirmed(self, handle: RRef[Any]) -> bool:
        if handle.owner_name == self.name or handle.fork_id is None:
            return True
        rec = self.book.users.get(handle.fork_id)
        return bool(rec is not None and rec.confirmed)

    def release(self, handle: RRef[Any]) -> None:
        """From any thread (also a finalizer): queue the release for the loop."""
        if self.host.stopped or handle.runtime is not self:
            return
        self._releases.append(handle)
        self.host.call_soon(self.flush)

    def to_here(self, handle: RRef[Any], timeout: float | None) -> Any:
        t = timeout if timeout is not None else self.host.default_timeout
        if handle.owner_name == self.name:
            return self.host.run(self.values.value(handle.rref_id, t))
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def finished(value: Any, exc: BaseException | None) -> None:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        self.host.call_soon(self._start_fetch, handle, t, finished)
        # The fetch ends itself at ``t``; the margin bounds the wait also when the loop stops before it can.
        try:
            return fut.result(timeout=t + _FETCH_MARGIN)
        except concurrent.futures.TimeoutError:
            raise E.RpcTimeout(f"to_here: no answer from {handle.owner_name!r} within {t:g}s") from None

    # -- loop thread ------------------------------------------------------------------------------------

    def _start_remote(self, handle: RRef[Any], request: CallRequest) -> None:
        if request.worker.name == self.name:
            self.values.create_local(handle.rref_id, request.fn, request.args, request.kwargs)
            return
        assert handle.fork_id is not None
        self.book.new_user(handle.fork_id, handle.rref_id, request.worker.name, self.name, confirmed=False)

        def done(_value: Any, exc: BaseException | None) -> None:
            if exc is not None:
                self._creation_failed(handle, exc)
                return
            if handle.fork_id is not None and (rec := self.book.users.get(handle.fork_id)) is not None:
                rec.confirmed = True

        self.host.start_call(request, done)

    def _creation_failed(self, handle: RRef[Any], exc: BaseException) -> None:
        if handle.fork_id is None:
            return
        self._creation_errors[handle.fork_id] = exc
        if isinstance(exc, _NEVER_RAN):
            # the owner never counted this fork: releasing the handle must not send a delete
            self.book.users.pop(handle.fork_id, None)

    def _start_fetch(self, handle: RRef[Any], timeout: float, finished: OnResult) -> None:
        assert handle.fork_id is not None
        err = self._creation_errors.get(handle.fork_id)
        if err is not None:
            finished(None, E.RRefCreationFailed(f"creating RRef {handle.rref_id} failed: {err}"))
            return
        rec = self.book.users.get(handle.fork_id)
        if self.host.is_dead(handle.owner_name) or (rec is not None and rec.owner_dead):
            finished(None, E.OwnerDied(handle.owner_name, f"it owned RRef {handle.rref_id}"))
            return
        worker: Worker | None = self.host.worker(handle.owner_name)
        if worker is None:
            finished(None, E.OwnerDied(handle.owner_name, "not in the current round"))
            return

        def done(value: Any, exc: BaseException | None) -> None:
            if isinstance(exc, E.WorkerDied) and not isinstance(exc, E.OwnerDied):  # fate-sharing with the owner
                exc = E.OwnerDied(handle.owner_name, f"it owned RRef {handle.rref_id}: {exc}")
            finished(value, exc)

        retry = self.host.control_retry.model_copy(update={"deadline": max(timeout, 0.001),
                                                             "attempt_timeout": None})
        self.host.send_request(worker, "fetch", timeout=timeout, retry=retry, rref=handle.rref_id,
                               fork=handle.fork_id, payload={"timeout": timeout}, on_done=done)

    def _send_control(self, c: Control) -> None:
        def done(exc: BaseException | None) -> None:
            if exc is None:
                if c.kind == "fork":
                    rec = self.book.users.get(c.fork)
                    parent = rec.parent if rec is not None else self._fork_parents.pop(c.fork, "")
                    self._fork_parents.pop(c.fork, None)
                    self._send_controls(self.book.fork_confirmed(c.fork, c.rref, parent))
                return
            if not isinstance(exc, E.WorkerDied):
                log.warning("%s: RRef %s %s of %s to %s failed: %s", self.name, c.kind, c.fork, c.rref, c.dst, exc)
            if c.kind == "fork":  # never confirmed: the parent must not wait for it forever
                parent = self._fork_parents.pop(c.fork, "")
                if parent:
                    self._send_controls(self.book.accepted_by_child(c.fork, parent, c.rref))

        self.host.send_control(c.dst, c.kind, c.rref, c.fork, done)

    def _send_controls(self, controls: list[Control]) -> None:
        for c in controls:
            self._send_control(c)

    # -- the hooks of an RPC layer (loop thread) ----------------------------------------------------------

    def encode_ref(self, value: Any, dst: str, created: list[str]) -> RRefWire:
        if not isinstance(value, RRef) or value.runtime is not self:
            raise E.PayloadError("an RRef of another agent cannot be sent")
        if value.released:
            raise E.RRefDeleted(f"RRef {value.rref_id} was released; it cannot be sent")
        fork = self._new_id()
        parent = self.book.fork_for(dst, value.rref_id, value.owner_name, fork, value,
                                    own_fork=None if value.owner_name == self.name else value.fork_id)
        created.append(fork)
        return RRefWire(owner=value.owner_name, rref=value.rref_id, fork=fork, parent=parent)

    def decode_ref(self, wire: RRefWire) -> RRef[Any]:
        rec, controls = self.book.received(wire.rref, wire.fork, wire.owner, wire.parent)
        if rec is not None:
            # remembered in case the handle is released before the owner confirms the fork
            self._fork_parents[wire.fork] = wire.parent
        self._send_controls(controls)
        if wire.owner == self.name:
            return OwnerRRef(self, wire.rref, None, self.name)
        return UserRRef(self, wire.rref, wire.fork, wire.owner)

    def undelivered(self, created: list[str]) -> None:
        for fork in created:
            controls, freed = self.book.fork_abandoned(fork)
            self._send_controls(controls)
            self.values.wake(freed)

    def on_request(self, request: Incoming) -> None:
        self.values.on_request(request)

    def worker_gone(self, name: str, replaced: bool) -> None:
        self.values.wake(self.book.worker_died(name))
        self._send_controls(self.book.after_death)
        self.book.after_death = []
        if replaced:
            self.book.dead.discard(name)  # the name lives on in its new incarnation

    def worker_back(self, name: str) -> None:
        self.book.dead.discard(name)

    def flush(self) -> None:
        while self._releases and not self._closed:
            handle = self._releases.popleft()
            if handle.owner_name == self.name:
                self.values.wake(self.book.handle_dropped(handle.rref_id))
            elif handle.fork_id is not None:
                self._send_controls(self.book.released(handle.fork_id))
        self.host.poke()

    def release_all(self, report: ShutdownReport) -> None:
        self.flush()
        report.leaked_user_rrefs = sorted(f"{r.rref}@{r.owner} (fork {f})" for f, r in self.book.users.items())
        for fork in list(self.book.users):
            self._send_controls(self.book.released(fork))

    def report(self, report: ShutdownReport) -> None:
        book = self.book
        report.leaked_owner_rrefs = {r: sorted(rec.forks.values()) + ["<local handle>"] * rec.handles
                                     for r, rec in book.owners.items()}
        report.parked_deletes = {r: sorted(f) for r, f in book.parked.items()}
        report.pending_children = sorted(book.children)

    def close(self) -> None:
        self._closed = True
        self.values.wake_all()

    def summary(self) -> dict[str, Any]:
        state = self.book.summary()
        state["freed_log"] = list(self.book.freed_log or [])
        return state
