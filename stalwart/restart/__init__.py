"""In-process restart of training ranks, coordinated through etcd (see :mod:`stalwart.restart.wrapper`).

Usage, in a script run by ``stalwart agent -- python train.py``. Either style of training function works;
after a fault in any rank, ``train`` is called again on every healthy rank of the job, in the same process.

**The wrapper builds the process group** (the default group of the iteration is ready when ``train``
starts)::

    import stalwart
    from stalwart.restart import InitProcessGroup, RankAssignment

    @stalwart.restartable(initialize=InitProcessGroup("nccl", timeout=600),
                          rank_assignment=RankAssignment(min_world_size=8, divisible_by=8))
    def train(call_wrapper: stalwart.CallWrapper) -> None:
        model = build_model()                 # the default process group of this iteration is ready
        restore_state(model)                  # e.g. from memory kept outside, or from a peer
        for step in range(...):
            with call_wrapper.atomic():       # a restart never lands between the update and the count
                optimizer.step()
                state.step += 1
            call_wrapper.ping(step=state.step)  # progress for the operator (optional)

    train()

**The function initialises it itself**, as a script written for torchrun does::

    @stalwart.restartable()
    def train() -> None:
        dist.init_process_group("nccl")       # with or without arguments; env:// or a store alike
        ...
        dist.destroy_process_group()          # optional

Here ``init_process_group`` returns the group of the iteration (built with the call's backend and
timeout), ``init_method`` and ``store`` go unused (groups always bootstrap from the iteration's etcd Store),
and a ``rank`` or ``world_size`` that contradicts the iteration's fails the job with
:class:`ProcessGroupConflict` naming both (see :mod:`stalwart.restart.user_group`).

``max_restarts``, ``soft_timeout``, ``hard_timeout`` and ``barrier_timeout`` left out of the decorator come
from the TrainingJob's ``restartPolicy.inProcess``. Updates that must not be applied twice (the optimizer step
and the step counter, a checkpoint write) belong in ``call_wrapper.atomic()``: an interrupt waits for the
section to end, so a restart cannot land between the two halves.
``@stalwart.restartable(prepare=fn)`` runs ``fn()`` once per process before its first round (a warm spare
while it waits parked) and hands its result to the function as ``call_wrapper.prepared``: build the model and
optimizer there, and a promoted spare has them ready (see :mod:`.rounds`).
Importing this package does not import torch; torch is imported when a wrapped function first runs.
"""

from __future__ import annotations

from stalwart.restart.assignment import RankAssignment, WorldTooSmall
from stalwart.restart.decorator import Restartable, restartable
from stalwart.restart.errors import ProcessGroupConflict
from stalwart.restart.handover import is_parked
from stalwart.restart.interrupt import RestartInterrupt
from stalwart.restart.optimizer_slots import materialize_optimizer_state
from stalwart.restart.peers import StateMismatch, SyncInterrupted, SyncResult, sync_from_peers
from stalwart.restart.policies import (
    Abort,
    AbortProcessGroup,
    Compose,
    CudaHealthCheck,
    FaultCounter,
    Finalize,
    FinalizeCallback,
    GroupArgs,
    HealthCheck,
    Initialize,
    InitProcessGroup,
    IterationContext,
    Unhealthy,
)
from stalwart.restart.snapshots import PeerSnapshots
from stalwart.restart.wrapper import CallWrapper, NonRetryable, RestartConfig, RestartExit

__all__ = [
    "Abort",
    "AbortProcessGroup",
    "CallWrapper",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "Finalize",
    "FinalizeCallback",
    "GroupArgs",
    "HealthCheck",
    "InitProcessGroup",
    "Initialize",
    "IterationContext",
    "NonRetryable",
    "PeerSnapshots",
    "ProcessGroupConflict",
    "RankAssignment",
    "RestartConfig",
    "RestartExit",
    "RestartInterrupt",
    "Restartable",
    "StateMismatch",
    "SyncInterrupted",
    "SyncResult",
    "Unhealthy",
    "WorldTooSmall",
    "is_parked",
    "materialize_optimizer_state",
    "restartable",
    "sync_from_peers",
]
