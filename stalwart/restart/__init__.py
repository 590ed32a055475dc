"""In-process restart of training ranks, coordinated through etcd (see :mod:`stalwart.restart.wrapper`).

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
