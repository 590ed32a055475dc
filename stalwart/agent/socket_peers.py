"""Which of the agent's rank processes is on the other end of a Unix socket, and the slot it holds.

The agent's local sockets (the barrier relay's) never take a request's word for who sent it: each connection is
bound, by its peer's process id as the kernel gave it when it connected (``SO_PEERCRED``), to one of the
agent's own rank processes, or to a process one of them started (a rank's command may be a shell around the
interpreter), and the slot the agent gave that rank.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Peer", "SlotOf", "parent_pid", "peer_pid", "rank_slot", "slot_of_ranks"]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who is on the other end of a connection: the relay's own number for it (in accept order) and the process
    id the kernel gave for it when it connected (``SO_PEERCRED``; 0 where the kernel gave none)."""

    ident: int
    pid: int


#: The slot a connection's rank holds now, as the agent knows it (``None``: not one of the agent's ranks, or a
#: parked one with no slot yet). Asked at every request: a spare's rank gets its slot when it is handed over.
SlotOf = Callable[[Peer], "int | None"]

#: How many parents :func:`rank_slot` looks through (a rank's command may be a shell around the interpreter).
_MAX_ANCESTORS = 8


def rank_slot(pid: int, slots: Mapping[int, int], parent: Callable[[int], int | None]) -> int | None:
    """The slot of the agent's rank process that is ``pid`` or one of its ancestors (``slots``: process id of
    each running rank the agent started, to its slot); ``None`` when none is."""
    for _ in range(_MAX_ANCESTORS):
        if pid <= 1:
            return None
        if pid in slots:
            return slots[pid]
        nxt = parent(pid)
        if nxt is None:
            return None
        pid = nxt
    return None


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (from ``/proc``), or ``None`` when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after it start after its last ")".
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 else None


def peer_pid(conn: socket.socket) -> int:
    """The process id of a Unix socket's peer when it connected, or 0 where the kernel gives none."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return 0
    pid, _, _ = struct.unpack("3i", raw)
    return int(pid)


def slot_of_ranks(running: Callable[[], Mapping[int, int]]) -> SlotOf:
    """The agent's :data:`SlotOf`: the peer's process (or an ancestor) is one of ``running()`` (process id of
    each running rank process the agent started, to its slot)."""
    return lambda peer: rank_slot(peer.pid, running(), parent_pid)
