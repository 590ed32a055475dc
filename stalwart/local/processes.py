"""The process kubelet's container runtime: a container is a local process (its "main process", PID 1 of a real
container) plus whatever it starts, found by environment markers where a runtime would use the container's
cgroup.

Signals as a container runtime sends them:
- stopping a container sends SIGTERM to its main process only; whatever the main process started hears of it
  only if the main process passes it on (a real runtime signals PID 1, never the whole container). When the
  grace period ends, every process of the container gets SIGKILL;
- when the main process exits, every process it left behind gets SIGKILL (a container's PID namespace ends
  with its PID 1);
- a partitioned node's processes are paused with SIGSTOP and resumed with SIGCONT (they live on, unseen, and
  act again once the partition heals).

Every container process is started with a parent-death signal, so none outlives a crashed control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from stalwart.procfs import process_state

# Environment markers: they let the kubelet find every process of a container, including those that left its
# process group.
POD_MARKER = "STALWART_LOCAL_POD_UID"
CONTAINER_MARKER = "STALWART_LOCAL_CONTAINER"
CLUSTER_MARKER = "STALWART_LOCAL_CLUSTER"
#: Rounds of "find, then signal" when pausing: a process forked between a scan and the signal is found by the
#: next scan (a paused process cannot fork, so the rounds end).
_PAUSE_ROUNDS = 10
#: Seconds pause_pods waits for the kernel to stop what it signalled (SIGSTOP is only queued by kill()).
_PAUSE_SETTLE = 5.0


def marked_pids(name: str, value: str) -> list[int]:
    """Processes whose environment has ``name=value`` (those of other users are not readable: skipped)."""
    needle = f"{name}={value}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(entry.name))
    return out


def signal_marked(name: str, value: str, sig: int) -> int:
    """Send ``sig`` to every process marked ``name=value``; return how many were signalled."""
    return len(signal_marked_pids(name, value, sig))


def signal_marked_pids(name: str, value: str, sig: int) -> list[int]:
    """Send ``sig`` to every process marked ``name=value``; return the pids signalled."""
    out = []
    for pid in marked_pids(name, value):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            out.append(pid)
    return out


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: no such process, or a zombie waiting to be reaped."""
    return process_state(pid) in ("", "Z")


def cluster_id(directory: Path) -> str:
    """The value of :data:`CLUSTER_MARKER` for the cluster in ``directory``: a digest of its path, so that a
    pod's environment does not name the directory that holds the admin's kubeconfig."""
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:32]


def container_id(pod_uid: str, container: str) -> str:
    """The value of :data:`CONTAINER_MARKER` for one container of one pod."""
    return f"{pod_uid}/{container}"


def pause_pods(uids: list[str]) -> list[int]:
    """SIGSTOP every process of these pods, children forked meanwhile included; returns the paused pids."""
    paused: set[int] = set()
    for _ in range(_PAUSE_ROUNDS):
        found = {pid for uid in uids for pid in marked_pids(POD_MARKER, uid)} - paused
        if not found:
            break
        for pid in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        paused |= found
    # kill() only queues SIGSTOP: a process scheduled meanwhile may still act (write, answer) for a moment.
    # Return once each is stopped (or gone), so that "paused" means it can no longer do anything.
    deadline = time.monotonic() + _PAUSE_SETTLE
    while any(process_state(pid) not in ("T", "t", "Z", "") for pid in paused) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sorted(paused)


def resume_pods(uids: list[str]) -> int:
    """SIGCONT every process of these pods; returns how many were signalled."""
    return sum(signal_marked(POD_MARKER, uid, signal.SIGCONT) for uid in uids)


def kill_pods(uids: list[str]) -> int:
    """SIGKILL every process of these pods (a paused one too); returns how many were signalled."""
    return sum(signal_marked(POD_MARKER, uid, signal.SIGKILL) for uid in uids)


def _pdeathsig() -> None:
    """In the child: die with the kubelet, so no container outlives a crashed control plane."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def child_setup(enter: Callable[[], None] | None) -> Callable[[], None]:
    """The preexec function of a container process: the parent-death signal, then ``enter`` if any."""
    if enter is None:
        return _pdeathsig

    def setup() -> None:
        _pdeathsig()
        enter()

    return setup


def _open_log(cwd: Path, log: Path) -> BinaryIO:
    """Create the working directory and open the container's log for appending (the child inherits it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    return open(log, "ab")  # handed to the child process, closed by the caller


async def start_process(argv: list[str], env: dict[str, str], cwd: Path, log: Path,
                        enter: Callable[[], None] | None = None) -> asyncio.subprocess.Process:
    """Start a container's main process in a session of its own, stdout and stderr appended to ``log``; ``enter``
    runs in the child before exec (the node's network: :meth:`.netns.NodeNetwork.enter`). Raises OSError when it
    cannot be started."""
    out = await asyncio.to_thread(_open_log, cwd, log)
    try:
        return await asyncio.create_subprocess_exec(
            *argv, env=env, cwd=str(cwd), stdin=asyncio.subprocess.DEVNULL, stdout=out,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=child_setup(enter))
    finally:
        out.close()


async def kill_leftovers(container: str) -> list[int]:
    """SIGKILL whatever is left of a container whose main process is gone; returns the pids killed."""
    return await asyncio.to_thread(signal_marked_pids, CONTAINER_MARKER, container, signal.SIGKILL)


async def stop_container(proc: asyncio.subprocess.Process, container: str, grace: float) -> list[int]:
    """Stop a container as a runtime does: SIGTERM to the main process, up to ``grace`` seconds for it to exit,
    then SIGKILL to every process of the container. Returns the pids killed besides the main process."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), max(grace, 0.01))
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    left = await kill_leftovers(container)
    await proc.wait()
    return [pid for pid in left if pid != proc.pid]
