"""What the kernel says of a process, shared by the agent and the local cluster (neither may import the other)."""

from __future__ import annotations

__all__ = ["process_state"]


def process_state(pid: int) -> str:
    """The kernel's state letter of process ``pid``: ``R`` running, ``S`` sleeping, ``D`` in an uninterruptible
    wait, ``T`` stopped, ``t`` traced, ``Z`` ended but not yet reaped...; ``""`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The command name in parentheses may itself hold spaces and parentheses: the state follows the last.
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return ""
