"""Three etcd members on loopback in one raft group (the shape of the chart's ``etcd.replicas: 3``), with fsync
on as etcd's default, TLS and authentication: they elect a leader, replicate a write, and are all gone after
cleanup."""

from __future__ import annotations

import os

import pytest

from stalwart.etcd.client import connect
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
    finally:
        group.cleanup()
    assert [pid for pid in pids if alive(pid)] == []
    assert not group.dir.exists()

