"""The serving side of the agent: fencing, deduplication, running called functions and replying.

Each request carries its sender's round epoch; one from another epoch is answered ``stale_epoch`` or
``epoch_ahead`` and never run, and so is one from an incarnation known dead. A request is run once per
(sender, incarnation, id) (:mod:`.dedup`): a duplicate of a running one waits for its reply, of a finished
one gets the recorded reply again. Plain registered functions run on a bounded pool of worker threads,
coroutine functions and ``inline`` ones on the loop. Request types other than ``call`` and the shutdown
barrier's ``done`` go to the layer that serves them (:mod:`.extension`). Everything here runs on the
agent's loop thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import traceback
from collections.abc import Callable
from typing import Any

from stalwart.api.rpc import ErrorInfo, ErrorKind
from stalwart.rpc import errors as E
from stalwart.rpc.codec import Blobs, Frame, decode_frame, encode_frame, header_json
from stalwart.rpc.dedup import CompletionTable, Verdict
from stalwart.rpc.extension import Incoming, RpcExtension
from stalwart.rpc.reactor import Reactor
from stalwart.rpc.registry import Registered, Registry
from stalwart.rpc.transport import OutFrame, ReplyChannel, Transport, joined

log = logging.getLogger(__name__)


class Server:
    """The requests agent ``name`` serves. ``epoch`` and ``dead`` read the agent's membership state;
    ``encode`` and ``decode`` turn payloads into JSON trees and back (:class:`~.calls.Caller`'s)."""

    def __init__(self, name: str, incarnation: str, reactor: Reactor, transport: Transport, registry: Registry, *,
                 executor: concurrent.futures.ThreadPoolExecutor, epoch: Callable[[], int],
                 dead: dict[str, str], encode: Callable[[Any, Blobs, str, list[str], str], Any],
                 decode: Callable[[Frame, str], Any]) -> None:
        self.name = name
        self.incarnation = incarnation
        self.dedup: CompletionTable[bytes] = CompletionTable()
        self.incoming = 0  # requests admitted and not yet answered
        self.done_from: set[str] = set()  # peers that passed the shutdown barrier (or died)
        self.extensions: dict[str, RpcExtension] = {}  # request type -> the layer that serves it
        self._dup_waiters: dict[tuple[str, str, int], list[ReplyChannel]] = {}
        self._reactor = reactor
        self._transport = transport
        self._registry = registry
        self._executor = executor
        self._epoch = epoch
        self._dead = dead
        self._encode = encode
        self._decode = decode

    def on_request(self, data: bytes | bytearray, channel: ReplyChannel) -> None:
        try:
            frame = decode_frame(data)
        except E.PayloadError as e:
            log.warning("%s: dropped a malformed request from %s: %s", self.name, channel.peer, e)
            return
        h = frame.header
        if h.kind != "req":
            return
        req = Incoming(h, frame, channel)
        epoch = self._epoch()
        if h.epoch != epoch:
            kind: ErrorKind = "stale_epoch" if h.epoch < epoch else "epoch_ahead"
            self._send_reply(req, ErrorInfo(
                kind=kind, message=f"message of epoch {h.epoch}, {self.name} is in epoch {epoch}"), record=False)
            return
        if h.src in self._dead and self._dead[h.src] in ("", h.inc):
            self._send_reply(req, ErrorInfo(kind="stale_epoch", message=f"{h.src} is dead to {self.name}"),
                             record=False)
            return
        verdict, stored = self.dedup.admit((h.src, h.inc), h.id, h.ack)
        if verdict == Verdict.NEW:
            self.incoming += 1
            try:
                self._dispatch(req)
            except Exception as e:
                log.exception("%s: handling %s from %s failed", self.name, h.type, h.src)
                self.reply_error(req, "bad_request", str(e))
        elif verdict == Verdict.RUNNING:
            self._dup_waiters.setdefault((h.src, h.inc, h.id), []).append(channel)
        elif verdict == Verdict.DONE:
            assert stored is not None
            self._reply(channel, stored, h.type)
        else:
            self._send_reply(req, ErrorInfo(kind="expired", message="duplicate of a finished request"), record=False)

    def _dispatch(self, req: Incoming) -> None:
        h = req.header
        if h.type == "call":
            decoded = self.decode_call(req)
            if decoded is not None:
                self._start_call(req, self._registry.lookup(decoded[0]), decoded[1], decoded[2])
        elif h.type == "done":
            self.done_from.add(h.src)
            self.reply_ok(req)
        elif (ext := self.extensions.get(h.type)) is not None:
            ext.on_request(req)
        else:
            self.reply_error(req, "bad_request", f"{self.name} serves no {h.type!r} requests")

    def decode_call(self, req: Incoming) -> tuple[str, list[Any], dict[str, Any]] | None:
        """The function and arguments of a ``call`` or ``remote``; None when answered with an error."""
        h = req.header
        try:
            entry = self._registry.lookup(h.fn or "")
        except E.UnknownFunction as e:
            self.reply_error(req, "unknown_function", str(e))
            return None
        try:
            payload = self._decode(req.frame, "args")
            if not (isinstance(payload, dict) and isinstance(payload.get("a"), list)
                    and isinstance(payload.get("k"), dict)):
                raise E.PayloadError("args: expected {'a': [...], 'k': {...}}")
        except E.PayloadError as e:
            self.reply_error(req, "bad_request", str(e))
            return None
        return entry.name, payload["a"], payload["k"]

    def reply_error(self, req: Incoming, kind: ErrorKind, message: str, *, tb: str = "", type_name: str = "") -> None:
        self._send_reply(req, ErrorInfo(kind=kind, message=message[:60000], traceback=tb[:250000],
                                        type=type_name[:250]), record=True)

    def reply_ok(self, req: Incoming) -> None:
        self._send_reply(req, None, record=True)

    def reply_value(self, req: Incoming, value: Any) -> None:
        blobs = Blobs()
        try:
            payload = self._encode(value, blobs, req.header.src, [], "result")
        except E.RpcError as e:
            self.reply_error(req, "remote", str(e), type_name=type(e).__name__)
            return
        except Exception as e:
            self.reply_error(req, "remote", f"cannot encode the result: {e}", type_name="PayloadError")
            return
        self._send_reply(req, None, record=True, blobs=blobs, payload=payload)

    def _send_reply(self, req: Incoming, err: ErrorInfo | None, *, record: bool, blobs: Blobs | None = None,
                    payload: Any = None) -> None:
        h = req.header
        header = header_json(
            kind="rep", type=h.type, id=h.id, src=self.name, inc=self.incarnation, epoch=self._epoch(), err=err,
            payload=payload, blobs=blobs.meta if blobs is not None else None)
        frame: OutFrame = encode_frame(header, blobs)
        if record:
            frame = joined(frame)  # the completion record must not follow later changes of a result tensor
            self.incoming -= 1
            self.dedup.complete((h.src, h.inc), h.id, frame)
            waiters = self._dup_waiters.pop((h.src, h.inc, h.id), [])
            self._reactor.poke()
        else:
            waiters = []
        for ch in [req.channel, *waiters]:
            self._reply(ch, frame, h.type)

    def _reply(self, channel: ReplyChannel, frame: OutFrame, mtype: str) -> None:
        if not self._transport.send_reply_nowait(channel, frame):
            self._reactor.spawn(self._transport.send_reply(channel, frame, mtype))

    async def invoke(self, fn: str, args: Any, kwargs: Any) -> Any:
        entry = self._registry.lookup(fn)
        if entry.is_async:
            return await entry.fn(*args, **kwargs)
        if entry.inline:
            return entry.fn(*args, **kwargs)
        return await self._reactor.loop.run_in_executor(self._executor, lambda: entry.fn(*args, **kwargs))

    def _start_call(self, req: Incoming, entry: Registered, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Run a called function: a coroutine function as a task, an inline one now, any other on a worker
        thread whose completion comes back to the loop as one callback (no task, no asyncio future)."""
        if entry.is_async:
            self._reactor.spawn(self._run_call(req, entry.name, args, kwargs))
            return
        if entry.inline:
            try:
                value = entry.fn(*args, **kwargs)
            except Exception as e:
                self.reply_error(req, "remote", f"{e}", tb=traceback.format_exc(), type_name=type(e).__name__)
                return
            del args, kwargs
            self.reply_value(req, value)
            return
        fn = entry.fn

        def work() -> Any:
            try:
                return fn(*args, **kwargs)
            finally:  # release argument handles before the reply (their deletes may go out first)
                args.clear()
                kwargs.clear()

        try:
            self._executor.submit(work).add_done_callback(
                lambda f: self._reactor.call_soon(self._call_finished, req, f))
        except RuntimeError as e:  # the worker threads are shut down
            self.reply_error(req, "remote", f"{e}", type_name="RpcShutdown")

    def _call_finished(self, req: Incoming, f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            self.reply_error(req, "remote", "the call was cancelled by shutdown", type_name="RpcShutdown")
            return
        e = f.exception()
        if e is not None:
            self.reply_error(req, "remote", f"{e}", tb="".join(traceback.format_exception(e)),
                             type_name=type(e).__name__)
            return
        self.reply_value(req, f.result())

    async def _run_call(self, req: Incoming, fn: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        try:
            value = await self.invoke(fn, args, kwargs)
        except Exception as e:
            self.reply_error(req, "remote", f"{e}", tb=traceback.format_exc(), type_name=type(e).__name__)
            return
        del args, kwargs  # release argument handles before the reply (their deletes may go out first)
        self.reply_value(req, value)

    def forget(self, name: str, incarnation: str, replaced: bool) -> None:
        """``name`` died: drop its completion records (only ``incarnation``'s when ``replaced``)."""
        if replaced:
            self.dedup.forget_sender((name, incarnation))
            return
        self.dedup.forget_worker(name)
        for key in [k for k in self._dup_waiters if k[0] == name]:
            del self._dup_waiters[key]
        self.done_from.add(name)
