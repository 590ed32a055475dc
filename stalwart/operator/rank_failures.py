"""Why a job failed, when its agents give up on behalf of the ranks: the condition reason, its message and
``status.lastFailure``, from the pod's exit code and the failure its agent recorded in etcd. Pure.

An agent exits with the code its ranks gave up with (:mod:`stalwart.api.exit_codes`): ``RESTARTS_EXHAUSTED``
when the same kind of fault kept coming back until ``maxRestarts`` in-process restarts were spent,
``NON_RETRYABLE`` when the training function raised :class:`stalwart.NonRetryable`. Its progress record
carries the last failure the ranks saw (the exception's type and message, or the hang), which is what a user
needs to read in ``kubectl describe tj``: it becomes ``lastFailure`` in the status model of
:mod:`.failures` (detected by the ``Rank`` that reported it, with the pod's exit code).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from stalwart.api.exit_codes import ExitCode
from stalwart.api.failure_rules import FailureReason
from stalwart.api.restart import FailureInfo, ProgressRecord
from stalwart.api.status import FailureRecord
from stalwart.operator.failures import reason_of_kind, short_type

__all__ = ["REASON_NON_RETRYABLE_RAISED", "REASON_RESTARTS_EXHAUSTED", "RankVerdict", "rank_verdict"]

#: Condition reasons for jobs whose ranks gave up.
REASON_RESTARTS_EXHAUSTED = "RestartsExhausted"
REASON_NON_RETRYABLE_RAISED = "NonRetryableExit"  # the reason any non-retryable exit code gets


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


def _time(t: float) -> datetime:
    return datetime.fromtimestamp(int(t), UTC)


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
    recorded = [(p.round, p.last_failure) for p in progress if p.node_id == pod and p.last_failure is not None]
    if not recorded:
        return RankVerdict(reason, f"{what}: pod {pod} exited {exit_code}", FailureRecord(
            pod=pod, reason=FailureReason.PROCESS_EXITED.value, message=f"exit code {exit_code}",
            exit_code=exit_code, detected_by="Pod", time=_time(now)))
    round_, last = max(recorded, key=lambda r: r[1].time)
    who = f"rank {last.rank} on pod {last.pod or pod}" if last.rank is not None else f"pod {last.pod or pod}"
    return RankVerdict(reason, f"{what}; the last failure, {who}: {_what(last)}", FailureRecord(
        rank=last.rank, pod=last.pod or pod, reason=reason_of_kind(last.kind),
        message=((last.message or "") if last.exception else last.reason)[:32768] or None,
        exception_type=short_type(last.exception) if last.exception else None, exit_code=exit_code, detected_by="Rank",
        round=round_ if last.iteration is not None else None, iteration=last.iteration, time=_time(last.time)))
