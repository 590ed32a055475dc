"""What the kernel says of a process, shared by the agent and the local cluster (neither may import the other)."""

from __future__ import annotations

__all__ = ["process_state", "stat_fields"]


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name, the state first (``proc(5)``'s field 3 is
    index 0, field N index N - 3); ``[]`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name in parentheses may itself hold spaces and parentheses: the fields follow the last.
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return []


def process_state(pid: int) -> str:
    """The kernel's state letter of process ``pid``: ``R`` running, ``S`` sleeping, ``D`` in an uninterruptible
    wait, ``T`` stopped, ``t`` traced, ``Z`` ended but not yet reaped...; ``""`` when there is no such process."""
    fields = stat_fields(pid)
    return fields[0] if fields else ""
