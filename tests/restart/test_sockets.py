"""The gloo abort: shutting down the process group's connections frees a rank blocked in a collective."""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from stalwart.restart.sockets import (
    SocketSnapshot,
    connection_states,
    retransmitting_peers,
    shutdown_sockets_since,
    socket_inodes,
)

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


def _group_pair() -> tuple[object, object, SocketSnapshot]:
    """Two gloo process groups (ranks 0 and 1 of one world) in this process, over a HashStore."""
    store = dist.HashStore()
    before = SocketSnapshot()
    groups: list[object] = [None, None]

    def build(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=120))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return groups[0], groups[1], before


def test_shutdown_frees_a_rank_blocked_in_allreduce() -> None:
    pg0, pg1, before = _group_pair()
    outcome: list[BaseException | None] = []
    ready = threading.Event()

    def blocked() -> None:
        x = torch.ones(4)
        work = pg0.allreduce([x])  # type: ignore[attr-defined]
        ready.set()
        try:
            work.wait()
            outcome.append(None)
        except RuntimeError as e:
            outcome.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    assert ready.wait(60)
    # Rank 1 never joins the collective (it "failed"); its connections are shut down instead. The collective
    # timeout is 120 s and the thread is joined well before: only the shutdown can have freed it.
    n = shutdown_sockets_since(before)
    t.join(60)
    assert not t.is_alive()
    assert n >= 1  # gloo closes the other end itself once it sees this one shut down
    assert outcome and isinstance(outcome[0], RuntimeError)
    assert pg1 is not None


@contextlib.contextmanager
def _connection() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """A listener on loopback, a client connected to it and the accepted side; all closed at the end."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    try:
        yield listener, client, server_side
    finally:
        for s in (client, server_side, listener):
            s.close()


def test_listening_and_excluded_sockets_are_left_alone() -> None:
    before = SocketSnapshot()
    with _connection() as (listener, _client, server_side):
        kept = [listener.getsockname()]
        assert shutdown_sockets_since(before, keep_peers=kept) == 1  # only the accepted side (peer = client)
        assert server_side.recv(1) == b""  # that side was shut down: end of stream at once
        # The listener still accepts (a shut-down listener would have failed this).
        other = socket.create_connection(listener.getsockname())
        other.close()
        assert len(socket_inodes()) >= 3


def _states_until(before: SocketSnapshot, done: Callable[[list[str]], bool]) -> list[str]:
    deadline = time.monotonic() + 10
    while not done(states := connection_states(before)):
        assert time.monotonic() < deadline, states
        time.sleep(0.01)
    return states


def test_connection_states_name_each_new_connection_and_what_waits_in_it() -> None:
    before = SocketSnapshot()
    with _connection() as (listener, client, server_side):
        client.sendall(b"x" * 100)  # not read: 100 bytes wait in the accepted side's queue
        states = _states_until(before, lambda st: any(line.endswith("queued 0/100") for line in st))
        fds = {listener.fileno(): "LISTEN", client.fileno(): "ESTABLISHED", server_side.fileno(): "ESTABLISHED"}
        assert [line.split()[:3] for line in states] == [["fd", str(fd), st] for fd, st in sorted(fds.items())]
        assert states[[*sorted(fds)].index(server_side.fileno())].endswith("queued 0/100")
        # A connection shut down on one side: the other side's state says the peer has closed it.
        server_side.shutdown(socket.SHUT_RDWR)
        _states_until(before, lambda st: any(line.split()[1:3] == [str(client.fileno()), "CLOSE_WAIT"]
                                             for line in st))
        assert connection_states(SocketSnapshot()) == []  # none opened since now


# Rows of /proc/net/tcp as the kernel wrote them: a connection from 10.251.0.1 to 10.251.0.2:7777 idle, then with
# 1,000 bytes sent after its peer's neighbour entry was pointed nowhere (4 retransmissions in 4 s), then others.
IDLE = "   0: 0100FB0A:B776 0200FB0A:1E61 01 00000000:00000000 00:00000000 00000000     0        0 3016563 1"
CUT = "   0: 0100FB0A:B776 0200FB0A:1E61 01 000003E8:00000000 01:00000105 00000004     0        0 3016563 2"
# In flight on a healthy link: the retransmission timer is armed, nothing was retransmitted yet.
IN_FLIGHT = "   1: 0100007F:A000 0100007F:B000 01 00000200:00000000 01:00000014 00000000     0        0 3016570 2"
# A receiver that does not read (a hung peer): its window is full, the zero-window probe timer (4) runs.
FULL_WINDOW = "   2: 0100007F:A001 0100007F:B001 01 00010000:00000000 04:00000064 00000003     0        0 3016571 2"
# Shut down by the abort: not ESTABLISHED any more.
SHUT = "   3: 0100007F:A002 0100007F:B002 04 00000001:00000000 01:00000064 00000002     0        0 3016572 2"
# An IPv6 row for a v4-mapped peer (::ffff:10.251.0.2), retransmitting.
V6 = ("   4: 0000000000000000FFFF00000100FB0A:B777 0000000000000000FFFF00000200FB0A:1E62 01 00000010:00000000 "
      "01:00000105 00000002     0        0 3016573 2")


@pytest.mark.parametrize(("rows", "inodes", "expected"), [
    ([IDLE], {"3016563"}, []),
    ([CUT], {"3016563"}, ["10.251.0.2:7777"]),
    ([CUT], {"9"}, []),  # not one of the group's connections (etcd's, or opened before the group)
    ([IN_FLIGHT, FULL_WINDOW, SHUT], {"3016570", "3016571", "3016572"}, []),
    ([V6, CUT], {"3016573", "3016563"}, ["10.251.0.2:7777", "10.251.0.2:7778"]),
], ids=["idle", "cut", "not-the-groups", "healthy-or-hung-or-shut", "ipv6"])
def test_a_link_is_down_where_sent_bytes_are_retransmitted_unacknowledged(
        rows: list[str], inodes: set[str], expected: list[str]) -> None:
    assert retransmitting_peers(rows, frozenset(inodes)) == expected
