"""The per-pod agent: join the node rendezvous, run the rank processes, supervise them, report progress.

One loop per round: join (:class:`~stalwart.agent.rendezvous.NodeHandle`), launch ``nproc_per_node`` rank
processes with torchrun's environment plus the ``STALWART_*`` variables the restart wrapper reads (the job's
in-process restart settings among them, from the operator's JobRecord), then poll every ``poll_interval``
seconds: process exits, status files (heartbeat, step, restarts), the round's end, SIGTERM. What to do about
the processes is :func:`~stalwart.agent.supervision.supervise`'s decision.

A wrapped rank process that dies is replaced in the next in-process iteration by the pod's standby process
when it has one (:mod:`stalwart.agent.standby`), else by a process started for it.

A wrapped rank process that dies, or that the agent kills (hung past its hard timeout, or stopped past its
soft timeout), cannot say so itself: the agent records the fault in the rank's restart iteration (fenced by
the round's epoch), which interrupts its peers at once and names the culprit. Every wait on a process has a
deadline: a stopped process is killed at once when the round ends (it cannot act on SIGTERM), any other gets
``term_grace`` seconds; one that returned from the training function but does not exit is killed after
``finish_grace`` seconds.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stalwart.agent import progress as book_
from stalwart.agent.drill import DrillListener, Target
from stalwart.agent.handover import grow_due, handover_env, keep_at_round_end, next_step, write_handover
from stalwart.agent.metrics import AgentMetrics
from stalwart.agent.parking import Parking, PodProcess, how_started
from stalwart.agent.processes import LONG_AGO, RankProc, RankProcesses
from stalwart.agent.progress import NodeState, ProgressReporter
from stalwart.agent.rank_env import handover_file, parked_env, rank_env, status_file
from stalwart.agent.rank_liveness import PodLease, RankLiveness
from stalwart.agent.relay import BarrierRelay, socket_path
from stalwart.agent.rendezvous import (
    Fenced,
    NodeHandle,
    Rendezvous,
    RendezvousCancelled,
    RendezvousClosed,
    RendezvousSettings,
    RoundInfo,
)
from stalwart.agent.settings import PodSettings
from stalwart.agent.socket_peers import slot_of_ranks
from stalwart.agent.standby import Standby, replacement
from stalwart.agent.supervision import fault_for, supervise
from stalwart.agent.tuning import AgentTuning
from stalwart.agent.warm_spares import keeps_processes
from stalwart.api import pod_env
from stalwart.api.exit_codes import ExitCode
from stalwart.api.handover import Handover
from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import NodeRecord
from stalwart.api.restart import STACKS_SIGNAL, FaultKind
from stalwart.etcd.client import connect
from stalwart.etcd.faults import record_fault
from stalwart.etcd.store import StoreError
from stalwart.net import free_port

log = logging.getLogger(__name__)

__all__ = ["Agent"]


class Agent:
    """Runs ``command`` as this pod's rank processes until the job ends; :meth:`run` returns the exit code."""

    def __init__(self, settings: PodSettings, command: Sequence[str], options: AgentTuning | None = None,
                 *, environ: dict[str, str] | None = None) -> None:
        if not command:
            raise ValueError("command: give the training command after `--`")
        self.settings = settings
        self.command = list(command)
        self.options = options or AgentTuning()
        self.base_env = dict(os.environ if environ is None else environ)
        self.store = connect(settings.etcd_endpoints, settings.etcd_credentials(),
                             probe=settings.keys.prefix if settings.etcd_secret_dir else None)
        self._ctx = f"job={settings.job} node={settings.node_id}"
        self.node_ttl = self.options.node_ttl or self._lease_ttl()
        self.rdzv = Rendezvous(self.store, settings.keys, RendezvousSettings(
            min_nodes=settings.min_nodes, max_nodes=settings.max_nodes,
            last_call_timeout=self.options.last_call_timeout, join_timeout=self.options.join_timeout,
            node_ttl=self.node_ttl))
        self.master_port = free_port(settings.pod_ip)
        self.handle: NodeHandle = self.rdzv.node(NodeRecord(
            node_id=settings.node_id, address=settings.pod_ip, nproc=settings.nproc_per_node,
            spare=settings.spare, master_port=self.master_port), incarnation=settings.pod_uid)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"stalwart-agent-{settings.node_id}-"))
        self.ranks = RankProcesses(self.options.status_interval, self.options.finish_grace, context=self._ctx)
        self.standby = Standby(self.ranks, self.run_dir, enabled=self.options.standby,
                               nproc=settings.nproc_per_node, context=self._ctx)
        self.process_restarts = 0
        self.info: RoundInfo | None = None
        self.job: JobRecord | None = None
        self._terminate = threading.Event()
        self._kept = False  # the processes outlived the last round (warm spares)
        self._grow_asked = 0  # the epoch of the round this node asked to end to grow the world
        self.reporter = ProgressReporter(self.store, settings.keys, settings.node_id,
                                         interval=self.options.progress_interval, context=self._ctx)
        self.parking = Parking(self.store, PodProcess(settings, self.command, self.base_env, self.run_dir), self.ranks,
                               self.reporter, warm_spares=self.options.warm_spares,
                               fork_server=self.options.fork_server, context=self._ctx)
        self.drill = DrillListener(self.store, settings, self._drill_targets, context=self._ctx)
        pod_lease = PodLease(self.store, node=lambda: (self.handle.lease, self.node_ttl), context=self._ctx)
        self.liveness = RankLiveness(self.store, settings.keys, settings.node_id, pod_lease, context=self._ctx)
        self.relay = BarrierRelay(self.store, settings.keys, socket_path(self.run_dir),  # bound by peer pid
                                  slot_of=slot_of_ranks(lambda: {p.popen.pid: p.slot for p in list(
                                      self.ranks.procs.values()) if p.slot >= 0 and p.exit_code is None}),
                                  linger=self.options.relay_linger, context=self._ctx,
                                  lend=lambda ttl, gone, within: pod_lease.lend(ttl, gone, timeout=within))
        self.relay_socket: Path | None = None
        self.metrics = AgentMetrics()

    # -- signals ------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Forward a stop request (SIGTERM): the ranks get SIGTERM, then SIGKILL after ``term_grace``; a join
        or wait of the rendezvous returns at once."""
        self._terminate.set()
        self.handle.cancel()

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: object) -> None:
            log.info("%s: signal %d: stopping the rank processes", self._ctx, signum)
            # From a thread: the main thread may hold the lock of the very event a stop request sets.
            threading.Thread(target=self.request_stop, name="stalwart-stop", daemon=True).start()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        # A launcher that ran the agent as a background job of a non-interactive shell (`agent &`, some CI
        # runners) left SIGQUIT ignored, and the rank processes would inherit that: a hung rank could not be
        # asked for its stacks. A container's first process starts with every signal at its default.
        if signal.getsignal(STACKS_SIGNAL) is signal.SIG_IGN:
            signal.signal(STACKS_SIGNAL, signal.SIG_DFL)

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self, decided: Callable[[int], None] | None = None) -> int:
        """Run until the job ends here; the exit code. ``decided`` is told the code once the rank processes are
        gone, before the rest of the clean-up (the command arms its exit's bound there: see stalwart.exits)."""
        self.drill.start()
        self.relay_socket = self.relay.path if self.relay.start() else None
        if self.settings.metrics_port is not None:
            try:
                self.metrics.serve(self.settings.metrics_port)
            except OSError as e:  # training matters more than its figures
                log.warning("%s: cannot serve metrics on port %d: %s", self._ctx, self.settings.metrics_port, e)
        code = int(ExitCode.FAILED)
        try:
            self.parking.arrive(self.rdzv.view() if self.rdzv.wait_loaded(5.0) else None)
            code = self._run()
            return code
        finally:
            self.drill.stop()
            self.ranks.stop_all(grace=self.options.term_grace)
            self.ranks.close()
            if decided is not None:
                decided(code)
            self.relay.stop()  # after the ranks: one still at a barrier while it stops is answered
            self.liveness.lease.revoke()  # what the ranks left bound to it goes now, not at its TTL
            self.metrics.close()
            with contextlib.suppress(Exception):
                self.handle.leave()
            self.rdzv.shutdown()
            self.store.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _run(self) -> int:
        while not self._terminate.is_set():
            self._publish("joining", force=True)
            try:
                info = self.handle.join()
            except RendezvousClosed:
                log.info("%s: the rendezvous is closed; nothing left to run", self._ctx)
                return int(ExitCode.OK)
            except RendezvousCancelled:
                break
            except Fenced as e:
                # A zombie back from a partition: the job went on without this pod. Its ranks' round is over
                # (every write of theirs is refused) and no handover will come; they stop now.
                log.warning("%s: %s; stopping the rank processes and leaving", self._ctx, e)
                self.ranks.stop_all(grace=self.options.term_grace)
                return int(ExitCode.FENCED)
            self.info = info
            self.job = self._read_job()
            log.info("%s: round %d (epoch %d) as %s, world size %d", self._ctx, info.round, info.epoch, info.role,
                     info.world_size)
            step = next_step(info.role, kept=self._kept, warm=self._warm(), spare_ranks=self.options.spare_ranks)
            if self._kept and not (step == "hand_over" or (step == "park" and self.parking.parked)):
                self.ranks.stop_all(grace=self.options.term_grace)
            self._kept = False
            if step in ("park", "wait"):
                self.parking.wait_in(info)
                self.parking.maybe_park(step, self.job)
                self._publish("joining", force=True)
                with contextlib.suppress(RendezvousCancelled):
                    while not self._terminate.is_set() and self.handle.wait_round_end(1.0) is None:
                        self.parking.maybe_park(step, self.job)
                        self.parking.note_exits()
                self.ranks.poll()
                self._kept = keep_at_round_end(self.ranks.views(), parked=self.parking.parked,
                                               warm=step == "park")
                continue
            self.reporter.join(info.round, info.epoch, self.handle.fence(), kept=step == "hand_over",
                               ended=self.handle.end_seen, world_size=info.world_size,
                               nodes=info.header.members + info.header.spares,
                               soft_timeout=self.job.soft_timeout_seconds if self.job is not None else None)
            self.parking.start_forks()
            if step == "hand_over":
                self._hand_over(info)
            else:
                self._launch_all(info)
            outcome = self._supervise_round(info)
            if outcome is not None:
                return outcome
        self.ranks.stop_all(grace=self.options.term_grace)
        self._publish("failed", force=True)
        return int(ExitCode.TERMINATED)

    def _supervise_round(self, info: RoundInfo) -> int | None:
        """Supervise until the round ends (``None``: join again) or the job ends here (the exit code)."""
        while not self._terminate.is_set():
            self.ranks.poll()
            self._keep_standby(info)
            views = self.ranks.views()
            self.liveness.watch([(p.local_rank, self.ranks.statuses.get(p.local_rank))
                                 for p in self.ranks.procs.values() if p.exit_code is None], time.monotonic())
            actions = supervise(views, restarts_used=self.process_restarts,
                                max_restarts=self.options.max_restarts)
            for action in actions:
                if action.kind == "finish":
                    return self._finish(action.exit_code, action.reason, action.local_ranks)
                if action.kind == "kill":
                    for lr in action.local_ranks:
                        self._kill_hung(lr, action.fault or "hard_timeout", action.reason)
                elif action.kind == "respawn":
                    for lr in action.local_ranks:
                        self._respawn(info, lr, action.exit_code, action.reason)
                elif action.kind == "restart_all":
                    self._note_exits(action.local_ranks)
                    self.process_restarts += 1
                    self.reporter.book = book_.restarted_all(self.reporter.book)
                    self.ranks.stop_all(grace=self.options.term_grace)
                    with contextlib.suppress(Exception):
                        self.handle.request_rerendezvous(action.reason)
                    self._wait_round_end()
                    return None
            end = self.handle.round_end()
            if end is not None:
                if end.closed and self._wait_finishing():
                    continue
                log.info("%s: round %d ended: %s", self._ctx, info.round, end.reason)
                self._kept = keep_at_round_end(self.ranks.views(), parked=False,
                                               warm=self._warm())
                if not self._kept:
                    self.ranks.stop_all(grace=self.options.term_grace)
                return None
            self._maybe_grow(info)
            self._publish(self._state())
            self._terminate.wait(self.options.poll_interval)
        return None

    def _maybe_grow(self, info: RoundInfo) -> None:
        """A shrunken world grows back, in process, once a node waits outside the round."""
        member = info.member
        due = functools.partial(grow_due, warm=self._warm(), group_rank=None if member is None else member.group_rank,
                                members=info.header.members, max_nodes=self.settings.max_nodes)
        # Counting the waiting nodes may cost a read of etcd: only once the rest says the world would grow.
        if self._grow_asked == info.epoch or not due(waiting=1) or not due(waiting=self.handle.waiting_count()):
            return
        self._grow_asked = info.epoch
        log.info("%s: round %d has %d of %d nodes and a node waits: asking for a new round", self._ctx,
                 info.round, info.header.members, self.settings.max_nodes)
        with contextlib.suppress(Exception):
            self.handle.request_rerendezvous("growing the world back")

    def _warm(self) -> bool:
        return keeps_processes(self.options.warm_spares, self.job, spare_ranks=self.options.spare_ranks)

    def _keep_standby(self, info: RoundInfo) -> None:
        history = self.reporter.book.history
        ended = self.standby.keep(
            warm=self._warm(), member=info.member is not None and not self.parking.parked, command=self.command,
            stepped=history[-1].stepped if history and history[-1].round == info.round else None,
            env=lambda lr: parked_env(self.settings, lr, base_env=self.base_env, run_dir=self.run_dir),
            node_id=self.settings.node_id)
        if ended is not None:
            self.parking.failed(ended, self._state())

    def _lease_ttl(self) -> int:
        """The job's lease TTL (``rendezvous.leaseTTLSeconds``, at least etcd's 2 s), 10 s without its record:
        how long after this node's last keep-alive the operator and the other nodes count it lost."""
        record = self._read_job()
        return 10 if record is None else max(2, record.lease_ttl_seconds)

    def _read_job(self) -> JobRecord | None:
        """The operator's record of the job (its timeouts), or ``None``: a job run without the operator, or
        one whose record cannot be read now (the ranks then use their own defaults)."""
        try:
            kv = self.store.get(self.settings.keys.job)
            return None if kv is None else JobRecord.from_json_bytes(kv.value)
        except (StoreError, ValueError) as e:
            log.warning("%s: cannot read the job's record: %s", self._ctx, e)
            return None

    def _wait_finishing(self) -> bool:
        """The rendezvous closed because the job is succeeding: give the ranks time to return."""
        deadline = time.monotonic() + self.options.finish_grace
        while time.monotonic() < deadline and not self._terminate.is_set():
            self.ranks.poll()
            if self.ranks.all_exited():
                return True
            time.sleep(self.options.poll_interval)
        return False

    def _wait_round_end(self) -> None:
        deadline = time.monotonic() + 3 * self.node_ttl
        with contextlib.suppress(RendezvousCancelled):
            while time.monotonic() < deadline and not self._terminate.is_set():
                if self.handle.wait_round_end(0.5) is not None:
                    return

    def _finish(self, code: int, reason: str, local_ranks: Sequence[int] = ()) -> int:
        if code == 0:
            log.info("%s: %s", self._ctx, reason)
            self.ranks.last_words()  # each returned in its last iteration
            with contextlib.suppress(Exception):
                self.handle.close_rendezvous("job succeeded")
            self._publish("succeeded", force=True)
        else:
            log.error("%s: giving up: %s", self._ctx, reason)
            self._note_exits(local_ranks)
            self.ranks.stop_all(grace=self.options.term_grace)
            self.ranks.last_words()  # each wrote it before exiting
            # Ranks that gave up (restarts exhausted, non-retryable) recorded the failure behind it, with the
            # exception: that is the job's last failure, not "exited 90".
            if code in (ExitCode.RESTARTS_EXHAUSTED, ExitCode.NON_RETRYABLE):
                self.reporter.book = book_.gave_up(self.reporter.book, list(self.ranks.statuses.values()))
            self._publish("failed", force=True)
        return code

    # -- processes -------------------------------------------------------------------------------------------

    def _rank_env(self, info: RoundInfo, local_rank: int) -> dict[str, str]:
        return rank_env(self.settings, info, local_rank, base_env=self.base_env, run_dir=self.run_dir,
                        master_port=self.master_port, spare_ranks=self.options.spare_ranks,
                        restarts=self.process_restarts, job=self.job, relay_socket=self.relay_socket)

    def _launch_all(self, info: RoundInfo) -> None:
        self.ranks.procs = {}
        self.parking.parked = False
        for lr in range(self.settings.nproc_per_node):
            self._spawn(info, lr)

    def _hand_over(self, info: RoundInfo) -> None:
        """Give the running processes their places in the new round (they continue there in process)."""
        for p in self.ranks.procs.values():
            env = self._rank_env(info, p.local_rank)
            # Its slot first: the process asks the relay for the pod's lease as soon as it reads its handover.
            p.slot, p.status_read, p.done_since = int(env[pod_env.SLOT]), LONG_AGO, None
            write_handover(p.handover or handover_file(self.run_dir, p.local_rank),
                           Handover(epoch=info.epoch, round=info.round, env=handover_env(env)))
            if self.parking.parked:
                self.ranks.wrapped.add(p.local_rank)
        log.info("%s: handed %d running rank process(es) over to round %d%s", self._ctx, len(self.ranks.procs),
                 info.round, " (a warm spare promoted)" if self.parking.parked else "")
        self.parking.parked = False

    def _spawn(self, info: RoundInfo, local_rank: int) -> None:
        status = self.run_dir / f"rank-{local_rank}.json"
        for stale in (status, handover_file(self.run_dir, local_rank)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        self.ranks.statuses.pop(local_rank, None)  # the old process's status must not judge the new one
        env = self._rank_env(info, local_rank)
        p = self.ranks.start(self.command, env, local_rank, slot=int(env[pod_env.SLOT]), status_file=status,
                             fresh=True)
        log.info("%s: started local rank %d (pid %d%s)", self._ctx, local_rank, p.popen.pid, how_started(p))

    def _respawn(self, info: RoundInfo, local_rank: int, code: int, reason: str) -> None:
        old = self.ranks.procs[local_rank]
        why = old.killed_hung or reason
        if not old.killed_hung:
            self._record_fault(old, "process_died", reason if code == ExitCode.ABANDONED
                               else f"the process exited {code}" if code >= 0
                               else f"the process was killed by signal {-code}")
        self._note_exits((local_rank,))
        self.process_restarts += 1
        if replacement(standby_alive=self.standby.alive(), in_round=self.info is info) == "standby":
            p = self.standby.take(local_rank, self._rank_env(info, local_rank), status=status_file(self.run_dir,
                                                                                                    local_rank),
                                  write=lambda path, env: write_handover(path, Handover(
                                      epoch=info.epoch, round=info.round, env=handover_env(env))))
            log.warning("%s: local rank %d (%s): the standby process (pid %d) takes its place", self._ctx,
                        local_rank, why, p.popen.pid)
        else:
            log.warning("%s: respawning local rank %d (%s)", self._ctx, local_rank, why)
            self._spawn(info, local_rank)
        self.reporter.book = book_.respawned(self.reporter.book, local_rank, self.ranks.procs[local_rank].popen.pid)
        # Said at once, not at the next progress tick: a forked respawn can be back in training within a
        # second, and the operator must learn of the new process before it sees the recovery, or it counts a
        # process restart as one in process.
        self._publish(self._state(), force=True)

    def _kill_hung(self, local_rank: int, fault: FaultKind, reason: str) -> None:
        p = self.ranks.procs[local_rank]
        if p.exit_code is None and not p.killed_hung:
            if fault == "stopped":
                log.warning("%s: local rank %d (pid %d) is stopped and made no progress within its soft "
                            "timeout: killing it", self._ctx, local_rank, p.popen.pid)
            else:
                log.warning("%s: local rank %d (pid %d) made no progress within its hard timeout: killing it",
                            self._ctx, local_rank, p.popen.pid)
            p.killed_hung = "stopped past the soft timeout" if fault == "stopped" else "hard timeout"
            if self.ranks.dump_stacks(p):
                log.warning("%s: local rank %d (pid %d): its threads' stacks are in the pod's log above", self._ctx,
                            p.local_rank, p.popen.pid)
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()
            self._record_fault(p, fault, reason)

    def _record_fault(self, p: RankProc, kind: FaultKind, reason: str) -> None:
        """Record the fault of a wrapped rank process that cannot (:func:`~.supervision.fault_for`), so that its
        peers are interrupted now and the fault names it."""
        p.status_read = LONG_AGO  # its last word, not the one read up to status_interval ago
        st, info = self.ranks.read_status(p), self.info
        self.liveness.end(p.local_rank, st, reason)  # before a respawn of its slot can write its own
        if info is None:
            return
        rec = fault_for(st, epoch=info.epoch, slot=p.slot, node_id=self.settings.node_id, kind=kind, reason=reason,
                        time=time.time())
        if rec is None:
            if st is not None and st.epoch != info.epoch:
                log.info("%s: local rank %d was still in the round of epoch %s: no fault recorded in epoch %d",
                         self._ctx, p.local_rank, st.epoch, info.epoch)
            return
        try:
            record_fault(self.store, self.settings.keys, info.epoch, rec)
        except (StoreError, ValueError) as e:  # the peers then learn of it from their collectives or its lease
            log.warning("%s: could not record the fault of local rank %d: %s", self._ctx, p.local_rank, e)

    # -- progress -----------------------------------------------------------------------------------------

    def _book_view(self, p: RankProc) -> book_.ProcView:
        return book_.ProcView(p.local_rank, p.slot, p.popen.pid, p.started, self.ranks.statuses.get(p.local_rank),
                              p.exit_code)

    def _note_exits(self, local_ranks: Sequence[int]) -> None:
        """Record rank processes that ended on their own (or were killed for a hang) for the operator."""
        for lr in local_ranks:
            p = self.ranks.procs.get(lr)
            if p is not None and p.exit_code not in (None, 0):
                self.reporter.book = book_.exited(self.reporter.book, self._book_view(p), now=time.time(),
                                                  hung=bool(p.killed_hung))
        self.reporter.publish(self._state(), force=True)

    def _drill_targets(self) -> list[Target]:
        """The live rank processes, for fault drills."""
        epoch = self.info.epoch if self.info is not None else 0
        return [Target(p.local_rank, p.popen.pid, self.ranks.statuses.get(p.local_rank), epoch, str(p.status_file))
                for p in list(self.ranks.procs.values()) if p.exit_code is None and p.slot >= 0]

    def _state(self) -> NodeState:
        states = {st.state for st in self.ranks.statuses.values()}
        return "restarting" if states & {"barrier", "restarting"} else "running"

    def _publish(self, state: NodeState, *, force: bool = False) -> None:
        ranks = [self._book_view(p) for p in self.ranks.procs.values() if p.slot >= 0]  # a parked one has no slot yet
        wall = time.time()
        self.reporter.book = book_.observed(self.reporter.book, ranks, now=time.monotonic(), wall=wall)
        self.metrics.observe(self.reporter.book, wall=wall)
        self.reporter.publish(state, force=force)
