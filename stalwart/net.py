"""Network helpers shared by the agent and the local cluster (neither layer may import the other's)."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

#: Where :func:`free_port` looks first: below the kernel's ephemeral range (whose ports any process's outgoing
#: connection may take between the check and the caller's bind) and below Kubernetes' NodePorts (30000-32767).
LOW_PORT = 11000
HIGH_PORT = 30000
_TRIES = 64
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Where :func:`free_port` notes the ports it handed out, machine-wide (one file per port, per user): another
#: process's caller skips a port handed out in the last :data:`CLAIM_SECONDS`, in which its caller binds it.
CLAIMS = Path(tempfile.gettempdir()) / f"stalwart-ports-{os.getuid()}"
CLAIM_SECONDS = 120.0


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


def _claim(port: int) -> bool:
    """Note ``port`` as handed out now; False when another caller on this machine did so within
    :data:`CLAIM_SECONDS` (it may not have bound it yet). Where claims cannot be kept (no writable temporary
    directory), every port counts as unclaimed, as before claims were kept."""
    path = CLAIMS / str(port)
    try:
        CLAIMS.mkdir(mode=0o700, exist_ok=True)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            if time.time() - path.stat().st_mtime < CLAIM_SECONDS:
                return False
            os.utime(path)  # an old claim: its caller bound the port long ago, or never will
            return True
    except OSError:
        return True


#: Not the global generator, which belongs to the user's script; drawn from the OS, so forked processes differ.
_DRAW = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` at the time of the call, for a caller that binds it soon after: drawn at random
    outside the ephemeral range, so that no outgoing connection takes it meanwhile, and not one another caller
    of this function on the machine was handed in the last :data:`CLAIM_SECONDS` (two suites, or two test
    workers, drawing the same port before either bound it); where that range leaves no room, or every draw is
    taken, the one the OS picks."""
    high = min(HIGH_PORT, ephemeral_low())
    if high - LOW_PORT >= 1000:
        for _ in range(_TRIES):
            port = _DRAW.randrange(LOW_PORT, high)
            if bindable(host, port) and _claim(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
