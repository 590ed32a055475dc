"""Pods that outlive their training (issue 29, item 3): the pure verdict over the records, table by table, and
what the reconcile does with it (success, the Event, the condition, the deletion or not)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, progress, rank_report, status, stepping

from stalwart.api.restart import ProgressRecord, RoundSummary
from stalwart.api.spec import SuccessPolicy
from stalwart.api.status import ConditionStatus, Phase
from stalwart.operator.lingering import Lingering, RanksReturned, ranks_returned
from stalwart.operator.model import (
    CloseRendezvous,
    CreatePod,
    DeletePod,
    EmitEvent,
    EtcdView,
    PatchStatus,
    ReconcileSettings,
)
from stalwart.operator.reconcile import condition, reconcile

LIMIT = 30.0
AGENT_ENDED = "its agent reported that every rank returned"


def ended(node: str, slot: int, *, at: float, epoch: int = 7) -> ProgressRecord:
    """The record an agent writes last: every local rank returned (``succeeded``), at ``at``."""
    return progress(node, state="succeeded", epoch=epoch, updated=at, step=100,
                    ranks=(rank_report(slot, state="done", step=100, step_time=at - 0.5),),
                    history=(RoundSummary(round=1, epoch=epoch, stepped=0),))


def done(node: str, *slots: int, at: float = NOW) -> ProgressRecord:
    """An agent still alive whose ranks all passed the completion barrier (its processes have not exited)."""
    return progress(node, updated=at, step=100, ranks=tuple(rank_report(s, state="done", step=100) for s in slots),
                    history=(RoundSummary(round=1, epoch=7, stepped=0),))


def view(*records: ProgressRecord, **kw: Any) -> EtcdView:
    return etcd("worker-0", "worker-1", progress=records, **kw)


def full(name: str) -> str:
    return f"{JOB}-{name}"


# -- the verdict ---------------------------------------------------------------------------------------------

CASES: list[tuple[str, list[Any], EtcdView, SuccessPolicy, RanksReturned | None]] = [
    ("issue-29: one pod exited, the other's agent reported its end and hangs",
     [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 31), ended("worker-1", 1, at=NOW - 31.5)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 31, 0.0, (Lingering(full("worker-0"), AGENT_ENDED),), (full("worker-1"),))),
    ("within the limit: the pod may still exit on its own",
     [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 10), ended("worker-1", 1, at=NOW - 12)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 10, 20.0, (Lingering(full("worker-0"), AGENT_ENDED),), (full("worker-1"),))),
    ("the clock is the last agent's report",
     [pod("worker-0"), pod("worker-1")],
     view(ended("worker-0", 0, at=NOW - 50), ended("worker-1", 1, at=NOW - 20)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 20, 10.0, (Lingering(full("worker-0"), AGENT_ENDED),
                                       Lingering(full("worker-1"), AGENT_ENDED)), ())),
    ("ranks done, their agent alive (a rank process stuck at its exit), the other agent ended",
     [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(done("worker-0", 0), ended("worker-1", 1, at=NOW - 40)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 40, 0.0, (Lingering(full("worker-0"), "its 1 rank(s) reported done"),),
                   (full("worker-1"),))),
    ("a member still trains", [pod("worker-0"), pod("worker-1")],
     view(ended("worker-0", 0, at=NOW - 60), stepping("worker-1", 1)), SuccessPolicy.ALL_WORKERS, None),
    ("one rank of a member done, another still running", [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(progress("worker-0", ranks=(rank_report(0, state="done"), rank_report(2, state="running"))),
          ended("worker-1", 1, at=NOW - 60)), SuccessPolicy.ALL_WORKERS, None),
    ("a member without a record", [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(ended("worker-1", 1, at=NOW - 60)), SuccessPolicy.ALL_WORKERS, None),
    ("the end reported in an earlier round is no end of this one", [pod("worker-0"), pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 60, epoch=6), ended("worker-1", 1, at=NOW - 60)),
     SuccessPolicy.ALL_WORKERS, None),
    ("ranks done everywhere, no agent ended: no moment to count from", [pod("worker-0"), pod("worker-1")],
     view(done("worker-0", 0), done("worker-1", 1)), SuccessPolicy.ALL_WORKERS, None),
    ("etcd unread", [pod("worker-0"), pod("worker-1", "Succeeded")], EtcdView(reachable=False),
     SuccessPolicy.ALL_WORKERS, None),
    ("no round sealed", [pod("worker-0"), pod("worker-1", "Succeeded")], EtcdView(progress=(
        ended("worker-0", 0, at=NOW - 60),)), SuccessPolicy.ALL_WORKERS, None),
    ("RankZero: rank 0's agent ended, the other member trains on",
     [pod("worker-0"), pod("worker-1")], view(ended("worker-0", 0, at=NOW - 31), stepping("worker-1", 1)),
     SuccessPolicy.RANK_ZERO, RanksReturned(1, NOW - 31, 0.0, (Lingering(full("worker-0"), AGENT_ENDED),), ())),
    ("RankZero: another member's end says nothing of rank 0",
     [pod("worker-0"), pod("worker-1")], view(stepping("worker-0", 0), ended("worker-1", 1, at=NOW - 60)),
     SuccessPolicy.RANK_ZERO, None),
    ("a member's pod failed after its agent reported the end: not alive, its ranks returned",
     [pod("worker-0", "Failed", exit_code=137), pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 40), ended("worker-1", 1, at=NOW - 40)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 40, 0.0, (), (full("worker-1"),))),
    ("a member being deleted is not lingering",
     [pod("worker-0", deleting_since=NOW - 5), pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 40), ended("worker-1", 1, at=NOW - 40)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 40, 0.0, (), (full("worker-1"),))),
    ("a member's pod gone, its end reported", [pod("worker-1", "Succeeded")],
     view(ended("worker-0", 0, at=NOW - 40), ended("worker-1", 1, at=NOW - 40)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 40, 0.0, (), (full("worker-1"),))),
    ("a spare alive is no member's pod", [pod("worker-0", "Succeeded"), pod("worker-1"), pod("spare-0")],
     view(ended("worker-0", 0, at=NOW - 40), ended("worker-1", 1, at=NOW - 40)), SuccessPolicy.ALL_WORKERS,
     RanksReturned(1, NOW - 40, 0.0, (Lingering(full("worker-1"), AGENT_ENDED),), (full("worker-0"),))),
]


@pytest.mark.parametrize(("pods", "etcd_view", "policy", "want"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_ranks_returned(pods: list[Any], etcd_view: EtcdView, policy: SuccessPolicy,
                        want: RanksReturned | None) -> None:
    assert ranks_returned(pods, etcd_view, policy=policy, now=NOW, limit=LIMIT) == want


# -- the decision ----------------------------------------------------------------------------------------------

SETTINGS = ReconcileSettings(linger_limit=LIMIT)


def issue_29(returned_ago: float, **spec: Any) -> Any:
    """2 workers + 1 spare, Running: worker-1 exited 0, the spare too, worker-0's agent reported that every
    rank returned ``returned_ago`` seconds ago and its pod is still Running."""
    pods = [pod("worker-0"), pod("worker-1", "Succeeded"), pod("spare-0", "Succeeded")]
    records = view(ended("worker-0", 0, at=NOW - returned_ago), ended("worker-1", 1, at=NOW - returned_ago - 0.3))
    return observe(job(status(Phase.RUNNING), spares=1, **spec), pods, records)


def events(d: Any, reason: str) -> list[str]:
    return [e.message for e in of(d, EmitEvent) if e.reason == reason]


def test_a_pod_alive_past_the_limit_after_every_rank_returned_ends_the_job_succeeded() -> None:
    d = reconcile(issue_29(31), SETTINGS)
    assert d.status.phase == Phase.SUCCEEDED
    (message,) = events(d, "PodLingering")
    assert message == (f"pod {full('worker-0')} still running 31s after every rank of round 1 returned "
                       f"({AGENT_ENDED}); deleting it")
    assert [e.type for e in of(d, EmitEvent) if e.reason == "PodLingering"] == ["Warning"]
    assert events(d, "PhaseSucceeded")
    lingering = condition(d.status, "PodsLingering")
    assert lingering is not None and lingering.status == ConditionStatus.TRUE and lingering.reason == "PodLingering"
    assert lingering.message == (f"pod(s) {full('worker-0')} still running 31s after every rank of round 1 "
                                 "returned, past the limit of 30s; deleted (cleanPodPolicy Running)")
    succeeded = condition(d.status, "Succeeded")
    assert succeeded is not None and succeeded.status == ConditionStatus.TRUE
    assert succeeded.message == (f"every rank of round 1 returned ({full('worker-1')} exited 0; "
                                 f"{full('worker-0')} did not exit within 30s)")
    # Deleted once, as lingering (not a second time for cleanPodPolicy); the rendezvous closed; nothing replaced.
    assert [(a.name, a.reason, a.grace) for a in of(d, DeletePod)] == [(full("worker-0"), "PodLingering", 30)]
    assert of(d, CloseRendezvous) and not of(d, CreatePod)
    assert of(d, PatchStatus)


def test_within_the_limit_nothing_is_said_and_the_operator_looks_again_at_the_limit() -> None:
    d = reconcile(issue_29(10), SETTINGS)
    assert d.status.phase == Phase.RUNNING
    assert not events(d, "PodLingering") and not of(d, DeletePod) and condition(d.status, "PodsLingering") is None
    assert d.requeue_after == pytest.approx(20)


def test_the_limit_is_the_operators_setting() -> None:
    d = reconcile(issue_29(3), ReconcileSettings(linger_limit=2))
    assert d.status.phase == Phase.SUCCEEDED and events(d, "PodLingering")
    with pytest.raises(ValueError, match="linger_limit"):
        ReconcileSettings(linger_limit=0)


def test_clean_pod_policy_none_leaves_the_lingering_pod_and_says_so() -> None:
    d = reconcile(issue_29(31, runPolicy={"cleanPodPolicy": "None"}), SETTINGS)
    assert d.status.phase == Phase.SUCCEEDED and not of(d, DeletePod)
    (message,) = events(d, "PodLingering")
    assert message.endswith("left running: cleanPodPolicy None keeps every pod")
    lingering = condition(d.status, "PodsLingering")
    assert lingering is not None and lingering.message is not None
    assert lingering.message.endswith("left running (cleanPodPolicy None)")


def test_every_member_lingering_is_named() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods,
                          view(ended("worker-0", 0, at=NOW - 45), ended("worker-1", 1, at=NOW - 44))), SETTINGS)
    assert d.status.phase == Phase.SUCCEEDED
    assert len(events(d, "PodLingering")) == 2
    assert sorted(a.name for a in of(d, DeletePod)) == [full("worker-0"), full("worker-1")]
    lingering = condition(d.status, "PodsLingering")
    assert lingering is not None and f"{full('worker-0')}, {full('worker-1')} still running 44s" in str(
        lingering.message)


def test_a_job_whose_pods_exit_in_time_never_shows_the_condition() -> None:
    obs = issue_29(1)
    d = reconcile(replace(obs, pods=(pod("worker-0", "Succeeded"), *obs.pods[1:])), SETTINGS)
    assert d.status.phase == Phase.SUCCEEDED and condition(d.status, "PodsLingering") is None
    assert not events(d, "PodLingering")


def test_the_condition_turns_false_once_no_pod_is_left_running_and_nothing_is_said_twice() -> None:
    first = reconcile(issue_29(31), SETTINGS)
    # The lingering pod is terminating: still running, nothing new.
    terminating = [pod("worker-0", deleting_since=NOW), pod("worker-1", "Succeeded"), pod("spare-0", "Succeeded")]
    d = reconcile(observe(job(first.status, spares=1), terminating, view(), now=NOW + 5), SETTINGS)
    c = condition(d.status, "PodsLingering")
    assert c is not None and c.status == ConditionStatus.TRUE
    assert not of(d, EmitEvent) and not of(d, DeletePod)
    # Gone: the condition says so, and still names the pod.
    gone = [pod("worker-1", "Succeeded"), pod("spare-0", "Succeeded")]
    d = reconcile(observe(job(d.status, spares=1), gone, view(), now=NOW + 40), SETTINGS)
    c = condition(d.status, "PodsLingering")
    assert c is not None and c.status == ConditionStatus.FALSE and c.reason == "LingeringPodsGone"
    assert full("worker-0") in str(c.message)
    assert d.status.phase == Phase.SUCCEEDED and not of(d, EmitEvent)
