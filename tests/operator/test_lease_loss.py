"""A member whose agent's lease ran out while its pod ran on (a node cut off from etcd, or whose keep-alives came
too late) and which came back before the operator counted it lost: the round's manifest lists it as lost, and
``lastFailure`` names it. The pure facts as a table, then through the operator's pure core (each decision's
status is the next observation's, as the runner does)."""

from __future__ import annotations

import pytest
from opbuild import JOB, NOW, job, manifest, observe, pod, progress, rank_report, status

from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import FaultRecord, ProgressRecord, RoundSummary
from stalwart.api.status import Phase, Position, RestartCounts
from stalwart.operator.lease_loss import lease_facts
from stalwart.operator.model import EtcdView
from stalwart.operator.reconcile import reconcile

W0, W1, S0, S1 = (f"{JOB}-{n}" for n in ("worker-0", "worker-1", "spare-0", "spare-1"))
WARM = {"spares": 1, "restartPolicy": {"inProcess": {"warmSpares": True}}}
R1 = RoundSummary(round=1, epoch=7, stepped=0)


def lost(m: Manifest, *pods: str, spares: tuple[str, ...] = ()) -> Manifest:
    return m.model_copy(update={"lost": list(pods), "spares": list(spares)})


ROUND2 = manifest("worker-0", "spare-0", round_=2)
BACK = manifest("worker-0", "worker-1", round_=2)


@pytest.mark.parametrize(("m", "live", "expected"), [
    (None, {W1}, []),  # no round yet
    (manifest("worker-0", "worker-1"), {W1}, []),  # the first round lost no one
    (lost(ROUND2, W1), {W0, W1, S0}, [(W1, NOW - 3, "round 2 went on without it")]),
    (lost(ROUND2, W1, spares=(W1,)), {W0, W1, S0}, [(W1, NOW - 3, "waits as a spare of round 2")]),
    (lost(BACK, W1), {W0, W1}, [(W1, NOW - 3, "is a member of round 2")]),  # back and registered before the seal
    (lost(ROUND2, W1), {W0, S0}, []),  # deleted (a scale-down) or gone: the operator counts it already
    (lost(ROUND2, f"{JOB}-worker-7"), {W0, S0, f"{JOB}-worker-7"}, [(f"{JOB}-worker-7", NOW, "went on")]),
])
def test_lease_facts(m: Manifest | None, live: set[str], expected: list[tuple[str, float, str]]) -> None:
    reports = (progress("worker-0"), progress("worker-1", updated=NOW - 3))
    facts = lease_facts(m, reports, live, NOW)
    assert [(f.pod, f.time) for f in facts] == [(p, t) for p, t, _ in expected]
    for f, (_, _, said) in zip(facts, expected, strict=True):
        assert (f.detected_by, f.reason, f.position) == ("Heartbeat", "PeerLost", None)
        assert "lease ran out" in f.message and said in f.message, f.message


def record(spares: tuple[str, ...] = (S0,)) -> JobRecord:
    return JobRecord(job_name=JOB, namespace="ns", uid="uid-1", members=[W0, W1], spares=list(spares), min_nodes=2,
                     max_nodes=2, nproc_per_node=1, join_timeout_seconds=600, last_call_seconds=1,
                     leaseTTLSeconds=4, max_restarts=10, soft_timeout_seconds=60, hard_timeout_seconds=90,
                     barrier_timeout_seconds=120, warm_spares=True, backoff_limit=5)


def node(name: str, slot: int, *, round_: int, epoch: int, step: int | None, history: tuple[RoundSummary, ...],
         updated: float = NOW) -> ProgressRecord:
    return progress(name, epoch=epoch, round_=round_, step=step, history=history, updated=updated,
                    ranks=(rank_report(slot, step=step, first_step=step),))


@pytest.mark.parametrize("deleting", [False, True])
def test_a_member_whose_lease_ran_out_and_came_back_is_the_last_failure(deleting: bool) -> None:
    """Round 2 went on with the spare after worker-1's lease ran out; its pod runs on (the API never lost it).
    It is the job's last failure, the recovery counts once, in process, and a later fault of round 2 is not
    replaced by it. A worker being deleted is named by the operator's own fact, not by its lease."""
    st = status(Phase.RUNNING, position=Position(round=1, iteration=0), round=1, world_size=2,
                tracked_pods=sorted([W0, W1, S0]))
    worker1 = pod("worker-1", deleting_since=NOW - 1) if deleting else pod("worker-1")
    pods = [pod("worker-0"), worker1, pod("spare-0")]
    kept2 = RoundSummary(round=2, epoch=9, kept=True)
    silent = node("worker-1", 1, round_=1, epoch=7, step=50, history=(R1,), updated=NOW - 5)
    round2 = EtcdView(manifest=lost(ROUND2, W1), epoch=9, record=record(),
                      progress=(node("worker-0", 0, round_=2, epoch=9, step=None, history=(R1, kept2)), silent,
                                node("spare-0", 1, round_=2, epoch=9, step=None, history=(kept2,))))
    d1 = reconcile(observe(job(st, **WARM), pods, round2))
    lf = d1.status.last_failure
    if deleting:  # the operator's own record of it stands: no lease fact of a pod it saw deleted
        assert lf is not None and (lf.pod, lf.detected_by) == (W1, "Pod"), lf
        return
    assert d1.status.phase == Phase.RESTARTING
    assert lf is not None and (lf.pod, lf.reason, lf.detected_by) == (W1, "PeerLost", "Heartbeat"), lf
    assert (lf.round, lf.iteration) == (1, 0) and lf.time is not None and lf.time.timestamp() == NOW - 5
    # Round 2 steps: recovered in process (the survivor and the spare kept their processes), counted once.
    stepped2 = RoundSummary(round=2, epoch=9, stepped=0, kept=True)
    back = node("worker-1", 0, round_=0, epoch=0, step=None, history=())  # registered again, waiting
    stepping2 = EtcdView(manifest=lost(ROUND2, W1), epoch=9, record=record(),
                         progress=(node("worker-0", 0, round_=2, epoch=9, step=51, history=(R1, stepped2)), back,
                                   node("spare-0", 1, round_=2, epoch=9, step=51, history=(stepped2,))))
    d2 = reconcile(observe(job(d1.status, **WARM), pods, stepping2))
    assert d2.status.phase == Phase.RUNNING
    assert d2.status.restarts == RestartCounts(in_process=1, process_restarts=0, pod_replacements=0)
    assert d2.status.last_failure is not None and d2.status.last_failure.pod == W1
    again = reconcile(observe(job(d2.status, **WARM), pods, stepping2))
    assert again.status.restarts == d2.status.restarts and again.status.last_failure == d2.status.last_failure
    # A rank of round 2 raises later: that is the last failure, and stays so after its recovery.
    boom = FaultRecord(slot=1, rank=1, node_id=S0, iteration=0, kind="exception", reason="ValueError('boom')",
                       time=NOW + 1)
    faulted = EtcdView(manifest=lost(ROUND2, W1), epoch=9, record=record(), faults=((200, boom),),
                       progress=stepping2.progress)
    d3 = reconcile(observe(job(again.status, **WARM), pods, faulted, now=NOW + 2))
    lf3 = d3.status.last_failure
    assert lf3 is not None and (lf3.pod, lf3.reason) == (S0, "Exception"), lf3
    it1 = RoundSummary(round=2, epoch=9, stepped=1, kept=True)
    recovered = EtcdView(manifest=lost(ROUND2, W1), epoch=9, record=record(), faults=((200, boom),),
                         progress=(node("worker-0", 0, round_=2, epoch=9, step=60, history=(R1, it1)), back,
                                   node("spare-0", 1, round_=2, epoch=9, step=60, history=(it1,))))
    d4 = reconcile(observe(job(d3.status, **WARM), pods, recovered, now=NOW + 3))
    assert d4.status.last_failure is not None and d4.status.last_failure.pod == S0, d4.status.last_failure
    assert d4.status.restarts is not None and d4.status.restarts.in_process == 2
