"""`kubectl get tj` tells the truth: each way the status used to lie, walked through the operator's pure core.

Each test feeds a sequence of observations to :func:`reconcile` the way the runner does (each decision's status is
the next observation's), with the agents' reports as the agents write them.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, progress, rank_report, status, stepping

from stalwart.api.restart import FaultRecord, RankExit, RoundSummary
from stalwart.api.status import (
    Condition,
    ConditionStatus,
    FailureRecord,
    Phase,
    Position,
    RestartCounts,
    TrainingJobStatus,
)
from stalwart.operator.model import EmitEvent, EtcdView, PatchStatus
from stalwart.operator.reconcile import condition, reconcile

PODS = [pod("worker-0"), pod("worker-1")]
AT_START = Position(round=1, iteration=0)


def reasons(d: object) -> list[str]:
    return [e.reason for e in of(d, EmitEvent)]  # type: ignore[arg-type]


def both(round_: int, iteration: int, step: int, *, epoch: int, earlier: tuple[RoundSummary, ...] = (),
         faults: tuple[tuple[int, FaultRecord], ...] = ()) -> EtcdView:
    """Both workers stepping at ``step`` in ``round_``/``iteration`` (their reports say so)."""
    return etcd("worker-0", "worker-1", epoch=epoch, faults=faults,
                progress=(stepping("worker-0", 0, step=step, round_=round_, iteration=iteration, epoch=epoch,
                                   earlier=earlier),
                          stepping("worker-1", 1, step=step, round_=round_, iteration=iteration, epoch=epoch,
                                   earlier=earlier)))


def exception(iteration: int, slot: int = 1) -> FaultRecord:
    return FaultRecord(slot=slot, rank=slot, node_id=f"{JOB}-worker-{slot}", iteration=iteration, kind="exception",
                       reason="RuntimeError('boom')", time=NOW)


# -- 1. counts that add up ---------------------------------------------------------------------------------


def test_four_in_process_restarts_in_two_rounds_count_four() -> None:
    """The agents' own counters restart in every round; the status does not."""
    st = status(Phase.RUNNING, position=AT_START)
    # Round 1 (epoch 7): two faults, each recovered in process.
    for it in (1, 2):
        faulted = both(1, it - 1, 10 * it, epoch=7, faults=((100 + it, exception(it - 1)),))
        d = reconcile(observe(job(st), PODS, faulted))
        d = reconcile(observe(job(d.status), PODS, both(1, it, 10 * it + 1, epoch=7)))
        st = d.status
    assert st.restarts is not None and st.restarts.in_process == 2
    # A new round (a spare took over after a deliberate scale change: no fault), then two more faults in it.
    round1 = (RoundSummary(round=1, epoch=7, stepped=2),)
    for it in (1, 2):
        d = reconcile(observe(job(st), PODS, both(2, it - 1, 30 + it, epoch=9, earlier=round1,
                                                  faults=((200 + it, exception(it - 1)),))))
        d = reconcile(observe(job(d.status), PODS, both(2, it, 31 + it, epoch=9, earlier=round1)))
        st = d.status
    assert st.restarts is not None and st.restarts.in_process == 4 and st.total_restarts == 4
    assert st.position == Position(round=2, iteration=2)
    # An operator that restarts reads this status back and the same reports: nothing counted twice.
    again = reconcile(observe(job(TrainingJobStatus.model_validate(st.to_wire())), PODS,
                              both(2, 2, 34, epoch=9, earlier=round1)))
    assert again.status.restarts == st.restarts


def test_a_killed_rank_is_one_process_restart_not_an_in_process_one() -> None:
    st = status(Phase.RUNNING, position=AT_START)
    death = RankExit(local_rank=0, slot=1, rank=1, round=1, iteration=0, pid=42, signal="SIGKILL", time=NOW)
    survivor = FaultRecord(slot=0, rank=0, node_id=f"{JOB}-worker-0", iteration=0, kind="exception",
                           reason="RuntimeError('Connection reset by peer')", time=NOW - 0.1)
    records = (stepping("worker-0", 0, step=50), stepping("worker-1", 1, step=50, exits=(death,)))
    d = reconcile(observe(job(st), PODS, etcd("worker-0", "worker-1", faults=((100, survivor),), progress=records)))
    assert d.status.phase == Phase.RESTARTING
    records = (stepping("worker-0", 0, step=51, iteration=1),
               stepping("worker-1", 1, step=51, iteration=1, respawned=(1,), exits=(death,)))
    d = reconcile(observe(job(d.status), PODS, etcd("worker-0", "worker-1", progress=records)))
    assert d.status.phase == Phase.RUNNING
    assert d.status.restarts == RestartCounts(in_process=0, process_restarts=1) and d.status.total_restarts == 1


# -- 2. one failure record per fault, naming the culprit ---------------------------------------------------


def test_last_failure_names_the_killed_rank_not_the_survivor() -> None:
    st = status(Phase.RUNNING, position=AT_START)
    survivor = FaultRecord(slot=0, rank=0, node_id=f"{JOB}-worker-0", iteration=0, kind="exception",
                           reason="RuntimeError('Connection reset by peer')", time=NOW - 0.2)
    death = RankExit(local_rank=0, slot=1, rank=1, round=1, iteration=0, pid=42, signal="SIGKILL", time=NOW - 0.1)
    # The survivor's error arrives first; the agent's report of the death a moment later.
    d1 = reconcile(observe(job(st), PODS, etcd("worker-0", "worker-1", faults=((100, survivor),),
                                               progress=(stepping("worker-0", 0, step=50),))))
    d2 = reconcile(observe(job(d1.status), PODS, etcd(
        "worker-0", "worker-1", faults=((100, survivor),),
        progress=(stepping("worker-0", 0, step=50), stepping("worker-1", 1, step=50, exits=(death,))))))
    lf = d2.status.last_failure
    assert lf is not None and (lf.rank, lf.pod, lf.reason, lf.signal) == (1, f"{JOB}-worker-1", "ProcessExited",
                                                                         "SIGKILL")
    assert lf.secondary is not None and lf.secondary[0].message == "Connection reset by peer"


def test_last_failure_follows_each_fault_even_without_a_new_in_process_restart() -> None:
    st = status(Phase.RUNNING, position=Position(round=1, iteration=4), in_process=4,
                last_failure=FailureRecord(rank=0, pod=f"{JOB}-worker-0", reason="Exception", round=1, iteration=3))
    noticed = FaultRecord(slot=0, rank=0, node_id=f"{JOB}-worker-0", iteration=4, kind="peer_lost",
                          reason="the heartbeat lease of slot 1 ended", time=NOW, lost_slots=[1])
    d = reconcile(observe(job(st), PODS, etcd("worker-0", "worker-1", faults=((300, noticed),), progress=(
        stepping("worker-0", 0, step=90, iteration=4), stepping("worker-1", 1, step=90, iteration=4)))))
    lf = d.status.last_failure
    assert lf is not None and (lf.rank, lf.pod, lf.reason, lf.detected_by) == (1, f"{JOB}-worker-1", "PeerLost",
                                                                               "Heartbeat")
    assert (lf.round, lf.iteration) == (1, 4) and d.status.phase == Phase.RESTARTING
    restarting = condition(d.status, "Restarting")
    assert restarting is not None and restarting.reason == "PeerLost"


def test_a_graceful_pod_delete_sets_last_failure() -> None:
    st = status(Phase.RUNNING, position=AT_START, tracked_pods=[f"{JOB}-worker-0", f"{JOB}-worker-1"])
    pods = [pod("worker-0"), pod("worker-1", deleting_since=NOW - 1, deletion_grace=30)]
    d = reconcile(observe(job(st), pods, both(1, 0, 50, epoch=7)))
    lf = d.status.last_failure
    assert lf is not None and (lf.pod, lf.reason, lf.detected_by) == (f"{JOB}-worker-1", "PodLost", "Pod")
    assert "deleted" in (lf.message or "") and d.status.phase == Phase.RESTARTING


def test_the_status_patch_replaces_last_failure_whole() -> None:
    from stalwart.operator.runner import status_patch

    old = TrainingJobStatus(last_failure=FailureRecord(pod="a", reason="PodLost", message="the pod was deleted",
                                                       exit_code=137))
    new = TrainingJobStatus(last_failure=FailureRecord(rank=1, pod="b", reason="Exception", message="boom"))
    patch = status_patch(old.to_wire(), new.to_wire())
    assert patch["lastFailure"] == {"rank": 1, "pod": "b", "reason": "Exception", "message": "boom", "exitCode": None}
    # What the API server makes of it (a JSON merge patch) is exactly the new record.
    merged = dict(old.to_wire()["lastFailure"])
    for key, value in patch["lastFailure"].items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    assert merged == new.to_wire()["lastFailure"]


# -- 3. phases from evidence ----------------------------------------------------------------------------------


def test_running_only_once_a_step_completed() -> None:
    started = etcd("worker-0", "worker-1", progress=(
        progress("worker-0", ranks=(rank_report(0, state="running"),)),
        progress("worker-1", ranks=(rank_report(1, state="running"),))))
    d = reconcile(observe(job(status(Phase.STARTING)), PODS, started))
    assert d.status.phase == Phase.STARTING
    running = condition(d.status, "Running")
    assert running is not None and running.reason == "WaitingForFirstStep"
    d = reconcile(observe(job(d.status), PODS, both(1, 0, 1, epoch=7)))
    assert d.status.phase == Phase.RUNNING and d.status.progress is not None and d.status.progress.step == 1


def test_restarting_from_the_fault_until_the_first_step_after_it() -> None:
    st = status(Phase.RUNNING, position=AT_START)
    faulted = both(1, 0, 50, epoch=7, faults=((100, exception(0)),))
    d = reconcile(observe(job(st), PODS, faulted))
    assert d.status.phase == Phase.RESTARTING
    # The ranks are back in their training function, but no step completed yet in the new iteration.
    back = etcd("worker-0", "worker-1", faults=((100, exception(0)),), progress=(
        progress("worker-0", ranks=(rank_report(0, iteration=1, step=50),),
                 history=(RoundSummary(round=1, epoch=7, stepped=0),)),))
    d = reconcile(observe(job(d.status), PODS, back))
    assert d.status.phase == Phase.RESTARTING
    d = reconcile(observe(job(d.status), PODS, both(1, 1, 51, epoch=7)))
    assert d.status.phase == Phase.RUNNING and "RestartedInProcess" in reasons(d)


def test_no_progress_past_the_soft_timeout_is_stalled() -> None:
    st = status(Phase.RUNNING, position=AT_START)
    stuck = rank_report(1, step=50, step_time=NOW - 70, progress_time=NOW - 70)
    view = etcd("worker-0", "worker-1", progress=(
        stepping("worker-0", 0, step=50), progress("worker-1", ranks=(stuck,),
                                                   history=(RoundSummary(round=1, epoch=7, stepped=0),))))
    d = reconcile(observe(job(st), PODS, view))  # softTimeoutSeconds defaults to 60
    stalled = condition(d.status, "Stalled")
    assert stalled is not None and stalled.status == ConditionStatus.TRUE and stalled.reason == "NoProgress"
    assert stalled.message is not None and f"rank 1 (pod {JOB}-worker-1)" in stalled.message
    assert d.status.phase == Phase.RESTARTING
    assert d.status.last_failure is not None and d.status.last_failure.reason == "Hang"
    assert d.status.last_failure.detected_by == "Progress" and "Stalled" in reasons(d)
    # Steps go on: no longer stalled, running again, and nothing was restarted.
    d = reconcile(observe(job(d.status), PODS, both(1, 0, 51, epoch=7)))
    stalled = condition(d.status, "Stalled")
    assert stalled is not None and stalled.status == ConditionStatus.FALSE
    assert d.status.phase == Phase.RUNNING and d.status.restarts == RestartCounts()


@pytest.mark.parametrize(("own", "now_limit", "silent_for", "stalled"), [
    (None, None, 45, False),  # the spec's 60 s: not yet
    (30.0, None, 45, True),   # @restartable(soft_timeout=30): the rank's own limit, passed
    (120.0, None, 70, False),  # a longer one of its own: 70 s is no stall for it, though past the spec's 60 s
    (None, None, 70, True),
    # Before its first ping in a new iteration the rank gives itself the startup allowance (its group waits for
    # a respawned peer): 70 s there is no stall, though past its soft timeout of 30 s ...
    (30.0, 120.0, 70, False),
    # ... until the allowance has passed too; after the ping its soft timeout is the limit again.
    (30.0, 120.0, 130, True),
    (30.0, 30.0, 45, True),
], ids=["spec-not-yet", "own-shorter", "own-longer", "spec-passed", "startup-not-yet", "startup-passed",
        "pinged"])
def test_a_stall_is_judged_by_the_limit_the_rank_uses(own: float | None, now_limit: float | None,
                                                       silent_for: float, stalled: bool) -> None:
    st = status(Phase.RUNNING, position=AT_START)
    stuck = rank_report(1, step=50, step_time=NOW - silent_for, progress_time=NOW - silent_for)
    stuck = stuck.model_copy(update={"soft_timeout": own, "stall_limit": now_limit})
    view = etcd("worker-0", "worker-1", progress=(
        stepping("worker-0", 0, step=50), progress("worker-1", ranks=(stuck,),
                                                   history=(RoundSummary(round=1, epoch=7, stepped=0),))))
    cond = condition(reconcile(observe(job(st), PODS, view)).status, "Stalled")  # the spec says 60 s
    assert (cond is not None and cond.status == ConditionStatus.TRUE) is stalled
    if stalled:
        assert cond is not None and cond.message is not None
        limit = now_limit or own or 60
        named = "startup allowance" if limit > (own or 60) else "soft timeout"
        assert f"({named} {limit:g}s) on rank 1 (pod {JOB}-worker-1)" in cond.message


@pytest.mark.parametrize(("still_open", "since", "blamed"), [
    # Rank 1 was stopped; its hang was recorded at NOW - 70, and its agent killed and respawned it. The survivor,
    # rank 0, has waited in its collective since just before (NOW - 76) and is still waiting for the new rank 1 to
    # start: its silence is that fault's doing, whether the operator still counts the incident open ...
    (True, 76, False),
    # ... or saw it end (its status read before the recovery's patch, or a step counted): not a new hang.
    (False, 76, False),
    # A stall past the soft timeout (60 s) that began after the fault was recorded is news: a new incident.
    (False, 64, True),
], ids=["open", "closed", "after-the-fault"])
def test_a_survivor_silent_since_before_the_last_fault_is_not_its_culprit(still_open: bool, since: float,
                                                                          blamed: bool) -> None:
    hang = FailureRecord(rank=1, pod=f"{JOB}-worker-1", reason="Hang", detected_by="Process", round=1, iteration=0,
                         time=datetime.fromtimestamp(NOW - 70, UTC), message="killed by its agent and respawned")
    conditions = [cond for cond in reconcile(observe(job(status(Phase.RUNNING, position=AT_START)), PODS,
                                                     both(1, 0, 50, epoch=7))).status.conditions or []
                  if cond.type != "Restarting"]
    if still_open:
        conditions.append(Condition(type="Restarting", status=ConditionStatus.TRUE, reason="Hang",
                                    last_transition_time=hang.time))
    st = status(Phase.RESTARTING if still_open else Phase.RUNNING, position=Position(round=1, iteration=1),
                last_failure=hang, conditions=conditions)
    waiting = rank_report(0, step=50, step_time=NOW - since, progress_time=NOW - since)
    view = etcd("worker-0", "worker-1", progress=(
        progress("worker-0", ranks=(waiting,), history=(RoundSummary(round=1, epoch=7, stepped=0, faulted=0),)),
        progress("worker-1", ranks=(rank_report(1, state="barrier", iteration=1),),
                 history=(RoundSummary(round=1, epoch=7, stepped=0, faulted=0, respawned=[1]),))))
    d = reconcile(observe(job(st), PODS, view))
    lf = d.status.last_failure
    assert lf is not None
    if blamed:
        assert (lf.rank, lf.pod, lf.detected_by) == (0, f"{JOB}-worker-0", "Progress") and "Stalled" in reasons(d)
    else:
        assert (lf.rank, lf.pod, lf.detected_by) == (1, f"{JOB}-worker-1", "Process"), lf
        assert "Stalled" not in reasons(d)


# -- 4. no false alarms ---------------------------------------------------------------------------------------


def test_an_etcd_outage_is_a_condition_not_a_phase_change() -> None:
    st = reconcile(observe(job(status(Phase.RUNNING, position=AT_START)), PODS, both(1, 0, 50, epoch=7))).status
    d = reconcile(observe(job(st), PODS, EtcdView(reachable=False)))
    assert d.status.phase == Phase.RUNNING and "PhaseRestarting" not in reasons(d)
    degraded = condition(d.status, "CoordinationDegraded")
    assert degraded is not None and degraded.status == ConditionStatus.TRUE and degraded.reason == "EtcdUnreachable"
    d = reconcile(observe(job(d.status), PODS, both(1, 0, 60, epoch=7)))
    degraded = condition(d.status, "CoordinationDegraded")
    assert degraded is not None and degraded.status == ConditionStatus.FALSE
    assert d.status.phase == Phase.RUNNING and d.status.restarts == RestartCounts()


def test_a_finished_member_is_not_lost() -> None:
    st = status(Phase.RUNNING, position=AT_START, tracked_pods=[f"{JOB}-worker-0", f"{JOB}-worker-1"])
    pods = [pod("worker-0", "Succeeded", exit_code=0), pod("worker-1")]
    d = reconcile(observe(job(st), pods, both(1, 0, 100, epoch=7)))
    assert d.status.phase == Phase.RUNNING and "PhaseRestarting" not in reasons(d)
    assert d.status.last_failure is None


def test_start_up_does_not_flip_to_restarting() -> None:
    # The agents last reported before the round was sealed (epoch 0, joining).
    joining = etcd("worker-0", "worker-1", progress=(progress("worker-0", epoch=0, state="joining"),
                                                     progress("worker-1", epoch=0, state="joining")))
    d = reconcile(observe(job(status(Phase.STARTING)), PODS, joining))
    assert d.status.phase == Phase.STARTING and "PhaseRestarting" not in reasons(d)


# -- 5. small lies ----------------------------------------------------------------------------------------------


def test_restarts_column_is_zero_not_blank() -> None:
    d = reconcile(observe(job(), []))
    (patch,) = of(d, PatchStatus)
    assert patch.status.total_restarts == 0 and patch.status.to_wire()["totalRestarts"] == 0


def test_ready_replicas_follow_the_pods_after_success() -> None:
    st = status(Phase.RUNNING, position=AT_START, ready_replicas=2, replicas=2)
    done = [pod("worker-0", "Succeeded", exit_code=0), pod("worker-1", "Succeeded", exit_code=0)]
    d = reconcile(observe(job(st), done, both(1, 0, 100, epoch=7)))
    assert d.status.phase == Phase.SUCCEEDED and d.status.ready_replicas == 0 and d.status.replicas == 2


def test_silence_during_an_etcd_outage_is_no_stall() -> None:
    st = reconcile(observe(job(status(Phase.RUNNING, position=AT_START)), PODS, both(1, 0, 50, epoch=7))).status
    # etcd is away for 90s (longer than the soft timeout): the agents cannot write either.
    st = reconcile(observe(job(st), PODS, EtcdView(reachable=False), now=NOW + 90)).status
    # Back: the agents' last reports are 90s old, their next writes a moment away. Not a stall...
    stale = both(1, 0, 50, epoch=7)
    d = reconcile(observe(job(st), PODS, stale, now=NOW + 91))
    d = reconcile(observe(job(d.status), PODS, stale, now=NOW + 92))
    assert d.status.phase == Phase.RUNNING and condition(d.status, "Stalled") is None
    # ... unless they stay silent for the soft timeout after etcd is back.
    d = reconcile(observe(job(d.status), PODS, stale, now=NOW + 91 + 61))
    stalled = condition(d.status, "Stalled")
    assert stalled is not None and stalled.status == ConditionStatus.TRUE


def test_restarts_that_ran_into_the_fault_again_count_also_when_the_job_fails() -> None:
    st = status(Phase.RUNNING, position=AT_START)
    repeats = RoundSummary(round=1, epoch=7, stepped=0, faulted=2)
    reports = etcd("worker-0", "worker-1", progress=(progress("worker-0", history=(repeats,)),))
    # The rank gave up (restarts exhausted) before the operator looked in between.
    pods = [pod("worker-0"), pod("worker-1", "Failed", exit_code=90)]
    d = reconcile(observe(job(st), pods, reports))
    assert d.status.phase == Phase.FAILED
    assert d.status.restarts == RestartCounts(in_process=2) and d.status.total_restarts == 2
