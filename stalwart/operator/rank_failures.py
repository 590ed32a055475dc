"""Why a job failed, when its agents give up on behalf of the ranks: the condition reason, its message and
``status.lastFailure``, from the pod's exit code and the failure its agent recorded in etcd. Pure.

An agent exits with the code its ranks gave up with (:mod:`stalwart.api.exit_codes`): ``RESTARTS_EXHAUSTED``
when the same kind of fault kept coming back until ``maxRestarts`` in-process restarts were spent,
``NON_RETRYABLE`` when the training function raised :class:`stalwart.NonRetryable`. Its progress record
carries the last failure the ranks saw (the exception's type and message, or the hang), which is what a user
needs to read in ``kubectl describe tj``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FailureInfo, ProgressRecord
from stalwart.api.spec import FailureReason
from stalwart.api.status import FailureRecord

__all__ = ["REASON_NON_RETRYABLE_RAISED", "REASON_RESTARTS_EXHAUSTED", "RankVerdict", "failure_reason_of_kind",
           "rank_verdict"]

#: Condition reasons for jobs whose ranks gave up.
REASON_RESTARTS_EXHAUSTED = "RestartsExhausted"
REASON_NON_RETRYABLE_RAISED = "NonRetryableExit"  # the reason any non-retryable exit code gets

_HANG_KINDS = frozenset({"soft_timeout", "hard_timeout", "stopped"})


def failure_reason_of_kind(kind: str | None) -> FailureReason:
    """The status reason of a rank fault kind (see ``stalwart.api.restart.FaultKind``)."""
    if kind in _HANG_KINDS:
        return FailureReason.HANG
    if kind in ("process_died", "peer_lost"):
        return FailureReason.PROCESS_EXITED
    return FailureReason.EXCEPTION


@dataclass(frozen=True, slots=True)
class RankVerdict:
    """The condition reason and message of the failed job, and its ``lastFailure``."""

    reason: str
    message: str
    last_failure: FailureRecord


def _what(failure: FailureInfo) -> str:
    if failure.exception:
        return f"{failure.exception}: {failure.message or ''}".rstrip(": ")
    return failure.reason


def rank_verdict(pod: str, exit_code: int | None, progress: Iterable[ProgressRecord],
                 now: float) -> RankVerdict | None:
    """The verdict for ``pod`` that ended with ``exit_code``, or ``None`` when its ranks did not give up (any
    other code). The last failure is the newest its agent recorded; without one, the exit code stands."""
    if exit_code == ExitCode.RESTARTS_EXHAUSTED:
        reason, what = REASON_RESTARTS_EXHAUSTED, "the in-process restart budget (maxRestarts) is spent"
    elif exit_code == ExitCode.NON_RETRYABLE:
        reason, what = REASON_NON_RETRYABLE_RAISED, "the training function raised a non-retryable error"
    else:
        return None
    failures = [p.last_failure for p in progress if p.node_id == pod and p.last_failure is not None]
    if not failures:
        message = f"{what}: pod {pod} exited {exit_code}"
        return RankVerdict(reason, message, FailureRecord(
            pod=pod, reason=FailureReason.PROCESS_EXITED.value, message=f"exit code {exit_code}",
            time=datetime.fromtimestamp(int(now), UTC)))
    last = max(failures, key=lambda f: f.time)
    who = f"rank {last.rank} on pod {last.pod or pod}" if last.rank is not None else f"pod {last.pod or pod}"
    return RankVerdict(reason, f"{what}; the last failure, {who}: {_what(last)}", FailureRecord(
        rank=last.rank, pod=last.pod or pod, reason=failure_reason_of_kind(last.kind).value,
        message=_what(last)[:32768], time=datetime.fromtimestamp(int(last.time), UTC)))
