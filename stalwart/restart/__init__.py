"""In-process restart of training ranks, coordinated through etcd (see :mod:`stalwart.restart.wrapper`).

Usage, in a script run by ``stalwart agent -- python train.py``::

    import stalwart
    from stalwart.restart import InitProcessGroup, RankAssignment

    @stalwart.restartable(max_restarts=20, soft_timeout=120, hard_timeout=300,
                          initialize=InitProcessGroup("nccl", timeout=600),
                          rank_assignment=RankAssignment(min_world_size=8, divisible_by=8))
    def train(call_wrapper: stalwart.CallWrapper) -> None:
        model = build_model()                 # the default process group of this iteration is ready
        restore_state(model)                  # e.g. from memory kept outside, or from a peer
        for step in range(...):
            ...
            call_wrapper.ping(step=step)      # progress for the operator (optional)
            with call_wrapper.atomic():       # a checkpoint write is never interrupted halfway
                save_checkpoint(...)

    train()

After a fault in any rank, ``train`` is called again on every healthy rank of the job, in the same process.
Importing this package does not import torch; torch is imported when a wrapped function first runs.
"""

from __future__ import annotations

from stalwart.restart.assignment import RankAssignment, WorldTooSmall
from stalwart.restart.interrupt import RestartInterrupt
from stalwart.restart.policies import (
    Abort,
    AbortProcessGroup,
    Compose,
    CudaHealthCheck,
    FaultCounter,
    Finalize,
    FinalizeCallback,
    HealthCheck,
    Initialize,
    InitProcessGroup,
    IterationContext,
    Unhealthy,
)
from stalwart.restart.wrapper import (
    CallWrapper,
    NonRetryable,
    Restartable,
    RestartConfig,
    RestartExit,
    restartable,
)

__all__ = [
    "Abort",
    "AbortProcessGroup",
    "CallWrapper",
    "Compose",
    "CudaHealthCheck",
    "FaultCounter",
    "Finalize",
    "FinalizeCallback",
    "HealthCheck",
    "InitProcessGroup",
    "Initialize",
    "IterationContext",
    "NonRetryable",
    "RankAssignment",
    "RestartConfig",
    "RestartExit",
    "RestartInterrupt",
    "Restartable",
    "Unhealthy",
    "WorldTooSmall",
    "restartable",
]
