"""Whether each stalwart process that decided to exit was gone within the bound (issue 29): an agent hung at
interpreter exit after "every rank returned" must show up as a failure, not as a slow CI.

What a process decided, and when, comes from its own log (the ``%(asctime)s`` of stalwart's log lines, to the
millisecond): the agent's ``every rank returned`` or ``nothing left to run``, and the ``leaving with exit code N``
line of :mod:`stalwart.exits` that every stalwart process logs once it has decided to exit, naming its pid (its
ranks write to the same log, and their own leaving lines are not its decision; nor is a rank's error that
happens to say "every rank returned": only the agent's runner's lines that end so count). When it ended comes
from who saw it end:

* a container of a local cluster: the kubelet's book (:mod:`.containerbook`), to the millisecond, with the
  container's processes that outlived its main process (``leftovers``: the kubelet killed them); a cluster
  started in this process (:meth:`~.cluster.LocalCluster.up`) is followed (:func:`follow`) and judged by
  :class:`ClusterExits`;
* a process a test starts itself (``python -m stalwart agent`` without a cluster): :class:`WatchedProcess`, a
  ``subprocess.Popen`` whose end a thread sees on the process's pidfd, without reaping it.

The pytest plugin (:mod:`.pytest_plugin`) judges, after each test, everything of this process's clusters and
watched processes that the test touched; ``bench/ends.py`` measures the same facts over many jobs. Everything
here is per process (what this process started), so several pytest-xdist workers never see each other's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from stalwart.local.containerbook import BOOK, read_book
from stalwart.local.processes import CONTAINER_MARKER, container_id

__all__ = ["EXIT_BOUND", "SLACK", "ClusterExits", "Instance", "LogFacts", "Problem", "WatchedProcess", "follow",
           "followed", "judge_watched", "log_facts", "read_log", "take_watched"]

#: Seconds a stalwart process that decided to exit may take to be gone (``stalwart.exits.EXIT_BOUND``, the
#: contract of issue 29; repeated here so that this check does not move with the code it checks).
EXIT_BOUND = 10.0
#: What a test's check allows past the bound. On the 2-core machines the suite runs on, with other tests'
#: processes beside it, a process's last steps, the log line's write and the watcher's notice of the end each
#: wait for a CPU; a hang is unbounded, so 5 s more tells it apart as well and keeps a busy machine from failing
#: a correct process. The exit soak (``bench/ends.py``) counts against the bound itself.
SLACK = 5.0
LEAVING = "leaving with exit code"
#: Seconds the kubelet may take to write a container's end to its book once the process is gone.
BOOK_GRACE = 3.0
#: The agent's lines on deciding that its job is over here (before it closes its streams and leaves): a line of
#: its runner's logger that ends with one of these (a rank's error may say "before every rank returned").
DECIDED = ("every rank returned", "nothing left to run")
DECIDER = " stalwart.agent.runner: "
#: Main processes that only wrap the one that logs (``sh -c 'stalwart agent -- ...; ...'``): the kubelet sees the
#: shell's end, not the logging process's, so such a container is not judged.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash", "busybox"})
#: How much of the end of a log is read: the lines that matter are its last ones.
LOG_TAIL_BYTES = 512 * 1024
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_BOUND = re.compile(r"\(bound ([0-9.]+)s(?:, pid (\d+))?\)")


@dataclass(frozen=True)
class LogFacts:
    """What a log says of its process's end (wall-clock seconds, ``None`` where it says nothing).

    ``decided``: the earliest of the agent's decision lines (:data:`DECIDED`) and the last ``leaving`` line;
    ``leaving``: the last ``leaving with exit code`` line; ``returned``: the last ``{"event": "done"}`` of the
    example trainer (a rank's training function returned); ``tail``: the last lines; ``bound``: the bound the
    process itself declared on its ``leaving`` line (``(bound 10s)``; the operator keeps a longer one)."""

    decided: float | None
    leaving: float | None
    returned: float | None
    tail: tuple[str, ...]
    bound: float | None = None

    def limit(self, bound: float | None) -> float:
        """The seconds allowed from the decision to the end: ``bound``, or the declared bound (else
        :data:`EXIT_BOUND`) plus :data:`SLACK`."""
        return bound if bound is not None else (self.bound or EXIT_BOUND) + SLACK


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    with contextlib.suppress(ValueError):
        return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def log_facts(text: str, tail_lines: int = 25, *, pid: int | None = None) -> LogFacts:
    """What ``text``, a process's log, says of its end. ``pid``: the process judged, when its children (its ranks)
    write to the same log: their ``leaving`` lines, which name their own pids, are theirs, not its."""
    lines = text.splitlines()
    decisions: list[float] = []
    leaving: float | None = None
    returned: float | None = None
    declared: float | None = None
    for line in lines:
        if line.startswith("{") and '"done"' in line:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                event = json.loads(line)
                if event.get("event") == "done":
                    returned = max(returned or 0.0, float(event["time"]))
            continue
        if LEAVING in line:
            m = _BOUND.search(line)
            if pid is not None and m is not None and m[2] is not None and int(m[2]) != pid:
                continue  # a child's
            leaving = _stamp(line) or leaving
            declared = float(m[1]) if m else declared
        elif DECIDER in line and line.rstrip().endswith(DECIDED):
            t = _stamp(line)
            if t is not None:
                decisions.append(t)
    if leaving is not None:
        decisions.append(leaving)
    return LogFacts(min(decisions) if decisions else None, leaving, returned, tuple(lines[-tail_lines:]),
                    declared)


def read_log(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of the log at ``path`` (from its first whole line), ``""`` when it is gone."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            data = f.read()
    except OSError:
        return ""
    if size > limit:
        data = data[data.find(b"\n") + 1:]
    return data.decode(errors="replace")


@dataclass(frozen=True)
class Problem:
    """A process that decided to exit and was not gone within the bound (``what`` says how), or that left
    processes behind; ``who`` names it (pod and pid), ``tail`` is the end of its log."""

    who: str
    what: str
    tail: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = "\n".join(f"    | {line}" for line in self.tail)
        return f"{self.who}: {self.what}" + (f"\n  its last log lines:\n{lines}" if lines else "")


def _late(who: str, facts: LogFacts, ended: float | None, bound: float, tail: tuple[str, ...]) -> Problem | None:
    if facts.decided is None:
        return None
    if ended is None:
        return Problem(who, f"still running {time.time() - facts.decided:.1f}s after it decided to exit "
                            f"(bound {bound:g}s)", tail)
    took = ended - facts.decided
    if took > bound:
        return Problem(who, f"ended {took:.1f}s after it decided to exit (bound {bound:g}s)", tail)
    return None


# --- containers of a local cluster -------------------------------------------------------------------------------


@dataclass
class Instance:
    """One instance of a container (one main process) as the kubelet's book tells it."""

    namespace: str
    pod: str
    uid: str
    container: str
    pid: int
    started: float
    log: Path
    ended: float | None = None
    exit_code: int | None = None
    leftovers: list[int] = field(default_factory=list)
    superseded: bool = False  # a later instance of the container started: this one's log is its .previous.log
    #: When this process first saw the main process gone while the book had no end for it yet.
    gone: float | None = None
    argv: tuple[str, ...] = ()

    @property
    def wrapped(self) -> bool:
        """Its main process is a shell around the process that logs (see :data:`SHELLS`)."""
        return bool(self.argv) and Path(self.argv[0]).name in SHELLS

    @property
    def who(self) -> str:
        return f"pod {self.namespace}/{self.pod} container {self.container} (pid {self.pid})"

    def log_path(self) -> Path:
        return self.log.with_name(f"{self.container}.previous.log") if self.superseded else self.log

    def facts(self) -> LogFacts:
        return log_facts(read_log(self.log_path()), pid=self.pid)

    def running(self) -> bool:
        """No end in the book, and the pid is still this container's process."""
        if self.ended is not None:
            return False
        try:
            env = Path(f"/proc/{self.pid}/environ").read_bytes()
        except OSError:
            return False
        return f"{CONTAINER_MARKER}={container_id(self.uid, self.container)}".encode() in env.split(b"\0")


class ClusterExits:
    """The container instances of the local cluster in ``directory``, from its kubelet's book, and the judgement
    of those touched since the last :meth:`judge`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / BOOK
        self.offset = 0
        self.instances: dict[tuple[str, str, int], Instance] = {}
        self._unsettled: set[tuple[str, str, int]] = set()

    def update(self) -> set[tuple[str, str, int]]:
        """Read what the book gained; the keys of the instances it touched."""
        records, self.offset = read_book(self.path, self.offset)
        touched = set()
        for rec in records:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                key = (str(rec["uid"]), str(rec["container"]), int(rec["pid"]))
                if rec["event"] == "started":
                    for other in self.instances.values():
                        if (other.uid, other.container) == key[:2] and other.pid != key[2]:
                            other.superseded = True
                    self.instances[key] = Instance(str(rec["namespace"]), str(rec["pod"]), key[0], key[1], key[2],
                                                   float(rec["time"]), Path(rec["log"]),
                                                   argv=tuple(str(a) for a in rec.get("argv") or ()))
                inst = self.instances.get(key)
                if inst is None:
                    continue
                if rec["event"] == "ended" and inst.ended is None:
                    inst.ended, inst.exit_code = float(rec["time"]), int(rec["exitCode"])
                elif rec["event"] == "leftovers":
                    inst.leftovers += [int(p) for p in rec["pids"]]
                touched.add(key)
        return touched

    def judge(self, bound: float | None = None, *, wait: bool = True) -> list[Problem]:
        """Judge every instance touched since the last call (or left unsettled by it): one that decided to exit
        must have ended within ``bound`` seconds of deciding (default: the bound it declared, plus
        :data:`SLACK`), leaving no process behind. One that decided but
        still runs is waited for (with ``wait``) until ``bound`` after its decision; one that has not decided is
        judged again by a later call (a pod the test left running is stopped by its namespace's deletion). A
        container whose main process is a shell wrapping the one that logs is not judged (:data:`SHELLS`)."""
        pending = self.update() | self._unsettled
        self._unsettled = set()
        problems: list[Problem] = []
        while pending:
            waiting: dict[tuple[str, str, int], float] = {}
            for key in sorted(pending):
                inst = self.instances[key]
                if inst.wrapped:
                    continue
                facts = inst.facts()
                limit = facts.limit(bound)
                if inst.ended is None and inst.gone is None and not inst.running():
                    # Gone before the kubelet wrote its end to the book (it notes ends on its next pass).
                    inst.gone = time.time()
                if inst.ended is None and inst.gone is not None and time.time() < inst.gone + BOOK_GRACE:
                    if wait:  # its end (and any leftovers) should reach the book in a moment
                        waiting[key] = inst.gone + BOOK_GRACE
                    else:
                        self._unsettled.add(key)
                    continue
                if inst.ended is None and inst.gone is None:
                    if facts.decided is None or (not wait and time.time() < facts.decided + limit):
                        self._unsettled.add(key)
                    elif time.time() < facts.decided + limit:
                        waiting[key] = facts.decided + limit
                    else:
                        problems.append(_late(inst.who, facts, None, limit, facts.tail)
                                        or Problem(inst.who, "still running", facts.tail))
                    continue
                late = _late(inst.who, facts, inst.ended if inst.ended is not None else inst.gone, limit,
                             facts.tail)
                if late is not None:
                    problems.append(late)
                if inst.leftovers and facts.decided is not None:
                    problems.append(Problem(inst.who, f"left processes behind when it ended (pids "
                                                      f"{inst.leftovers}, killed by the kubelet)", facts.tail))
            if not waiting:
                break
            time.sleep(min(0.1, max(0.0, min(waiting.values()) - time.time())))
            pending = set(waiting)
            self._unsettled |= self.update() - pending
        return problems


_followed: dict[Path, ClusterExits] = {}
_followed_lock = threading.Lock()


def follow(directory: Path) -> ClusterExits:
    """Judge the cluster in ``directory`` too (idempotent)."""
    d = directory.resolve()
    with _followed_lock:
        return _followed.setdefault(d, ClusterExits(d))


def followed() -> list[ClusterExits]:
    """The clusters this process follows whose directory still exists."""
    with _followed_lock:
        for d in [d for d in _followed if not d.exists()]:
            del _followed[d]
        return list(_followed.values())


# --- processes a test starts itself ------------------------------------------------------------------------------


_watched: list[WatchedProcess] = []
_watched_lock = threading.Lock()


class WatchedProcess(subprocess.Popen[Any]):
    """A ``subprocess.Popen`` (same arguments) that knows when its process ended: a thread waits on the process's
    pidfd (which never reaps it, so the owner's ``wait`` and ``communicate`` work as before) and notes the time.
    The output the owner reads through :meth:`communicate` is kept for the judgement. Every one started is
    judged by the pytest plugin after the test (:func:`take_watched`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended_at: float | None = None
        self.output = ""
        self._seen_end = threading.Event()
        threading.Thread(target=self._watch, name=f"watch-{self.pid}", daemon=True).start()
        with _watched_lock:
            _watched.append(self)

    def _watch(self) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:  # already gone (and reaped)
            self.ended_at = time.time()
            self._seen_end.set()
            return
        try:
            select.select([fd], [], [])
            self.ended_at = time.time()
        finally:
            os.close(fd)
            self._seen_end.set()

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        out, err = super().communicate(input, timeout)
        for part in (out, err):
            if part:
                self.output += part if isinstance(part, str) else part.decode(errors="replace")
        return out, err

    def ended(self) -> bool:
        """Whether its end was seen."""
        return self._seen_end.is_set()

    def wait_end(self, timeout: float) -> bool:
        """Whether its end was seen within ``timeout`` seconds."""
        return self._seen_end.wait(timeout)


def take_watched() -> list[WatchedProcess]:
    """The watched processes started since the last call."""
    with _watched_lock:
        out = list(_watched)
        _watched.clear()
    return out


def judge_watched(procs: Iterable[WatchedProcess], bound: float | None = None) -> list[Problem]:
    """Each of ``procs`` must have ended, within ``bound`` seconds of deciding to exit where its log says it did
    (default: the bound it declared, plus :data:`SLACK`).
    One still running is killed (its process group too when it leads one) after the report is made."""
    problems: list[Problem] = []
    for p in procs:
        args: Any = p.args
        argv: list[Any] = list(args) if isinstance(args, list | tuple) else [args]
        who = f"process {p.pid} ({' '.join(os.fsdecode(a) for a in argv[:6])})"
        facts = log_facts(p.output, pid=p.pid)
        if not p.ended():
            # Its end may be a moment from being seen (the owner just reaped it); one that decided to exit is
            # given the rest of its bound.
            p.wait_end(max(0.2, facts.decided + facts.limit(bound) - time.time()
                           if facts.decided is not None else 0.0))
        if p.ended():
            if not p.output and p.returncode is None:
                # Ended, but the owner never read its output: read it now (its pipes are at their end).
                with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                    p.communicate(timeout=2.0)
                facts = log_facts(p.output, pid=p.pid)
            problem = _late(who, facts, p.ended_at, facts.limit(bound), facts.tail)
        else:
            _kill(p)
            facts = log_facts(p.output, pid=p.pid)
            problem = _late(who, facts, None, facts.limit(bound), facts.tail) or Problem(
                who, "still running at the end of the test (killed now)", facts.tail)
        if problem is not None:
            problems.append(problem)
    return problems


def _kill(p: WatchedProcess) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, signal.SIGKILL)
        else:
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
        p.communicate(timeout=5.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=5.0)
