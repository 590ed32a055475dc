"""A pod's processes before a round takes them: its fork server and a spare's parked rank processes.

When each starts is :mod:`.warm_spares`' decision (parked at all; and, for a pod that arrived while the job ran,
not before the round's ranks have stepped). This module starts them and watches the parked ones: one that ends
before a round took it (its ``prepare`` hook raised) is said once, in the pod's log and in its progress report.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stalwart.agent import progress as book_
from stalwart.agent.handover import NextStep
from stalwart.agent.processes import RankProc, RankProcesses, start_fork_server
from stalwart.agent.progress import NodeState, ProgressReporter
from stalwart.agent.rank_env import handover_file, parked_env, parked_report, shared_env, status_file
from stalwart.agent.rendezvous import RoundInfo
from stalwart.agent.rendezvous.view import View
from stalwart.agent.settings import PodSettings
from stalwart.agent.standby import parked_failure, read_report
from stalwart.agent.warm_spares import SteppedProbe, WrapperProbe, joins_late, park_now
from stalwart.api.job_record import JobRecord
from stalwart.api.restart import FailureInfo
from stalwart.etcd.store import Store
from stalwart.forkserver import ForkedProcess

log = logging.getLogger(__name__)

__all__ = ["Parking", "how_started"]


def how_started(p: RankProc) -> str:
    return ", forked from the fork server" if isinstance(p.popen, ForkedProcess) else ""


@dataclass(frozen=True, slots=True)
class PodProcess:
    """What every process of the pod is started from: its command, environment and run directory."""

    settings: PodSettings
    command: list[str]
    base_env: Mapping[str, str]
    run_dir: Path


class Parking:
    """The fork server, started once, and the parked rank processes of a spare (``parked``: they run and wait
    for their first round)."""

    def __init__(self, store: Store, pod: PodProcess, ranks: RankProcesses, reporter: ProgressReporter, *,
                 warm_spares: bool, fork_server: bool, context: str) -> None:
        self._store, self._pod, self._ranks, self._reporter = store, pod, ranks, reporter
        self._forced, self._fork_server, self._ctx = warm_spares, fork_server, context
        self._wrapper = WrapperProbe(store, pod.settings.keys, context=context)
        self.parked = False
        # Not started after arrive() only where this pod joined a running job and waits for the round to step.
        self._started_forks = False
        self._stepped: SteppedProbe | None = None

    def arrive(self, view: View | None) -> None:
        """Before the first join: start the fork server now (its imports overlap the rendezvous) unless this pod
        joins a running job (``view``: the rendezvous as loaded; ``None``: not loaded in time)."""
        if view is not None and joins_late(view, self._pod.settings.node_id):
            log.info("%s: joining a running job: the fork server and any parked process start once the round's "
                     "ranks have stepped", self._ctx)
        else:
            self.start_forks()

    def start_forks(self) -> None:
        """Start the fork server, once."""
        if not self._started_forks:
            self._started_forks = True
            self._ranks.forks = start_fork_server(self._pod.command, shared_env(self._pod.settings, self._pod.base_env),
                                                  enabled=self._fork_server, context=self._ctx)

    def wait_in(self, info: RoundInfo) -> None:
        """This pod waits outside the round ``info`` (a spare, or arrived after its seal)."""
        self._stepped = SteppedProbe(self._store, self._pod.settings.keys, info.epoch, info.header.members,
                                     context=self._ctx) if not self._started_forks else None

    def maybe_park(self, step: NextStep, job: JobRecord | None) -> None:
        """Park this spare's processes if it is time (:func:`~.warm_spares.park_now`, and the round has stepped
        where this pod joined a running job)."""
        if (step == "park" and not self.parked and (self._stepped is None or self._stepped())
                and park_now(self._forced, job, self._wrapper)):
            self.start_forks()
            self._launch()

    def _launch(self) -> None:
        """Start this spare's processes before any round takes them: they import the script and wait."""
        pod, self._ranks.procs, self.parked = self._pod, {}, True
        for lr in range(pod.settings.nproc_per_node):
            with contextlib.suppress(FileNotFoundError):
                handover_file(pod.run_dir, lr).unlink()
            with contextlib.suppress(FileNotFoundError):
                parked_report(pod.run_dir, lr).unlink()
            env = parked_env(pod.settings, lr, base_env=pod.base_env, run_dir=pod.run_dir)
            p = self._ranks.start(pod.command, env, lr, slot=-1, status_file=status_file(pod.run_dir, lr),
                                  fresh=False, report=parked_report(pod.run_dir, lr))
            log.info("%s: started local rank %d parked (pid %d%s)", self._ctx, lr, p.popen.pid, how_started(p))

    def note_exits(self) -> None:
        """Say once, in the pod's log and in its report to the operator (which names the pod and the exception
        in the job's ``PrepareFailed`` condition), that a parked process ended before any round took it (its
        ``prepare`` hook raised: ``PREPARE_FAILED``). It is not started again while the pod waits (it would
        fail the same way): a round that needs the pod starts its processes afresh. The running job's ranks
        are not touched: nothing of them failed."""
        if not self.parked:
            return
        for p in self._ranks.procs.values():
            if p.exit_code is None and (code := p.popen.poll()) is not None:
                p.exit_code = code
                failure = parked_failure(pod=self._pod.settings.node_id, local_rank=p.local_rank, code=code,
                                         report=read_report(p.report), now=time.time())
                log.error("%s: parked local rank %d (pid %d) ended before a round took it: %s%s; the spare's "
                          "processes start afresh when a round needs this pod", self._ctx, p.local_rank,
                          p.popen.pid, failure.reason,
                          f" ({failure.exception}: {failure.message})" if failure.exception else "")
                self.failed(failure, "joining")

    def failed(self, failure: FailureInfo, state: NodeState) -> None:
        """A parked process (or the pod's standby) ended before a round took it: reported at once."""
        self._reporter.book = book_.parked_failed(self._reporter.book, failure)
        self._reporter.publish(state, force=True)
