"""An in-memory model of one etcd v3 server, for simulating thousands of agents on one machine.

It offers the subset of :class:`stalwart.etcd.store.Store` the rendezvous and restart code calls (``get``,
``get_prefix``, ``put``, ``delete``, ``txn``, ``revision``, ``watch``, leases), with etcd 3.5's semantics:

* one revision counter; every request that changes keys advances it by one, and every key it changes gets
  that revision as ``mod_revision`` (``create_revision`` too when the key is new; ``version`` counts puts);
  a request that changes nothing (a failed compare with reads only, a delete of nothing) leaves it;
* transactions: a branch that writes one key twice is refused; every compare must hold (over a range with
  ``prefix``: every key under it, and an empty range compares as a key with zero fields, except a ``value``
  compare, which fails); ops run in order and a read sees the writes before it in the same transaction;
* leases: a put under an unknown lease is refused; revoking a lease deletes its keys in one revision;
* prefix watches from a start revision deliver every change under the prefix in revision order (a delete
  as a key with zero create revision and version, as etcd sends it);
* ``proposals`` counts what etcd's ``etcd_server_proposals_committed_total`` counts for these calls: every
  put, delete, transaction with a write in either branch, lease grant and lease revoke; reads and read-only
  transactions are not proposals.

``tests/bench/test_scale_memetcd.py`` runs the same operations on this model and on a real etcd server and
compares every answer, revision, watch event and the proposal count.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stalwart.etcd.store import (
    MAX_VALUE_BYTES,
    Compare,
    Delete,
    Get,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    StoreError,
    Txn,
    TxnResult,
    WatchEvent,
    check_value_size,
)

_OPS: dict[str, Callable[[Any, Any], bool]] = {"==": operator.eq, "!=": operator.ne, "<": operator.lt,
                                               ">": operator.gt}
_EMPTY = KeyValue("", b"", 0, 0, 0, 0)


@dataclass(slots=True)
class Counters:
    """What the server did: raft proposals, read requests and the keys and bytes they returned."""

    proposals: int = 0
    reads: int = 0
    keys_read: int = 0
    bytes_read: int = 0


@dataclass(slots=True)
class MemWatch:
    """A prefix watch: a cursor into the server's change log. ``next`` never blocks (the simulator owns time)."""

    server: MemEtcd
    key: str
    prefix: bool
    cursor: int
    cancelled: bool = False

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key

    def next(self, timeout: float | None = None) -> WatchEvent | None:
        log = self.server.log
        while not self.cancelled and self.cursor < len(log):
            ev = log[self.cursor]
            self.cursor += 1
            if self.matches(ev.kv.key):
                return ev
        return None

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class MemEtcd:
    """The model server. ``log`` holds every change in revision order (one entry per changed key)."""

    revision_now: int = 1
    keys: dict[str, KeyValue] = field(default_factory=dict)
    sorted_keys: list[str] = field(default_factory=list)
    leases: dict[int, int] = field(default_factory=dict)  # id -> ttl
    lease_keys: dict[int, set[str]] = field(default_factory=dict)
    log: list[WatchEvent] = field(default_factory=list)
    log_revisions: list[int] = field(default_factory=list)
    counters: Counters = field(default_factory=Counters)
    next_lease: int = 0x7E57_0000_0000
    #: The client's cap on a value (the Store refuses a larger put before sending it).
    value_limit: int = MAX_VALUE_BYTES
    #: etcd's own limits on a transaction (defaults of --max-txn-ops and --max-request-bytes).
    txn_ops_limit: int = 128
    request_limit: int = 1572864

    # -- reads ------------------------------------------------------------------------------------------

    def _range(self, key: str, prefix: bool) -> list[KeyValue]:
        if not prefix:
            kv = self.keys.get(key)
            return [] if kv is None else [kv]
        i = bisect.bisect_left(self.sorted_keys, key)
        out: list[KeyValue] = []
        while i < len(self.sorted_keys) and self.sorted_keys[i].startswith(key):
            out.append(self.keys[self.sorted_keys[i]])
            i += 1
        return out

    def _count_read(self, kvs: list[KeyValue]) -> list[KeyValue]:
        self.counters.reads += 1
        self.counters.keys_read += len(kvs)
        self.counters.bytes_read += sum(len(kv.key) + len(kv.value) for kv in kvs)
        return kvs

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        kvs = self._count_read(self._range(key, False))
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str, *, keys_only: bool = False,
                   timeout: float | None = None) -> tuple[list[KeyValue], int]:
        kvs = self._count_read(self._range(prefix, True))
        return ([dataclasses.replace(kv, value=b"") for kv in kvs] if keys_only else kvs), self.revision_now

    def count_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        self.counters.reads += 1
        return len(self._range(prefix, True))

    def revision(self, *, timeout: float | None = None) -> int:
        return self.revision_now

    # -- writes -----------------------------------------------------------------------------------------

    def _changed(self, changes: list[WatchEvent], rev: int) -> None:
        for ev in changes:
            self.log.append(ev)
            self.log_revisions.append(rev)

    def _put(self, key: str, value: bytes, lease: int, rev: int, changes: list[WatchEvent]) -> None:
        check_value_size(key, value, self.value_limit)
        if lease and lease not in self.leases:
            raise LeaseNotFound(f"put {key}: etcdserver: requested lease not found")
        old = self.keys.get(key)
        if old is None:
            bisect.insort(self.sorted_keys, key)
            kv = KeyValue(key, value, rev, rev, 1, lease)
        else:
            if old.lease and old.lease != lease:
                self.lease_keys.get(old.lease, set()).discard(key)
            kv = KeyValue(key, value, old.create_revision, rev, old.version + 1, lease)
        if lease:
            self.lease_keys.setdefault(lease, set()).add(key)
        self.keys[key] = kv
        changes.append(WatchEvent("put", kv))

    def _delete(self, key: str, prefix: bool, rev: int, changes: list[WatchEvent]) -> None:
        for kv in self._range(key, prefix):
            del self.keys[kv.key]
            self.sorted_keys.pop(bisect.bisect_left(self.sorted_keys, kv.key))
            if kv.lease:
                self.lease_keys.get(kv.lease, set()).discard(kv.key)
            changes.append(WatchEvent("delete", KeyValue(kv.key, b"", 0, rev, 0, 0)))

    def _compare(self, c: Compare) -> bool:
        kvs = self._range(c.key, c.prefix)
        if not kvs:
            if c.target == "value":
                return False
            kvs = [_EMPTY]
        op = _OPS[c.op]
        for kv in kvs:
            fields: dict[str, int | bytes] = {"mod": kv.mod_revision, "create": kv.create_revision,
                                              "version": kv.version, "lease": kv.lease, "value": kv.value}
            actual = fields[c.target]
            if not op(actual, c.value):
                return False
        return True

    def txn(self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
            *, timeout: float | None = None) -> TxnResult:
        nested = [op for op in (*success, *failure) if isinstance(op, Txn)]
        flat = [*success, *failure, *(o for t in nested for o in (*t.success, *t.failure))]
        for op in flat:
            if isinstance(op, Put):
                check_value_size(op.key, op.value, self.value_limit)
        if max(len(compare), len(success), len(failure), *(len(t.compare) for t in nested)) > self.txn_ops_limit:
            raise StoreError("etcd txn failed: etcdserver: too many operations in txn request")
        size = sum(len(op.key) + len(op.value) for op in flat if isinstance(op, Put))
        if size > self.request_limit:
            raise StoreError("etcd txn failed: etcdserver: request is too large")
        writes = any(isinstance(op, (Put, Delete)) for op in flat)
        # Every compare, the nested ones too, is judged on the store as it is before the transaction.
        ok = all(self._compare(c) for c in compare)
        path: list[tuple[Op, Sequence[Op]]] = []
        for op in success if ok else failure:
            if isinstance(op, Txn):
                path.append((op, op.success if all(self._compare(c) for c in op.compare) else op.failure))
            else:
                path.append((op, ()))
        for branch in (success, failure):
            # etcd refuses a key written twice in a branch, a nested branch's writes counted with its parent's.
            base = [op.key for op in branch if isinstance(op, (Put, Delete))]
            subs = [[o.key for o in sub if isinstance(o, (Put, Delete))]
                    for t in branch if isinstance(t, Txn) for sub in (t.success, t.failure)]
            for keys in (base, *(base + sub for sub in subs)):
                if len(keys) != len(set(keys)):
                    raise StoreError("etcd txn failed: etcdserver: duplicate key given in txn request")
        rev = self.revision_now + 1
        changes: list[WatchEvent] = []
        reads: list[list[KeyValue]] = []
        counts: list[int] = []
        for op, inner in path:
            if isinstance(op, Txn):
                for o in inner:
                    self._apply(o, rev, changes)
                reads.append([])
                counts.append(0)
            else:
                found, read = self._apply(op, rev, changes)
                reads.append(read)
                counts.append(found)
        if writes:
            self.counters.proposals += 1
        else:
            self.counters.reads += 1
        if changes:
            self.revision_now = rev
            self._changed(changes, rev)
        return TxnResult(ok, self.revision_now, reads, counts)

    def _apply(self, op: Put | Delete | Get, rev: int, changes: list[WatchEvent]) -> tuple[int, list[KeyValue]]:
        """One operation of a transaction at ``rev``: how many keys a read found, and what it returns."""
        if isinstance(op, Put):
            self._put(op.key, op.value, op.lease, rev, changes)
            return 0, []
        if isinstance(op, Delete):
            self._delete(op.key, op.prefix, rev, changes)
            return 0, []
        found = self._range(op.key, op.prefix)
        read = [] if op.count_only else self._count_read(found)
        return len(found), [dataclasses.replace(kv, value=b"") for kv in read] if op.keys_only else read

    def put(self, key: str, value: bytes, *, lease: int = 0, timeout: float | None = None) -> int:
        return self.txn((), [Put(key, value, lease)]).revision

    def delete(self, key: str, *, timeout: float | None = None) -> bool:
        before = self.revision_now
        self.txn((), [Delete(key)])
        return self.revision_now != before

    def delete_prefix(self, prefix: str, *, timeout: float | None = None) -> int:
        n = len(self._range(prefix, True))
        self.txn((), [Delete(prefix, True)])
        return n

    # -- watches ------------------------------------------------------------------------------------------

    def watch(self, key: str, *, prefix: bool = False, start_revision: int = 0) -> MemWatch:
        start = self.revision_now + 1 if start_revision <= 0 else start_revision
        return MemWatch(self, key, prefix, bisect.bisect_left(self.log_revisions, start))

    def events_since(self, cursor: int) -> list[WatchEvent]:
        """The changes logged from ``cursor`` on (the simulator's fan-out reads these once for all watchers)."""
        return self.log[cursor:]

    # -- leases -----------------------------------------------------------------------------------------

    def lease_grant(self, ttl: int, *, keepalive: bool = True, timeout: float | None = None) -> int:
        if ttl < 1:
            raise ValueError(f"ttl: a lease needs at least 1 second, got {ttl}")
        self.counters.proposals += 1
        self.next_lease += 1
        self.leases[self.next_lease] = ttl
        return self.next_lease

    def lease_revoke(self, lease_id: int, *, timeout: float | None = None) -> None:
        """Revoke (or expire: etcd's expiry is a revoke the leader proposes) a lease and delete its keys."""
        if lease_id not in self.leases:
            return
        self.counters.proposals += 1
        del self.leases[lease_id]
        keys = sorted(self.lease_keys.pop(lease_id, set()))
        if keys:
            rev = self.revision_now + 1
            changes: list[WatchEvent] = []
            for key in keys:
                self._delete(key, False, rev, changes)
            self.revision_now = rev
            self._changed(changes, rev)

    def lease_ttl(self, lease_id: int, *, timeout: float | None = None) -> int:
        self.counters.reads += 1
        return self.leases.get(lease_id, -1)

    def lost_leases(self) -> set[int]:
        return set()

    def close(self) -> None:
        pass
