"""The PrepareFailed condition: a pod's parked process whose prepare hook raised is named, with the exception,
in the job's status (a condition and a Warning event), and the running job is not failed by it."""

from __future__ import annotations

from typing import Any

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, progress, status, stepping

from stalwart.api.restart import FailureInfo, ProgressRecord
from stalwart.api.status import Condition, ConditionStatus, Phase
from stalwart.operator.model import EmitEvent
from stalwart.operator.parked_status import PreparedVerdict, parked_failures, prepare_verdict
from stalwart.operator.reconcile import condition, reconcile

RAISED = FailureInfo(pod="", reason="the prepare hook raised on a parked process (exit code 100, PREPARE_FAILED)",
                     exception="ValueError", message="bad config", time=NOW - 3)
DIED = FailureInfo(pod="", reason="the standby process ended before a round took it: killed by signal 9",
                   time=NOW - 3)
HEAD = "a parked process ended before a round took it (the running job is not affected): "


def failed(node: str, failure: FailureInfo, **kw: Any) -> ProgressRecord:
    return progress(node, **kw).model_copy(update={"parked_failure": failure})


def cond(status_: ConditionStatus, message: str) -> Condition:
    return Condition(type="PrepareFailed", status=status_, reason="x", message=message)


def test_parked_failures_of_live_pods_only() -> None:
    records = [failed("spare-0", RAISED, epoch=0, state="joining"), progress("worker-0"),
               failed("spare-1", DIED, epoch=0)]
    assert parked_failures(records, {f"{JOB}-spare-0", f"{JOB}-worker-0"}) == [(f"{JOB}-spare-0", RAISED)]


NAMED = f"{HEAD}pod {JOB}-spare-0: ValueError: bad config"


@pytest.mark.parametrize(("failures", "current", "want"), [
    ([], None, None),
    ([], cond(ConditionStatus.FALSE, "no pod reports a failed parked process"), None),
    ([], cond(ConditionStatus.TRUE, NAMED),
     PreparedVerdict(ConditionStatus.FALSE, "NoPrepareFailure", "no pod reports a failed parked process", False)),
    ([(f"{JOB}-spare-0", RAISED)], None, PreparedVerdict(ConditionStatus.TRUE, "PrepareHookRaised", NAMED, True)),
    ([(f"{JOB}-spare-0", RAISED)], cond(ConditionStatus.TRUE, NAMED),   # said once: no second event
     PreparedVerdict(ConditionStatus.TRUE, "PrepareHookRaised", NAMED, False)),
    ([(f"{JOB}-worker-1", DIED)], None,
     PreparedVerdict(ConditionStatus.TRUE, "ParkedProcessEnded", f"{HEAD}pod {JOB}-worker-1: {DIED.reason}", True)),
    ([(f"{JOB}-spare-0", RAISED), (f"{JOB}-worker-1", DIED)], cond(ConditionStatus.TRUE, NAMED),
     PreparedVerdict(ConditionStatus.TRUE, "PrepareHookRaised", f"{NAMED}; pod {JOB}-worker-1: {DIED.reason}", True)),
])
def test_prepare_verdict(failures: list[tuple[str, FailureInfo]], current: Condition | None,
                         want: PreparedVerdict | None) -> None:
    assert prepare_verdict(failures, current) == want


def test_a_spare_whose_prepare_raised_is_named_and_the_job_runs_on() -> None:
    pods = [pod("worker-0"), pod("worker-1"), pod("spare-0")]
    view = etcd("worker-0", "worker-1", progress=(
        stepping("worker-0", 0), stepping("worker-1", 1), failed("spare-0", RAISED, epoch=0, state="joining")))
    d = reconcile(observe(job(status(Phase.RUNNING), spares=1), pods, view))
    assert d.status.phase == Phase.RUNNING and d.status.last_failure is None
    prepared = condition(d.status, "PrepareFailed")
    assert prepared is not None and prepared.status == ConditionStatus.TRUE
    assert prepared.reason == "PrepareHookRaised" and prepared.message == NAMED
    assert [(e.type, e.message) for e in of(d, EmitEvent) if e.reason == "PrepareFailed"] == [("Warning", NAMED)]
    # The next reconcile, from that status, says nothing again.
    again = reconcile(observe(job(d.status, spares=1), pods, view))
    assert not [e for e in of(again, EmitEvent) if e.reason == "PrepareFailed"]
    assert condition(again.status, "PrepareFailed") == prepared
