"""The calling side of the agent: pending requests, their attempts, retries, deadlines and replies.

User calls are retried only when the caller says they are idempotent; protocol requests and control
messages always are (``control_retry``) and are stamped with the current epoch on every attempt (they stay
valid across rounds between surviving workers); a user call keeps the epoch it was made in. A reply that
finds no pending call (it came after its call's deadline, or is a duplicate) is dropped. Everything here
runs on the agent's loop thread.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.api.rpc import MessageType, RRefWire
from stalwart.rpc import errors as E
from stalwart.rpc.codec import Blobs, Frame, decode_frame, decode_payload, encode_frame, encode_payload, header_json
from stalwart.rpc.extension import CallRequest, OnAck, OnResult
from stalwart.rpc.membership import Worker
from stalwart.rpc.reactor import Reactor
from stalwart.rpc.retry import RetryOptions, backoff_delay
from stalwart.rpc.timers import Timer
from stalwart.rpc.transport import OutFrame, Transport

log = logging.getLogger(__name__)

#: Encodes a layer's object found in a payload for a destination (appending what to undo if undelivered).
RefEncoder = Callable[[Any, str, list[str]], RRefWire]


@dataclass(eq=False, slots=True)
class Call:
    """One outgoing request while it is pending (retries included)."""

    id: int
    dst: str
    address: str
    mtype: MessageType
    deadline: float
    retry: RetryOptions | None
    restamp: bool  # stamp the current epoch on every attempt (protocol messages)
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
    started: float = 0.0
    inc: str = ""  # the incarnation of ``dst`` it was sent to


class Caller:
    """The requests agent ``name`` (incarnation ``incarnation``) sends and the replies it gets."""

    def __init__(self, name: str, incarnation: str, reactor: Reactor, transport: Transport, *,
                 epoch: Callable[[], int], encoder: Callable[[], RefEncoder | None],
                 decoder: Callable[[RRefWire], Any], rng: random.Random) -> None:
        self.name = name
        self.incarnation = incarnation
        self.pending: dict[int, Call] = {}
        self._reactor = reactor
        self._transport = transport
        self._epoch = epoch
        self._encoder = encoder
        self._decoder = decoder
        self._rng = rng
        self._next_id = 1

    def encode(self, value: Any, blobs: Blobs, dst: str, created: list[str], path: str) -> Any:
        """A payload's JSON tree for ``dst`` (its tensors into ``blobs``)."""
        enc = self._encoder()
        return encode_payload(value, blobs, (lambda v: enc(v, dst, created)) if enc is not None else None, path)

    def decode(self, frame: Frame, path: str = "payload") -> Any:
        return decode_payload(frame.header.payload, frame, self._decoder, path)

    def start_user(self, req: CallRequest, dead: bool, on_done: OnResult,
                   undelivered: Callable[[list[str]], None]) -> None:
        """Send a user call (``dead``: its worker is known dead: it fails at once)."""
        now = self._reactor.time()
        created: list[str] = []

        decoded = self._decoding(on_done)

        def done(frame: Frame | None, exc: BaseException | None) -> None:
            if isinstance(exc, E.TransportError | E.PayloadError) and call.attempt <= 1 and created:
                undelivered(created)
            decoded(frame, exc)

        w = req.worker
        call = Call(id=self.alloc_id(), dst=w.name, address=w.address, mtype=req.mtype, deadline=now + req.timeout,
                    retry=req.retry, restamp=False, epoch=self._epoch(), on_done=done, fn=req.fn, rref=req.rref,
                    fork=req.fork, user=True, started=now, inc=w.incarnation)
        if dead:
            done(None, E.WorkerDied(w.name))
            return
        try:
            blobs = Blobs()
            call.payload = {"a": self.encode(list(req.args), blobs, w.name, created, "args"),
                            "k": self.encode(req.kwargs, blobs, w.name, created, "kwargs")}
            call.blobs = blobs
        except E.RpcError as e:
            done(None, e)
            return
        except Exception as e:
            done(None, E.PayloadError(f"cannot encode the arguments: {e}"))
            return
        self.launch(call)

    def request(self, worker: Worker, mtype: MessageType, *, timeout: float, retry: RetryOptions,
                rref: str | None, fork: str | None, payload: Any, on_done: OnResult) -> None:
        """Send a protocol request (restamped, retried); ``on_done`` gets the decoded reply."""
        now = self._reactor.time()
        self.launch(Call(id=self.alloc_id(), dst=worker.name, address=worker.address, mtype=mtype,
                         deadline=now + timeout, retry=retry, restamp=True, epoch=self._epoch(),
                         on_done=self._decoding(on_done),
                         rref=rref, fork=fork, payload=payload, started=now, inc=worker.incarnation))

    def _decoding(self, on_done: OnResult) -> Callable[[Frame | None, BaseException | None], None]:
        """A call's completion that hands ``on_done`` the decoded reply payload (or the error)."""

        def done(frame: Frame | None, exc: BaseException | None) -> None:
            if exc is not None:
                on_done(None, exc)
                return
            assert frame is not None
            try:
                value = self.decode(frame)
            except E.RpcError as e:
                on_done(None, e)
                return
            on_done(value, None)

        return done

    def control(self, worker: Worker, kind: MessageType, rref: str, fork: str, *, retry: RetryOptions,
                on_done: OnAck) -> None:
        """Send a control message (restamped, retried); ``on_done`` gets None once it is acknowledged."""
        now = self._reactor.time()
        self.launch(Call(id=self.alloc_id(), dst=worker.name, address=worker.address, mtype=kind,
                         deadline=now + retry.deadline, retry=retry, restamp=True, epoch=self._epoch(),
                         on_done=lambda _frame, exc: on_done(exc), rref=rref, fork=fork, started=now,
                         inc=worker.incarnation))

    def launch(self, call: Call) -> None:
        self.pending[call.id] = call
        call.deadline_timer = self._reactor.schedule(call.deadline, lambda: self._expire(call))
        self._attempt(call)

    def alloc_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def low_water(self) -> int:
        """Every request id below this is finished here (pending ids are in increasing insertion order)."""
        for cid in self.pending:
            return cid
        return self._next_id

    def _attempt(self, call: Call) -> None:
        if call.finished:
            return
        call.attempt += 1
        n = call.attempt
        call.retry_timer = None
        header = header_json(
            kind="req", type=call.mtype, id=call.id, src=self.name, inc=self.incarnation,
            epoch=self._epoch() if call.restamp else call.epoch, ack=self.low_water(), fn=call.fn,
            rref=call.rref, fork=call.fork, payload=call.payload,
            blobs=call.blobs.meta if call.blobs is not None else None)
        try:
            frame = encode_frame(header, call.blobs)
        except E.RpcError as e:
            self.finish(call, None, e)
            return
        if call.retry is not None and call.retry.attempt_timeout is not None:
            call.attempt_timer = self._reactor.schedule(
                self._reactor.time() + call.retry.attempt_timeout,
                lambda: self._attempt_failed(call, n, E.RpcTimeout(
                    f"no reply from {call.dst} within attempt_timeout={call.retry.attempt_timeout}s"
                    if call.retry else "no reply")))
        try:
            if self._transport.send_request_nowait(call.address, frame):
                return
        except E.RpcError as e:
            self._attempt_failed(call, n, e)
            return
        self._reactor.spawn(self._send(call, n, frame))

    async def _send(self, call: Call, n: int, frame: OutFrame) -> None:
        try:
            await self._transport.send_request(call.address, frame, call.mtype)
        except E.RpcError as e:
            self._attempt_failed(call, n, e)
        except Exception as e:
            log.exception("%s: sending to %s failed", self.name, call.dst)
            self._attempt_failed(call, n, E.TransportError(str(e)))

    def _attempt_failed(self, call: Call, n: int, err: BaseException) -> None:
        if call.finished or n != call.attempt or call.retry_timer is not None:
            return
        self._reactor.cancel(call.attempt_timer)
        call.attempt_timer = None
        call.last_error = err
        retry = call.retry
        if retry is not None and call.attempt <= retry.max_retries:
            due = self._reactor.time() + backoff_delay(retry, call.attempt, self._rng)
            if due < call.deadline and due < call.started + retry.deadline:
                call.retry_timer = self._reactor.schedule(due, lambda: self._attempt(call))
                return
        self.finish(call, None, err)

    def _expire(self, call: Call) -> None:
        if call.finished:
            return
        waited = self._reactor.time() - call.started
        last = f"; last error: {call.last_error}" if call.last_error else ""
        self.finish(call, None, E.RpcTimeout(
            f"{call.mtype} {call.fn or call.rref or ''} to {call.dst} timed out after {waited:.3g}s "
            f"({call.attempt} attempt(s){last})"))

    def finish(self, call: Call, frame: Frame | None, exc: BaseException | None) -> None:
        if call.finished:
            return
        call.finished = True
        self.pending.pop(call.id, None)
        self._reactor.cancel(call.deadline_timer)
        self._reactor.cancel(call.attempt_timer)
        self._reactor.cancel(call.retry_timer)
        call.blobs = None
        try:
            call.on_done(frame, exc)
        except Exception:
            log.exception("%s: completion of %s to %s failed", self.name, call.mtype, call.dst)
        self._reactor.poke()

    def fail_calls_to(self, name: str, incarnation: str | None, reason: str) -> None:
        """``name`` died: its pending calls fail (only those sent to ``incarnation`` unless it is None)."""
        for call in [c for c in self.pending.values()
                     if c.dst == name and (incarnation is None or c.inc == incarnation)]:
            self.finish(call, None, E.WorkerDied(name, reason))

    def on_link_down(self, address: str) -> None:
        for call in list(self.pending.values()):
            if call.address == address and call.retry_timer is None and not call.finished:
                self._attempt_failed(call, call.attempt, E.TransportError(f"stream to {call.dst} broke"))

    def on_reply(self, data: bytes | bytearray) -> None:
        try:
            frame = decode_frame(data)
        except E.PayloadError as e:
            log.warning("%s: dropped a malformed reply: %s", self.name, e)
            return
        h = frame.header
        call = self.pending.get(h.id)
        if h.kind != "rep" or call is None or call.dst != h.src or call.mtype != h.type:
            log.debug("%s: dropped a late or unmatched reply %s/%s from %s", self.name, h.type, h.id, h.src)
            return
        if h.err is not None:
            kind = h.err.kind
            if kind == "expired":
                return
            retryable = call.retry is not None and (kind == "epoch_ahead" or (kind == "stale_epoch"
                                                                               and call.restamp))
            sent = self._epoch() if call.restamp else call.epoch
            err = E.error_from_info(call.dst, h.err, sent_epoch=sent, current_epoch=h.epoch)
            if retryable:
                self._attempt_failed(call, call.attempt, err)
            else:
                self.finish(call, None, err)
            return
        self.finish(call, frame, None)

    def stop(self, name: str) -> list[str]:
        """Fail every pending call (the agent stops); returns what they were."""
        pending = sorted(f"{c.mtype} to {c.dst}" for c in self.pending.values())
        for call in list(self.pending.values()):
            self.finish(call, None, E.RpcShutdown(f"agent {name} shut down"))
        return pending
