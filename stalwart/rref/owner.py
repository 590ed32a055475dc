"""The owner's side of the RRef runtime: computing values, waiting for them, and serving the protocol's
requests (``remote``, ``fetch``, ``fork``, ``accept``, ``delete``). Runs on the agent's loop thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from stalwart.rpc.errors import RpcTimeout, RRefCreationFailed, RRefDeleted
from stalwart.rpc.extension import Incoming, RpcHost
from stalwart.rref.book import Control, RRefBook


class Values:
    """The values worker ``host.name`` owns, in ``book``; ``send`` sends control messages."""

    def __init__(self, host: RpcHost, book: RRefBook, send: Callable[[list[Control]], None]) -> None:
        self._host = host
        self._book = book
        self._send = send
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}

    def create_local(self, rref: str, fn: str, args: Any, kwargs: Any) -> None:
        self._book.handle_added(rref)
        self._book.create(rref, None, self._host.name)
        self._host.spawn(self._compute(rref, fn, args, kwargs))

    async def _compute(self, rref: str, fn: str, args: Any, kwargs: Any) -> None:
        try:
            value = await self._host.invoke(fn, args, kwargs)
        except BaseException as e:
            self._book.set_error(rref, "rref_failed", f"{type(e).__name__}: {e}")
        else:
            self._book.set_value(rref, value)
        self.wake([rref])

    def wake(self, rrefs: list[str]) -> None:
        """The values ``rrefs`` are ready, failed or freed: wake who waits for them."""
        for r in rrefs:
            for fut in self._waiters.pop(r, []):
                if not fut.done():
                    fut.set_result(None)

    def wake_all(self) -> None:
        self.wake(list(self._waiters))

    async def value(self, rref: str, limit: float) -> Any:
        """The owner's value of ``rref`` once computed; raises the typed error otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        name = self._host.name
        while True:
            rec = self._book.owners.get(rref)
            if rec is None and rref in self._book.freed:
                raise RRefDeleted(f"RRef {rref} was deleted on its owner {name}")
            if rec is not None and rec.state == "ready":
                return rec.value
            if rec is not None and rec.state == "failed":
                assert rec.error is not None
                raise RRefCreationFailed(f"RRef {rref} on {name}: {rec.error[1]}")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise RpcTimeout(f"RRef {rref}: value not ready on {name} within {limit}s")
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.setdefault(rref, []).append(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)

    def on_request(self, req: Incoming) -> None:
        h, host, book = req.header, self._host, self._book
        match h.type:
            case "remote":
                decoded = host.decode_call(req)
                if decoded is None:
                    return
                fn, args, kwargs = decoded
                if h.rref is None or h.fork is None:
                    host.reply_error(req, "bad_request", "remote needs rref and fork")
                    return
                if book.create(h.rref, h.fork, h.src):
                    self.wake([h.rref])  # its creator already let go of it: nothing to compute
                else:
                    host.spawn(self._compute(h.rref, fn, args, kwargs))
                host.reply_ok(req)
            case "fetch":
                timeout = h.payload.get("timeout") if isinstance(h.payload, dict) else None
                if not isinstance(timeout, int | float) or not 0 < timeout <= 86400:
                    host.reply_error(req, "bad_request", "fetch: payload.timeout must be in (0, 86400]")
                    return
                host.spawn(self._fetch(req, h.rref or "", float(timeout)))
            case "fork":
                if book.fork_request(h.rref or "", h.fork or "", h.src):
                    host.reply_ok(req)
                else:
                    host.reply_error(req, "rref_deleted", f"RRef {h.rref} is already deleted")
            case "accept":
                controls, freed = book.child_accepted(h.fork or "")
                self._send(controls)
                self.wake(freed)
                host.reply_ok(req)
            case "delete":
                self.wake(book.delete_request(h.rref or "", h.fork or "", h.src))
                host.reply_ok(req)
            case _:
                host.reply_error(req, "bad_request", f"not an RRef request: {h.type}")

    async def _fetch(self, req: Incoming, rref: str, limit: float) -> None:
        host = self._host
        try:
            value = await self.value(rref, limit)
        except RRefDeleted as e:
            host.reply_error(req, "rref_deleted", str(e))
            return
        except RRefCreationFailed as e:
            host.reply_error(req, "rref_failed", str(e))
            return
        except RpcTimeout as e:
            host.reply_error(req, "remote", str(e), type_name="RpcTimeout")
            return
        host.reply_value(req, value)
