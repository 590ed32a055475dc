"""The operator's adapter to etcd: one :class:`~stalwart.etcd.store.Store` per distinct endpoint list, a job's view
read in one transaction, the operator's writes (JobRecord, expected nodes, close, fencing), the finalizer's
prefix deletion, and one watch per store that wakes a job's reconcile when its agents report.

All methods are synchronous (the Store is); the operator calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import ClosedRecord, ExpectedNodes, FenceRecord
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.keys import FENCED, ROOT, JobKeys
from stalwart.etcd.store import Get, Put, Store, StoreError
from stalwart.jitter import RNG
from stalwart.operator import metrics
from stalwart.operator.model import EtcdView
from stalwart.operator.observe import etcd_view, fault_entries

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Called with (namespace, job uid) when something under that job's prefix changes.
OnChange = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """An etcd cluster and how to log in to it (TLS material and/or a user, from the job's
    ``spec.rendezvous.secretRef`` or the operator's own). The credentials keep secrets out of ``repr``."""

    endpoints: tuple[str, ...]
    credentials: EtcdCredentials = field(default_factory=EtcdCredentials)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: at least one etcd endpoint (host:port) is required")


class EtcdAccess:
    """The etcd side of the operator. ``on_change`` (optional) is called from a watch thread."""

    def __init__(self, *, timeout: float = 5.0, on_change: OnChange | None = None,
                 enable_auth: bool = False) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.on_change = on_change
        #: Turn authentication on where it is off, when logging in as root (see etcd_client.connect).
        self.enable_auth = enable_auth
        self._stores: dict[EtcdTarget, Store] = {}
        self._watchers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def store(self, target: EtcdTarget | Sequence[str]) -> Store:
        """The Store for ``target`` (endpoints alone mean no TLS, no user), created on first use."""
        key = target if isinstance(target, EtcdTarget) else EtcdTarget(tuple(target))
        with self._lock:
            if self._stop.is_set():
                raise StoreError("the operator's etcd access is closed")
            store = self._stores.get(key)
            if store is None:
                store = connect(list(key.endpoints), key.credentials, timeout=self.timeout,
                                enable_auth=self.enable_auth)
                self._stores[key] = store
                if self.on_change is not None:
                    t = threading.Thread(target=self._watch, args=(store,), name=f"etcd-watch-{len(self._stores)}",
                                         daemon=True)
                    self._watchers.append(t)
                    t.start()
            return store

    # -- reads ---------------------------------------------------------------------------------------------

    def read(self, endpoints: EtcdTarget | Sequence[str], keys: JobKeys) -> EtcdView:
        """The job's records (JobRecord, rendezvous, progress) read at one revision, in one round trip, then
        the fault records of the current round (a second read: their prefix depends on the round's epoch)."""
        store = self.store(endpoints)
        try:
            result = store.txn([], [Get(keys.job), Get(keys.rendezvous, prefix=True),
                                    Get(keys.progress, prefix=True), Get(keys.prefix + FENCED, prefix=True,
                                                                         keys_only=True)])
            view = etcd_view(keys, [kv for kvs in result.responses for kv in kvs])
            if view.epoch:
                kvs, _ = store.get_prefix(f"{keys.restart}{view.epoch}/fault/")
                view = replace(view, faults=fault_entries(kvs))
        except StoreError:
            metrics.ETCD_ERRORS.labels("read").inc()
            raise
        return view

    # -- writes --------------------------------------------------------------------------------------------

    def write_record(self, endpoints: EtcdTarget | Sequence[str], keys: JobKeys, record: JobRecord,
                     expected: Sequence[str]) -> None:
        """Write the JobRecord and (when non-empty) the expected nodes, atomically."""
        ops = [Put(keys.job, record.to_json_bytes())]
        if expected:
            ops.append(Put(keys.expected, ExpectedNodes(node_ids=list(expected)).to_json_bytes()))
        self._write("write record", lambda: self.store(endpoints).txn([], ops))

    def revoke(self, endpoints: EtcdTarget | Sequence[str], lease_id: int) -> None:
        """Revoke a lost node's lease (fencing): its node key goes at once, so it cannot join a new round."""
        self._write("revoke", lambda: self.store(endpoints).lease_revoke(lease_id))

    def write_fence(self, endpoints: EtcdTarget | Sequence[str], keys: JobKeys, record: FenceRecord) -> None:
        """Write a fenced pod's fence record (once written it stays until the job's keys go)."""
        self._write("fence", lambda: self.store(endpoints).put(keys.fenced(record.pod_uid), record.to_json_bytes()))

    def close_rendezvous(self, endpoints: EtcdTarget | Sequence[str], keys: JobKeys, reason: str) -> None:
        self._write("close", lambda: self.store(endpoints).put(
            keys.closed, ClosedRecord(reason=reason[:1024]).to_json_bytes()))

    def delete_job(self, endpoints: EtcdTarget | Sequence[str], keys: JobKeys) -> int:
        """Delete every key under the job's prefix and nothing else; returns how many went."""
        deleted: int = self._write("delete prefix", lambda: self.store(endpoints).delete_prefix(keys.prefix))
        return deleted

    def _write(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreError:
            metrics.ETCD_ERRORS.labels(what).inc()
            raise

    # -- wake-ups --------------------------------------------------------------------------------------------

    def _watch(self, store: Store) -> None:
        """Watch every job prefix on ``store`` and call ``on_change``; reconnect with capped, jittered backoff
        until :meth:`close`."""
        backoff = 0.2
        while not self._stop.is_set():
            try:
                with store.watch(ROOT, prefix=True) as watch:
                    backoff = 0.2
                    while not self._stop.is_set():
                        event = watch.next(timeout=0.5)
                        if event is None:
                            continue
                        parts = event.kv.key[len(ROOT):].split("/", 2)
                        if len(parts) >= 2 and self.on_change is not None:
                            self.on_change(parts[0], parts[1])
            except StoreError as e:
                if self._stop.is_set():
                    return
                log.debug("etcd watch on %s failed (%s); retrying in %.1fs", store.endpoints, e, backoff)
                self._stop.wait(backoff * RNG.uniform(0.5, 1.5))
                backoff = min(backoff * 2, 5.0)

    def close(self) -> None:
        """Stop the watch threads and close every store. Idempotent."""
        self._stop.set()
        for t in self._watchers:
            t.join(timeout=5.0)
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
