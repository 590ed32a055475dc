"""Every option of :func:`stalwart.restartable`, validated on construction, and how the job's settings fill in
the options a decorator leaves out."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stalwart.api.base import positive_seconds
from stalwart.api.restart_settings import RESTART_SETTINGS, order_problem
from stalwart.restart.assignment import RankAssignment
from stalwart.restart.policies import (
    Abort,
    AbortProcessGroup,
    CudaHealthCheck,
    Finalize,
    HealthCheck,
    Initialize,
    InitProcessGroup,
)

__all__ = ["JOB_SETTINGS", "RestartConfig"]

#: The options a TrainingJob's ``restartPolicy.inProcess`` sets (through the agent), by its field.
JOB_SETTINGS: Mapping[str, str] = {setting.option: setting.wire for setting in RESTART_SETTINGS}


@dataclass(frozen=True)
class RestartConfig:
    """Every knob of :func:`restartable`, validated on construction (errors name the argument).

    * ``max_restarts``: in-process restarts allowed; one more fault exits ``RESTARTS_EXHAUSTED``.
    * ``soft_timeout``: seconds without progress of the main thread (or ``ping()``) after which the
      iteration is interrupted and restarted (progress is sampled every ``monitor_interval``); before the
      iteration's first ``ping()``, ``barrier_timeout`` if longer.
    * ``hard_timeout``: seconds without progress after which the agent kills and respawns the process
      (must exceed ``soft_timeout``).
    * ``barrier_timeout``: how long an iteration barrier waits for missing processes before it seals
      without them, and how long building an iteration's process group may take; ``start_timeout``: the
      barrier's wait in the first iteration, when processes are still starting.
    * ``completion_timeout``: how long a returned rank waits for the others to return.
    * ``heartbeat_ttl``: TTL (seconds) of the process's etcd lease; ``monitor_interval``: the monitor's tick.
    * ``initialize``, ``abort``, ``finalize``, ``health_check``, ``rank_assignment``: the policies.
    * ``etcd_timeout``: deadline of each etcd call; ``coordination_timeout``: how long etcd may stay
      unreachable (calls are retried) before the process exits ``COORDINATION_LOST``.
    * ``prepare``: a callable taking no arguments, run once per process before its first round (on a warm
      spare while it waits parked, so that its model is built before a round needs it); its result is
      ``CallWrapper.prepared`` in every call of the training function in that process (see
      :func:`stalwart.restart.rounds.run_rounds`); ``prepare_timeout``: seconds it may take before the process
      ends itself ``PREPARE_FAILED`` (its threads' stacks in its log; nothing else bounds a parked process).

    Under a TrainingJob, the options in :data:`JOB_SETTINGS` that the decorator does not set come from the
    job's ``restartPolicy.inProcess`` (:meth:`for_job`).
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
    prepare: Callable[[], Any] | None = None
    prepare_timeout: float = 1800.0

    def __post_init__(self) -> None:
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts: expected an int >= 0, got {self.max_restarts!r}")
        for name in ("soft_timeout", "hard_timeout", "barrier_timeout", "start_timeout", "completion_timeout",
                     "monitor_interval", "etcd_timeout", "coordination_timeout", "prepare_timeout"):
            positive_seconds(name, getattr(self, name))
        problem = order_problem(lambda setting: getattr(self, setting.option), lambda setting: setting.option)
        if problem is not None:
            raise ValueError(f"{problem[0]}: {problem[1]}")
        if isinstance(self.heartbeat_ttl, bool) or not isinstance(self.heartbeat_ttl, int) or self.heartbeat_ttl < 2:
            raise ValueError(f"heartbeat_ttl: expected an int >= 2 seconds, got {self.heartbeat_ttl!r}")
        for name, kind in (("initialize", Initialize), ("abort", Abort), ("finalize", Finalize),
                           ("health_check", HealthCheck), ("rank_assignment", RankAssignment)):
            value = getattr(self, name)
            if value is None and name in ("finalize", "health_check"):
                continue
            if not isinstance(value, kind):
                raise TypeError(f"{name}: expected a {kind.__name__} policy, got {value!r}")
        if self.prepare is not None:
            _check_prepare(self.prepare)

    def for_job(self, settings: Mapping[str, float | int], explicit: frozenset[str]) -> RestartConfig:
        """This configuration with the job's ``settings`` (option name -> value) in place of the options not
        in ``explicit`` (those the decorator set). Raises ValueError naming both sources when the mix is
        invalid (e.g. a decorator's ``soft_timeout`` above the job's hard timeout)."""
        changes = {name: value for name, value in settings.items() if name in JOB_SETTINGS and name not in explicit}
        if not changes:
            return self
        try:
            return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            given = ", ".join(f"{n}={getattr(self, n)!r}" for n in sorted(explicit & JOB_SETTINGS.keys()))
            job = ", ".join(f"{JOB_SETTINGS[n]}={v!r}" for n, v in sorted(changes.items()))
            raise ValueError(f"{e} (from @restartable({given}) and the TrainingJob's "
                             f"restartPolicy.inProcess {job})") from None


def _check_prepare(prepare: object) -> None:
    """Refuse a ``prepare`` hook that could not be called as the wrapper calls it: ``prepare()``, synchronously."""
    if not callable(prepare):
        raise TypeError(f"prepare: expected a callable taking no arguments, got {prepare!r}")
    if inspect.iscoroutinefunction(prepare) or inspect.isasyncgenfunction(prepare):
        raise TypeError(f"prepare: expected a plain callable, got the async {prepare!r} (its result would never "
                        "run)")
    try:
        sig = inspect.signature(prepare)
    except (TypeError, ValueError):  # a builtin without a signature: it is called as it is
        return
    try:
        sig.bind()
    except TypeError:
        raise TypeError(f"prepare: expected a callable taking no arguments, got {prepare!r} with parameters "
                        f"{sig} (bind its arguments first, e.g. functools.partial(build, options))") from None
