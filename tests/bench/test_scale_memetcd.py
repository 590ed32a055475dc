"""The simulator's etcd model answers as the real etcd server does, on the operations the protocols use.

One script of operations runs on a fresh real etcd server (through stalwart's Store) and on
:class:`bench.scalesim.memetcd.MemEtcd`; every answer, every revision (relative to the start), every watch
event and the count of raft proposals must agree. Lease ids differ between the two and are mapped by order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rendezvous import proposals
from bench.scalesim.memetcd import MemEtcd
from stalwart.etcd.store import Compare, Delete, Get, KeyValue, Put, Store, StoreError, Txn, ValueTooLarge
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration

P = "/sim/"


class Normal:
    """Revisions relative to the start, lease ids by grant order: what can be compared across the two."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.leases: dict[int, int] = {0: 0}

    def rev(self, r: int) -> int:
        return r - self.base if r else 0

    def kv(self, kv: KeyValue | None) -> tuple[Any, ...] | None:
        if kv is None:
            return None
        return (kv.key, kv.value, self.rev(kv.create_revision), self.rev(kv.mod_revision), kv.version,
                self.leases.get(kv.lease, -1))


def script(s: Any, n: Normal) -> list[Any]:
    """The operations, with every answer normalised."""
    out: list[Any] = []

    def lease(ttl: int) -> int:
        lid = s.lease_grant(ttl, keepalive=False) if isinstance(s, Store) else s.lease_grant(ttl)
        n.leases[lid] = len(n.leases)
        return int(lid)

    def txn(compare: list[Compare], success: list[Any], failure: list[Any] = ()) -> None:  # type: ignore[assignment]
        r = s.txn(compare, success, failure)
        out.append(("txn", r.succeeded, n.rev(r.revision), [[n.kv(kv) for kv in rr] for rr in r.responses]))

    out.append(("put", n.rev(s.put(P + "a", b"1"))))
    out.append(("put", n.rev(s.put(P + "a", b"2"))))  # version 2, create kept
    txn([Compare(P + "b", "create", "==", 0)], [Put(P + "b", b"x")], [Get(P + "b")])
    txn([Compare(P + "b", "create", "==", 0)], [Put(P + "b", b"y")], [Get(P + "b")])  # refused: reads b
    first = lease(30)
    second = lease(30)
    txn([], [Put(P + "n/1", b"one", first), Put(P + "n/2", b"two", first), Put(P + "n/3", b"three", second)])
    rev = s.get_prefix(P + "n/")[1]
    # A compare over a range: every key under it must hold; an empty range compares as zero.
    txn([Compare(P + "n/", "create", "<", rev + 1, prefix=True)], [Put(P + "m", b"ok")])
    txn([Compare(P + "n/", "create", "<", rev, prefix=True)], [Put(P + "m", b"no")], [Get(P + "m")])
    txn([Compare(P + "empty/", "create", "<", 1, prefix=True)], [Put(P + "e", b"1")])
    txn([Compare(P + "missing", "value", "==", b"")], [Put(P + "v", b"1")])  # a value compare on nothing fails
    txn([Compare(P + "a", "value", "==", b"2"), Compare(P + "a", "version", "==", 2)], [Get(P + "a")])
    txn([Compare(P + "a", "lease", "==", 0), Compare(P + "n/1", "mod", ">", 0)], [Delete(P + "nothing")])
    txn([Compare(P + "a", "mod", "!=", 0)], [Put(P + "c", b"1"), Get(P + "c"), Delete(P + "d"), Get(P + "a")])
    # A registration that claims the sealer's key only while nobody holds it: a nested transaction, one write.
    for node in ("r1", "r2"):
        txn([Compare(P + "reg/" + node, "create", "==", 0)],
            [Get(P + "sealer"), Put(P + "reg/" + node, b"n", first),
             Txn((Compare(P + "sealer", "create", "==", 0),), (Put(P + "sealer", node.encode(), first),))],
            [Get(P + "reg/" + node)])
    txn([], [Get(P + "reg/", prefix=True, keys_only=True), Get(P + "sealer")])
    with pytest.raises(StoreError, match="duplicate key"):
        s.txn([], [Put(P + "c", b"2"), Delete(P + "c")])
    # etcd's own limits on one transaction (defaults): 128 operations, 1.5 MiB of request; nothing is written.
    with pytest.raises(StoreError, match="too many operations in txn request"):
        s.txn([], [Put(P + f"many/{i}", b"1") for i in range(129)])
    with pytest.raises(StoreError, match="duplicate key given in txn request"):
        s.txn([], [Put(P + "dup", b"1"), Txn((), (Put(P + "dup", b"2"),))])
    with pytest.raises(StoreError, match="request is too large"):
        s.txn([], [Put(P + f"large/{i}", b"x" * (256 * 1024)) for i in range(6)])
    out.append(("get", n.kv(s.get(P + "b")), n.kv(s.get(P + "nope"))))
    kvs, r = s.get_prefix(P)
    out.append(("range", [n.kv(kv) for kv in kvs], n.rev(r)))
    s.lease_revoke(first)  # deletes n/1 and n/2 in one revision
    out.append(("after revoke", [n.kv(kv) for kv in s.get_prefix(P + "n/")[0]], n.rev(s.revision())))
    out.append(("ttl", s.lease_ttl(first)))
    out.append(("delete missing", s.delete(P + "zzz"), n.rev(s.revision())))
    out.append(("delete prefix", s.delete_prefix(P + "n/"), n.rev(s.revision())))
    with pytest.raises(ValueTooLarge):
        s.put(P + "big", b"x" * (256 * 1024 + 1))
    return out


def events(s: Any, n: Normal, start: int) -> list[Any]:
    w = s.watch(P, prefix=True, start_revision=start)
    got = []
    while (ev := w.next(2.0)) is not None:
        got.append((ev.type, n.kv(ev.kv)))
    w.cancel()
    return got


def test_the_model_answers_as_the_real_server(private_etcd: EtcdServer) -> None:
    store = Store([private_etcd.endpoint], timeout=10)
    try:
        real_base = store.revision()
        real_props = proposals(private_etcd.endpoint)
        real_n = Normal(real_base)
        real = script(store, real_n)
        real_props = proposals(private_etcd.endpoint) - real_props
        real_events = events(store, real_n, real_base + 1)
    finally:
        store.close()
    mem = MemEtcd()
    mem_n = Normal(mem.revision())
    model = script(mem, mem_n)
    assert model == real
    assert mem.counters.proposals == real_props
    model_events = events(mem, mem_n, mem_n.base + 1)
    assert model_events == real_events
    assert ("delete", (P + "n/1", b"", 0, real_events[-3][1][3], 0, 0)) in model_events
