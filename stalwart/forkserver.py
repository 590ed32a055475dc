"""A pod's fork server: one process that imports torch (and what else the agent names) once, then starts each
rank process by ``fork``, so that a rank (a respawn after a crash, the second rank of a pod, a warm spare's
parked process) starts in a fraction of a second instead of paying the imports again (3-7 CPU-seconds each).

The agent starts it (``python [options] -m stalwart.forkserver FD MODULE...``) with the interpreter and
options of the training command and the environment every local rank shares, and speaks to it over a private
``SOCK_SEQPACKET`` socket pair (JSON messages, never pickles): ``spawn`` (argv, environment, what to run)
answered with the child's pid and a pidfd passed over the socket, and, when a child ends, its exit code as
``subprocess`` reports it (negative: the signal). Signals go through the pidfd, so a pid reused after the exit
is never signalled. :class:`ForkServer` is the agent's side; :class:`ForkedProcess` looks to the agent like a
``subprocess.Popen``.

What a forked rank sees that a fresh one would not: modules imported before its environment was set. The
fork server runs with the environment its ranks share (``OMP_NUM_THREADS`` included); only the variables that
differ per rank (``RANK``, the slot, the status file, ...) are set after the fork, and nothing preloaded reads
them at import. Python's ``random`` and (when loaded) NumPy's global generator are seeded afresh in the child,
as they would be in a new process; torch's default seed is a constant either way.

When the server cannot start (the command's interpreter has no stalwart, it exits, it is not ready within its
deadline) or the command is not ``python script ...`` / ``python -m module ...``, the agent starts its ranks
as plain processes, as it always could. When the server dies, the ranks it started are killed (their exit
codes are lost with it) and the agent starts plain processes from then on.

It imports nothing of stalwart: it runs in the training command's interpreter before anything is set up.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ForkServer", "ForkedProcess", "Target", "parse_command"]

log = logging.getLogger(__name__)

#: Seconds the first spawn waits for the server's imports: what a fresh rank would have spent on them anyway.
READY_TIMEOUT = 120.0

#: What the server imports before it says it is ready (torch's optimizers pull in torch._dynamo on first
#: use: imported here, a rank does not pay it either).
PRELOAD = ("torch", "torch.distributed", "torch.optim", "torch._dynamo", "stalwart.restart")

_MAX_MESSAGE = 1 << 20  # a spawn request carries one environment: far below this
_MAX_FDS = 2  # a message carries a child's pidfd, or the standard output and error a spawn request gives it
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_FLAGS = frozenset({"-u", "-B", "-s", "-O", "-OO", "-E", "-I", "-P"})
_WITH_ARG = frozenset({"-X", "-W"})


@dataclass(frozen=True, slots=True)
class Target:
    """A training command the fork server can run: ``interpreter`` (the interpreter and its options), then a
    script or a module (exactly one) and its arguments."""

    interpreter: tuple[str, ...]
    script: str | None
    module: str | None
    args: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"script": self.script, "module": self.module, "args": list(self.args), "title": self.command()}

    def command(self) -> list[str]:
        """The command as the user wrote it: what ``ps`` shows for each rank."""
        run = ["-m", self.module] if self.module is not None else [self.script or ""]
        return [*self.interpreter, *run, *self.args]


def parse_command(command: Sequence[str]) -> Target | None:
    """``command`` as a fork server's target, or None when it is not a Python command the server can run (a
    shell wrapper, ``python -c``, an option it does not know): such a command always starts as a process."""
    if not command or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    i, interpreter = 1, [command[0]]
    while i < len(command) and command[i].startswith("-"):
        opt = command[i]
        if opt == "-m" and i + 1 < len(command):
            return Target(tuple(interpreter), None, command[i + 1], tuple(command[i + 2:]))
        if opt in _FLAGS:
            interpreter.append(opt)
        elif opt in _WITH_ARG and i + 1 < len(command):
            interpreter += [opt, command[i + 1]]
            i += 1
        else:
            return None
        i += 1
    if i >= len(command):
        return None
    return Target(tuple(interpreter), command[i], None, tuple(command[i + 1:]))


# -- the agent's side ----------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it, without blocking (``socket.recv_fds`` of Python
    3.11 drops its flags)."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize),
                                                socket.MSG_DONTWAIT)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


@dataclass(eq=False)
class ForkedProcess:
    """A rank process the fork server started: what the agent uses of ``subprocess.Popen``."""

    server: ForkServer
    pid: int
    pidfd: int
    args: list[str]
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.server.pump(1.0 if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended; the server's word of it is on its way
                signal.pidfd_send_signal(self.pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self, code: int) -> None:
        self.returncode = code
        with contextlib.suppress(OSError):
            os.close(self.pidfd)


@dataclass(eq=False)
class ForkServer:
    """The agent's connection to its fork server."""

    target: Target
    process: subprocess.Popen[bytes]
    sock: socket.socket
    context: str = ""
    ready_timeout: float = READY_TIMEOUT
    ready: bool = False
    dead: bool = False
    children: dict[int, ForkedProcess] = field(default_factory=dict)
    _replies: list[dict[str, Any]] = field(default_factory=list)
    _early_exits: dict[int, int] = field(default_factory=dict)  # a child that ended before its spawn returned
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def start(cls, target: Target, env: Mapping[str, str], preload: Sequence[str] = PRELOAD,
              context: str = "") -> ForkServer:
        """Start the server (its imports run while the caller goes on; :meth:`spawn` waits for them)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Room in the server's own command line for each child to write the training command over it
        # (:func:`_retitle`), so that ps, top and py-spy show a rank as what it runs.
        room = "_" * len(_title_bytes(target.command()))
        try:
            process = subprocess.Popen([*target.interpreter, "-m", "stalwart.forkserver", str(theirs.fileno()), room,
                                        *preload], env=dict(env), pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(target, process, ours, context)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the server has done its imports, waiting up to ``timeout`` seconds for them; a server not
        ready by then is given up."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not self.ready and not self.dead and time.monotonic() < deadline:
                self.pump(min(1.0, max(0.0, deadline - time.monotonic())))
            if not self.ready:
                self._lost(f"it was not ready within {timeout:g}s")
            return not self.dead

    def spawn(self, env: Mapping[str, str], *, timeout: float = 10.0, target: Target | None = None,
              stdout: int | None = None, stderr: int | None = None) -> ForkedProcess | None:
        """Fork one rank process with ``env`` (its whole environment); None when the server cannot (the
        caller starts a plain process). ``target``: another script or module than the server's (run by the
        same interpreter); ``stdout``, ``stderr``: descriptors the child writes to instead of the server's."""
        target = self.target if target is None else target
        streams = {name: fd for name, fd in (("stdout", stdout), ("stderr", stderr)) if fd is not None}
        with self._lock:
            if not self.ready and not self.wait_ready(self.ready_timeout):
                return None
            if self.dead:
                return None
            try:
                _send(self.sock, {"op": "spawn", "env": dict(env), "streams": list(streams), **target.to_json()},
                      list(streams.values()))
            except OSError:
                self._lost("it refused a spawn request")
                return None
            deadline = time.monotonic() + timeout
            while not self._replies and not self.dead:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._lost(f"it did not answer a spawn request within {timeout:g}s")
                    return None
                self.pump(left)
            if self.dead:
                return None
            reply = self._replies.pop(0)
            if "error" in reply:
                return None
            child = ForkedProcess(self, int(reply["pid"]), int(reply["pidfd"]), target.command())
            if child.pid in self._early_exits:
                child._ended(self._early_exits.pop(child.pid))
            else:
                self.children[child.pid] = child
            return child

    def pump(self, timeout: float) -> None:
        """Read what the server said within ``timeout`` seconds: readiness, spawned children, exits."""
        with self._lock:
            if self.dead:
                return
            readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
            while readable:
                try:
                    data, fds = _receive(self.sock)
                except BlockingIOError:
                    return
                except OSError as e:
                    self._lost(f"its socket failed: {e}")
                    return
                if not data:
                    self._lost("it exited")
                    return
                self._take(json.loads(data), fds)

    def _take(self, message: dict[str, Any], fds: list[int]) -> None:
        if message.get("ready"):
            self.ready = True
        elif "exit" in message:
            pid, code = int(message["pid"]), int(message["exit"])
            child = self.children.pop(pid, None)
            if child is not None:
                child._ended(code)
            else:
                self._early_exits[pid] = code
        else:
            if fds:
                message["pidfd"] = fds[0]
            self._replies.append(message)

    def _lost(self, why: str) -> None:
        """The server is gone or broken: kill what it started (nobody would learn their exit codes)."""
        if self.dead:
            return
        self.dead = True
        log.warning("%s: the fork server (pid %d) is lost (%s); rank processes start as plain processes from now on"
                    "%s", self.context, self.process.pid, why,
                    f", and the {len(self.children)} it started are killed" if self.children else "")
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        for child in list(self.children.values()):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
            select.select([child.pidfd], [], [], 5.0)  # the kill lands within a tick; bounded all the same
            child._ended(-signal.SIGKILL)
        self.children.clear()
        with contextlib.suppress(OSError):
            self.sock.close()

    def close(self, timeout: float = 5.0) -> None:
        """End the server (its children should be gone first: their exits are reported through it)."""
        with self._lock:
            self.dead = True
            with contextlib.suppress(OSError):
                self.sock.close()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
            for child in self.children.values():
                with contextlib.suppress(OSError):
                    os.close(child.pidfd)
            self.children.clear()


# -- the server's side ---------------------------------------------------------------------------------------


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)


def _serve(sock: socket.socket) -> dict[str, Any] | None:
    """Answer spawn requests until the agent hangs up (None: the server exits) or a child is forked (its
    request: the child runs it)."""
    pidfds: dict[int, int] = {}  # pidfd -> pid
    while True:
        # No deadline on purpose: the server has nothing to do but answer; the agent's end (even SIGKILL)
        # closes the socket, which ends this wait.
        readable, _, _ = select.select([sock.fileno(), *pidfds], [], [])
        for fd in readable:
            if fd in pidfds:
                pid = pidfds.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                with contextlib.suppress(OSError):
                    _send(sock, {"pid": pid, "exit": _exit_code(status)})
                continue
            try:
                data, streams = _receive(sock)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                return None
            request = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError as e:  # out of memory or processes: the agent starts a plain process instead
                _close(streams)
                _send(sock, {"error": str(e)})
                continue
            if pid == 0:
                sock.close()
                for other in pidfds:
                    os.close(other)
                for name, stream in zip(request.get("streams", ()), streams, strict=False):
                    os.dup2(stream, 1 if name == "stdout" else 2)
                _close(streams)
                return dict(request)
            _close(streams)
            pidfd = os.pidfd_open(pid)
            pidfds[pidfd] = pid
            try:
                _send(sock, {"pid": pid}, [pidfd])
            except OSError:
                return None


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _title_bytes(command: Sequence[str]) -> bytes:
    return b"".join(os.fsencode(arg) + b"\0" for arg in command)


def _retitle(command: Sequence[str]) -> None:
    """Write ``command`` over this process's command line (the kernel's copy that ps and /proc/PID/cmdline read:
    ``arg_start`` to ``arg_end`` in /proc/self/stat), NUL-padded; left as it is when it does not fit."""
    import ctypes

    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5), counted from the state (3)
    title = _title_bytes(command)
    if start and len(title) <= end - start:
        ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


def _become(request: dict[str, Any]) -> None:
    """In the forked child: take the request's environment and arguments, then run its script or module as
    ``__main__`` (its exceptions and SystemExit end the process as they would end a fresh one)."""
    import runpy

    _retitle(request["title"])
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy.random")
    if numpy is not None:
        numpy.seed()  # a fresh process seeds from the OS; so does this one
    args = list(request["args"])
    if request.get("module"):
        sys.argv = ["-m", *args]  # runpy puts the module's path in argv[0]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        script = request["script"]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _cuda_driver_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return any("/libcuda.so" in line for line in maps)


def _main(argv: Sequence[str]) -> None:
    import importlib

    sock = socket.socket(fileno=int(argv[0]))
    # The cyclic collector would scan the growing heap of the imports again and again, and find nothing to free:
    # a quarter of torch's import (0.6 of 2.5 CPU-seconds here). Off while importing; then the heap is frozen, as
    # the gc module advises for a server that forks: a child's collections skip what was preloaded (they would
    # find nothing there to free) and leave its pages shared with the server's. Measured on real servers, CPU to
    # ready: 1.43-1.54 s, against 1.73-1.88 s with one full collection in its place. (A frozen heap made a rank's
    # exit quicker, which exposed a race at the end of an iteration, since fixed: see stalwart/etcd/faults.py.)
    gc.disable()
    for name in argv[2:]:  # argv[1]: the room for the children's titles
        try:
            importlib.import_module(name)
        except ImportError as e:  # the ranks will meet it themselves, with their own traceback
            sys.stderr.write(f"stalwart fork server: preloading {name}: {e}\n")
    gc.freeze()
    gc.enable()
    # A fork copies only the thread that forks: a Python thread a preloaded module started could hold a lock
    # in every child. (Native pools, like the BLAS library's, reinitialise in the child, as they do for every
    # DataLoader worker forked from a training process.)
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate())
        sys.stderr.write(f"stalwart fork server: threads after preloading ({names}); not forking from here\n")
        return
    # Nor does the CUDA driver survive a fork: once a preloaded module has loaded it (torch.cuda.is_available()
    # at import time does), a forked child could not use the GPU.
    if _cuda_driver_loaded():
        sys.stderr.write("stalwart fork server: the CUDA driver was loaded while preloading; not forking from here\n")
        return
    _send(sock, {"ready": True})
    request = _serve(sock)
    if request is None:
        # The agent hung up: nothing of the server's needs finalising, and tearing down what torch's import
        # built costs about a CPU-second.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _become(request)


if __name__ == "__main__":
    _main(sys.argv[1:])
