"""This pod's rank processes as the agent sees them (:class:`RankProcesses`): start them, poll their exits, read
their status files (at most every ``status_interval``), turn both into the
:class:`~stalwart.agent.supervision.ProcView` the supervision decision reads, and stop them with a deadline.

What to do about them is :func:`~stalwart.agent.supervision.supervise`'s decision and the agent's loop
(:mod:`stalwart.agent.runner`); nothing here talks to etcd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from stalwart import exits
from stalwart.agent.supervision import ProcView
from stalwart.api.restart import STACKS_SIGNAL, RankStatus
from stalwart.forkserver import ForkedProcess, ForkServer, parse_command
from stalwart.procfs import process_state

log = logging.getLogger(__name__)

__all__ = ["RankProc", "RankProcess", "RankProcesses", "start_fork_server"]


#: A monotonic time before any other: a status file never read (or due now), a process started before the agent
#: knew it. Not 0.0: ``time.monotonic()`` counts from the machine's boot, so on a node up for less than a
#: ``status_interval`` (or a grace) 0.0 is not long ago.
LONG_AGO = float("-inf")

#: How long a hung rank process gets to write its stacks and end before it is killed (it takes milliseconds).
STACKS_GRACE = 1.0


def start_fork_server(command: Sequence[str], env: Mapping[str, str], *, enabled: bool,
                      context: str = "") -> ForkServer | None:
    """Start the pod's fork server for ``command`` now, so that its imports overlap the rendezvous (``None``:
    not enabled, a command it cannot run, or it failed to start: rank processes start fresh)."""
    target = parse_command(command) if enabled else None
    if target is None:
        if enabled:
            log.info("%s: the command is not `python SCRIPT ...` nor `python -m MODULE ...`: its rank processes "
                     "start fresh, each importing what it needs", context)
        return None
    try:
        server = ForkServer.start(target, env, context=context)
    except OSError as e:
        log.warning("%s: cannot start the fork server (%s): rank processes start fresh", context, e)
        return None
    log.info("%s: fork server started (pid %d): rank processes start by fork once it has imported torch",
             context, server.process.pid)
    return server


class RankProcess(Protocol):
    """What the agent uses of a rank process: a ``subprocess.Popen``, or a process its fork server started."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass(slots=True)
class RankProc:
    """One rank process of this pod."""

    local_rank: int
    slot: int  # -1 while parked (no round yet)
    popen: RankProcess
    status_file: Path
    killed_hung: str = ""  # why the agent killed it (hung past the hard timeout, stopped), "" when it did not
    exit_code: int | None = None
    status_read: float = LONG_AGO
    done_since: float | None = None  # when its status first said "done" (the function returned)
    killed_after_done: bool = False
    started: float = LONG_AGO  # monotonic time it was started
    #: Its handover file when not the local rank's own (a standby's, which it keeps after taking a rank's place).
    handover: Path | None = None
    #: Where it writes why it ended while parked (a parked process's; :mod:`stalwart.agent.standby`).
    report: Path | None = None


@dataclass(slots=True)
class RankProcesses:
    """The rank processes of this pod, by local rank, and what their status files last said."""

    status_interval: float
    finish_grace: float
    context: str = ""
    procs: dict[int, RankProc] = field(default_factory=dict)
    statuses: dict[int, RankStatus] = field(default_factory=dict)
    #: Local ranks whose script has shown it runs the restart wrapper (its respawns are treated as such too).
    wrapped: set[int] = field(default_factory=set)
    #: The pod's fork server, which runs the same command (None: every process starts fresh).
    forks: ForkServer | None = None
    #: The pod's standby process, parked behind the ranks (:mod:`stalwart.agent.standby`), if there is one.
    standby: RankProc | None = None

    def _popen(self, command: Sequence[str], env: Mapping[str, str]) -> RankProcess:
        popen: RankProcess | None = self.forks.spawn(env) if self.forks is not None else None
        if popen is None:
            popen = subprocess.Popen(list(command), env=dict(env), start_new_session=False)
        return popen

    def start(self, command: Sequence[str], env: Mapping[str, str], local_rank: int, *, slot: int,
              status_file: Path, fresh: bool, report: Path | None = None) -> RankProc:
        """Start local rank ``local_rank``, forked from the fork server when there is one that can;
        ``fresh``: a process of a round (its start time counts), not a parked one."""
        p = RankProc(local_rank, slot, self._popen(command, env), status_file,
                     started=time.monotonic() if fresh else LONG_AGO, report=report)
        self.procs[local_rank] = p
        return p

    def start_standby(self, command: Sequence[str], env: Mapping[str, str], *, handover: Path,
                      report: Path) -> RankProc:
        """Start the pod's standby process, parked (no local rank, no slot until it takes one's place)."""
        self.standby = RankProc(-1, -1, self._popen(command, env), Path(os.devnull), handover=handover,
                                report=report)
        return self.standby

    @staticmethod
    def forked(p: RankProc) -> bool:
        return isinstance(p.popen, ForkedProcess)

    def poll(self) -> None:
        for p in self.procs.values():
            if p.exit_code is None:
                p.exit_code = p.popen.poll()
                if p.exit_code is not None:
                    # Its last word decides what its death means (a wrapped process is respawned into the next
                    # iteration, a plain one restarts the round): read it now, not up to status_interval later.
                    # A forked process can die before the agent ever read its status file.
                    p.status_read = LONG_AGO
            if p.exit_code is not None and p.exit_code < 0 and p.killed_after_done:
                p.exit_code = 0  # it returned from the training function; only its exit hung (and was ended)

    def all_exited(self) -> bool:
        return all(p.exit_code is not None for p in self.procs.values())

    def read_status(self, p: RankProc) -> RankStatus | None:
        # Exits are polled every tick (cheap); status files, which only feed the hard timeout and progress,
        # at most every status_interval, to keep the agent's share of the CPU negligible.
        now = time.monotonic()
        if now - p.status_read < self.status_interval:
            return self.statuses.get(p.local_rank)
        p.status_read = now
        try:
            st = RankStatus.from_json_bytes(p.status_file.read_bytes())
        except (OSError, ValueError):
            self.statuses.pop(p.local_rank, None)
            return None
        self.statuses[p.local_rank] = st
        return st

    def last_words(self) -> None:
        """Read every status file now (each process wrote its last word before returning or exiting)."""
        for p in self.procs.values():
            p.status_read = LONG_AGO
            self.read_status(p)

    def views(self) -> list[ProcView]:
        return [self.view(p) for p in self.procs.values()]

    def view(self, p: RankProc) -> ProcView:
        st = self.read_status(p)
        if st is None:
            return ProcView(p.local_rank, p.exit_code, wrapped=p.local_rank in self.wrapped)
        self.wrapped.add(p.local_rank)
        now = time.monotonic()
        if st.state == "done" and p.exit_code is None:
            p.done_since = p.done_since or now
            # Both clocks are CLOCK_MONOTONIC, which every process of the machine shares.
            exit_overran = st.exiting is not None and now - st.exiting > exits.EXIT_BOUND
            if (exit_overran or now - p.done_since > self.finish_grace) and not p.killed_after_done:
                if exit_overran:
                    log.warning("%s: local rank %d returned from the training function and began to exit, but "
                                "is still there %gs later (a finaliser that blocks; its stacks are in its log): "
                                "killing it", self.context, p.local_rank, exits.EXIT_BOUND)
                else:
                    log.warning("%s: local rank %d returned from the training function but its process has not "
                                "exited in %.0fs: killing it", self.context, p.local_rank, self.finish_grace)
                p.killed_after_done = True
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
        # The heartbeat is the main thread's progress in every phase but the last.
        age = now - st.heartbeat if st.state not in ("done", "failed") else None
        stopped = p.exit_code is None and age is not None and process_state(p.popen.pid) == "T"
        return ProcView(p.local_rank, p.exit_code, wrapped=True, heartbeat_age=age, hard_timeout=st.hard_timeout,
                        soft_timeout=st.soft_timeout, stopped=stopped)

    def dump_stacks(self, p: RankProc) -> bool:
        """Have a hung process write its threads' stacks to the log and end itself (:mod:`stalwart.restart.stacks`:
        the signal's own action ends it right after the dump, so it takes no step in between); the caller kills
        it anyway. A stopped process cannot act on a signal, and one whose status does not say it takes the
        signal is not sent it. True when it was sent."""
        st = self.statuses.get(p.local_rank)
        if st is None or not st.dumps_stacks or process_state(p.popen.pid) in ("T", "t"):
            return False
        with contextlib.suppress(OSError):  # the action is to dump core too: not a core file per hung rank
            _, hard = resource.prlimit(p.popen.pid, resource.RLIMIT_CORE)
            resource.prlimit(p.popen.pid, resource.RLIMIT_CORE, (0, hard))
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.popen.pid, STACKS_SIGNAL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=STACKS_GRACE)  # faulthandler writes from its signal handler: milliseconds
        return True

    def stop_all(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace``, to every process and the standby; a stopped (or traced) process
        gets SIGKILL at once: it cannot act on SIGTERM, so waiting would only hold the pod up."""
        every = [*self.procs.values(), *([self.standby] if self.standby is not None else [])]
        self.standby = None  # parked: it holds nothing of a round, and SIGTERM ends its wait at once
        running = [p for p in every if p.popen.poll() is None]
        for p in running:
            state = process_state(p.popen.pid)
            with contextlib.suppress(ProcessLookupError):
                if state in ("T", "t"):
                    log.warning("%s: local rank %d (pid %d) is stopped: killing it", self.context, p.local_rank,
                                p.popen.pid)
                    p.popen.kill()
                else:
                    p.popen.terminate()
        deadline = time.monotonic() + grace
        for p in running:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s: local rank %d ignored SIGTERM for %.0fs: killing it", self.context, p.local_rank,
                            grace)
                with contextlib.suppress(ProcessLookupError):
                    p.popen.kill()
                try:
                    p.popen.wait(timeout=10)
                except subprocess.TimeoutExpired:  # in uninterruptible sleep; the kernel reaps it later
                    log.error("%s: local rank %d (pid %d) survived SIGKILL for 10s", self.context, p.local_rank,
                              p.popen.pid)
        for p in every:
            p.exit_code = p.popen.poll()

    def close(self) -> None:
        """End the fork server (after :meth:`stop_all`: it reports the exits of what it started)."""
        if self.forks is not None:
            self.forks.close()
