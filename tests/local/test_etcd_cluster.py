"""Three etcd members on loopback in one raft group (the shape of the chart's ``etcd.replicas: 3``), with fsync
on as etcd's default, TLS and authentication: they elect a leader, replicate a write, and are all gone after
cleanup."""

from __future__ import annotations

import os
import time

import pytest

from stalwart.etcd.client import connect
from stalwart.etcd.store import StoreError, StoreUnavailable
from stalwart.local.etcd import EtcdServer
from stalwart.local.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("fsync", [True, False])
def test_without_fsync_the_server_is_told_so_and_with_it_not(fsync: bool) -> None:
    server = EtcdServer(fsync=fsync)
    try:
        assert ("--unsafe-no-fsync" in server.command()) is not fsync
    finally:
        server.cleanup()


def test_three_members_with_tls_and_auth_replicate_a_write_and_end() -> None:
    group = EtcdCluster(3, tls=True, auth=True, fsync=True)
    group.start(timeout=90)
    pids = [m.process.pid for m in group.members if m.process is not None]
    try:
        assert len(pids) == 3
        assert all("--unsafe-no-fsync" not in m.command() for m in group.members)
        # Each member by itself, with the group's one client certificate and root login: a write through the
        # first is read back from the third (replicated by raft, not a member's own copy).
        with connect([group.endpoints[0]], group.credentials(), timeout=30) as first:
            first.put("/group/key", b"written through member 0")
        with connect([group.endpoints[2]], group.credentials(), timeout=30) as third:
            got = third.get("/group/key")
            assert got is not None and got.value == b"written through member 0"
        by_name = [f"localhost:{m.client_port}" for m in group.members]
        _a_client_of_all_three_moves_past_a_stopped_member(group, by_name)
    finally:
        group.cleanup()
    assert [pid for pid in pids if alive(pid)] == []
    assert not group.dir.exists()


def _a_client_of_all_three_moves_past_a_stopped_member(group: EtcdCluster, endpoints: list[str]) -> None:
    """The chart's shape: every member named by host name, over TLS with a login. The member in use is
    stopped; a read goes on at once through the next, a lease kept alive outlives its TTL, a broken watch is
    opened again, and a write lands once the store has moved on."""
    with connect(endpoints, group.credentials(), timeout=5) as store:
        assert store._members.current().endpoint == endpoints[0]
        lease = store.lease_grant(3)
        store.put("/group/leased", b"kept", lease=lease)
        rev = store.put("/group/before", b"1")
        watch = store.watch("/group/", prefix=True, start_revision=rev + 1)
        group.members[0].stop()
        got = store.get("/group/before")  # a read is made again on the next member
        assert got is not None and got.value == b"1"
        assert store._members.current().endpoint != endpoints[0]
        deadline = time.monotonic() + 30
        broke: StoreError | None = None
        while broke is None and time.monotonic() < deadline:
            try:  # the stream to the stopped member breaks: the caller watches again
                assert watch.next(1.0) is None
            except StoreError as e:
                broke = e
        watch.cancel()
        assert isinstance(broke, StoreUnavailable), broke
        rev = store.put("/group/after", b"2")
        with store.watch("/group/", prefix=True, start_revision=rev) as again:
            event = again.next(5.0)
            assert event is not None and event.kv.key == "/group/after"
        time.sleep(4.5)  # longer than the lease's TTL: only keep-alives through another member keep it
        assert store.lease_ttl(lease) > 0
        kept = store.get("/group/leased")
        assert kept is not None and kept.value == b"kept"


def test_a_server_that_cannot_start_says_why_in_the_error(etcd: EtcdServer) -> None:
    """Its peer port taken: the error carries the log's last lines (a group's cleanup removes the log)."""
    clash = EtcdServer(peer_port=etcd.peer_port)
    try:
        with pytest.raises(RuntimeError, match=r"etcd exited with 1; its log \(.*\) ends:\n(.|\n)*"
                                               r"address already in use"):
            clash.start(timeout=30)
        assert clash.process is not None and clash.process.poll() == 1
    finally:
        clash.cleanup()
