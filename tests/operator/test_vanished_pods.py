"""Pods that disappear from the API without a deletion the operator saw (force-deleted, or deleted while no
operator watched): counted once as a pod replacement, and never for pods the operator removed itself.

Each test walks the pure core through a sequence of reconciles, feeding each decision's status into the
next observation as the runner does (``job(d.status)``); an operator restart is a reconcile that starts from
the status last written to the API with no memory of its own (no overlay of assumed pods)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, status, stepping

from stalwart.api.status import ConditionStatus, Phase, Position, TrainingJobStatus
from stalwart.operator.model import (
    CreatePod,
    Decision,
    DeletePod,
    EmitEvent,
    EtcdView,
    PatchStatus,
    PodView,
    RevokeLease,
)
from stalwart.operator.reconcile import condition, reconcile


def full(*names: str) -> list[str]:
    return [f"{JOB}-{n}" for n in names]


def tracked(*names: str) -> list[str] | None:
    return sorted(full(*names)) or None


def replacements(d: Decision) -> int:
    return d.status.restarts.pod_replacements if d.status.restarts is not None else 0


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in of(d, EmitEvent)]


def created(d: Decision) -> list[str]:
    return [a.name.removeprefix(f"{JOB}-") for a in of(d, CreatePod)]


def assumed(name: str) -> PodView:
    """A pod this operator created that the watch has not shown yet (the runner's overlay)."""
    return replace(pod(name, "Pending"), assumed=True)


def running_status(*names: str, replacements: int = 0, **kw: Any) -> TrainingJobStatus:
    kw.setdefault("position", Position(round=1, iteration=0))
    return status(Phase.RUNNING, replacements=replacements, tracked_pods=tracked(*names), **kw)


ROUND = etcd("worker-0", "worker-1", leases={"worker-0": 10, "worker-1": 11})


# -- the pure function, one reconcile ---------------------------------------------------------------------


@pytest.mark.parametrize(("before", "pods", "counted", "new_pods", "after"), [
    # A running worker force-deleted: fenced, replaced by a fresh spare, counted.
    (running_status("worker-0", "worker-1"), [pod("worker-0")], 1, ["spare-0"], tracked("worker-0")),
    # The same pod, still there: nothing happens.
    (running_status("worker-0", "worker-1"), [pod("worker-0"), pod("worker-1")], 0, [],
     tracked("worker-0", "worker-1")),
    # Never tracked (a status from before tracking, or a pod never seen alive): recreated, not counted.
    (running_status(), [pod("worker-0")], 0, ["worker-1"], tracked("worker-0")),
    # Created by this operator, not in the watch yet: not tracked, so its absence later is not a loss.
    (running_status("worker-0"), [pod("worker-0"), assumed("worker-1")], 0, [], tracked("worker-0")),
    # A pod seen Terminating is a deletion (counted by that rule, once), no longer tracked.
    (running_status("worker-0", "worker-1"), [pod("worker-0"), pod("worker-1", deleting_since=NOW - 1)], 1,
     ["spare-0"], tracked("worker-0")),
    # Before the job started (Pending): the pod is recreated without counting.
    (status(Phase.PENDING, tracked_pods=tracked("worker-0", "worker-1")), [pod("worker-0", "Pending")], 0,
     ["worker-1"], tracked("worker-0")),
], ids=["vanished-running", "still-there", "untracked", "assumed", "seen-terminating", "not-started"])
def test_one_reconcile(before: TrainingJobStatus, pods: list[PodView], counted: int, new_pods: list[str],
                       after: list[str] | None) -> None:
    d = reconcile(observe(job(before), pods, ROUND))
    assert replacements(d) == counted
    assert created(d) == new_pods
    assert d.status.tracked_pods == after


def test_vanished_running_worker_is_fenced_counted_and_named() -> None:
    d = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0")], ROUND,
                          last_patch=NOW - 0.1))
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 11)]
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("RevokeLease") < kinds.index("CreatePod")
    st = d.status
    assert st.restarts is not None and st.restarts.pod_replacements == 1 and st.total_restarts == 0
    assert st.last_failure is not None and st.last_failure.pod == f"{JOB}-worker-1"
    assert st.last_failure.reason == "PodLost" and "disappeared" in (st.last_failure.message or "")
    assert st.phase == Phase.RESTARTING
    restarting = condition(st, "Restarting")
    assert restarting is not None and restarting.status == ConditionStatus.TRUE
    assert restarting.reason == "PodDisappeared"
    assert {"PodDisappeared", "PodReplaced", "PhaseRestarting"} <= set(reasons(d))
    (event,) = [e for e in of(d, EmitEvent) if e.reason == "PodDisappeared"]
    assert event.type == "Warning" and f"{JOB}-worker-1" in event.message
    # Patched at once although the last patch was 0.1s ago: a new replacement does not wait for the rate limit.
    (patch,) = of(d, PatchStatus)
    assert patch.status.restarts is not None and patch.status.restarts.pod_replacements == 1


# -- sequences of reconciles --------------------------------------------------------------------------------


def test_repeated_reconciles_count_once() -> None:
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0")], ROUND))
    assert replacements(d1) == 1 and created(d1) == ["spare-0"]
    # The replacement is not in the watch yet, then it is, then it runs and joins the next round.
    d2 = reconcile(observe(job(d1.status), [pod("worker-0"), assumed("spare-0")], ROUND))
    d3 = reconcile(observe(job(d2.status), [pod("worker-0"), pod("spare-0", "Pending")], ROUND))
    new_round = etcd("worker-0", "spare-0", epoch=9, progress=(stepping("worker-0", 0, round_=2, epoch=9),))
    d4 = reconcile(observe(job(d3.status), [pod("worker-0"), pod("spare-0")], new_round))
    d5 = reconcile(observe(job(d4.status), [pod("worker-0"), pod("spare-0")], new_round))
    for d in (d2, d3, d4, d5):
        assert replacements(d) == 1 and not of(d, CreatePod) and "PodDisappeared" not in reasons(d)
    assert d3.status.tracked_pods == tracked("worker-0", "spare-0")
    assert d4.status.phase == Phase.RUNNING
    restarting = condition(d4.status, "Restarting")
    assert restarting is not None and restarting.status == ConditionStatus.FALSE
    # While the lost member is still in the round, the Restarting reason keeps saying it disappeared.
    assert condition(d3.status, "Restarting").reason == "PodDisappeared"  # type: ignore[union-attr]


def test_operator_restart_counts_once() -> None:
    # The pod vanished while no operator ran: the new one starts from the written status, no overlay.
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0")], ROUND))
    assert replacements(d1) == 1
    # It restarts again after writing that status, before the watch showed the replacement; the
    # replacement was created, so it is in the new operator's index.
    written = d1.status
    d2 = reconcile(observe(job(written), [pod("worker-0"), pod("spare-0", "Pending")], ROUND))
    assert replacements(d2) == 1 and not of(d2, CreatePod)
    # ... and once more with the replacement running: still one.
    d3 = reconcile(observe(job(d2.status), [pod("worker-0"), pod("spare-0")], etcd("worker-0", "spare-0")))
    assert replacements(d3) == 1 and not of(d3, CreatePod)


def test_own_deletions_count_zero() -> None:
    # Scale-down: the surplus pod goes untracked in the decision that deletes it.
    three = running_status("worker-0", "worker-1", "worker-2")
    pods = [pod("worker-0"), pod("worker-1"), pod("worker-2")]
    d1 = reconcile(observe(job(three, replicas=2, generation=2), pods, ROUND))
    assert [a.name for a in of(d1, DeletePod)] == full("worker-2")
    assert d1.status.tracked_pods == tracked("worker-0", "worker-1")
    d2 = reconcile(observe(job(d1.status, replicas=2, generation=2), pods[:2], ROUND))
    assert replacements(d2) == 0 and not of(d2, CreatePod)

    # A failed pod: counted once as a failure, deleted by us (force, its node is gone), then gone.
    failed = pod("worker-1", "Failed", reason="NodeLost")
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0"), failed], ROUND))
    assert replacements(d1) == 1 and of(d1, DeletePod)[0].grace == 0
    assert d1.status.tracked_pods == tracked("worker-0")
    d2 = reconcile(observe(job(d1.status), [pod("worker-0"), assumed("spare-0")], ROUND))
    assert replacements(d2) == 1 and not of(d2, CreatePod)


def test_suspend_and_resume_count_zero() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1"), runPolicy={"suspend": True}), pods,
                           ROUND))
    assert d1.status.tracked_pods is None and d1.status.phase == Phase.SUSPENDED
    d2 = reconcile(observe(job(d1.status, runPolicy={"suspend": True}), [], ROUND))
    d3 = reconcile(observe(job(d2.status), [], ROUND))
    assert created(d3) == ["worker-0", "worker-1"]
    assert replacements(d2) == replacements(d3) == 0
    # An operator that restarts with the suspension decided but not yet written: still zero.
    d4 = reconcile(observe(job(running_status("worker-0", "worker-1"), runPolicy={"suspend": True}), [],
                           ROUND))
    assert replacements(d4) == 0 and d4.status.tracked_pods is None


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_pods_cleaned_up_after_the_job_finished_count_zero(outcome: str) -> None:
    if outcome == "succeeded":
        pods = [pod("worker-0", "Succeeded", exit_code=0), pod("worker-1", "Succeeded", exit_code=0)]
        d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), pods, ROUND))
    else:
        d1 = reconcile(observe(job(running_status("worker-0", "worker-1"), restartPolicy={"backoffLimit": 0}),
                               [pod("worker-0")], ROUND))
    assert d1.status.phase == (Phase.SUCCEEDED if outcome == "succeeded" else Phase.FAILED)
    assert d1.status.tracked_pods is None
    d2 = reconcile(observe(job(d1.status), [], ROUND))
    assert replacements(d2) == replacements(d1) and not of(d2, CreatePod)


def test_vanished_pod_past_the_backoff_limit_fails_the_job() -> None:
    d = reconcile(observe(job(running_status("worker-0", "worker-1", replacements=2),
                              restartPolicy={"backoffLimit": 2}), [pod("worker-0")], ROUND))
    assert d.status.phase == Phase.FAILED
    failed = condition(d.status, "Failed")
    assert failed is not None and failed.reason == "BackoffLimitExceeded" and not of(d, CreatePod)


def test_vanished_while_etcd_is_unreachable_is_counted_when_it_is_back() -> None:
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0")],
                           EtcdView(reachable=False)))
    assert replacements(d1) == 0 and not of(d1, CreatePod) and d1.requeue_after is not None
    assert d1.status.tracked_pods == tracked("worker-0", "worker-1")
    d2 = reconcile(observe(job(d1.status), [pod("worker-0")], ROUND))
    assert replacements(d2) == 1 and created(d2) == ["spare-0"]
    assert of(d2, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 11)]
    d3 = reconcile(observe(job(d2.status), [pod("worker-0"), assumed("spare-0")], ROUND))
    assert replacements(d3) == 1


def test_a_pod_seen_terminating_then_gone_counts_once() -> None:
    terminating = pod("worker-1", deleting_since=NOW - 1)
    d1 = reconcile(observe(job(running_status("worker-0", "worker-1")), [pod("worker-0"), terminating], ROUND))
    assert replacements(d1) == 1
    d2 = reconcile(observe(job(d1.status), [pod("worker-0"), assumed("spare-0")], ROUND))
    assert replacements(d2) == 1 and not of(d2, CreatePod)


def test_two_vanish_at_once_count_two() -> None:
    d = reconcile(observe(job(running_status("worker-0", "worker-1", "spare-0"), spares=1), [pod("worker-0")],
                          ROUND))
    assert replacements(d) == 2 and created(d) == ["spare-1", "spare-2"]
