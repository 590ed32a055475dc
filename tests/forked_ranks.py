"""Rank processes for tests, forked as an agent's are: one fork server per test process (stalwart.forkserver),
started on first use and ended, shown to end, at the session's end (tests/conftest.py). Each rank then skips the
imports of torch (about 2 CPU-seconds a process) that the server paid once; a command the server cannot run, or a
lost server, starts a plain process instead, as the agent does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from stalwart.agent.processes import RankProcess
from stalwart.forkserver import ForkServer, parse_command

_SERVER: list[ForkServer] = []


def fork_server() -> ForkServer | None:
    """This test process's fork server; None once it was lost."""
    if not _SERVER:
        target = parse_command([sys.executable, "-m", "stalwart.examples.train"])
        assert target is not None
        # With the environment ranks share (libgomp reads OMP_NUM_THREADS when torch loads, in the server), and
        # faulthandler on, inherited by every fork: a rank that times out in a test is sent SIGABRT and dumps
        # every thread's stack first (Captured.communicate).
        _SERVER.append(ForkServer.start(target, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
                                        context="tests"))
    server = _SERVER[0]
    return None if server.dead else server


def close_fork_server() -> tuple[bool, int | None]:
    """End this test process's fork server: whether it was lost before (its ranks then started as plain
    processes), and its exit code (None: none was started)."""
    if not _SERVER:
        return False, None
    server = _SERVER.pop()
    lost = server.dead
    server.close()
    return lost, server.process.returncode


def spawn_rank(cmd: list[str], env: dict[str, str], *, stdout: int | None = None,
               stderr: int | None = None) -> RankProcess:
    """One rank process running ``cmd`` (``python SCRIPT ...`` or ``python -m MODULE ...``) with ``env`` as its
    whole environment; ``stdout``, ``stderr``: descriptors instead of the test process's."""
    target = parse_command(cmd)
    server = fork_server() if target is not None and target.interpreter == (sys.executable,) else None
    proc = server.spawn(env, target=target, stdout=stdout, stderr=stderr) if server is not None else None
    return proc if proc is not None else subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)


@dataclass
class Captured:
    """A rank process whose standard output and error are read into memory as it runs."""

    proc: RankProcess
    streams: dict[str, str] = field(default_factory=dict)
    readers: list[threading.Thread] = field(default_factory=list)

    def communicate(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the process (killed after ``timeout`` seconds, as ``subprocess.run`` does) and its output;
        (exit code, output, error)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)  # faulthandler writes where every thread waits, then it ends
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
            for reader in self.readers:
                reader.join(30)
            # Its own words say where it waited (its stacks, when faulthandler is on): pytest shows them with the
            # failure.
            print(f"--- {getattr(self.proc, 'args', '?')} timed out after {timeout}s; the end of its stderr:\n"
                  f"{self.streams.get('stderr', '')[-8000:]}")
            raise
        finally:
            for reader in self.readers:
                reader.join(30)
        return code, self.streams.get("stdout", ""), self.streams.get("stderr", "")


def start_captured(cmd: list[str], env: dict[str, str], *, stdout: bool = True) -> Captured:
    """:func:`spawn_rank` with its standard error (and output, unless ``stdout`` is false) read into memory."""
    pipes = {name: os.pipe() for name in (("stdout", "stderr") if stdout else ("stderr",))}
    try:
        proc = spawn_rank(cmd, env, stdout=pipes["stdout"][1] if stdout else None, stderr=pipes["stderr"][1])
    except BaseException:
        for read, _ in pipes.values():
            os.close(read)
        raise
    finally:
        for _, write in pipes.values():
            os.close(write)
    captured = Captured(proc)

    def read(name: str, fd: int) -> None:
        with open(fd, encoding="utf-8", errors="replace") as stream:
            captured.streams[name] = stream.read()

    for name, (fd, _) in pipes.items():
        reader = threading.Thread(target=read, args=(name, fd), daemon=True, name=f"rank-{name}")
        reader.start()
        captured.readers.append(reader)
    return captured
