"""The etcd store adapter against a real etcd server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from stalwart.etcd.store import (
    MAX_VALUE_BYTES,
    Compare,
    Delete,
    Get,
    Put,
    Store,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    ValueTooLarge,
    WatchCompacted,
    WatchRange,
    prefix_range_end,
)
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"


def test_put_get_delete(store: Store, prefix: str) -> None:
    rev = store.put(prefix + "k", b"v1")
    kv = store.get(prefix + "k")
    assert kv is not None
    assert (kv.value, kv.mod_revision, kv.create_revision, kv.version) == (b"v1", rev, rev, 1)
    rev2 = store.put(prefix + "k", b"v2")
    kv2 = store.get(prefix + "k")
    assert kv2 is not None and kv2.mod_revision == rev2 > rev and kv2.create_revision == rev and kv2.version == 2
    assert store.delete(prefix + "k") is True
    assert store.get(prefix + "k") is None
    assert store.delete(prefix + "k") is False


def test_prefix_ops_do_not_touch_neighbours(store: Store, prefix: str) -> None:
    for name in ("a/1", "a/2", "a/3", "ab", "b/1"):
        store.put(prefix + name, name.encode())
    kvs, rev = store.get_prefix(prefix + "a/")
    assert [kv.key for kv in kvs] == [prefix + "a/1", prefix + "a/2", prefix + "a/3"]
    assert rev >= max(kv.mod_revision for kv in kvs)
    assert store.count_prefix(prefix + "a/") == 3
    assert store.delete_prefix(prefix + "a/") == 3
    left, _ = store.get_prefix(prefix)
    assert [kv.key for kv in left] == [prefix + "ab", prefix + "b/1"]


def test_delete_prefix_refuses_empty(store: Store) -> None:
    with pytest.raises(ValueError, match="prefix"):
        store.delete_prefix("")


def test_txn_create_if_absent_then_cas_on_mod_revision(store: Store, prefix: str) -> None:
    key = prefix + "cas"
    absent = [Compare(key, "create", "==", 0)]
    first = store.txn(absent, [Put(key, b"one")], [Get(key)])
    assert first.succeeded
    second = store.txn(absent, [Put(key, b"two")], [Get(key)])
    assert not second.succeeded
    [[current]] = second.responses
    assert current.value == b"one" and current.mod_revision == first.revision

    stale = store.txn([Compare(key, "mod", "==", first.revision - 1)], [Put(key, b"stale")], [Get(key)])
    assert not stale.succeeded
    fresh = store.txn([Compare(key, "mod", "==", first.revision)], [Put(key, b"fresh")])
    assert fresh.succeeded
    got = store.get(key)
    assert got is not None and got.value == b"fresh"


def test_txn_value_and_version_compares_and_multi_ops(store: Store, prefix: str) -> None:
    store.put(prefix + "x", b"1")
    store.put(prefix + "y", b"1")
    res = store.txn(
        [Compare(prefix + "x", "value", "==", b"1"), Compare(prefix + "y", "version", "==", 1)],
        [Delete(prefix + "x"), Put(prefix + "z", b"3"), Get(prefix, prefix=True)],
    )
    assert res.succeeded
    assert [kv.key for kv in res.responses[2]] == [prefix + "y", prefix + "z"]
    assert not store.txn([Compare(prefix + "y", "value", "!=", b"1")], [Delete(prefix + "y")]).succeeded
    assert store.get(prefix + "y") is not None


def test_txn_compare_over_a_prefix_holds_for_every_key_under_it(store: Store, prefix: str) -> None:
    first = store.put(prefix + "nodes/a", b"1")
    later = store.put(prefix + "nodes/b", b"1")
    store.put(prefix + "other", b"1")  # outside the compared range
    # Every node key created before `later`? No: nodes/b was created at `later`.
    assert not store.txn([Compare(prefix + "nodes/", "create", "<", later, prefix=True)],
                         [Put(prefix + "sealed", b"x")]).succeeded
    assert store.get(prefix + "sealed") is None
    assert store.txn([Compare(prefix + "nodes/", "create", "<", later + 1, prefix=True)],
                     [Put(prefix + "sealed", b"x")]).succeeded
    # An empty range holds any condition.
    assert store.txn([Compare(prefix + "none/", "create", "<", first, prefix=True)], []).succeeded


def test_value_size_cap(store: Store, prefix: str) -> None:
    with pytest.raises(ValueTooLarge, match="limit"):
        store.put(prefix + "big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(ValueTooLarge):
        store.txn([], [Put(prefix + "big", b"x" * (MAX_VALUE_BYTES + 1))])
    assert store.get(prefix + "big") is None


def test_watch_from_revision_sees_history_and_new_events(store: Store, prefix: str) -> None:
    rev = store.put(prefix + "w/a", b"1")
    store.put(prefix + "w/b", b"2")
    with store.watch(prefix + "w/", prefix=True, start_revision=rev) as w:
        first = w.next(timeout=5)
        second = w.next(timeout=5)
        assert first is not None and second is not None
        assert [(e.type, e.kv.key) for e in (first, second)] == [("put", prefix + "w/a"), ("put", prefix + "w/b")]
        store.delete(prefix + "w/a")
        ev = w.next(timeout=5)
        assert ev is not None and (ev.type, ev.kv.key) == ("delete", prefix + "w/a")
        assert w.next(timeout=0.2) is None


def test_watch_single_key_ignores_others(store: Store, prefix: str) -> None:
    with store.watch(prefix + "one") as w:
        store.put(prefix + "one-not", b"x")
        store.put(prefix + "one", b"y")
        ev = w.next(timeout=5)
        assert ev is not None and ev.kv.key == prefix + "one"


def test_a_txn_counts_keys_without_reading_them(store: Store, prefix: str) -> None:
    store.put(prefix + "c/1", b"x" * 100)
    res = store.txn((), [Put(prefix + "c/2", b"y"), Get(prefix + "c/", prefix=True, count_only=True),
                         Get(prefix + "c/1")])
    assert res.counts == [0, 2, 1] and res.responses[1] == [] and len(res.responses[2]) == 1


def test_one_watch_over_several_ranges_with_puts_filtered_out(store: Store, prefix: str) -> None:
    store.put(prefix + "gone/1", b"x")
    ranges = [WatchRange(prefix + "seal/3"), WatchRange(prefix + "gone/", prefix=True, no_put=True),
              WatchRange(prefix + "fault/", prefix=True)]
    with store.watch_ranges(ranges) as w:
        store.put(prefix + "seal/30", b"not this one")  # a key, not a prefix
        store.put(prefix + "gone/2", b"a put: filtered out")
        store.put(prefix + "other/1", b"outside every range")
        store.put(prefix + "fault/1", b"f")
        store.delete(prefix + "gone/1")
        store.put(prefix + "seal/3", b"s")
        got = [w.next(timeout=5) for _ in range(3)]
        assert [(e.type, e.kv.key) for e in got if e is not None] == [
            ("put", prefix + "fault/1"), ("delete", prefix + "gone/1"), ("put", prefix + "seal/3")]
        assert w.next(timeout=0.3) is None
    with pytest.raises(ValueError, match="ranges"):
        store.watch_ranges([])


def test_watch_compacted_revision_is_a_typed_error(private_etcd: EtcdServer) -> None:
    with Store([private_etcd.endpoint]) as s:
        first = s.put("/c/k", b"1")
        for i in range(5):
            s.put("/c/k", str(i).encode())
        s.compact(s.revision())
        # etcd first confirms the watch, then cancels it as compacted: the error surfaces on next().
        with pytest.raises(WatchCompacted) as info, s.watch("/c/k", start_revision=first) as w:
            w.next(timeout=5)
        assert info.value.compact_revision > first


def test_lease_keeps_key_alive_then_revoke_deletes_it(store: Store, prefix: str) -> None:
    lease = store.lease_grant(2)
    store.put(prefix + "leased", b"x", lease=lease)
    time.sleep(3.5)  # longer than the TTL: only the keep-alive thread keeps it
    kv = store.get(prefix + "leased")
    assert kv is not None and kv.lease == lease
    assert store.lease_ttl(lease) > 0
    store.lease_revoke(lease)
    assert store.get(prefix + "leased") is None
    assert store.lease_ttl(lease) == -1
    store.lease_revoke(lease)  # revoking twice is harmless


def test_lease_without_keepalive_expires_and_close_stops_keepalive(etcd: EtcdServer, prefix: str) -> None:
    with Store([etcd.endpoint]) as s:
        short = s.lease_grant(1, keepalive=False)
        s.put(prefix + "short", b"x", lease=short)
        kept = s.lease_grant(1)
        s.put(prefix + "kept", b"x", lease=kept)
        deadline = time.monotonic() + 10
        while s.get(prefix + "short") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.get(prefix + "short") is None
        assert s.get(prefix + "kept") is not None
        keepalive = s._keepalive
    # close() stopped this store's keep-alive thread, so the kept lease now runs out.
    assert keepalive is not None and not keepalive._thread.is_alive()
    with Store([etcd.endpoint]) as check:
        deadline = time.monotonic() + 10
        while check.get(prefix + "kept") is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert check.get(prefix + "kept") is None


def test_a_lease_unanswered_past_its_ttl_says_this_process_is_fenced(private_etcd: EtcdServer,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # Cut off from etcd (here: etcd gone), the keep-alive thread knows the lease is over once no refresh was
    # answered for longer than its TTL, without waiting for etcd to say so; only etcd's answer marks it lost.
    s = Store([private_etcd.endpoint], timeout=1.0)
    try:
        lease = s.lease_grant(2)
        private_etcd.kill()
        with caplog.at_level("WARNING", logger="stalwart.etcd.leases"):
            deadline = time.monotonic() + 30
            while "this process is fenced" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
        said = [r.getMessage() for r in caplog.records if "this process is fenced" in r.getMessage()]
        assert len(said) == 1 and f"lease {lease:x}: no keep-alive answered for" in said[0], said
        assert lease not in s.lost_leases()
    finally:
        s.close()


def test_server_restart_mid_test_typed_errors_then_reconnect(private_etcd: EtcdServer) -> None:
    s = Store([private_etcd.endpoint], timeout=2.0)
    try:
        s.put("/r/k", b"before")
        w = s.watch("/r/", prefix=True)
        private_etcd.kill()

        with pytest.raises(StoreUnavailable):
            s.get("/r/k")
        with pytest.raises((StoreUnavailable, StoreTimeout)):
            s.txn([Compare("/r/k", "create", "!=", 0)], [Put("/r/k", b"during")])
        # The watch stream ends with a typed error rather than hanging.
        with pytest.raises(StoreError):
            for _ in range(10):
                w.next(timeout=2)
        w.cancel()

        private_etcd.start()
        deadline = time.monotonic() + 15
        while True:
            try:
                kv = s.get("/r/k")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "store did not reconnect after the server came back"
                time.sleep(0.1)
        assert kv is not None and kv.value == b"before"
        with s.watch("/r/k") as w2:
            s.put("/r/k", b"after")
            ev = w2.next(timeout=5)
            assert ev is not None and ev.kv.value == b"after"
    finally:
        s.close()


def test_call_deadline_is_a_typed_timeout_when_server_is_frozen(private_etcd: EtcdServer) -> None:
    import os
    import signal

    s = Store([private_etcd.endpoint], timeout=0.5)
    try:
        s.put("/f/k", b"1")
        assert private_etcd.process is not None
        os.kill(private_etcd.process.pid, signal.SIGSTOP)
        try:
            # kill() only queues the signal: a request sent before every thread of etcd has stopped can still
            # be answered. Wait until all of them are stopped (state T).
            tasks = Path(f"/proc/{private_etcd.process.pid}/task")
            for _ in range(1000):
                try:
                    states = {(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()}
                except OSError:  # a thread ended while being read
                    states = set()
                if states == {"T"}:
                    break
                time.sleep(0.01)
            with pytest.raises(StoreTimeout):
                s.get("/f/k")
        finally:
            os.kill(private_etcd.process.pid, signal.SIGCONT)
    finally:
        s.close()


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        Store([])
    with pytest.raises(ValueError, match="endpoints"):
        Store(["no-port"])
    with pytest.raises(ValueError, match="timeout"):
        Store(["127.0.0.1:1"], timeout=0)


def test_closed_store_refuses_calls(etcd: EtcdServer) -> None:
    s = Store([etcd.endpoint])
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get("/x")
