"""The per-pod agent: join the node rendezvous, run the rank processes, supervise them, report progress.

One loop per round: join (:class:`~stalwart.agent.rendezvous.NodeHandle`), launch ``nproc_per_node`` rank
processes with torchrun's environment plus the ``STALWART_*`` variables the restart wrapper reads, then poll
every ``poll_interval`` seconds: process exits, status files (heartbeat, step, restarts), the round's end,
SIGTERM. What to do about the processes is :func:`~stalwart.agent.supervision.supervise`'s decision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.agent import progress as book_
from stalwart.agent.drill import DrillListener, Target
from stalwart.agent.progress import NodeState, ProgressReporter
from stalwart.agent.rendezvous import NodeHandle, Rendezvous, RendezvousClosed, RendezvousSettings, RoundInfo
from stalwart.agent.settings import AgentSettings
from stalwart.agent.supervision import ProcView, supervise
from stalwart.api.exit_codes import ExitCode
from stalwart.api.rendezvous import NodeRecord
from stalwart.api.restart import RankStatus
from stalwart.etcd_client import connect
from stalwart.local.etcd import free_port
from stalwart.restart.environment import RankEnvironment

log = logging.getLogger(__name__)

__all__ = ["Agent", "AgentOptions"]


@dataclass(frozen=True, slots=True)
class AgentOptions:
    """Tunables of the agent (CLI flags), validated on construction."""

    max_restarts: int = 10
    poll_interval: float = 0.1
    progress_interval: float = 1.0
    status_interval: float = 0.5
    term_grace: float = 30.0
    finish_grace: float = 60.0
    join_timeout: float = 600.0
    last_call_timeout: float = 5.0
    node_ttl: int = 10
    spare_ranks: bool = False

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected >= 0, got {self.max_restarts}")
        for name in ("poll_interval", "progress_interval", "status_interval", "term_grace", "finish_grace",
                     "join_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected seconds > 0, got {getattr(self, name)}")


@dataclass(slots=True)
class _Proc:
    local_rank: int
    popen: subprocess.Popen[bytes]
    status_file: Path
    killed_hung: bool = False
    exit_code: int | None = None
    status_read: float = 0.0
    slot: int = 0
    started: float = 0.0


@dataclass(slots=True)
class _Progress:
    process_restarts: int = 0
    statuses: dict[int, RankStatus] = field(default_factory=dict)


class Agent:
    """Runs ``command`` as this pod's rank processes until the job ends; :meth:`run` returns the exit code."""

    def __init__(self, settings: AgentSettings, command: Sequence[str], options: AgentOptions | None = None,
                 *, environ: dict[str, str] | None = None) -> None:
        if not command:
            raise ValueError("command: give the training command after `--`")
        self.settings = settings
        self.command = list(command)
        self.options = options or AgentOptions()
        self.base_env = dict(os.environ if environ is None else environ)
        self.store = connect(settings.etcd_endpoints, settings.etcd_credentials(),
                             probe=settings.keys.prefix if settings.etcd_secret_dir else None)
        self.rdzv = Rendezvous(self.store, settings.keys, RendezvousSettings(
            min_nodes=settings.min_nodes, max_nodes=settings.max_nodes,
            last_call_timeout=self.options.last_call_timeout, join_timeout=self.options.join_timeout,
            node_ttl=self.options.node_ttl))
        self.master_port = free_port(settings.pod_ip)
        self.handle: NodeHandle = self.rdzv.node(NodeRecord(
            node_id=settings.node_id, address=settings.pod_ip, nproc=settings.nproc_per_node,
            spare=settings.spare, master_port=self.master_port))
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"stalwart-agent-{settings.node_id}-"))
        self.procs: dict[int, _Proc] = {}
        self._wrapped: set[int] = set()
        self.progress = _Progress()
        self.info: RoundInfo | None = None
        self._terminate = threading.Event()
        self._ctx = f"job={settings.job} node={settings.node_id}"
        self.reporter = ProgressReporter(self.store, settings.keys, settings.node_id,
                                         interval=self.options.progress_interval, context=self._ctx)
        self.drill = DrillListener(self.store, settings, self._drill_targets, context=self._ctx)

    # -- signals ------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Forward a stop request (SIGTERM): the ranks get SIGTERM, then SIGKILL after ``term_grace``."""
        self._terminate.set()

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: object) -> None:
            log.info("%s: signal %d: stopping the rank processes", self._ctx, signum)
            self.request_stop()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.drill.start()
        try:
            return self._run()
        finally:
            self.drill.stop()
            self._stop_all(grace=self.options.term_grace)
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
            self.info = info
            log.info("%s: round %d (epoch %d) as %s, world size %d", self._ctx, info.round, info.epoch, info.role,
                     info.world_size)
            if info.role == "waiting" or (info.role == "spare" and not self.options.spare_ranks):
                self._publish("joining", force=True)
                while not self._terminate.is_set() and self.handle.wait_round_end(1.0) is None:
                    pass
                continue
            self.reporter.book = book_.joined(self.reporter.book, info.round, info.epoch)
            self.reporter.world_size = info.world_size
            self._launch_all(info)
            outcome = self._supervise_round(info)
            if outcome is not None:
                return outcome
        self._stop_all(grace=self.options.term_grace)
        self._publish("failed", force=True)
        return int(ExitCode.TERMINATED)

    def _supervise_round(self, info: RoundInfo) -> int | None:
        """Supervise until the round ends (``None``: join again) or the job ends here (the exit code)."""
        while not self._terminate.is_set():
            self._poll()
            views = [self._view(p) for p in self.procs.values()]
            actions = supervise(views, restarts_used=self.progress.process_restarts,
                                max_restarts=self.options.max_restarts)
            for action in actions:
                if action.kind == "finish":
                    return self._finish(action.exit_code, action.reason, action.local_ranks)
                if action.kind == "kill":
                    for lr in action.local_ranks:
                        self._kill_hung(lr)
                elif action.kind == "respawn":
                    for lr in action.local_ranks:
                        self._respawn(info, lr, action.exit_code, action.reason)
                elif action.kind == "restart_all":
                    self._note_exits(action.local_ranks)
                    self.progress.process_restarts += 1
                    self.reporter.book = book_.restarted_all(self.reporter.book)
                    self._stop_all(grace=self.options.term_grace)
                    with contextlib.suppress(Exception):
                        self.handle.request_rerendezvous(action.reason)
                    self._wait_round_end()
                    return None
            end = self.handle.round_end()
            if end is not None:
                if end.closed and self._wait_finishing():
                    continue
                log.info("%s: round %d ended: %s", self._ctx, info.round, end.reason)
                self._stop_all(grace=self.options.term_grace)
                return None
            self._publish(self._state())
            self._terminate.wait(self.options.poll_interval)
        return None

    def _wait_finishing(self) -> bool:
        """The rendezvous closed because the job is succeeding: give the ranks time to return."""
        deadline = time.monotonic() + self.options.finish_grace
        while time.monotonic() < deadline and not self._terminate.is_set():
            self._poll()
            if all(p.exit_code is not None for p in self.procs.values()):
                return True
            time.sleep(self.options.poll_interval)
        return False

    def _wait_round_end(self) -> None:
        deadline = time.monotonic() + 3 * self.options.node_ttl
        while time.monotonic() < deadline and not self._terminate.is_set():
            if self.handle.wait_round_end(0.5) is not None:
                return

    def _finish(self, code: int, reason: str, local_ranks: Sequence[int] = ()) -> int:
        if code == 0:
            log.info("%s: %s", self._ctx, reason)
            with contextlib.suppress(Exception):
                self.rdzv.close("job succeeded")
            self._publish("succeeded", force=True)
        else:
            log.error("%s: giving up: %s", self._ctx, reason)
            self._note_exits(local_ranks)
            self._stop_all(grace=self.options.term_grace)
            self._publish("failed", force=True)
        return code

    # -- processes -------------------------------------------------------------------------------------------

    def _rank_env(self, info: RoundInfo, local_rank: int) -> dict[str, str]:
        s = self.settings
        m = info.manifest
        nproc = s.nproc_per_node
        member = info.member
        spare = member is None
        if member is not None:
            first, group_rank = member.rank_offset, member.group_rank
        else:
            first, group_rank = m.world_size + m.spares.index(s.node_id) * nproc, len(m.members)
        slots = m.world_size + (len(m.spares) * nproc if self.options.spare_ranks else 0)
        slot = first + local_rank
        env = dict(self.base_env)
        env.update({
            "RANK": str(slot), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(m.world_size),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(group_rank), "ROLE_RANK": str(slot),
            "ROLE_WORLD_SIZE": str(m.world_size), "MASTER_ADDR": m.master_addr,
            "MASTER_PORT": str(m.master_port or self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.progress.process_restarts),
            "TORCHELASTIC_RUN_ID": s.job_uid,
        })
        if "OMP_NUM_THREADS" not in self.base_env and nproc > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun does: ranks sharing a node must not oversubscribe it
        renv = RankEnvironment(etcd_endpoints=s.etcd_endpoints, job=s.job, job_uid=s.job_uid, node_id=s.node_id,
                               epoch=info.epoch, slot=slot, slots=max(slots, slot + 1),
                               target_world=m.world_size, spare=spare,
                               status_file=str(self.run_dir / f"rank-{local_rank}.json"), local_rank=local_rank)
        env.update(renv.to_env())
        env.update(s.etcd_env())
        if s.rpc_token is not None:
            env["STALWART_RPC_TOKEN"] = s.rpc_token.get_secret_value()
        return env

    def _launch_all(self, info: RoundInfo) -> None:
        self.procs = {}
        for lr in range(self.settings.nproc_per_node):
            self._spawn(info, lr)

    def _spawn(self, info: RoundInfo, local_rank: int) -> None:
        status = self.run_dir / f"rank-{local_rank}.json"
        with contextlib.suppress(FileNotFoundError):
            status.unlink()
        self.progress.statuses.pop(local_rank, None)  # the old process's status must not judge the new one
        env = self._rank_env(info, local_rank)
        popen = subprocess.Popen(self.command, env=env, start_new_session=False)
        self.procs[local_rank] = _Proc(local_rank, popen, status, slot=int(env["STALWART_SLOT"]),
                                       started=time.monotonic())
        log.info("%s: started local rank %d (pid %d)", self._ctx, local_rank, popen.pid)

    def _respawn(self, info: RoundInfo, local_rank: int, code: int, reason: str) -> None:
        old = self.procs[local_rank]
        why = "hard timeout" if old.killed_hung else reason
        self._note_exits((local_rank,))
        self.progress.process_restarts += 1
        log.warning("%s: respawning local rank %d (%s)", self._ctx, local_rank, why)
        self._spawn(info, local_rank)
        self.reporter.book = book_.respawned(self.reporter.book, local_rank, self.procs[local_rank].popen.pid)

    def _kill_hung(self, local_rank: int) -> None:
        p = self.procs[local_rank]
        if p.exit_code is None and not p.killed_hung:
            log.warning("%s: local rank %d (pid %d) made no progress within its hard timeout: killing it",
                        self._ctx, local_rank, p.popen.pid)
            p.killed_hung = True
            with contextlib.suppress(ProcessLookupError):
                p.popen.kill()

    def _poll(self) -> None:
        for p in self.procs.values():
            if p.exit_code is None:
                p.exit_code = p.popen.poll()

    def _read_status(self, p: _Proc) -> RankStatus | None:
        # Exits are polled every tick (cheap); status files, which only feed the hard timeout and progress,
        # at most every status_interval, to keep the agent's share of the CPU negligible.
        now = time.monotonic()
        if now - p.status_read < self.options.status_interval:
            return self.progress.statuses.get(p.local_rank)
        p.status_read = now
        try:
            st = RankStatus.from_json_bytes(p.status_file.read_bytes())
        except (OSError, ValueError):
            self.progress.statuses.pop(p.local_rank, None)
            return None
        self.progress.statuses[p.local_rank] = st
        return st

    def _view(self, p: _Proc) -> ProcView:
        st = self._read_status(p)
        if st is None:
            # Once a script has shown it runs the restart wrapper, its respawns are treated as such too.
            return ProcView(p.local_rank, p.exit_code, wrapped=p.local_rank in self._wrapped)
        self._wrapped.add(p.local_rank)
        age = time.monotonic() - st.heartbeat if st.state == "running" else None
        return ProcView(p.local_rank, p.exit_code, wrapped=True, heartbeat_age=age, hard_timeout=st.hard_timeout)

    def _stop_all(self, grace: float) -> None:
        running = [p for p in self.procs.values() if p.popen.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                p.popen.terminate()
        deadline = time.monotonic() + grace
        for p in running:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s: local rank %d ignored SIGTERM for %.0fs: killing it", self._ctx, p.local_rank,
                            grace)
                p.popen.kill()
                p.popen.wait(timeout=10)
        for p in self.procs.values():
            p.exit_code = p.popen.poll()

    # -- progress -----------------------------------------------------------------------------------------

    def _book_view(self, p: _Proc) -> book_.ProcView:
        return book_.ProcView(p.local_rank, p.slot, p.popen.pid, p.started, self.progress.statuses.get(p.local_rank),
                              p.exit_code)

    def _note_exits(self, local_ranks: Sequence[int]) -> None:
        """Record rank processes that ended on their own (or were killed for a hang) for the operator."""
        for lr in local_ranks:
            p = self.procs.get(lr)
            if p is not None and p.exit_code not in (None, 0):
                self.reporter.book = book_.exited(self.reporter.book, self._book_view(p), now=time.time(),
                                                  hung=p.killed_hung)
        self.reporter.publish(self._state(), force=True)

    def _drill_targets(self) -> list[Target]:
        """The live rank processes, for fault drills."""
        epoch = self.info.epoch if self.info is not None else 0
        return [Target(p.local_rank, p.popen.pid, self.progress.statuses.get(p.local_rank), epoch, str(p.status_file))
                for p in list(self.procs.values()) if p.exit_code is None]

    def _state(self) -> NodeState:
        states = {st.state for st in self.progress.statuses.values()}
        return "restarting" if states & {"barrier", "restarting"} else "running"

    def _publish(self, state: NodeState, *, force: bool = False) -> None:
        self.reporter.book = book_.observed(self.reporter.book, [self._book_view(p) for p in self.procs.values()],
                                            now=time.monotonic(), wall=time.time())
        self.reporter.publish(state, force=force)
