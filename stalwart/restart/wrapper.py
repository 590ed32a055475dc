"""``stalwart.restartable``: re-run a training function in process after a fault anywhere in the job.

Each rank process runs the loop below; all of them agree through etcd (:mod:`.coordination`):

1. **barrier** of iteration *n*: the process says it is ready (and healthy); the first process that sees
   every slot arrived, or the barrier timeout pass, seals the iteration with a rank assignment
   (:mod:`.assignment`); everyone reads the same seal. Processes left out wait as spares.
2. **run**: Initialize (the process group is built from the iteration's etcd Store), then the function.
   The monitor thread interrupts it when any process reports a fault in *n*, or when this one stalls past
   the soft timeout.
3. **fault**: the process reports it (fenced by the epoch), runs Abort (which shuts the process group's
   connections, freeing peers blocked in collectives at once), Finalize and HealthCheck, and goes to the
   barrier of *n + 1*.
4. **completion**: when the function returns, the process waits until every active process returned (the
   completion barrier) and returns the result; a fault seen meanwhile restarts the iteration instead.

A rank process gives up with a documented exit code (:mod:`stalwart.api.exit_codes`) after ``max_restarts``
restarts, when it is unhealthy, when too few processes are left, or when its round is over.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar, overload

from stalwart.agent.rendezvous.errors import StaleEpoch
from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import ArrivalRecord, FailureInfo, FaultKind, FaultRecord, SealRecord
from stalwart.etcd_client import EtcdCredentials, connect
from stalwart.restart import drill
from stalwart.restart.assignment import Candidate, RankAssignment, WorldTooSmall, initial_ranks
from stalwart.restart.coordination import CoordinationTimeout, Coordinator, EpochView
from stalwart.restart.environment import RankEnvironment
from stalwart.restart.interrupt import Interrupter, RestartInterrupt
from stalwart.restart.monitor import Monitor, StatusFile
from stalwart.restart.policies import (
    Abort,
    AbortProcessGroup,
    CudaHealthCheck,
    Finalize,
    HealthCheck,
    Initialize,
    InitProcessGroup,
    IterationContext,
    Unhealthy,
)
from stalwart.store import StoreError

log = logging.getLogger(__name__)

__all__ = ["CallWrapper", "NonRetryable", "RestartConfig", "RestartExit", "Restartable", "restartable"]

P = ParamSpec("P")
R = TypeVar("R")


class NonRetryable(Exception):
    """Raise from the training function to fail the job instead of restarting (exit code NON_RETRYABLE)."""


class RestartExit(SystemExit):
    """The wrapper gives up: the process exits with ``code`` (an :class:`ExitCode`)."""

    def __init__(self, code: ExitCode, reason: str) -> None:
        super().__init__(int(code))
        self.exit_code = code
        self.reason = reason

    def __str__(self) -> str:
        return f"exit {int(self.exit_code)} ({self.exit_code.name}): {self.reason}"


def _seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RestartConfig:
    """Every knob of :func:`restartable`, validated on construction (errors name the argument).

    * ``max_restarts``: in-process restarts allowed; one more fault exits ``RESTARTS_EXHAUSTED``.
    * ``soft_timeout``: seconds without progress of the main thread (or ``ping()``) after which the
      iteration is interrupted and restarted (progress is sampled with one-second resolution).
    * ``hard_timeout``: seconds without progress after which the agent kills and respawns the process
      (must exceed ``soft_timeout``).
    * ``barrier_timeout``: how long an iteration barrier waits for missing processes before it seals
      without them; ``start_timeout``: the same for the first iteration, when processes are still starting.
    * ``completion_timeout``: how long a returned rank waits for the others to return.
    * ``heartbeat_ttl``: TTL (seconds) of the process's etcd lease; ``monitor_interval``: the monitor's tick.
    * ``initialize``, ``abort``, ``finalize``, ``health_check``, ``rank_assignment``: the policies.
    * ``etcd_timeout``: deadline of each etcd call; ``coordination_timeout``: how long etcd may stay
      unreachable (calls are retried) before the process exits ``COORDINATION_LOST``.
    """

    max_restarts: int = 10
    soft_timeout: float = 60.0
    hard_timeout: float = 120.0
    barrier_timeout: float = 60.0
    start_timeout: float = 300.0
    completion_timeout: float = 60.0
    heartbeat_ttl: int = 10
    monitor_interval: float = 0.1
    initialize: Initialize = field(default_factory=InitProcessGroup)
    abort: Abort = field(default_factory=AbortProcessGroup)
    finalize: Finalize | None = None
    health_check: HealthCheck | None = field(default_factory=CudaHealthCheck)
    rank_assignment: RankAssignment = field(default_factory=RankAssignment)
    etcd_timeout: float = 5.0
    coordination_timeout: float = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected an int >= 0, got {self.max_restarts!r}")
        for name in ("soft_timeout", "hard_timeout", "barrier_timeout", "start_timeout", "completion_timeout",
                     "monitor_interval", "etcd_timeout", "coordination_timeout"):
            _seconds(name, getattr(self, name))
        if self.hard_timeout <= self.soft_timeout:
            raise ValueError(f"hard_timeout: must exceed soft_timeout ({self.soft_timeout}s), "
                             f"got {self.hard_timeout}")
        if isinstance(self.heartbeat_ttl, bool) or not isinstance(self.heartbeat_ttl, int) or self.heartbeat_ttl < 2:
            raise ValueError(f"heartbeat_ttl: expected an int >= 2 seconds, got {self.heartbeat_ttl!r}")
        for name, kind in (("initialize", Initialize), ("abort", Abort), ("finalize", Finalize),
                           ("health_check", HealthCheck), ("rank_assignment", RankAssignment)):
            value = getattr(self, name)
            if value is None and name in ("finalize", "health_check"):
                continue
            if not isinstance(value, kind):
                raise TypeError(f"{name}: expected a {kind.__name__} policy, got {value!r}")


class CallWrapper:
    """What the training function may receive (as a parameter named ``call_wrapper`` or annotated with
    this class): where it is in the job, and hooks to report progress and protect critical sections."""

    def __init__(self, session: _Session, iteration: int, rank: int, world_size: int) -> None:
        self._session = session
        #: In-process restart iteration (0 for the first run; also the number of restarts so far).
        self.iteration = iteration
        #: Rank and world size of this iteration (they may change between iterations).
        self.rank = rank
        self.world_size = world_size
        #: This process's slot (its fixed identity in the round).
        self.slot = session.env.slot

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


class _Session:
    """One rank process's run of a restartable function: etcd client, monitor, the loop."""

    def __init__(self, env: RankEnvironment, config: RestartConfig) -> None:
        self.env = env
        self.config = config
        self.store = connect(env.etcd_endpoints, EtcdCredentials.from_env(), timeout=config.etcd_timeout)
        self.coord = Coordinator(self.store, env.keys, env.epoch, slot=env.slot, node_id=env.node_id,
                                 lease_ttl=config.heartbeat_ttl, retry_for=config.coordination_timeout)
        self.interrupter = Interrupter()
        main = threading.current_thread() is threading.main_thread()
        self.monitor = Monitor(self.coord, self.interrupter, soft_timeout=config.soft_timeout,
                               interval=config.monitor_interval, status=StatusFile(env.status_file),
                               watch_main_thread=main)
        self.monitor.update_status(hard_timeout=config.hard_timeout)
        drill.install(env.status_file, lambda: self.monitor.status.state == "running")
        self.keep_peers = [(h, int(p)) for h, _, p in (e.rpartition(":") for e in env.etcd_endpoints)]
        self.own_faults = 0
        self.last_ctx: IterationContext | None = None

    def close(self) -> None:
        self.monitor.stop()
        self.coord.stop()
        self.store.close()
        self.interrupter.close()

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            inject: str | None) -> Any:
        self.coord.start()
        self.monitor.start()
        iteration = self._first_iteration()
        if isinstance(iteration, _Finished):
            return None
        while True:
            if iteration > self.config.max_restarts:
                self.monitor.update_status(state="failed")
                raise RestartExit(ExitCode.RESTARTS_EXHAUSTED,
                                  f"{iteration} in-process restarts; max_restarts is {self.config.max_restarts}")
            healthy, why = self._health()
            self.monitor.update_status(state="barrier", iteration=iteration, restarts=iteration)
            seal = self._barrier(iteration, healthy)
            if not healthy:
                raise RestartExit(ExitCode.UNHEALTHY, why)
            if seal.error:
                self.monitor.update_status(state="failed")
                raise RestartExit(ExitCode.WORLD_TOO_SMALL, seal.error)
            rank = seal.ranks.get(str(self.env.slot))
            if rank is None:
                self.monitor.update_status(state="inactive", rank=None, world_size=seal.world_size)
                outcome = self._wait_end(iteration, seal, deadline=None)
                if outcome == "done":
                    self.monitor.update_status(state="done")
                    return None
                iteration += 1
                continue
            done = self._run_iteration(fn, args, kwargs, inject, iteration=iteration, rank=rank,
                                       world_size=seal.world_size,
                                       active=frozenset(int(s) for s in seal.ranks))
            if isinstance(done, _Finished):
                self.monitor.update_status(state="done")
                return done.result
            iteration += 1

    def _first_iteration(self) -> int | _Finished:
        """Where a (re)started process joins: iteration 0 at the job's start; after a respawn, the next
        iteration, reporting the current one as faulted when this slot was running in it."""
        view = self.coord.view()
        if not view.seals:
            return max(view.arrivals, default=0)
        latest = max(view.seals)
        seal = view.seals[latest]
        if seal.error:
            raise RestartExit(ExitCode.WORLD_TOO_SMALL, seal.error)
        if latest + 1 in view.arrivals:
            return latest + 1
        if str(self.env.slot) in seal.ranks and latest not in view.faults:
            # The process that held this slot died during the iteration: the iteration cannot finish.
            self._report(latest, seal.ranks[str(self.env.slot)], "process_died",
                         "the process of this slot was restarted")
            return latest + 1
        if latest in view.faults:
            return latest + 1
        active = {int(s) for s in seal.ranks}
        if active <= view.done.get(latest, set()):
            return _Finished(None)
        self.monitor.update_status(state="inactive")
        if self._wait_end(latest, seal, deadline=None) == "done":
            return _Finished(None)
        return latest + 1

    def _health(self) -> tuple[bool, str]:
        if self.config.health_check is None or self.last_ctx is None:
            return True, ""
        try:
            self.config.health_check(self.last_ctx)
        except Unhealthy as e:
            log.error("slot %d: unhealthy: %s", self.env.slot, e)
            return False, str(e)
        return True, ""

    def _barrier(self, iteration: int, healthy: bool) -> SealRecord:
        self.coord.arrive(iteration, ArrivalRecord(slot=self.env.slot, node_id=self.env.node_id,
                                                   spare=self.env.spare, healthy=healthy))
        if not healthy:
            return SealRecord(iteration=iteration, world_size=0, ranks={}, sealed_by=self.env.slot,
                              error="unhealthy")
        # Processes start at different speeds (imports, CUDA): the first barrier waits longer.
        wait = self.config.barrier_timeout if iteration else max(self.config.barrier_timeout,
                                                                 self.config.start_timeout)
        deadline = time.monotonic() + wait

        def ready(view: EpochView) -> object:
            if iteration in view.seals:
                return view.seals[iteration]
            expected = set(range(self.env.slots))
            previous = view.arrivals.get(iteration - 1)
            if previous is not None:
                # A slot that took no part in the last iteration and has no live process is not waited for
                # again. Arrivals are bound to their process's lease and vanish with it, so the last seal
                # (which is not) also says who took part: a process cut off from etcd for a moment is waited
                # for, and comes back with a new lease, instead of being dropped from the world.
                took_part = set(previous)
                last_seal = view.seals.get(iteration - 1)
                if last_seal is not None:
                    took_part |= {int(s) for s in last_seal.ranks} | set(last_seal.inactive)
                expected -= {s for s in expected if s not in took_part and s not in view.alive}
            return expected <= set(view.arrivals.get(iteration, {}))

        timed_out = False
        try:
            view, result = self.coord.wait_until(ready, deadline)
        except CoordinationTimeout:
            view, timed_out = self.coord.view(), True
            result = view.seals.get(iteration)
        if isinstance(result, SealRecord):
            return result
        return self.coord.try_seal(self._decide(iteration, view, timed_out))

    def _decide(self, iteration: int, view: EpochView, timed_out: bool) -> SealRecord:
        arrivals = view.arrivals.get(iteration, {})
        previous_seal = view.seals.get(iteration - 1)
        if previous_seal is not None and not previous_seal.error:
            previous = {int(s): r for s, r in previous_seal.ranks.items()}
        else:
            previous = initial_ranks(self.env.target_world)
        candidates = [Candidate(slot=a.slot, spare=a.spare, healthy=a.healthy) for a in arrivals.values()]
        try:
            a = self.config.rank_assignment.assign(candidates, previous, self.env.target_world)
        except WorldTooSmall as e:
            return SealRecord(iteration=iteration, world_size=0, ranks={}, sealed_by=self.env.slot,
                              timed_out=timed_out, error=str(e))
        if timed_out:
            missing = sorted(set(range(self.env.slots)) - set(arrivals))
            log.warning("iteration %d: barrier timed out; slots %s missing", iteration, missing)
        return SealRecord(iteration=iteration, world_size=a.world_size,
                          ranks={str(s): r for s, r in a.ranks.items()}, inactive=a.inactive,
                          sealed_by=self.env.slot, timed_out=timed_out)

    def _wait_end(self, iteration: int, seal: SealRecord, deadline: float | None) -> str:
        """Wait until ``iteration`` ends: ``"done"`` (every active process returned) or ``"fault"`` (a fault
        was reported, or an active process that had not returned lost its heartbeat lease)."""
        active = {int(s) for s in seal.ranks}

        def ended(view: EpochView) -> object:
            if view.faults.get(iteration):
                return "fault"
            done = view.done.get(iteration, set())
            if active <= done:
                return "done"
            lost = sorted(s for s in active - done if s not in view.alive)
            if lost:
                self._report(iteration, seal.ranks.get(str(self.env.slot)), "peer_lost",
                             f"the heartbeat lease of slot(s) {lost} ended", lost_slots=lost)
                return "fault"
            return None

        _, result = self.coord.wait_until(ended, deadline)
        return str(result)

    def _report(self, iteration: int, rank: int | None, kind: FaultKind, reason: str,
                lost_slots: list[int] | None = None) -> None:
        rec = FaultRecord(slot=self.env.slot, rank=rank, node_id=self.env.node_id, iteration=iteration,
                          kind=kind, reason=reason[:2048], time=time.time(), lost_slots=lost_slots or [])
        self.coord.report_fault(rec)

    def _run_iteration(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                       inject: str | None, *, iteration: int, rank: int, world_size: int,
                       active: frozenset[int]) -> _Finished | None:
        from stalwart.agent.rendezvous.torch_store import EtcdTorchStore

        store = EtcdTorchStore(self.store, self.env.keys, self.env.epoch, scope=f"{iteration}/",
                               timeout=getattr(self.config.initialize, "timeout", 1800.0))
        ctx = IterationContext(iteration=iteration, slot=self.env.slot, rank=rank, world_size=world_size,
                               store=store, keep_peers=self.keep_peers, own_faults=self.own_faults,
                               extra={"local_rank": self.env.local_rank})
        self.last_ctx = ctx
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        self.monitor.update_status(state="running", iteration=iteration, rank=rank, world_size=world_size)
        call_kwargs = dict(kwargs)
        if inject is not None:
            call_kwargs[inject] = CallWrapper(self, iteration, rank, world_size)
        fault: BaseException | None = None
        result: Any = None
        self.interrupter.enter_user_code()
        self.monitor.begin(iteration, ctx, active)
        try:
            try:
                self.config.initialize(ctx)
                result = fn(*args, **call_kwargs)
            finally:
                self.interrupter.leave_user_code()
        except NonRetryable as e:
            self.interrupter.leave_user_code()
            self.monitor.end()
            self._report(iteration, rank, "exception", f"non-retryable: {e!r}")
            self._abort(ctx)
            raise RestartExit(ExitCode.NON_RETRYABLE, repr(e)) from e
        except (RestartInterrupt, Exception) as e:
            self.interrupter.leave_user_code()
            fault = e
        if fault is None:
            try:
                self.coord.mark_done(iteration)
                seal = self.coord.view().seals.get(iteration) or SealRecord(
                    iteration=iteration, world_size=world_size, ranks={}, sealed_by=self.env.slot)
                outcome = self._wait_end(iteration, seal, time.monotonic() + self.config.completion_timeout)
            except CoordinationTimeout:
                self._report(iteration, rank, "completion_timeout",
                             f"not every rank returned within {self.config.completion_timeout}s")
                outcome = "fault"
            self.monitor.end()
            if outcome == "done":
                self._finish(ctx)
                return _Finished(result)
            fault = RestartInterrupt("a peer failed before every rank returned")
        self.monitor.end()
        ctx.fault = fault
        seen = self.monitor.fault_seen(iteration)
        if isinstance(fault, RestartInterrupt) or self.interrupter.requested is not None:
            log.info("slot %d rank %d iteration %d: interrupted (%s)", self.env.slot, rank, iteration,
                     self.interrupter.requested or fault)
        else:
            self.own_faults += 1
            ctx.own_faults = self.own_faults
            if seen is None or seen.slot == self.env.slot:
                log.warning("slot %d rank %d iteration %d: fault: %r", self.env.slot, rank, iteration, fault)
            self._report(iteration, rank, "exception", repr(fault))
        self.monitor.update_status(state="restarting")
        self._abort(ctx)
        _release(fault)
        # The iteration's cause is its first fault in etcd (this process's error may be a consequence).
        first = self.coord.view().first_fault(iteration)
        if first is not None:
            self.monitor.update_status(last_failure=FailureInfo(
                rank=first.rank, pod=first.node_id, reason=f"{first.kind}: {first.reason}"[:2048], time=first.time))
        return None

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

        if dist.is_initialized():
            dist.destroy_process_group()


def _release(fault: BaseException) -> None:
    """Drop what the failed iteration's frames still hold (model, DDP, the process group and its threads and
    sockets) now, instead of at the next garbage collection: the traceback links those frames to the
    exception, and the exception is referenced from a frame still running."""
    tb = fault.__traceback__
    if tb is not None:
        traceback.clear_frames(tb)
    fault.__traceback__ = None
    # Exception contexts can form a cycle (an interrupt delivered while another exception is being handled),
    # so the walk stops at the first exception it has already seen.
    seen = {id(fault)}
    ctx = fault.__context__
    while ctx is not None and id(ctx) not in seen:
        seen.add(id(ctx))
        if ctx.__traceback__ is not None:
            traceback.clear_frames(ctx.__traceback__)
            ctx.__traceback__ = None
        ctx = ctx.__context__


def _injection(fn: Callable[..., Any]) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    for name, p in sig.parameters.items():
        ann = p.annotation
        if name == "call_wrapper" or ann is CallWrapper or ann == "CallWrapper":
            return name
    return None


class Restartable(Generic[P, R]):
    """The callable :func:`restartable` returns. Calling it runs the function with in-process restarts
    and returns its result (``None`` on a process that stayed a spare until the end)."""

    def __init__(self, fn: Callable[P, R], config: RestartConfig) -> None:
        self.fn = fn
        self.config = config
        self._inject = _injection(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        env = RankEnvironment.from_env()
        session = _Session(env, self.config)
        try:
            return session.run(self.fn, tuple(args), dict(kwargs), self._inject)  # type: ignore[no-any-return]
        except StaleEpoch as e:
            raise RestartExit(ExitCode.STALE_EPOCH, str(e)) from e
        except StoreError as e:
            raise RestartExit(ExitCode.COORDINATION_LOST, str(e)) from e
        finally:
            session.close()


@overload
def restartable(fn: Callable[P, R], /) -> Restartable[P, R]: ...


@overload
def restartable(fn: None = None, /, **options: Any) -> Callable[[Callable[P, R]], Restartable[P, R]]: ...


def restartable(fn: Callable[P, R] | None = None, /, **options: Any) \
        -> Restartable[P, R] | Callable[[Callable[P, R]], Restartable[P, R]]:
    """Make a training function restartable in process. Use as ``@restartable`` or
    ``@restartable(max_restarts=5, soft_timeout=30, ...)``; the options are :class:`RestartConfig`'s and are
    validated here, at decoration time. The process must run under ``stalwart agent`` (which sets the
    ``STALWART_*`` environment)."""
    config = RestartConfig(**options)

    def decorate(f: Callable[P, R]) -> Restartable[P, R]:
        if not callable(f):
            raise TypeError(f"restartable: expected a function, got {f!r}")
        return Restartable(f, config)

    return decorate(fn) if fn is not None else decorate

