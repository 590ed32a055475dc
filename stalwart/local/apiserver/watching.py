"""Watch streams over HTTP: one JSON event per line, from a resourceVersion or with the current state first
(``sendInitialEvents`` with the ``k8s.io/initial-events-end`` bookmark), periodic bookmarks when asked for, Table
output, ``timeoutSeconds``; a version older than the history is a 410 inside the stream, as the API server
sends it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from aiohttp import web

from stalwart.local.apiserver import tables
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.apiserver.selectors import FieldRequirement, Requirement
from stalwart.local.apiserver.storage import Event

JSON = dict[str, Any]
BOOKMARK_EVERY = 10.0


def wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "")


async def serve_watch(request: web.Request, store: ObjectStore, info: ResourceInfo,  # noqa: PLR0917
                      namespace: str | None, labels: list[Requirement],
                      fields: list[FieldRequirement]) -> web.StreamResponse:
    q = request.query
    table = wants_table(request)
    initial = q.get("sendInitialEvents") == "true"
    try:
        watcher = store.watch(info, namespace, None if initial else q.get("resourceVersion"), labels, fields)
    except ApiError as exc:
        if exc.code != 410:
            raise
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        await resp.write(json.dumps({"type": "ERROR", "object": exc.status()}).encode() + b"\n")
        await resp.write_eof()
        return resp
    timeout = float(q.get("timeoutSeconds") or 1800)
    bookmarks = q.get("allowWatchBookmarks") == "true"
    resp = web.StreamResponse(headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    include = q.get("includeObject", "Metadata")

    def encode(ev: Event) -> bytes:
        obj = {**ev.obj, "apiVersion": info.api_version, "kind": info.kind}
        if table:
            obj = tables.table([obj], info.group, info.plural, info.crd, str(ev.rv), include_object=include)
        return json.dumps({"type": ev.type, "object": obj}, separators=(",", ":")).encode() + b"\n"

    def bookmark(annotations: dict[str, str] | None = None) -> bytes:
        meta: JSON = {"resourceVersion": str(store.rv)}
        if annotations:
            meta["annotations"] = annotations
        return json.dumps({"type": "BOOKMARK", "object": {"kind": info.kind, "apiVersion": info.api_version,
                                                          "metadata": meta}}).encode() + b"\n"

    try:
        if initial:
            while not watcher.queue.empty():
                ev = watcher.queue.get_nowait()
                if ev is not None:
                    await resp.write(encode(ev))
            await resp.write(bookmark({"k8s.io/initial-events-end": "true"}))
        while True:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                got = await asyncio.wait_for(watcher.queue.get(), min(left, BOOKMARK_EVERY))
            except TimeoutError:
                if bookmarks:
                    await resp.write(bookmark())
                continue
            if got is None:
                break
            await resp.write(encode(got))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        store.unwatch(watcher)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp
