"""A job whose ranks give up: the operator fails it with the reason, the failure the ranks last saw (the
exception's type and message) in lastFailure, and an Event. Pure: table rows over the reconcile."""

from __future__ import annotations

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, progress, status

from stalwart.api.restart import FailureInfo
from stalwart.api.status import Phase
from stalwart.operator.failures import reason_of_kind
from stalwart.operator.model import EmitEvent
from stalwart.operator.rank_failures import rank_verdict
from stalwart.operator.reconcile import condition, reconcile

BOOM = FailureInfo(rank=1, pod=f"{JOB}-worker-1", reason="exception: ValueError('boom')", kind="exception",
                   exception="ValueError", message="boom", iteration=2, time=NOW - 5)


def test_restarts_exhausted_fails_the_job_with_the_exception_in_last_failure_and_an_event() -> None:
    pods = [pod("worker-0", "Failed", exit_code=90), pod("worker-1", "Failed", exit_code=90)]
    view = etcd("worker-0", "worker-1", progress=(progress("worker-0", state="failed", failure=BOOM),
                                                   progress("worker-1", state="failed", failure=BOOM)))
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, view))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "RestartsExhausted"
    assert failed.message == ("the in-process restart budget (maxRestarts) is spent; the last failure, rank 1 on "
                              f"pod {JOB}-worker-1: ValueError: boom")
    last = d.status.last_failure
    assert last is not None
    assert (last.rank, last.pod, last.reason, last.exception_type, last.message) == (
        1, f"{JOB}-worker-1", "Exception", "ValueError", "boom")
    assert (last.detected_by, last.exit_code, last.round, last.iteration) == ("Rank", 90, 1, 2)
    events = [(e.type, e.reason) for e in of(d, EmitEvent)]
    assert ("Warning", "RestartsExhausted") in events and ("Warning", "PhaseFailed") in events


def test_without_a_recorded_failure_the_exit_code_stands() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=90)]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, etcd("worker-0", "worker-1")))
    failed = condition(d.status, "Failed")
    assert failed is not None and failed.reason == "RestartsExhausted"
    last = d.status.last_failure
    assert last is not None and (last.message, last.exit_code, last.detected_by) == ("exit code 90", 90, "Pod")


def test_a_non_retryable_error_keeps_its_reason_and_names_the_exception() -> None:
    raised = BOOM.model_copy(update={"kind": "non_retryable", "exception": "stalwart.restart.errors.NonRetryable",
                                     "message": "bad data"})
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=91)]
    view = etcd("worker-0", "worker-1", progress=(progress("worker-1", state="failed", failure=raised),))
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, view))
    failed = condition(d.status, "Failed")
    assert failed is not None and failed.reason == "NonRetryableExit"
    assert d.status.last_failure is not None
    assert (d.status.last_failure.exception_type, d.status.last_failure.message) == ("NonRetryable", "bad data")
    assert failed.message.endswith("stalwart.restart.errors.NonRetryable: bad data")


@pytest.mark.parametrize(("kind", "reason"), [
    ("exception", "Exception"), ("init_timeout", "Hang"), ("non_retryable", "Exception"),
    ("soft_timeout", "Hang"), ("hard_timeout", "Hang"), ("stopped", "Hang"), ("process_died", "ProcessExited"),
    ("peer_lost", "PeerLost"),
    (None, "Exception"),
])
def test_fault_kinds_map_to_status_reasons(kind: str | None, reason: str) -> None:
    assert reason_of_kind(kind) == reason


def test_other_exit_codes_are_not_the_ranks_giving_up() -> None:
    assert rank_verdict(f"{JOB}-worker-1", 1, (), NOW) is None
    assert rank_verdict(f"{JOB}-worker-1", None, (), NOW) is None
