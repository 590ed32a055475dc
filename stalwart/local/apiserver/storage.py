"""The storage under the object store, as etcd is under kube-apiserver: objects by key, one cluster-wide
revision counter, a bounded history of changes, watches, consistent snapshots at a past revision and paged lists.

Stored objects are never mutated once stored: a write stores a new dict. So the history shares them with the
store (an event holds the object after the change and, for MODIFIED and DELETED, the one before it), and a
snapshot at revision ``rv`` is the current state with the history after ``rv`` undone.

- Watches with a label or field selector see objects enter and leave the selection as the API server's watch
  cache shows them: ADDED when a change makes an object match, DELETED (with the object as it was, at the new
  revision) when a change makes it stop matching.
- Paged lists (``limit``/``continue``) are consistent: every page is read from the snapshot of the first page's
  revision. A token older than the history gets 410 Expired, with a token that goes on at the latest revision.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import json
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from stalwart.local.apiserver.errors import ApiError, bad_request, expired
from stalwart.local.apiserver.selectors import FieldRequirement, Requirement, fields_match, labels_match

JSON = dict[str, Any]
Key = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name

EXPIRED_LIST = "The resourceVersion for the provided list is too old."
EXPIRED_CONTINUE = ("The provided continue parameter is too old to display a consistent list result. You can "
                    "start a new list without the continue parameter, or use the continue token in this response "
                    "to retrieve the remainder of the results. Continuing with the provided token results in an "
                    "inconsistent list - objects that were created, modified, or deleted between the time the "
                    "first chunk was returned and now may show up in the list.")


def now_rfc3339(offset: float = 0.0) -> str:
    t = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Event:
    """A change: ``obj`` after it (for DELETED: the last state, at the deletion's revision), ``old`` before it
    (None for ADDED)."""
    type: str  # ADDED, MODIFIED, DELETED
    rv: int
    group: str
    plural: str
    obj: JSON
    old: JSON | None = None


def key_of(group: str, plural: str, obj: JSON) -> Key:
    meta = obj.get("metadata") or {}
    return (group, plural, str(meta.get("namespace") or ""), str(meta.get("name") or ""))


@dataclass(eq=False)
class Watcher:
    """A registered watch: the events it should see are put on ``queue``; ``None`` marks the end."""
    group: str
    plural: str
    namespace: str | None
    labels: list[Requirement]
    fields: list[FieldRequirement]
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)

    def selects(self, obj: JSON) -> bool:
        meta = obj.get("metadata") or {}
        return ((self.namespace is None or meta.get("namespace", "") == self.namespace)
                and labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, obj))

    def view(self, ev: Event) -> Event | None:
        """The event as this watch sees it (a change across the selection's edge becomes ADDED or DELETED), or
        None if it does not concern it."""
        if (ev.group, ev.plural) != (self.group, self.plural):
            return None
        now = self.selects(ev.obj)
        if ev.type != "MODIFIED":
            return ev if now else None
        before = ev.old is not None and self.selects(ev.old)
        if now:
            return ev if before else replace(ev, type="ADDED")
        if before and ev.old is not None:
            old = {**ev.old, "metadata": {**ev.old["metadata"], "resourceVersion": str(ev.rv)}}
            return replace(ev, type="DELETED", obj=old)
        return None


@dataclass(frozen=True)
class Page:
    items: list[JSON]
    rv: int
    continue_token: str = ""
    remaining: int | None = None


def encode_continue(rv: int, start: str) -> str:
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if data.get("v") != "meta.k8s.io/v1" or not isinstance(data.get("rv"), int):
            raise ValueError("unknown version")
        return int(data["rv"]), str(data["start"])
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
        raise bad_request(f"continue key is not valid: {exc}") from None


class Storage:
    """See the module docstring. ``history`` bounds how far back watches, snapshots and paged lists reach."""

    def __init__(self, history: int = 50_000) -> None:
        self.rv = 1
        self.objects: dict[Key, JSON] = {}
        self.by_resource: dict[tuple[str, str], dict[Key, JSON]] = {}
        self.history: deque[Event] = deque(maxlen=history)
        self.compacted_rv = 0
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[Event], None]] = []

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def compact(self) -> None:
        """Forget the history (as etcd compaction does): older resourceVersions now get 410."""
        self.compacted_rv = self.rv
        self.history.clear()

    def put(self, key: Key, obj: JSON, type_: str) -> None:
        """Store ``obj`` (whose resourceVersion is already the new revision) and tell watches and listeners."""
        old = self.objects.get(key)
        self.objects[key] = obj
        self.by_resource.setdefault(key[:2], {})[key] = obj
        self._emit(Event(type_, int(obj["metadata"]["resourceVersion"]), key[0], key[1], obj, old))

    def pop(self, key: Key) -> JSON | None:
        """Remove the object at ``key``; the DELETED event carries its last state at a new revision."""
        old = self.objects.pop(key, None)
        if old is None:
            return None
        self.by_resource.get(key[:2], {}).pop(key, None)
        gone = {**old, "metadata": {**old["metadata"], "resourceVersion": self.next_rv()}}
        self._emit(Event("DELETED", self.rv, key[0], key[1], gone, old))
        return gone

    def _emit(self, ev: Event) -> None:
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(ev)
        for w in list(self.watchers):
            seen = w.view(ev)
            if seen is not None:
                w.queue.put_nowait(seen)
        for listener in list(self.listeners):
            listener(ev)

    def end_watches(self, group: str, plural: str) -> None:
        """End every watch of a resource that is no longer served, as the API server does."""
        for w in [w for w in self.watchers if (w.group, w.plural) == (group, plural)]:
            w.queue.put_nowait(None)
            self.watchers.discard(w)

    # --- reads ---------------------------------------------------------------------------------------------------

    def of_resource(self, group: str, plural: str) -> dict[Key, JSON]:
        """The current objects of one resource (do not modify)."""
        return self.by_resource.get((group, plural), {})

    def snapshot(self, group: str, plural: str, rv: int) -> dict[Key, JSON]:
        """The objects of a resource as they were at revision ``rv`` (410 Expired if the history no longer
        reaches back)."""
        if rv >= self.rv:
            return self.of_resource(group, plural)
        if rv < self.compacted_rv:
            raise expired(EXPIRED_LIST)
        state = dict(self.of_resource(group, plural))
        for ev in reversed(self.history):
            if ev.rv <= rv:
                break
            if (ev.group, ev.plural) != (group, plural):
                continue
            key = key_of(ev.group, ev.plural, ev.obj)
            if ev.old is None:
                state.pop(key, None)
            else:
                state[key] = ev.old
        return state

    @staticmethod
    def select(state: dict[Key, JSON], namespace: str | None, labels: list[Requirement],
               fields: list[FieldRequirement]) -> list[tuple[Key, JSON]]:
        """The objects of ``state`` (one resource's) in ``namespace`` (None: all) matching the selectors, in key
        order."""
        out = []
        for key in sorted(k for k in state if (namespace is None or k[2] == namespace)):
            obj = state[key]
            meta = obj.get("metadata") or {}
            if labels and not labels_match(labels, meta.get("labels")):
                continue
            if fields and not fields_match(fields, obj):
                continue
            out.append((key, obj))
        return out

    def page(self, group: str, plural: str, namespace: str | None, labels: list[Requirement],
             fields: list[FieldRequirement], *, limit: int = 0, token: str = "", exact_rv: int | None = None) -> Page:
        """A list, whole or one page of ``limit`` items from the ``continue`` ``token`` on."""
        start = ""
        rv = self.rv if exact_rv is None else exact_rv
        if token:
            rv, start = decode_continue(token)
            if rv == -1:
                rv = self.rv
            elif rv < self.compacted_rv:
                raise expired(EXPIRED_CONTINUE, encode_continue(-1, start))
        state = self.snapshot(group, plural, rv)
        selected = self.select(state, namespace, labels, fields)
        if start:
            selected = [(k, o) for k, o in selected if f"{k[2]}/{k[3]}" > start]
        if limit <= 0 or len(selected) <= limit:
            return Page([o for _, o in selected], rv)
        shown = selected[:limit]
        last = shown[-1][0]
        remaining = None if labels or fields else len(selected) - limit
        return Page([o for _, o in shown], rv, encode_continue(rv, f"{last[2]}/{last[3]}\x00"), remaining)

    def watch(self, group: str, plural: str, namespace: str | None, labels: list[Requirement],  # noqa: PLR0917
              fields: list[FieldRequirement], since: int | None, initial: Iterable[JSON] = ()) -> Watcher:
        """Register a watch. ``since`` None: ``initial`` objects as ADDED events first; a revision: every later
        event (410 Expired if it is older than the history)."""
        w = Watcher(group, plural, namespace, labels, fields)
        if since is None:
            for obj in initial:
                w.queue.put_nowait(Event("ADDED", int(obj["metadata"]["resourceVersion"]), group, plural, obj))
        else:
            if since < self.compacted_rv:
                raise ApiError(410, "Expired", f"too old resource version: {since} ({self.compacted_rv + 1})")
            for ev in self.history:
                if ev.rv > since:
                    seen = w.view(ev)
                    if seen is not None:
                        w.queue.put_nowait(seen)
        self.watchers.add(w)
        return w
