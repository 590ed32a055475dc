"""A watch on a key or prefix (:class:`Watch`): a stream of events that notices when it goes silent."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import grpc
from pyetcd.etcdrpc import rpc_pb2 as rpc

from stalwart.etcd import auth as store_auth
from stalwart.etcd.errors import StoreError, StorePermissionDenied, StoreTimeout, WatchCompacted, map_error
from stalwart.etcd.records import KeyValue, WatchEvent

if TYPE_CHECKING:
    from stalwart.etcd.store import Store

__all__ = ["WATCH_IDLE_CHECK", "Watch"]

log = logging.getLogger(__name__)

#: A watch that has delivered nothing for this many seconds asks etcd for a progress report; one that does not
#: answer within the store's timeout is silent (see :class:`Watch`).
WATCH_IDLE_CHECK = 10.0


class Watch:
    """A stream of events for a key or prefix (or several, on one stream), from a start revision.

    Iterate with :meth:`next` (which takes a timeout, so no wait is unbounded) or as an iterator. Cancel with
    :meth:`cancel` (also done by ``with``). Errors on the stream surface as :class:`StoreError` from ``next``.

    A stream can go silent without breaking: etcd stops delivering to a watcher that falls behind (an
    "unsynced" watcher) and a proxy can stall while the connection lives, so gRPC keepalives see nothing
    wrong. Whenever :meth:`next` has seen no response for :data:`WATCH_IDLE_CHECK` seconds it asks etcd for a
    progress report on the stream (answered at once by a synced watcher); if nothing at all arrives within the
    store's timeout after that, ``next`` raises :class:`StoreTimeout` and the caller re-reads and watches anew,
    as after any broken stream. A silent watch is thus noticed within ``WATCH_IDLE_CHECK`` + timeout seconds.
    """

    _END = object()

    def __init__(self, store: Store, ranges: list[tuple[bytes, bytes, bool]], start_revision: int) -> None:
        """``ranges``: (key, range_end, no_put) for each part watched, all on this one stream."""
        self._queue: queue.Queue[Any] = queue.Queue()
        self._requests: queue.Queue[Any] = queue.Queue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._to_create = len(ranges)
        self._create_error: StoreError | None = None
        self._answer_within = store.timeout
        self._last_response = time.monotonic()
        self._progress_asked: float | None = None
        for key, range_end, no_put in ranges:
            create = rpc.WatchCreateRequest(key=key, range_end=range_end, start_revision=start_revision,
                                            filters=[rpc.WatchCreateRequest.NOPUT] if no_put else [])
            self._requests.put(rpc.WatchRequest(create_request=create))
        key = ranges[0][0]
        self._store = store
        store._opened(self)  # the Store cancels this watch when it closes, if its owner has not
        self._member = store._members.current()
        try:
            # "hasleader": the member ends the stream when it loses its raft leader, as etcd's own client
            # asks, instead of keeping a watch that a minority member can no longer feed.
            metadata = [*(store._metadata(self._member, "watch") or []), ("hasleader", "true")]
            self._call = self._member.watch.Watch(self._request_iter(), metadata=metadata)
        except BaseException:
            store._ended(self)
            raise
        self._thread = threading.Thread(target=self._pump, args=(key,), name=f"etcd-watch:{key[:40]!r}",
                                        daemon=True)
        self._thread.start()
        if not self._created.wait(store.timeout):
            self.cancel()
            late = StoreTimeout(f"watch on {key!r} was not created within {store.timeout}s")
            store._stream_failed(self._member, late)
            raise late
        if self._create_error is not None:
            self.cancel()
            raise self._create_error

    def _request_iter(self) -> Iterator[Any]:
        while True:
            req = self._requests.get()
            if req is None:
                return
            yield req

    def _pump(self, key: bytes) -> None:
        try:
            for resp in self._call:
                self._last_response = time.monotonic()
                if resp.compact_revision:
                    err: StoreError = WatchCompacted(resp.compact_revision)
                    if not self._created.is_set():
                        self._create_error = err
                        self._created.set()
                    self._queue.put(err)
                    return
                if resp.created and not resp.canceled:
                    self._to_create -= 1
                    if self._to_create == 0:
                        self._created.set()
                if resp.canceled:
                    reason = resp.cancel_reason
                    err = StorePermissionDenied(f"watch on {key!r}: {store_auth.EXPLAIN['permission']}") \
                        if "permission denied" in reason else StoreError(f"watch canceled by server: {reason}")
                    if not self._created.is_set():
                        self._create_error = err
                        self._created.set()
                    self._queue.put(err)
                    return
                for ev in resp.events:
                    kind: Literal["put", "delete"] = "put" if ev.type == 0 else "delete"
                    self._queue.put(WatchEvent(kind, KeyValue._from_pb(ev.kv)))
        except grpc.RpcError as e:
            if not self._cancelled.is_set():
                failure = map_error(e, "watch")
                if not self._created.is_set():
                    self._create_error = failure
                    self._created.set()
                self._queue.put(failure)
        finally:
            self._queue.put(self._END)

    def next(self, timeout: float | None) -> WatchEvent | None:
        """The next event, or ``None`` when ``timeout`` passes first. Raises on a broken or silent stream."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            self._check_silence()
            return None
        if item is self._END:
            self._queue.put(item)
            raise StoreError("watch has ended")
        if isinstance(item, StoreError):
            self._queue.put(self._END)
            self._store._stream_failed(self._member, item)
            raise item
        assert isinstance(item, WatchEvent)
        return item

    def _check_silence(self) -> None:
        now = time.monotonic()
        asked = self._progress_asked
        if asked is not None and self._last_response >= asked:
            self._progress_asked = asked = None
        if asked is None:
            if now - self._last_response >= WATCH_IDLE_CHECK and not self._cancelled.is_set():
                self._progress_asked = now
                self._requests.put(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
            return
        if now - asked > self._answer_within:
            silent = StoreTimeout(f"watch silent: no answer to a progress request within {self._answer_within:g}s")
            self._store._stream_failed(self._member, silent)
            raise silent

    def __iter__(self) -> Iterator[WatchEvent]:
        while True:
            ev = self.next(timeout=WATCH_IDLE_CHECK / 2)
            if ev is not None:
                yield ev

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._requests.put(None)
        self._call.cancel()
        self._store._ended(self)
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            # A reader stuck in gRPC past the cancel: it is a daemon and ends with the channel, but say so.
            log.warning("watch %s: its reader thread did not stop within 5s of the cancel", self._thread.name)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()
