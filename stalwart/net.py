"""Network helpers shared by the agent and the local cluster (neither layer may import the other's)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Where :func:`free_port` looks first: below the kernel's ephemeral range (whose ports any process's outgoing
#: connection may take between the check and the caller's bind) and below Kubernetes' NodePorts (30000-32767).
LOW_PORT = 11000
HIGH_PORT = 30000
_TRIES = 64
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call, for a caller that binds it soon after: drawn at random
    outside the ephemeral range, so that only another caller of this function could take it meanwhile; where
    that range leaves no room, or every draw is taken, the one the OS picks."""
    high = min(HIGH_PORT, ephemeral_low())
    if high - LOW_PORT >= 1000:
        for _ in range(_TRIES):
            port = random.randrange(LOW_PORT, high)
            if bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
