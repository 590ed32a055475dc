"""Keeping a Store's leases alive: one thread per Store (:class:`KeepAlive`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from stalwart.etcd.errors import StoreError
from stalwart.jitter import RNG

if TYPE_CHECKING:
    from stalwart.etcd.store import Store

log = logging.getLogger(__name__)

__all__ = ["KeepAlive"]


class KeepAlive:
    """One thread per Store that refreshes every kept lease at a third of its TTL, with jitter.

    A lease etcd reports as gone (TTL <= 0) is dropped and remembered in :meth:`lost`, so its owner can
    notice it was fenced out. Transient failures are retried at the next tick; the lease survives as long as
    a refresh lands within its TTL. Once no refresh was answered for longer than the TTL, etcd has let the
    lease expire (it counts the TTL from a refresh it answered, before the answer came): the process behind a
    partition says so at once, as fenced, without waiting for etcd to tell it. Only etcd's own answer puts
    the lease in :meth:`lost` (a change of etcd's leader extends every lease).
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, next due monotonic time)
        self._lost: set[int] = set()
        self._answered: dict[int, float] = {}  # id -> when etcd last answered for it (monotonic)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keepalive", daemon=True)
        self._thread.start()

    def add(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            self._leases[lease_id] = (ttl, time.monotonic() + ttl / 3)
            self._answered[lease_id] = time.monotonic()  # granted just now
        self._wake.set()

    def remove(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)
            self._answered.pop(lease_id, None)

    def lost(self) -> set[int]:
        with self._lock:
            return set(self._lost)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                due = [(lid, ttl) for lid, (ttl, at) in self._leases.items() if at <= now]
                nxt = min((at for _, at in self._leases.values()), default=now + 1.0)
            for lid, ttl in due:
                if self._stop.is_set():
                    return
                try:
                    granted = self._store.lease_refresh(lid, timeout=max(0.5, ttl / 3))
                except StoreError as e:
                    log.warning("lease %x keep-alive failed, retrying: %s", lid, e)
                    self._overdue(lid, ttl)
                    retry = min(1.0, ttl / 6) * (0.5 + RNG.random())
                    with self._lock:
                        if lid in self._leases:
                            self._leases[lid] = (ttl, time.monotonic() + retry)
                    continue
                with self._lock:
                    if granted <= 0:
                        self._leases.pop(lid, None)
                        self._lost.add(lid)
                        log.warning("lease %x has expired; its keys are gone", lid)
                    elif lid in self._leases:
                        self._answered[lid] = time.monotonic()
                        jitter = 0.9 + 0.2 * RNG.random()
                        self._leases[lid] = (ttl, time.monotonic() + ttl / 3 * jitter)
            with self._lock:
                nxt = min((at for _, at in self._leases.values()), default=time.monotonic() + 1.0)
            self._wake.wait(timeout=max(0.01, min(1.0, nxt - time.monotonic())))
            self._wake.clear()

    def _overdue(self, lid: int, ttl: int) -> None:
        """Say once, when it happens, that ``lid`` went unanswered past its TTL: this process is fenced."""
        with self._lock:
            answered = self._answered.get(lid)
            if answered is None or time.monotonic() - answered <= ttl:
                return
            self._answered.pop(lid)  # said once; a later answer starts the count again
        log.warning("lease %x: no keep-alive answered for %.1fs, longer than its TTL (%ds): etcd has let it "
                    "expire, so this process is fenced (its keys are gone, writes bound to it or to its round "
                    "are refused)", lid, time.monotonic() - answered, ttl)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            # One refresh may still be in flight (its deadline is at most ttl/3); the thread ends after it.
            log.warning("lease keep-alive thread did not stop within 5s; it ends after its refresh in flight")
