"""Free ranks blocked in a gloo collective by shutting down the process group's TCP connections.

torch's API cannot free a peer blocked in a gloo collective: ``ProcessGroup.abort()``, ``shutdown()`` and
``destroy_process_group()`` leave it waiting until the collective timeout. Only its connections closing
frees it: gloo's pair sees end-of-stream and fails the pending operation at once ("Connection closed by
peer"). So stalwart snapshots the process's sockets before a process group is built, and to abort, shuts
down (``shutdown(SHUT_RDWR)``, not ``close``: the descriptors stay gloo's) every *connected* TCP socket
that appeared since, except connections to etcd. Peers blocked on those connections are freed in
well under a millisecond, on both sides, without shortening the collective timeout.

A gloo *listening* socket must be left alone: shutting it down makes gloo's listener thread abort the
process. Sockets are identified by inode (``socket:[N]``), not by descriptor number, so a descriptor
closed and reused in between is never touched.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable

log = logging.getLogger(__name__)

__all__ = ["SocketSnapshot", "connection_states", "retransmitting", "retransmitting_peers", "shutdown_sockets_since",
           "socket_inodes"]

_FD_DIR = "/proc/self/fd"


def socket_inodes() -> dict[int, str]:
    """Descriptor -> ``socket:[inode]`` for every socket the process has open now."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:  # not Linux: nothing to enumerate
        return out
    for name in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = target
    return out


class SocketSnapshot:
    """The sockets open at one moment (taken just before a process group is created)."""

    def __init__(self) -> None:
        self.inodes = frozenset(socket_inodes().values())


def _peer_endpoint(sock: socket.socket) -> tuple[str, int] | None:
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        if host.startswith("::ffff:"):
            host = host[len("::ffff:"):]
        return host, int(peer[1])
    return None


def shutdown_sockets_since(snapshot: SocketSnapshot, *, keep_peers: Iterable[tuple[str, int]] = ()) -> int:
    """Shut down each connected TCP socket opened after ``snapshot`` whose peer is not in ``keep_peers``.

    Returns how many were shut down. Listening sockets, non-TCP sockets and sockets already closed are
    skipped. Safe to call from any thread and more than once.
    """
    keep = {(h, p) for h, p in keep_peers}
    count = 0
    for fd, inode in socket_inodes().items():
        if inode in snapshot.inodes:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            # The descriptor may have been closed and reused since we listed it.
            if os.readlink(f"{_FD_DIR}/{fd}") != inode:
                continue
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            peer = _peer_endpoint(sock)
            if peer is None or peer in keep:
                continue
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError as e:
            log.debug("socket fd %d: %s", fd, e)
        finally:
            sock.detach()
    return count



#: /proc/net/tcp's state codes (include/net/tcp_states.h).
_TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
               "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN",
               "0B": "CLOSING"}


def _opened_since(snapshot: SocketSnapshot) -> dict[str, int]:
    """Inode number (as /proc/net/tcp writes it) -> descriptor of each socket opened since ``snapshot``."""
    return {inode[len("socket:["):-1]: fd for fd, inode in socket_inodes().items() if inode not in snapshot.inodes}


def _tcp_rows() -> list[str]:
    """The rows of this process's network namespace's TCP tables (IPv4 and IPv6), headers left out."""
    rows: list[str] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows += f.read().splitlines()[1:]
        except OSError:
            continue
    return rows


def connection_states(snapshot: SocketSnapshot) -> list[str]:
    """Each TCP socket opened since ``snapshot``, as the kernel has it: descriptor, state, local and remote
    address (hex, as /proc/net/tcp), bytes queued to send and to read. For the log of a rank that makes no
    progress: a connection still ESTABLISHED after its shutdown, or one with bytes queued, says where it waits."""
    fds = _opened_since(snapshot)
    out = []
    for row in _tcp_rows():
        cols = row.split()
        if len(cols) > 9 and cols[9] in fds:
            tx, _, rx = cols[4].partition(":")
            out.append(f"fd {fds[cols[9]]} {_TCP_STATES.get(cols[3], cols[3])} {cols[1]} -> {cols[2]} "
                       f"queued {int(tx, 16)}/{int(rx, 16)}")
    return sorted(out, key=lambda line: int(line.split()[1]))


def _endpoint(hex_address: str) -> str:
    """``ip:port`` of a /proc/net/tcp address (``0100007F:1F90``: the address in the kernel's byte order)."""
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.startswith("::ffff:"):
            ip = ip[len("::ffff:"):]
    return f"{ip}:{int(port, 16)}"


def retransmitting_peers(rows: Iterable[str], inodes: frozenset[str]) -> list[str]:
    """The remote ``ip:port`` of each connection among ``inodes`` (``/proc/net/tcp`` rows) that holds sent bytes
    the kernel is retransmitting unacknowledged: ESTABLISHED, bytes queued to send, the retransmission timer
    armed and at least one retransmission made. A peer whose process hangs or is paused still has its kernel
    acknowledge (a full receive window arms the zero-window probe instead, timer 4): such a connection means the
    network between the two carries nothing. Pure: the rows are read by :func:`retransmitting`."""
    out = []
    for row in rows:
        cols = row.split()
        if len(cols) <= 9 or cols[9] not in inodes or cols[3] != "01":
            continue
        tx = int(cols[4].partition(":")[0], 16)
        timer = cols[5].partition(":")[0]
        if tx > 0 and timer == "01" and int(cols[6], 16) >= 1:
            out.append(_endpoint(cols[2]))
    return sorted(set(out))


def retransmitting(snapshot: SocketSnapshot) -> list[str]:
    """:func:`retransmitting_peers` of the TCP connections this process opened since ``snapshot``."""
    return retransmitting_peers(_tcp_rows(), frozenset(_opened_since(snapshot)))
