"""A pod's standby process, and what a parked process that ends before any round took it says.

A wrapped rank process that dies while its pod lives (SIGKILL, an OOM kill, a hang its agent killed) is
replaced in the next restart iteration. Started afresh, the replacement imports torch and the script and runs
the ``prepare`` hook before it can rejoin. So the agent keeps one more process per pod, the *standby*: started
parked, as a warm spare's processes are (torch and the script imported, the ``prepare`` hook run, then
waiting for its handover file with no slot), behind the running ranks. When one of them dies the agent hands
the standby the dead rank's assignment in the current round (the same :class:`~stalwart.api.handover.Handover`
a warm spare's process receives at its promotion); it enters the round at once and joins the next iteration
as a respawn would, and the agent starts a new standby behind it.

When (:func:`standby_due`, pure): the pod runs ranks of a round (not a parked spare's), every one of them
has shown that it runs the restart wrapper (its status file: a plain script cannot wait parked; its process
would run the script outside any round) and trains (:func:`settled`: each runs its training function and a
step of their current iteration completed, so that the standby's imports and ``prepare`` never compete for
the CPU with a start or a recovery), warm spares are on for the job (the same setting that keeps a
pod's processes across rounds, :func:`~stalwart.agent.warm_spares.keeps_processes`), the agent's
``--no-standby`` and the container's ``STALWART_STANDBY=false`` do not turn it off, and no standby of this
agent ended on its own before (its ``prepare`` raised, or it died while parked: a second one would most
likely end the same way; a dead rank is then started afresh, as without a standby).

What it costs: one more process per pod, with what the script and the ``prepare`` hook hold (a second model
and optimizer, on the device if the hook moves them there), and the CPU of its imports and of ``prepare``
once, beside the running ranks. Waiting, it sleeps in the kernel until its handover file changes (inotify),
waking once a second to check that its agent lives.

With several local ranks per pod the standby does not know which one it will replace: it is started without
``LOCAL_RANK`` and runs ``prepare`` after its handover (a hook may choose its device by the local rank).

A parked process (a warm spare's or the standby) whose ``prepare`` hook raised ends ``PREPARE_FAILED`` after
writing the exception to its report file (``STALWART_PARKED_REPORT``); :func:`parked_failure` turns that (or
the bare exit code) into the :class:`~stalwart.api.restart.FailureInfo` the agent reports for the pod.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

from stalwart.agent.processes import RankProc, RankProcesses
from stalwart.api import pod_env
from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FailureInfo, RankStatus

log = logging.getLogger(__name__)

__all__ = ["Standby", "parked_failure", "read_report", "replacement", "settled", "standby_due"]


def settled(statuses: Sequence[RankStatus | None], stepped: int | None) -> bool:
    """Whether the pod's ranks train: each status says it runs its training function, in an iteration no later
    than ``stepped``, the last iteration of the round in which a rank of the pod completed a step (its
    agent's progress book: a reported step, or, for a script that reports none, 10 s in the function). Pure."""
    return bool(statuses) and stepped is not None and all(
        st is not None and st.state == "running" and st.iteration <= stepped for st in statuses)


def standby_due(*, enabled: bool, warm: bool, member: bool, wrapped: Sequence[bool], settled: bool, have: bool,
                given_up: bool) -> bool:
    """Whether the pod starts a standby process now: it is on (``enabled``: the agent's flag and the pod's
    setting; ``warm``: warm spares on for the job), the pod runs ranks of a round (``member``), each of
    them showed the restart wrapper (``wrapped``, one per local rank) and they train (``settled``), it has
    none (``have``: one alive), and none of this agent's ended on its own (``given_up``). Pure."""
    return (enabled and warm and member and bool(wrapped) and all(wrapped) and settled and not have
            and not given_up)


def replacement(*, standby_alive: bool, in_round: bool) -> Literal["standby", "spawn"]:
    """What takes a dead wrapped rank's place in the next iteration: the standby when one is alive and the
    agent is in a round (its assignment exists), else a process started for it. A rank killed for a hang is
    replaced alike. Pure."""
    return "standby" if standby_alive and in_round else "spawn"


def parked_failure(*, pod: str, local_rank: int | None, code: int, report: FailureInfo | None,
                   now: float) -> FailureInfo:
    """What the pod reports of a parked process that ended before a round took it (``code``: its exit code,
    negative for a signal; ``report``: what it wrote to its report file, if anything). Pure."""
    if report is not None:
        return report.model_copy(update={"pod": pod})
    what = (f"killed by signal {-code}" if code < 0 else
            f"exit code {code} ({ExitCode(code).name})" if code in ExitCode._value2member_map_ else f"exit code {code}")
    who = "the standby process" if local_rank is None else f"parked local rank {local_rank}"
    return FailureInfo(pod=pod, reason=f"{who} ended before a round took it: {what}", time=now)


def read_report(path: Path | None) -> FailureInfo | None:
    """The report a parked process wrote before it ended (``None``: none, or unreadable)."""
    if path is None:
        return None
    try:
        return FailureInfo.from_json_bytes(path.read_bytes())
    except (OSError, ValueError):
        return None


class Standby:
    """The pod's standby process (see the module docstring): started by :meth:`keep`, handed a dead rank's
    place by :meth:`take`; it lives in :attr:`RankProcesses.standby`, so that stopping the pod's processes
    stops it too."""

    def __init__(self, ranks: RankProcesses, run_dir: Path, *, enabled: bool, nproc: int, context: str = "") -> None:
        self.ranks, self.run_dir, self.enabled, self.nproc, self._ctx = ranks, run_dir, enabled, nproc, context
        self.started = 0
        #: Why no standby is started any more (its last one ended on its own), or ``None``.
        self.given_up: FailureInfo | None = None

    def keep(self, *, warm: bool, member: bool, stepped: int | None, command: Sequence[str],
             env: Callable[[int | None], dict[str, str]], node_id: str) -> FailureInfo | None:
        """Start a standby when one is due; note one that ended on its own (returned once, for the pod's
        report). ``stepped``: see :func:`settled`; ``env(local_rank)`` is a parked process's environment
        (``None``: no local rank)."""
        ended = self._ended(node_id)
        procs = list(self.ranks.procs.values())
        wrapped = [p.local_rank in self.ranks.wrapped and p.exit_code is None for p in procs]
        trains = settled([self.ranks.statuses.get(p.local_rank) for p in procs], stepped)
        if standby_due(enabled=self.enabled, warm=warm, member=member, wrapped=wrapped, settled=trains,
                       have=self.ranks.standby is not None, given_up=self.given_up is not None):
            self._start(command, env)
        return ended

    def _start(self, command: Sequence[str], make_env: Callable[[int | None], dict[str, str]]) -> None:
        self.started += 1
        # A directory of its own: the process sleeps until a file there changes, and the ranks' status files
        # change all the time.
        home = self.run_dir / f"standby-{self.started}"
        home.mkdir(exist_ok=True)
        handover, report = home / "handover.json", home / "parked.json"
        for stale in (handover, report):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        env = make_env(0 if self.nproc == 1 else None)
        env.update({pod_env.HANDOVER_FILE: str(handover), pod_env.PARKED_REPORT: str(report)})
        p = self.ranks.start_standby(command, env, handover=handover, report=report)
        log.info("%s: started a standby process (pid %d%s), parked behind the running ranks", self._ctx,
                 p.popen.pid, ", forked from the fork server" if self.ranks.forked(p) else "")

    def _ended(self, node_id: str) -> FailureInfo | None:
        p = self.ranks.standby
        if p is None or (code := p.popen.poll()) is None:
            return None
        self.ranks.standby = None
        p.exit_code = code
        self.given_up = parked_failure(pod=node_id, local_rank=None, code=code, report=read_report(p.report),
                                       now=time.time())
        log.error("%s: the standby process (pid %d) ended before it was needed: %s%s; a rank process that dies "
                  "is started afresh from now on", self._ctx, p.popen.pid, self.given_up.reason,
                  f" ({self.given_up.exception}: {self.given_up.message})" if self.given_up.exception else "")
        return self.given_up

    def alive(self) -> bool:
        p = self.ranks.standby
        return p is not None and p.popen.poll() is None

    def take(self, local_rank: int, env: Mapping[str, str], *, write: Callable[[Path, Mapping[str, str]], None],
             status: Path) -> RankProc:
        """Give the standby local rank ``local_rank``'s place (``env``: that rank's full environment in the
        current round, passed to ``write(handover_path, env)``); it becomes the pod's process of that rank."""
        p = self.ranks.standby
        assert p is not None and p.handover is not None, "take() without a standby"
        self.ranks.standby = None
        with contextlib.suppress(FileNotFoundError):
            status.unlink()  # the dead process's last word must not judge its successor
        self.ranks.statuses.pop(local_rank, None)
        # Its place first: it asks the relay for the pod's lease as soon as it reads its handover, and the relay
        # lends it to the agent's ranks only.
        p.local_rank, p.slot, p.status_file = local_rank, int(env[pod_env.SLOT]), status
        p.started = time.monotonic()
        self.ranks.procs[local_rank] = p
        self.ranks.wrapped.add(local_rank)
        write(p.handover, env)
        return p
