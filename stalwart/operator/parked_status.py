"""The job's ``PrepareFailed`` condition: a pod whose parked process (a warm spare's, or the pod's standby)
ended before a round took it, its ``prepare`` hook having raised (or it died). Pure.

Each agent reports the last such process of its pod (``ProgressRecord.parked_failure``, with the exception's
type and message). It is not a failure of the running job: ``status.lastFailure``, the phase and the restart
counters stay as they are. The condition names each live pod that reports one and what it raised (True,
reason ``PrepareHookRaised``, or ``ParkedProcessEnded`` when no exception was reported), with one Warning event
``PrepareFailed`` each time that changes; False (``NoPrepareFailure``) once no live pod reports one, when it
was set before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stalwart.api.restart import FailureInfo, ProgressRecord
from stalwart.api.status import Condition, ConditionStatus

__all__ = ["REASON_PREPARE_FAILED", "PreparedVerdict", "parked_failures", "prepare_verdict"]

#: The Warning event's reason.
REASON_PREPARE_FAILED = "PrepareFailed"
_MESSAGE = 1024


@dataclass(frozen=True, slots=True)
class PreparedVerdict:
    """The condition to set (``status``, ``reason``, ``message``) and whether to emit the Warning event."""

    status: ConditionStatus
    reason: str
    message: str
    event: bool


def parked_failures(progress: Sequence[ProgressRecord], live: Collection[str]) -> list[tuple[str, FailureInfo]]:
    """The live pods' reported parked failures, by pod name."""
    return sorted(((r.node_id, r.parked_failure) for r in progress
                   if r.parked_failure is not None and r.node_id in live), key=lambda pair: pair[0])


def _describe(pod: str, f: FailureInfo) -> str:
    what = f"{f.exception}: {f.message}" if f.exception else f.reason
    return f"pod {pod}: {what}"


def prepare_verdict(failures: Sequence[tuple[str, FailureInfo]], current: Condition | None) -> PreparedVerdict | None:
    """What the condition becomes (``None``: leave it unset)."""
    if not failures:
        if current is None or current.status == ConditionStatus.FALSE:
            return None
        return PreparedVerdict(ConditionStatus.FALSE, "NoPrepareFailure", "no pod reports a failed parked process",
                               event=False)
    raised = any(f.exception for _, f in failures)
    message = ("a parked process ended before a round took it (the running job is not affected): "
               + "; ".join(_describe(pod, f) for pod, f in failures))[:_MESSAGE]
    changed = current is None or current.status != ConditionStatus.TRUE or current.message != message
    return PreparedVerdict(ConditionStatus.TRUE, "PrepareHookRaised" if raised else "ParkedProcessEnded", message,
                           event=changed)
