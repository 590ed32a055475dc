"""``multiprocessing`` for the tests whose rank processes are Python functions: children forked from one server
per test process that imported torch once (the ``forkserver`` start method, torch preloaded), where ``spawn``
started each child afresh to import torch again (2 CPU-seconds and more a child: on two cores the suite's time is
its CPU). A child still gets the parent's ``sys.path`` and imports the test module its target lives in, as a
spawned one does. The server ends at the session's end, shown to end (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext

from stalwart.forkserver import PRELOAD


def context() -> ForkServerContext:
    """The ``forkserver`` context, its server preloading what the pods' fork servers preload."""
    ctx = multiprocessing.get_context("forkserver")
    assert isinstance(ctx, ForkServerContext)
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def stop_server(timeout: float = 30.0) -> int | None:
    """Ask this process's fork server to end (its "alive" pipe closed) and reap it within ``timeout`` seconds,
    killing it past that; its exit code (None: none was started)."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    pid = server._forkserver_pid
    if pid is None:
        return None
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the multiprocessing fork server (pid {pid}) did not end within {timeout:g}s")
        time.sleep(0.05)
    server._forkserver_pid = None
    address = server._forkserver_address
    server._forkserver_address = None
    if address and not address.startswith("\0"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    return os.waitstatus_to_exitcode(status)
