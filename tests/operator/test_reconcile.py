"""The operator's pure core: every phase transition and failure path, one table row or test each."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from opbuild import JOB, NOW, etcd, job, manifest, observe, of, pod, raw_job, spec, status, stepping

from stalwart.api.job_record import JobRecord
from stalwart.api.restart import FaultRecord, RoundSummary
from stalwart.api.status import ConditionStatus, Phase, Position, RestartCounts
from stalwart.operator.model import (
    CloseRendezvous,
    CreatePod,
    DeleteJob,
    DeletePod,
    EmitEvent,
    EnsureOwnedObjects,
    EtcdView,
    PatchStatus,
    ReconcileSettings,
    RevokeLease,
    SyncPodGroup,
    WriteJobRecord,
)
from stalwart.operator.pod_defaults import PodSecurity
from stalwart.operator.reconcile import condition, failure_action, reconcile


def names(actions: list[CreatePod] | list[DeletePod]) -> list[str]:
    return [a.name.removeprefix(f"{JOB}-") for a in actions]


def reasons(decision: object) -> list[str]:
    return [e.reason for e in of(decision, EmitEvent)]  # type: ignore[arg-type]


def ts(t: float) -> datetime:
    return datetime.fromtimestamp(int(t), UTC)


# -- creation and gang start -----------------------------------------------------------------------------


def test_new_job_creates_service_secret_workers_spares_and_record() -> None:
    d = reconcile(observe(job(spares=1), [], ready=False))
    assert isinstance(d.actions[0], EnsureOwnedObjects)
    assert names(of(d, CreatePod)) == ["worker-0", "worker-1", "spare-0"]
    assert [c.role for c in of(d, CreatePod)] == ["worker", "worker", "spare"]
    (record,) = of(d, WriteJobRecord)
    assert record.members == (f"{JOB}-worker-0", f"{JOB}-worker-1") and record.spares == (f"{JOB}-spare-0",)
    assert record.expected == record.members + record.spares
    (patch,) = of(d, PatchStatus)
    st = patch.status
    assert st.phase == Phase.PENDING and st.start_time == ts(NOW) and st.observed_generation == 1
    assert st.selector == "stalwart.dev/job-name=train"
    created = condition(st, "Created")
    assert created is not None and created.status == ConditionStatus.TRUE
    assert "PhasePending" in reasons(d)
    # Owned objects first, the record before the pods that read it, the status after them.
    kinds = [type(a).__name__ for a in d.actions]
    assert kinds.index("WriteJobRecord") < kinds.index("CreatePod") < kinds.index("PatchStatus")


@pytest.mark.parametrize(("gang", "written", "min_replicas", "want"), [
    (False, None, 2, None),
    (True, None, 2, 2),
    (True, 2, 2, None),
    (True, 2, 1, 1),
    (True, 1, 2, 2),
], ids=["no-gang-scheduler", "first-write", "up-to-date", "minimum-lowered", "minimum-raised"])
def test_pod_group_min_member_follows_min_replicas(gang: bool, written: int | None, min_replicas: int,
                                                   want: int | None) -> None:
    obs = replace(observe(job(minReplicas=min_replicas), [], ready=False), gang_scheduled=gang,
                  pod_group_min_member=written)
    d = reconcile(obs)
    assert of(d, SyncPodGroup) == ([] if want is None else [SyncPodGroup(want)])
    if want is not None:
        # The gang's minimum is set before any pod is created, so the scheduler never binds a part of it.
        kinds = [type(a).__name__ for a in d.actions]
        assert kinds.index("EnsureOwnedObjects") < kinds.index("SyncPodGroup") < kinds.index("CreatePod")


@pytest.mark.parametrize(("pods", "etcd_view", "phase", "reason"), [
    ([pod("worker-0", "Pending"), pod("worker-1", "Pending")], None, Phase.PENDING, None),
    ([pod("worker-0"), pod("worker-1", "Pending")], None, Phase.STARTING, "GangStarting"),
    ([pod("worker-0"), pod("worker-1")], None, Phase.STARTING, "GangStarting"),
    ([pod("worker-0"), pod("worker-1")], etcd("worker-0", "worker-1"), Phase.STARTING, "WaitingForFirstStep"),
    ([pod("worker-0"), pod("worker-1")], etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0),)),
     Phase.RUNNING, "StepsCompleting"),
    ([pod("worker-0"), pod("worker-1", "Pending", unschedulable=True)], None, Phase.STARTING, "Unschedulable"),
], ids=["pending", "gang-partial", "no-round-yet", "sealed-no-step", "running", "unschedulable"])
def test_gang_start_phases(pods: list[object], etcd_view: EtcdView | None, phase: Phase,
                           reason: str | None) -> None:
    d = reconcile(observe(job(status(Phase.PENDING)), pods, etcd_view))  # type: ignore[arg-type]
    assert d.status.phase == phase
    running = condition(d.status, "Running")
    if reason is not None:
        assert running is not None and running.reason == reason
    assert not of(d, CreatePod)


def test_running_status_reports_round_world_and_ready_counts() -> None:
    pods = [pod("worker-0"), pod("worker-1"), pod("spare-0")]
    d = reconcile(observe(job(status(Phase.STARTING), spares=1, nprocPerNode=4), pods,
                          etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0),))))
    st = d.status
    assert (st.phase, st.round, st.world_size) == (Phase.RUNNING, 1, 2)
    assert (st.replicas, st.ready_replicas, st.spare_replicas) == (2, 2, 1)
    assert "PhaseRunning" in reasons(d)


def test_elastic_round_seals_without_unschedulable_pods_never_below_min() -> None:
    pods = [pod("worker-0"), pod("worker-1"), pod("worker-2", "Pending", unschedulable=True)]
    d = reconcile(observe(job(status(Phase.STARTING), replicas=3, minReplicas=2), pods, etcd()))
    (record,) = of(d, WriteJobRecord)
    assert record.members == tuple(f"{JOB}-worker-{i}" for i in range(3))
    assert record.expected == (f"{JOB}-worker-0", f"{JOB}-worker-1")
    # With the round sealed at two nodes (>= minReplicas) the job runs.
    d = reconcile(observe(job(status(Phase.STARTING), replicas=3, minReplicas=2), pods,
                          etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0),))))
    assert d.status.phase == Phase.RUNNING and not of(d, CreatePod) and not of(d, DeletePod)


# -- failures ----------------------------------------------------------------------------------------------


def test_failed_worker_is_fenced_then_replaced_by_a_new_spare() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=92)]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, etcd("worker-0", "worker-1", leases={"worker-1": 55})))
    kinds = [type(a).__name__ for a in d.actions]
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 55)]
    assert kinds.index("RevokeLease") < kinds.index("CreatePod")
    assert names(of(d, DeletePod)) == ["worker-1"]
    assert names(of(d, CreatePod)) == ["spare-0"]
    assert of(d, CreatePod)[0].role == "spare"
    st = d.status
    # Replaced now; the recovery (RESTARTS) is counted when training completes a step again.
    assert st.restarts is not None and st.restarts.pod_replacements == 1 and st.total_restarts == 0
    assert st.last_failure is not None and st.last_failure.pod == f"{JOB}-worker-1"
    assert st.last_failure.reason == "ProcessExited" and st.last_failure.exit_code == 92
    assert st.last_failure.detected_by == "Pod" and st.phase == Phase.RESTARTING
    assert {"PodFailed", "PodReplaced", "PhaseRestarting"} <= set(reasons(d))


def test_a_pod_failing_before_the_job_started_counts_too() -> None:
    pods = [pod("worker-0", "Failed", exit_code=1)]
    d = reconcile(observe(job(status(Phase.PENDING), replicas=1, restartPolicy={"backoffLimit": 0}), pods))
    assert d.status.phase == Phase.FAILED and not of(d, CreatePod)


def test_replacement_names_never_repeat() -> None:
    # Two replacements happened before (spare-0, spare-1 existed and are gone); the next is spare-2.
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    d = reconcile(observe(job(status(Phase.RUNNING, replacements=2)), pods, etcd("worker-0", "worker-1")))
    assert names(of(d, CreatePod)) == ["spare-2"]


def test_replacement_is_not_repeated_while_the_failed_pod_terminates() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1, deleting_since=NOW - 1),
            pod("spare-0", "Pending")]
    d = reconcile(observe(job(status(Phase.RESTARTING, replacements=1)), pods, etcd("worker-0", "worker-1")))
    assert not of(d, CreatePod) and not of(d, DeletePod)
    assert d.status.restarts is not None and d.status.restarts.pod_replacements == 1


def test_backoff_limit_exhausted_fails_the_job() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    d = reconcile(observe(job(status(Phase.RUNNING, replacements=2), restartPolicy={"backoffLimit": 2}), pods,
                          etcd("worker-0", "worker-1")))
    assert d.status.phase == Phase.FAILED and not of(d, CreatePod)
    failed = condition(d.status, "Failed")
    assert failed is not None and failed.reason == "BackoffLimitExceeded"
    assert d.status.completion_time == ts(NOW)
    # cleanPodPolicy Running (the default): the running worker is deleted, the failed one already was.
    assert sorted(names(of(d, DeletePod))) == ["worker-0", "worker-1"]
    assert "PhaseFailed" in reasons(d)


@pytest.mark.parametrize(("rules", "pod_kw", "expected"), [
    ([], {"exit_code": 1}, "ReplacePod"),
    ([], {"exit_code": 91}, "FailJob"),  # NonRetryable raised by the training function
    ([], {"exit_code": 90}, "FailJob"),  # in-process restarts exhausted
    ([], {"exit_code": 92}, "ReplacePod"),  # unhealthy node
    ([], {"exit_code": None, "reason": "Evicted"}, "ReplacePod"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}], {"exit_code": 3}, "FailJob"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}], {"exit_code": 4}, "ReplacePod"),
    ([{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [0, 3]}}], {"exit_code": 4},
     "FailJob"),
    ([{"action": "ReplacePod", "onExitCodes": {"operator": "In", "values": [91]}}], {"exit_code": 91},
     "ReplacePod"),
    ([{"action": "FailJob", "onReasons": ["OOMKilled"]}], {"exit_code": 137, "reason": "OOMKilled"}, "FailJob"),
    ([{"action": "FailJob", "onReasons": ["Evicted"]}], {"reason": "Evicted"}, "FailJob"),
    ([{"action": "RestartInProcess", "onReasons": ["ProcessExited"]}], {"exit_code": 1}, "RestartInProcess"),
], ids=["default", "non-retryable", "exhausted", "unhealthy", "evicted", "rule-in", "rule-in-miss",
        "rule-notin", "rule-overrides-default", "oom", "evicted-rule", "restart-in-process"])
def test_exit_code_rules(rules: list[dict[str, object]], pod_kw: dict[str, object], expected: str) -> None:
    from stalwart.operator.reconcile import failure_reason

    jobv = job(restartPolicy={"rules": rules})
    assert jobv.spec is not None
    failed = pod("worker-1", "Failed", **pod_kw)
    action = failure_action(jobv.spec.restart_policy.rules, failure_reason(failed), failed.exit_code)
    assert action.value == expected


def test_fail_job_rule_ends_the_job_with_the_pod_named() -> None:
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=3)]
    d = reconcile(observe(job(status(Phase.RUNNING), restartPolicy={"rules": rules}), pods,
                          etcd("worker-0", "worker-1")))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "FailJobRule"
    assert failed.message is not None and f"{JOB}-worker-1" in failed.message and "exit code 3" in failed.message
    assert not of(d, CreatePod)


def test_non_retryable_exit_without_rules_fails_the_job() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=91)]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, etcd("worker-0", "worker-1")))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "NonRetryableExit"


def test_restart_in_process_rule_replaces_without_counting() -> None:
    rules = [{"action": "RestartInProcess", "onExitCodes": {"operator": "In", "values": [1]}}]
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    d = reconcile(observe(job(status(Phase.RUNNING), restartPolicy={"rules": rules, "backoffLimit": 0}), pods,
                          etcd("worker-0", "worker-1")))
    assert d.status.phase != Phase.FAILED
    assert names(of(d, CreatePod)) == ["spare-0"]
    assert d.status.restarts is not None and d.status.restarts.pod_replacements == 0


def test_pod_failed_with_its_node_is_deleted_without_grace() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", reason="NodeLost", exit_code=137)]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, etcd("worker-0", "worker-1")))
    assert of(d, DeletePod) == [DeletePod(f"{JOB}-worker-1", 0, "NodeLost")]
    assert names(of(d, CreatePod)) == ["spare-0"]


def test_pod_deleted_by_someone_else_is_fenced_and_replaced() -> None:
    gone = pod("worker-1", deleting_since=NOW - 1, deletion_grace=30)
    d = reconcile(observe(job(status(Phase.RUNNING)), [pod("worker-0"), gone],
                          etcd("worker-0", "worker-1", leases={"worker-1": 4})))
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 4)]
    assert names(of(d, CreatePod)) == ["spare-0"]
    assert not of(d, DeletePod)
    assert d.requeue_after == pytest.approx(59)  # when it would be stuck terminating


def test_pod_stuck_terminating_is_force_deleted() -> None:
    stuck = pod("worker-1", deleting_since=NOW - 70, deletion_grace=30)
    d = reconcile(observe(job(status(Phase.RESTARTING, replacements=1)), [pod("worker-0"), stuck,
                                                                          pod("spare-0")],
                          etcd("worker-0", "spare-0")), ReconcileSettings(terminating_grace_limit=30))
    assert of(d, DeletePod) == [DeletePod(f"{JOB}-worker-1", 0, "StuckTerminating")]
    assert "ForceDeleted" in reasons(d) and not of(d, CreatePod)


def test_no_replacement_while_etcd_is_unreachable() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, EtcdView(reachable=False)))
    assert not of(d, CreatePod) and not of(d, WriteJobRecord) and d.requeue_after is not None
    assert names(of(d, DeletePod)) == ["worker-1"]


def test_lost_member_means_restarting_until_the_new_round_steps() -> None:
    at_step = status(Phase.RUNNING, position=Position(round=1, iteration=0))
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    round1 = etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0, step=50),))
    d = reconcile(observe(job(at_step), pods, round1))
    assert d.status.phase == Phase.RESTARTING
    restarting = condition(d.status, "Restarting")
    assert restarting is not None and restarting.status == ConditionStatus.TRUE
    assert restarting.reason == "ProcessExited"
    # A new round is sealed with the replacement, but no step has completed in it: still restarting.
    pods = [pod("worker-0"), pod("spare-0")]
    round2 = etcd("worker-0", "spare-0", epoch=9, progress=(stepping("worker-0", 0, step=50),))
    d2 = reconcile(observe(job(d.status), pods, round2))
    assert d2.status.phase == Phase.RESTARTING and d2.status.round == 1
    # Its first step: running again, one recovery with new processes, counted once.
    stepped = stepping("worker-0", 0, step=41, round_=2, epoch=9,
                       earlier=(RoundSummary(round=1, epoch=7, stepped=0),))
    d3 = reconcile(observe(job(d2.status), pods, etcd("worker-0", "spare-0", epoch=9, progress=(stepped,))))
    assert d3.status.phase == Phase.RUNNING
    assert d3.status.restarts == RestartCounts(in_process=0, process_restarts=1, pod_replacements=1)
    assert d3.status.total_restarts == 1 and d3.status.position == Position(round=2, iteration=0)
    restarting = condition(d3.status, "Restarting")
    assert restarting is not None and restarting.status == ConditionStatus.FALSE
    assert "RestartedProcesses" in reasons(d3)
    d4 = reconcile(observe(job(d3.status), pods, etcd("worker-0", "spare-0", epoch=9, progress=(stepped,))))
    assert d4.status.restarts == d3.status.restarts and "RestartedProcesses" not in reasons(d4)


# -- in-process restarts and progress from etcd --------------------------------------------------------------


def test_in_process_restarts_progress_and_last_failure_come_from_etcd() -> None:
    fault = FaultRecord(slot=1, rank=1, node_id=f"{JOB}-worker-1", iteration=0, kind="exception",
                        reason="RuntimeError('boom')", time=NOW - 5)
    before = status(Phase.RUNNING, position=Position(round=1, iteration=0))
    pods = [pod("worker-0"), pod("worker-1")]
    faulted = etcd("worker-0", "worker-1", faults=((100, fault),),
                   progress=(stepping("worker-0", 0, step=120), stepping("worker-1", 1, step=120)))
    d = reconcile(observe(job(before), pods, faulted))
    st = d.status
    assert st.phase == Phase.RESTARTING and st.restarts == RestartCounts()
    assert st.last_failure is not None and (st.last_failure.rank, st.last_failure.pod) == (1, f"{JOB}-worker-1")
    assert (st.last_failure.reason, st.last_failure.exception_type, st.last_failure.message) == \
        ("Exception", "RuntimeError", "boom")
    assert "Fault" in reasons(d)
    resumed = etcd("worker-0", "worker-1", faults=((100, fault),),
                   progress=(stepping("worker-0", 0, step=121, iteration=1),
                             stepping("worker-1", 1, step=121, iteration=1)))
    d2 = reconcile(observe(job(st), pods, resumed))
    st2 = d2.status
    assert st2.phase == Phase.RUNNING and st2.restarts is not None and st2.restarts.in_process == 1
    assert st2.total_restarts == 1 and st2.progress is not None and st2.progress.step == 121
    assert "RestartedInProcess" in reasons(d2)
    # Reported again with nothing new: no new count, no new event.
    d3 = reconcile(observe(job(st2), pods, resumed))
    assert "RestartedInProcess" not in reasons(d3) and d3.status.restarts == st2.restarts


# -- suspend / resume, deadline ------------------------------------------------------------------------------


def test_suspend_deletes_pods_keeps_etcd_and_resume_recreates() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    running = status(Phase.RUNNING, start_time=ts(NOW - 100))
    d = reconcile(observe(job(running, runPolicy={"suspend": True}), pods, etcd("worker-0", "worker-1")))
    assert sorted(names(of(d, DeletePod))) == ["worker-0", "worker-1"]
    assert not of(d, RevokeLease) and not of(d, CreatePod) and not of(d, CloseRendezvous)
    assert d.status.phase == Phase.SUSPENDED and d.status.start_time is None
    suspended = condition(d.status, "Suspended")
    assert suspended is not None and suspended.status == ConditionStatus.TRUE
    d2 = reconcile(observe(job(d.status), [], etcd("worker-0", "worker-1")))
    assert names(of(d2, CreatePod)) == ["worker-0", "worker-1"]
    assert d2.status.phase == Phase.PENDING and d2.status.start_time == ts(NOW)
    assert d2.status.restarts is not None and d2.status.restarts.pod_replacements == 0
    resumed = condition(d2.status, "Suspended")
    assert resumed is not None and resumed.status == ConditionStatus.FALSE and resumed.reason == "Resumed"


def test_deadline_fails_the_job() -> None:
    st = status(Phase.RUNNING, start_time=ts(NOW - 50))
    pods = [pod("worker-0"), pod("worker-1")]
    stepped = etcd("worker-0", "worker-1", progress=(stepping("worker-0", 0),))
    d = reconcile(observe(job(st, runPolicy={"activeDeadlineSeconds": 60}), pods, stepped))
    assert d.status.phase == Phase.RUNNING and d.requeue_after == pytest.approx(10)
    d = reconcile(observe(job(st, runPolicy={"activeDeadlineSeconds": 40}), pods, etcd("worker-0", "worker-1")))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "DeadlineExceeded"
    assert sorted(names(of(d, DeletePod))) == ["worker-0", "worker-1"]


# -- success, clean-up, TTL ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "phases", "done"), [
    ("AllWorkers", ("Succeeded", "Succeeded"), True),
    ("AllWorkers", ("Succeeded", "Running"), False),
    ("RankZero", ("Succeeded", "Running"), True),
    ("RankZero", ("Running", "Succeeded"), False),
])
def test_success_policy(policy: str, phases: tuple[str, str], done: bool) -> None:
    pods = [pod("worker-0", phases[0]), pod("worker-1", phases[1]), pod("spare-0")]
    d = reconcile(observe(job(status(Phase.RUNNING), spares=1, successPolicy=policy), pods,
                          etcd("worker-0", "worker-1")))
    assert (d.status.phase == Phase.SUCCEEDED) == done
    assert not of(d, CreatePod)  # a finished pod is never "replaced"
    if done:
        assert d.status.completion_time == ts(NOW)
        succeeded = condition(d.status, "Succeeded")
        assert succeeded is not None and succeeded.status == ConditionStatus.TRUE
        assert "spare-0" in names(of(d, DeletePod))  # cleanPodPolicy Running


@pytest.mark.parametrize(("policy", "deleted"), [
    ("All", ["worker-0", "worker-1", "spare-0"]),
    ("Running", ["spare-0"]),
    ("None", []),
])
def test_clean_pod_policy(policy: str, deleted: list[str]) -> None:
    pods = [pod("worker-0", "Succeeded"), pod("worker-1", "Failed"), pod("spare-0")]
    st = status(Phase.SUCCEEDED, completion_time=ts(NOW - 5), replicas=2, ready_replicas=0, spare_replicas=1)
    d = reconcile(observe(job(st, spares=1, runPolicy={"cleanPodPolicy": policy}), pods, etcd()))
    assert sorted(names(of(d, DeletePod))) == sorted(deleted)
    assert of(d, CloseRendezvous)
    assert not of(d, PatchStatus) and not of(d, EmitEvent)  # nothing new to say


def test_ttl_after_finished() -> None:
    st = status(Phase.FAILED, completion_time=ts(NOW - 5))
    d = reconcile(observe(job(st, runPolicy={"ttlSecondsAfterFinished": 30}), [], etcd(closed=True)))
    assert not of(d, DeleteJob) and d.requeue_after == pytest.approx(25) and not of(d, CloseRendezvous)
    d = reconcile(observe(job(st, runPolicy={"ttlSecondsAfterFinished": 30}), [], etcd(closed=True),
                          now=NOW + 25))
    assert of(d, DeleteJob)


# -- invalid spec --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body_spec", "name", "field"), [
    ({**spec(), "replicas": 0}, JOB, "spec.replicas"),
    ({**spec(), "minReplicas": 5}, JOB, "minReplicas"),
    ({k: v for k, v in spec().items() if k != "template"}, JOB, "spec.template"),
    ({**spec(), "replicas": "2"}, JOB, "spec.replicas"),
    ({**spec(), "rendezvous": {"endpoints": ["http://etcd:2379"]}}, JOB, "spec.rendezvous.endpoints"),
    (spec(), "Bad_Name", "metadata.name"),
], ids=["replicas", "min-above-replicas", "missing-template", "string-replicas", "endpoint", "name"])
def test_invalid_spec_fails_once_with_a_condition_naming_the_field(body_spec: dict[str, object], name: str,
                                                                    field: str) -> None:
    jobv = raw_job(body_spec, name=name)
    d = reconcile(observe(jobv, []))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "InvalidSpec"
    assert failed.message is not None and field in failed.message
    assert reasons(d).count("InvalidSpec") == 1
    assert not of(d, CreatePod) and not of(d, EnsureOwnedObjects)
    again = reconcile(observe(type(jobv)(**{**{k: getattr(jobv, k) for k in jobv.__slots__},
                                            "status": d.status}), []))
    assert not of(again, EmitEvent) and not of(again, PatchStatus)


PRIVILEGED = {"spec": {"containers": [{"name": "trainer", "image": "img", "command": ["python", "train.py"],
                                        "securityContext": {"privileged": True}}],
                        "hostNetwork": True}}


@pytest.mark.parametrize(("level", "refused"), [(PodSecurity.RESTRICTED, True), (PodSecurity.BASELINE, True),
                                                (PodSecurity.OFF, False)])
def test_a_template_asking_for_the_host_is_refused_when_pod_security_is_restricted(level: PodSecurity,
                                                                                   refused: bool) -> None:
    settings = ReconcileSettings(pod_security=level)
    d = reconcile(observe(job(template=PRIVILEGED), [], ready=False), settings)
    failed = condition(d.status, "Failed")
    if not refused:
        assert failed is None and len(of(d, CreatePod)) == 2
        return
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "InvalidSpec"
    assert failed.message is not None
    assert failed.message.startswith("spec.template.spec.hostNetwork: ")
    assert "spec.template.spec.containers[0].securityContext.privileged" in failed.message
    assert reasons(d).count("InvalidSpec") == 1 and not of(d, CreatePod) and not of(d, EnsureOwnedObjects)
    # Failed for good: the next look changes nothing and says nothing again.
    again = reconcile(observe(job(d.status, template=PRIVILEGED), []), settings)
    assert not of(again, EmitEvent) and not of(again, CreatePod)


ADDS_A_CAPABILITY = {"spec": {"containers": [{"name": "trainer", "image": "img", "command": ["python", "train.py"],
                                               "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}]}}


def test_a_template_adding_a_capability_fails_by_default_without_any_pod() -> None:
    """Issue 31, finding 4: a capability the template adds was kept and the pods created (the default
    settings restrict pod security to the Pod Security Standards' restricted profile)."""
    d = reconcile(observe(job(template=ADDS_A_CAPABILITY), [], ready=False))
    failed = condition(d.status, "Failed")
    assert d.status.phase == Phase.FAILED and failed is not None and failed.reason == "InvalidSpec"
    assert failed.message is not None and failed.message.startswith(
        "spec.template.spec.containers[0].securityContext.capabilities.add[0]: 'SYS_PTRACE' is refused by the "
        "Pod Security Standards' baseline profile (control 'Capabilities';")
    events = [e for e in of(d, EmitEvent) if e.reason == "InvalidSpec"]
    assert [(e.type, e.message) for e in events] == [("Warning", failed.message)]
    assert not of(d, CreatePod) and not of(d, EnsureOwnedObjects) and not of(d, WriteJobRecord)


def test_spec_broken_after_start_stops_the_pods() -> None:
    jobv = raw_job({**spec(), "replicas": -1})
    running = type(jobv)(**{**{k: getattr(jobv, k) for k in jobv.__slots__}, "status": status(Phase.RUNNING)})
    d = reconcile(observe(running, [pod("worker-0"), pod("worker-1", "Succeeded")]))
    assert names(of(d, DeletePod)) == ["worker-0"] and d.status.phase == Phase.FAILED


# -- scale, records, deletion, rate limit --------------------------------------------------------------------


def test_scale_up_adds_workers_without_counting_replacements() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    d = reconcile(observe(job(status(Phase.RUNNING), replicas=4, generation=2), pods,
                          etcd("worker-0", "worker-1")))
    assert names(of(d, CreatePod)) == ["worker-2", "worker-3"]
    assert d.status.restarts is not None and d.status.restarts.pod_replacements == 0
    (record,) = of(d, WriteJobRecord)
    assert len(record.members) == 4


def test_scale_down_deletes_pods_outside_the_round_first() -> None:
    pods = [pod("worker-0"), pod("worker-1"), pod("worker-2"), pod("worker-3", "Pending")]
    d = reconcile(observe(job(status(Phase.RUNNING), replicas=2, generation=3), pods,
                          etcd("worker-0", "worker-1", "worker-2")))
    assert sorted(names(of(d, DeletePod))) == ["worker-2", "worker-3"]
    assert not of(d, CreatePod)


def test_job_record_is_rewritten_only_when_spec_or_pods_change() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    jobv = job(status(Phase.RUNNING))
    assert jobv.spec is not None
    members = [f"{JOB}-worker-0", f"{JOB}-worker-1"]
    record = JobRecord.model_validate({
        "jobName": JOB, "namespace": "ns", "uid": "uid-1", "generation": 1, "members": members,
        "minNodes": 2, "maxNodes": 2, "nprocPerNode": 1, "joinTimeoutSeconds": 600, "lastCallSeconds": 10,
        "leaseTTLSeconds": 10, "maxRestarts": 10, "softTimeoutSeconds": 60, "hardTimeoutSeconds": 90,
        "barrierTimeoutSeconds": 120, "backoffLimit": 6})
    same = etcd("worker-0", "worker-1", record=record, expected=tuple(members))
    assert not of(reconcile(observe(jobv, pods, same)), WriteJobRecord)
    assert of(reconcile(observe(job(status(Phase.RUNNING), generation=2), pods, same)), WriteJobRecord)


def test_deleting_job_is_left_to_the_finalizer() -> None:
    d = reconcile(observe(job(status(Phase.RUNNING), deleting=True), [pod("worker-0")]))
    assert d.actions == ()


def test_status_patches_are_rate_limited() -> None:
    pods = [pod("worker-0"), pod("worker-1")]
    records = (stepping("worker-0", 0, step=5),)
    obs_kw = {"etcd_view": etcd("worker-0", "worker-1", progress=records)}
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, last_patch=NOW - 0.3, **obs_kw))  # type: ignore[arg-type]
    assert not of(d, PatchStatus) and d.requeue_after == pytest.approx(0.7)
    d = reconcile(observe(job(status(Phase.RUNNING)), pods, last_patch=NOW - 1.0, **obs_kw))  # type: ignore[arg-type]
    (patch,) = of(d, PatchStatus)
    assert patch.status.progress is not None and patch.status.progress.step == 5
    # Nothing changed: nothing to patch, no matter how long ago the last patch was.
    d = reconcile(observe(job(d.status), pods, last_patch=NOW - 100, **obs_kw))  # type: ignore[arg-type]
    assert not of(d, PatchStatus)


def test_reconcile_is_deterministic() -> None:
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=1)]
    obs = observe(job(status(Phase.RUNNING)), pods, etcd("worker-0", "worker-1", leases={"worker-1": 3}))
    assert reconcile(obs) == reconcile(obs)


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="status_interval"):
        ReconcileSettings(status_interval=0)
    with pytest.raises(ValueError, match="delete_grace_seconds"):
        ReconcileSettings(delete_grace_seconds=-1)


def test_manifest_helper_is_consistent() -> None:
    m = manifest("worker-0", "worker-1", nproc=4)
    assert m.world_size == 8
