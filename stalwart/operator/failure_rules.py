"""Which failure a failed or lost pod had, and what the job's rules say to do about it. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.api.exit_codes import Disposition, ExitCode, disposition
from stalwart.api.failure_rules import ExitCodeOperator, FailureAction, FailureReason, FailureRule
from stalwart.operator.model import PodView

__all__ = ["failure_action", "failure_reason", "rule_matches"]


def failure_reason(pod: PodView, lost: bool = False, node_lost: bool = False) -> FailureReason:
    """The FailureReason of a failed pod, or of one ``lost`` (see ``node_loss.lost_pods``; ``node_lost``: its node
    is unreachable)."""
    if pod.reason in ("Evicted", "Preempting", "Preempted", "DeadlineExceeded"):
        return FailureReason.EVICTED
    if pod.reason == "OOMKilled":
        return FailureReason.OOM_KILLED
    if pod.reason == "NodeLost" or node_lost:
        return FailureReason.NODE_LOST
    if lost or pod.deleting:
        return FailureReason.POD_LOST
    return FailureReason.PROCESS_EXITED


def rule_matches(rule: FailureRule, reason: FailureReason, exit_code: int | None) -> bool:
    """A rule matches when any of its matchers does (onExitCodes needs a known exit code)."""
    if rule.on_reasons is not None and (reason in rule.on_reasons or (
            reason == FailureReason.NODE_LOST and FailureReason.POD_LOST in rule.on_reasons)):
        return True
    if rule.on_exit_codes is not None and exit_code is not None:
        listed = exit_code in rule.on_exit_codes.values
        return listed if rule.on_exit_codes.operator == ExitCodeOperator.IN else not listed
    return False


def failure_action(rules: Sequence[FailureRule], reason: FailureReason,
                   exit_code: int | None) -> FailureAction:
    """What to do about a pod that failed or was lost: the first matching rule's action; without one, the
    agent's exit code decides (codes that mean "retrying cannot help", e.g. restarts exhausted or
    NonRetryable, fail the job) and everything else replaces the pod."""
    for rule in rules:
        if rule_matches(rule, reason, exit_code):
            return rule.action
    if reason == FailureReason.PROCESS_EXITED and exit_code in _EXPLICIT_JOB_FAILURES:
        return FailureAction.FAIL_JOB
    return FailureAction.REPLACE_POD


#: Exit codes documented as job failures (restarts exhausted, NonRetryable). Other codes, FAILED (1) among
#: them, fall to JOB_FAILURE in ``disposition`` only because the agent retried them locally first; at the pod
#: level they still deserve a new pod while backoffLimit lasts.
_EXPLICIT_JOB_FAILURES = frozenset(c.value for c in ExitCode
                                   if c is not ExitCode.FAILED and disposition(c.value) == Disposition.JOB_FAILURE)
