"""``stalwart.restartable``: re-run a training function in process after a fault anywhere in the job.

Each rank process runs the loop below; all of them agree through etcd (:mod:`.coordination`):

1. **barrier** of iteration *n*: the process says it is ready (and healthy); the first process that sees
   every slot arrived, or the barrier timeout pass, seals the iteration with a rank assignment
   (:mod:`.assignment`); everyone reads the same seal. Processes left out wait as spares.
2. **run**: Initialize (the process group is built from the iteration's etcd Store, within the barrier
   timeout), then the function. The monitor thread interrupts it when any process reports a fault in *n*,
   or when this one stalls past the soft timeout.
3. **fault**: the process reports it (fenced by the epoch) unless it is the consequence of a fault another
   process reported first, runs Abort (which shuts the process group's connections, freeing peers blocked
   in collectives at once), Finalize and HealthCheck, and goes to the barrier of *n + 1*.
4. **completion**: when the function returns, the process waits until every active process returned (the
   completion barrier) and returns the result; a fault seen meanwhile restarts the iteration instead.

Two styles of training function work alike: one that leaves the default process group to the wrapper (it
is ready when the function starts), and one written for torchrun that calls
``dist.init_process_group(...)`` itself, with or without arguments, and perhaps
``dist.destroy_process_group()`` at its end (see :mod:`.user_group`).

A rank process gives up with a documented exit code (:mod:`stalwart.api.exit_codes`) after ``max_restarts``
restarts, when it is unhealthy, when too few processes are left, or when its round is over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import ArrivalRecord, FaultRecord, SealRecord, failure_info
from stalwart.etcd.client import EtcdCredentials, connect
from stalwart.etcd.keys import ALIVE, DONE, END, FAULT, SEAL
from stalwart.etcd.store import WatchEvent, WatchRange
from stalwart.restart import drill, phase_marks, stacks
from stalwart.restart.config import RestartConfig
from stalwart.restart.coordination import CoordinationTimeout, Coordinator
from stalwart.restart.environment import RankEnvironment
from stalwart.restart.errors import NonRetryable, RestartExit, describe, exception_name, release_frames
from stalwart.restart.handover import RoundWatch
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import (
    GroupArgs,
    InitProcessGroup,
    IterationContext,
    Unhealthy,
    group_released_last,
)
from stalwart.restart.protocol import (
    EpochView,
    Exit,
    Finished,
    Join,
    Participant,
    Report,
    Spare,
    WaitEnd,
    barrier_sealer,
    barrier_state,
    budget_left,
    completion_known,
    fault_report,
    iteration_end,
    join,
    missing_slots,
    of_another,
    placement,
    plan_seal,
    sealer_parts,
    unhealthy_seal,
    verdict,
)
from stalwart.restart.relay import RelayClient
from stalwart.restart.user_group import InitStandIn

log = logging.getLogger(__name__)

__all__ = ["CallWrapper", "NonRetryable", "RestartConfig", "RestartExit", "Session"]


class CallWrapper:
    """What the training function may receive (as a parameter named ``call_wrapper`` or annotated with
    this class): where it is in the job, and hooks to report progress and protect critical sections."""

    def __init__(self, session: Session, iteration: int, rank: int, world_size: int) -> None:
        self._session = session
        #: In-process restart iteration (0 for the first run; also the number of restarts so far).
        self.iteration = iteration
        #: Rank and world size of this iteration (they may change between iterations).
        self.rank = rank
        self.world_size = world_size
        #: This process's slot (its fixed identity in the round).
        self.slot = session.env.slot
        #: What the decorator's ``prepare`` hook returned, in this process, before its first round (``None``
        #: without a hook). The same object in every call: the hook ran once (on a warm spare, while it waited).
        self.prepared: Any = session.prepared

    @property
    def restarts(self) -> int:
        return self.iteration

    def ping(self, step: int | None = None) -> None:
        """Report progress (resets the soft timeout); ``step`` is published to the operator."""
        self._session.monitor.ping(None if step is None else int(step))

    def atomic(self) -> contextlib.AbstractContextManager[None]:
        """A section an interruption waits for (e.g. writing a checkpoint); it is raised at the section's end."""
        return self._session.interrupter.atomic()


@dataclass(slots=True)
class _Finished:
    result: Any


class Session:
    """One rank process's run of a restartable function: etcd client, monitor, the loop."""

    def __init__(self, env: RankEnvironment, config: RestartConfig, rounds: RoundWatch | None = None) -> None:
        self.env = env
        self.config = config
        self.me = Participant(slot=env.slot, node_id=env.node_id, slots=env.slots, target_world=env.target_world,
                              spare=env.spare)
        self.store = connect(env.etcd_endpoints, EtcdCredentials.from_env(), timeout=config.etcd_timeout)
        self.relay = RelayClient(env.relay_socket, context=f"slot {env.slot}") if env.relay_socket else None
        self.coord = Coordinator(self.store, env.keys, env.epoch, slot=env.slot, node_id=env.node_id,
                                 lease_ttl=config.heartbeat_ttl, retry_for=config.coordination_timeout,
                                 relay=self.relay)
        self.interrupter = Interrupter()
        main = threading.current_thread() is threading.main_thread()
        self.monitor = Monitor(self.coord, self.interrupter, soft_timeout=config.soft_timeout,
                               interval=config.monitor_interval, status=StatusFile(env.status_file),
                               watch_main_thread=main, startup_timeout=config.barrier_timeout,
                               hard_timeout=config.hard_timeout)
        self.monitor.update_status(dumps_stacks=stacks.install())
        drill.install(env.status_file, lambda: self.monitor.status.state == "running")
        # The job's minimum holds whatever the decorator asked for (README: the world never shrinks below it).
        self.assignment = config.rank_assignment.at_least(env.min_world)
        self.keep_peers = tuple((h, int(p)) for h, _, p in (e.rpartition(":") for e in env.etcd_endpoints))
        self.own_faults = 0
        self.last_ctx: IterationContext | None = None
        #: How the training function asks for its process group, once it has called init_process_group.
        self.group_args: GroupArgs | None = None
        #: The cause of the last interrupted iteration (for the exit reason when the budget runs out).
        self.last_cause: FaultRecord | None = None
        #: The interrupted iteration whose cause is read with the next arrival (in the same request), if any.
        self.cause_pending: int | None = None
        #: The seal of the last barrier this process passed (who took part: see ``barrier_sealer``).
        self.last_seal: SealRecord | None = None
        self.rounds = rounds  # a handover to a later round interrupts the function; the checks then leave
        if rounds is not None:
            rounds.on_new = lambda h: self.monitor._interrupt(f"round {h.round} (epoch {h.epoch}) took over")
        self.check_round: Callable[[], None] = rounds.check if rounds is not None else lambda: None
        #: The result of the decorator's ``prepare`` hook (set by :meth:`run`).
        self.prepared: Any = None

    def abort_last(self) -> None:
        """Abort the last iteration's process group (its round was fenced out before the fault path ran)."""
        if self.last_ctx is not None:
            self._abort(self.last_ctx)

    def close(self) -> None:
        self.monitor.stop()
        self.coord.stop()
        if self.relay is not None:
            self.relay.close()
        self.store.close()
        self.interrupter.close()

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            inject: str | None, prepared: Any = None) -> Any:
        self.prepared = prepared
        self.coord.start()
        self.monitor.start()
        iteration = self._first_iteration()
        if isinstance(iteration, _Finished):
            return None
        while True:
            self.check_round()
            over = budget_left(iteration, self.config.max_restarts)
            if over is not None:
                if self.cause_pending is not None:  # no arrival will read it: read it for the exit's reason
                    self._take_cause(self.cause_pending)
                over = budget_left(iteration, self.config.max_restarts,
                                   describe(self.last_cause) if self.last_cause else "")
                assert over is not None
                self.monitor.update_status(state="failed")
                raise RestartExit(over.code, over.reason)
            healthy, why = self._health()
            self.monitor.update_status(state="barrier", iteration=iteration, restarts=iteration)
            place = placement(self._barrier(iteration, healthy), self.me, healthy, why)
            if isinstance(place, Exit):
                if place.code != ExitCode.UNHEALTHY:
                    self.monitor.update_status(state="failed")
                raise RestartExit(place.code, place.reason)
            if isinstance(place, Spare):
                self.monitor.update_status(state="inactive", rank=None, world_size=place.seal.world_size)
                if self._wait_end(place.seal, deadline=None) == "done":
                    self.monitor.update_status(state="done")
                    return None
                phase_marks.knew()
                self.cause_pending = iteration
                iteration += 1
                continue
            done = self._run_iteration(fn, args, kwargs, inject, iteration=iteration, rank=place.rank,
                                       world_size=place.world_size, active=place.active)
            if isinstance(done, _Finished):
                return done.result
            iteration += 1

    def _first_iteration(self) -> int | _Finished:
        """Where a (re)started process joins (:func:`~.protocol.join`)."""
        view = self.coord.view()
        if view.seals:
            self.last_seal = view.seals[max(view.seals)]
        entry = join(view, self.me)
        if isinstance(entry, Exit):
            raise RestartExit(entry.code, entry.reason)
        if isinstance(entry, Finished):
            return _Finished(None)
        if isinstance(entry, Join):
            if entry.report is not None:
                self._report(entry.report)
            return entry.iteration
        assert isinstance(entry, WaitEnd)
        self.monitor.update_status(state="inactive")
        if self._wait_end(entry.seal, deadline=None) == "done":
            return _Finished(None)
        return entry.iteration + 1

    def _health(self) -> tuple[bool, str]:
        if self.config.health_check is None or self.last_ctx is None:
            return True, ""
        try:
            self.config.health_check(self.last_ctx)
        except Unhealthy as e:
            log.error("slot %d: unhealthy: %s", self.env.slot, e)
            return False, str(e)
        return True, ""

    def _previous_seal(self, iteration: int) -> SealRecord | None:
        """The seal of ``iteration - 1``: the one this process passed, else (it joined later) etcd's."""
        if iteration == 0:
            return None
        if self.last_seal is not None and self.last_seal.iteration == iteration - 1:
            return self.last_seal
        return self.coord.view([WatchRange(f"{SEAL}{iteration - 1}")]).seals.get(iteration - 1)

    def _barrier(self, iteration: int, healthy: bool) -> SealRecord:
        # One process follows the arrivals and seals; the others wait for the seal's one key (read with the
        # arrival, then watched). The sealer does its part even when it is unhealthy itself (it leaves after).
        # The sealer reads only what its decision looks at (sealer_parts), itself, after its arrival. The
        # interrupted iteration's cause is read with the arrival, in the same request: a NonRetryable anywhere
        # ends this process here, before it waits (its arrival goes with its lease when it exits).
        previous = self._previous_seal(iteration)
        sealer = barrier_sealer(previous) == self.env.slot
        parts = sealer_parts(iteration, previous, self.env.slots) if sealer else [WatchRange(f"{SEAL}{iteration}")]
        cause_of, self.cause_pending = self.cause_pending, None
        read = parts if parts is None or cause_of is None else [*parts, WatchRange(f"{FAULT}{cause_of}/", prefix=True)]
        start = self.coord.arrive(iteration, ArrivalRecord(slot=self.env.slot, node_id=self.env.node_id,
                                                           spare=self.env.spare, healthy=healthy), read,
                                  relay_read=not sealer)
        if cause_of is not None:
            self._take_cause(cause_of, start)
        if not healthy and not sealer:
            return unhealthy_seal(iteration, self.me)
        # Processes start at different speeds (imports, CUDA): the first barrier waits longer.
        wait = self.config.barrier_timeout if iteration else max(self.config.barrier_timeout,
                                                                 self.config.start_timeout)

        def ready(view: EpochView) -> object:
            self.check_round()
            return barrier_state(view, iteration, self.env.slots) if sealer else view.seals.get(iteration)

        timed_out = False
        try:
            view, result = self.coord.wait_until(ready, time.monotonic() + wait, parts, start=start)
        except CoordinationTimeout:
            view, timed_out = self.coord.view(), True
            result = view.seals.get(iteration)
        if not isinstance(result, SealRecord):
            if timed_out:
                log.warning("iteration %d: barrier timed out; slots %s missing", iteration,
                            missing_slots(view, iteration, self.env.slots))
            result = self.coord.try_seal(plan_seal(view, iteration, self.me, self.assignment,
                                                   timed_out))
        self.last_seal = result
        return result if healthy else unhealthy_seal(iteration, self.me)

    def _wait_end(self, seal: SealRecord, deadline: float | None) -> str:
        """Wait until the iteration of ``seal`` ends (:func:`~.protocol.iteration_end`): ``"done"`` or
        ``"fault"``, after reporting a peer it found lost.

        The wait is sent the iteration's fault records, its END record and the heartbeats' deletions, not every
        process's completion mark. A deletion of an active process's heartbeat is judged on a full read; so is
        the start of a spare's wait (an active process's monitor reports a peer lost while it waits, a spare
        has no such monitor)."""
        it = seal.iteration
        judge = [str(self.env.slot) not in seal.ranks]

        def notice(events: list[WatchEvent]) -> None:
            for ev in events:
                rel = ev.kv.key[len(self.coord.base):]
                if ev.type == "delete" and rel.startswith(ALIVE) and rel[len(ALIVE):] in seal.ranks:
                    judge[0] = True

        def ended(view: EpochView) -> object:
            self.check_round()
            known = completion_known(view, it)
            if known is not None:
                return known, None
            if not judge[0]:
                return None
            judge[0] = False
            return iteration_end(self.coord.view([WatchRange(f"{FAULT}{it}/", prefix=True), WatchRange(f"{END}{it}"),
                                                  WatchRange(f"{DONE}{it}/", prefix=True),
                                                  WatchRange(ALIVE, prefix=True)]), seal, self.me)

        parts = [WatchRange(f"{FAULT}{it}/", prefix=True), WatchRange(f"{END}{it}"),
                 WatchRange(ALIVE, prefix=True, no_put=True)]
        _, ended_as = self.coord.wait_until(ended, deadline, parts, notice=notice)
        assert isinstance(ended_as, tuple)
        outcome, report = ended_as
        if report is not None:
            self._report(report)
        return str(outcome)

    def _report(self, report: Report, error: BaseException | None = None) -> None:
        self.coord.report_fault(report.record(
            self.env.slot, self.env.node_id, time.time(), pid=self.monitor.pid,
            exception=None if error is None else exception_name(error), message=None if error is None else str(error)))

    @contextlib.contextmanager
    def _building(self, ctx: IterationContext) -> Iterator[None]:
        """While the process group is built: the peers passed the barrier together, so every wait for them
        in the iteration's Store ends within the barrier timeout, not the collective timeout."""
        ctx.store.deadline = time.monotonic() + self.config.barrier_timeout
        try:
            yield
        finally:
            ctx.store.deadline = None

    def _learn(self, args: GroupArgs) -> None:
        self.group_args = args

    def _fallback_group(self) -> GroupArgs:
        init = self.config.initialize
        if isinstance(init, InitProcessGroup):
            return GroupArgs(init.resolved_backend(), init.timeout)
        return GroupArgs(InitProcessGroup().resolved_backend(), InitProcessGroup().timeout)

    def _peer_fault(self, iteration: int) -> FaultRecord | None:
        """A fault of another process in ``iteration`` recorded already: an error here now is most likely its
        consequence (a peer reports before it aborts, and its abort is what breaks our collectives)."""
        seen = self.monitor.fault_seen(iteration)
        if seen is not None and of_another(seen, self.env.slot, self.monitor.pid):
            return seen
        others = self.coord.faults(iteration).faults_of_others(iteration, self.env.slot, self.monitor.pid)
        return others[0] if others else None

    def _run_iteration(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       inject: str | None, *, iteration: int, rank: int, world_size: int,
                       active: frozenset[int]) -> _Finished | None:
        from stalwart.etcd.torch_store import EtcdTorchStore

        timeout = getattr(self.config.initialize, "timeout", 1800.0)
        store = EtcdTorchStore(self.store, self.env.keys, self.env.epoch, scope=f"{iteration}/", timeout=timeout)
        # The group is built through it inside the interruptible region: an interrupt must not land in gRPC.
        store.shield = self.interrupter
        ctx = IterationContext(iteration=iteration, slot=self.env.slot, rank=rank, world_size=world_size,
                               store=store, local_rank=self.env.local_rank, keep_peers=self.keep_peers,
                               own_faults=self.own_faults, group_args=self.group_args)
        self.last_ctx = ctx
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        self.monitor.update_status(state="running", iteration=iteration, rank=rank, world_size=world_size)
        call_kwargs = dict(kwargs)
        if inject is not None:
            call_kwargs[inject] = CallWrapper(self, iteration, rank, world_size)
        stand_in = InitStandIn(ctx, fallback=self._fallback_group(), learn=self._learn,
                               deadline=lambda: self._building(ctx), fn_globals=getattr(fn, "__globals__", None))
        fault: BaseException | None = None
        result: Any = None
        # An interrupt may be delivered from the moment the wrapper enters user code (begin() delivers one
        # for a fault seen already): everything from there on is inside the try.
        try:
            try:
                try:
                    self.interrupter.enter_user_code()
                    self.monitor.begin(iteration, ctx, active)
                    with self._building(ctx):
                        self.config.initialize(ctx)
                    phase_marks.group_built()
                    stand_in.install()
                    result = fn(*args, **call_kwargs)
                finally:
                    self.interrupter.leave_user_code()
            finally:
                stand_in.restore()
        except NonRetryable as e:
            self.interrupter.leave_user_code()
            self.monitor.end()
            self._report(Report(iteration, rank, "non_retryable", f"non-retryable: {e!r}"), e)
            self._abort(ctx)
            raise RestartExit(ExitCode.NON_RETRYABLE, f"{exception_name(e)}: {e}") from e
        except (RestartInterrupt, Exception) as e:
            self.interrupter.leave_user_code()
            now = time.time()
            phase_marks.knew(now)
            phase_marks.left(now)
            fault = e
        if fault is None:
            try:
                seal = self._previous_seal(iteration + 1) or SealRecord(  # the seal of this iteration
                    iteration=iteration, world_size=world_size, ranks={}, sealed_by=self.env.slot)
                self.coord.mark_done(seal)
                outcome = self._wait_end(seal, time.monotonic() + self.config.completion_timeout)
            except CoordinationTimeout:
                self._report(Report(iteration, rank, "completion_timeout",
                                    f"not every rank returned within {self.config.completion_timeout}s"))
                outcome = "fault"
            self.monitor.end()
            if outcome == "done":
                # The job's outcome is decided: what is left is teardown, which the agent bounds as an exit
                # (its finish grace), never as a hang of training to restart from.
                self.monitor.update_status(state="done")
                self._finish(ctx)
                return _Finished(result)
            fault = RestartInterrupt("a peer failed before every rank returned")
        self.monitor.end()
        self._on_fault(ctx, fault)
        ctx = replace(ctx, fault=fault, own_faults=self.own_faults)
        self.last_ctx = ctx
        self.monitor.update_status(state="restarting")
        with group_released_last(ctx.group.retired):
            self._abort(ctx)
            release_frames(fault)
        # The iteration's cause, as every process will see it (this process's error may be a consequence): read
        # with the next arrival.
        self.cause_pending = iteration
        return None

    def _take_cause(self, iteration: int, view: EpochView | None = None) -> None:
        """Note the cause of the interrupted ``iteration`` (for the status and the exit reason) from ``view`` (a
        read of its fault records; read here when not given); when it is a NonRetryable raised elsewhere, this
        process gives up too: no restart can help."""
        cause = (view if view is not None else self.coord.faults(iteration)).cause(iteration)
        if cause is None:
            return
        self.last_cause = cause
        self.monitor.update_status(last_failure=failure_info(cause))
        end = verdict(cause, describe(cause))
        if end is not None:
            self.monitor.update_status(state="failed")
            raise RestartExit(end.code, end.reason)

    def _on_fault(self, ctx: IterationContext, fault: BaseException) -> None:
        """Report ``fault`` unless the iteration was interrupted, or it followed another process's fault."""
        iteration, rank = ctx.iteration, ctx.rank
        interrupted = (isinstance(fault, RestartInterrupt) or self.interrupter.requested is not None
                       or self.monitor.hung(iteration))
        peer = None if interrupted else self._peer_fault(iteration)
        report = fault_report(iteration, rank, interrupted=interrupted, peer_fault=peer,
                              init_deadline_hit=ctx.store.deadline_hit, barrier_timeout=self.config.barrier_timeout,
                              error=repr(fault))
        if interrupted:
            log.info("slot %d rank %d iteration %d: interrupted (%s)", self.env.slot, rank, iteration,
                     self.interrupter.requested or fault)
        elif peer is not None:
            log.info("slot %d rank %d iteration %d: %r after %s: taken as its consequence", self.env.slot, rank,
                     iteration, fault, describe(peer))
        if report is None:
            return
        self.own_faults += 1
        log.warning("slot %d rank %d iteration %d: fault: %r", self.env.slot, rank, iteration, fault)
        self._report(report, fault)

    def _abort(self, ctx: IterationContext) -> None:
        try:
            self.config.abort(ctx)
        except Exception as e:
            log.warning("slot %d: abort failed: %s", self.env.slot, e)
        if self.config.finalize is not None:
            try:
                self.config.finalize(ctx)
            except Exception as e:
                log.warning("slot %d: finalize failed: %s", self.env.slot, e)

    def _finish(self, ctx: IterationContext) -> None:
        import torch.distributed as dist

        # DDP keeps the group in reference cycles: the group is destroyed here, before the function returns
        # to the script, and its worker threads joined (see group_released_last).
        with group_released_last(ctx.group.retired, collect=True):
            if dist.is_initialized():
                dist.destroy_process_group()
