"""The status of a job with warm spares after a worker is lost, through the operator's pure core (each
decision's status is the next observation's, as the runner does): ``lastFailure`` names the lost pod, not the
survivor that noticed first; an Event says which spare took which ranks in which round; the recovery counts
as in process when every node kept its processes."""

from __future__ import annotations

from opbuild import JOB, NOW, job, manifest, observe, of, pod, progress, rank_report, status

from stalwart.api.job_record import JobRecord
from stalwart.api.restart import FaultRecord, ProgressRecord, RoundSummary
from stalwart.api.status import Phase, Position, RestartCounts
from stalwart.operator.failures import Fact
from stalwart.operator.incidents import lost_members
from stalwart.operator.model import EmitEvent, EtcdView
from stalwart.operator.reconcile import reconcile
from stalwart.operator.takeover import REASON_SPARE_TOOK_OVER, takeovers

W0, W1, S0, S1 = (f"{JOB}-{n}" for n in ("worker-0", "worker-1", "spare-0", "spare-1"))
WARM = {"spares": 1, "restartPolicy": {"inProcess": {"warmSpares": True}}}


def record(spares: tuple[str, ...] = (S0,)) -> JobRecord:
    return JobRecord(job_name=JOB, namespace="ns", uid="uid-1", members=[W0, W1], spares=list(spares), min_nodes=2,
                     max_nodes=2, nproc_per_node=1, join_timeout_seconds=600, last_call_seconds=1,
                     leaseTTLSeconds=10, max_restarts=10, soft_timeout_seconds=60, hard_timeout_seconds=90,
                     barrier_timeout_seconds=120, warm_spares=True, backoff_limit=5)


R1 = RoundSummary(round=1, epoch=7, stepped=0)


def node(name: str, slot: int, *, round_: int, epoch: int, step: int | None, history: tuple[RoundSummary, ...]) \
        -> ProgressRecord:
    return progress(name, epoch=epoch, round_=round_, step=step, history=history,
                    ranks=(rank_report(slot, step=step, first_step=step),))


def test_a_force_deleted_worker_is_the_last_failure_and_a_warm_spare_takes_its_rank_in_process() -> None:
    survivor_error = FaultRecord(slot=0, rank=0, node_id=W0, iteration=0, kind="exception",
                                 reason="RuntimeError('Connection closed by peer')", time=NOW - 0.5)
    st = status(Phase.RUNNING, position=Position(round=1, iteration=0), round=1, world_size=2,
                tracked_pods=sorted([W0, W1, S0]))
    pods = [pod("worker-0"), pod("worker-1"), pod("spare-0")]
    # 1. The survivor's collective broke: its error is the first thing the operator sees.
    round1 = EtcdView(manifest=manifest("worker-0", "worker-1"), epoch=7, record=record(),
                      faults=((100, survivor_error),),
                      progress=(node("worker-0", 0, round_=1, epoch=7, step=50, history=(R1,)),
                                node("worker-1", 1, round_=1, epoch=7, step=50, history=(R1,))))
    d1 = reconcile(observe(job(st, **WARM), pods, round1))
    assert d1.status.phase == Phase.RESTARTING and d1.status.last_failure is not None
    # Its error is about its peer, and W1 is its only one: W1 is named at once, the survivor's error is detail
    # (issue 37: the survivor used to be named until the loss was confirmed).
    lf = d1.status.last_failure
    assert (lf.pod, lf.rank, lf.reason, lf.detected_by) == (W1, 1, "PeerLost", "Peer"), lf
    assert [(s.pod, s.reason) for s in lf.secondary or []] == [(W0, "Exception")]
    assert [e.message for e in of(d1, EmitEvent) if e.reason == "Fault"] == [
        f"PeerLost on rank 1, pod {W1}: the only peer of rank 0 on pod {W0}, pod {W1}, closed its connections: "
        "Connection closed by peer"]
    # 2. Then: the worker is gone from the API (force-deleted), and the spare already took its rank in round 2
    # (the lost pod's agent left the rendezvous on its way out, before the operator saw the pod go).
    kept2 = RoundSummary(round=2, epoch=9, kept=True)
    round2 = EtcdView(manifest=manifest("worker-0", "spare-0", round_=2), epoch=9, record=record(),
                      progress=(node("worker-0", 0, round_=2, epoch=9, step=None, history=(R1, kept2)),
                                node("worker-1", 1, round_=1, epoch=7, step=50, history=(R1,)),
                                node("spare-0", 1, round_=2, epoch=9, step=None, history=(kept2,))))
    d2 = reconcile(observe(job(d1.status, **WARM), [pod("worker-0"), pod("spare-0")], round2))
    lf = d2.status.last_failure
    assert lf is not None and (lf.pod, lf.reason, lf.detected_by) == (W1, "PodLost", "Pod"), lf
    assert (lf.round, lf.iteration) == (1, 0)
    assert lf.secondary is not None and any(s.pod == W0 for s in lf.secondary)  # the survivor's error, as detail
    took = [e.message for e in of(d2, EmitEvent) if e.reason == REASON_SPARE_TOOK_OVER]
    assert took == [f"spare pod {S0} took rank 1 of world size 2 in round 2, replacing pod {W1} (PodLost), in process "
                    "(its parked processes were already running)"]
    assert d2.status.restarts is not None and d2.status.restarts.pod_replacements == 1
    # 3. Round 2 steps: recovered in process (every node kept its processes), counted once.
    stepped2 = RoundSummary(round=2, epoch=9, stepped=0, kept=True)
    stepping2 = EtcdView(manifest=manifest("worker-0", "spare-0", round_=2), epoch=9, record=record((S0, S1)),
                         progress=(node("worker-0", 0, round_=2, epoch=9, step=51, history=(R1, stepped2)),
                                   node("worker-1", 1, round_=1, epoch=7, step=50, history=(R1,)),
                                   node("spare-0", 1, round_=2, epoch=9, step=51, history=(stepped2,))))
    pods3 = [pod("worker-0"), pod("spare-0"), pod("spare-1")]
    d3 = reconcile(observe(job(d2.status, **WARM), pods3, stepping2))
    assert d3.status.phase == Phase.RUNNING
    assert d3.status.restarts == RestartCounts(in_process=1, process_restarts=0, pod_replacements=1)
    assert d3.status.last_failure is not None and d3.status.last_failure.pod == W1
    reasons = [e.reason for e in of(d3, EmitEvent)]
    assert "RestartedInProcess" in reasons and REASON_SPARE_TOOK_OVER not in reasons  # announced once
    again = reconcile(observe(job(d3.status, **WARM), pods3, stepping2))
    assert again.status.restarts == d3.status.restarts


def fact(pod_: str) -> Fact:
    return Fact("Pod", "PodLost", NOW, pod=pod_, message="gone")


def test_lost_members() -> None:
    history = (progress("worker-1", round_=1, history=(RoundSummary(round=1, epoch=7, stepped=3, faulted=4),)),
               progress("worker-2", round_=1, history=(RoundSummary(round=1, epoch=7, stepped=1),)),
               progress("spare-0", round_=0, epoch=0))
    facts = [fact(f"{JOB}-worker-1"), fact(f"{JOB}-spare-0"), fact(f"{JOB}-spare-9")]
    # Round 2 replaced worker-1 (it last ran iteration 4 of round 1); the spares never trained.
    gone, side = lost_members(facts, history, 2, Position(round=1, iteration=3))
    assert [(f.pod, f.position) for f in gone] == [(f"{JOB}-worker-1", Position(round=1, iteration=4))]
    assert [f.pod for f in side] == [f"{JOB}-spare-0", f"{JOB}-spare-9"]
    # Training counted past round 1 already: old news, not a new fault.
    gone, side = lost_members(facts, history, 2, Position(round=2, iteration=0))
    assert gone == [] and len(side) == 3
    # Still round 1 (the pod is no member only because it is a spare): nothing moves.
    gone, _ = lost_members(facts, history, 1, Position(round=1, iteration=0))
    assert gone == []


def test_takeovers() -> None:
    m2 = manifest("worker-0", "spare-0", round_=2, nproc=2)
    spare_history = progress("spare-0", round_=2, history=(RoundSummary(round=2, epoch=9, kept=True),))
    lost = status(Phase.RESTARTING).last_failure
    assert takeovers(1, m2, record(), (spare_history,), lost, warm=False) == [
        (S0, f"spare pod {S0} took ranks 2-3 of world size 4 in round 2, with processes started now")]
    # Announced already (its first round was superseded before it wrote a record of it): not again.
    assert takeovers(1, m2, record(), (), lost, warm=True, announced=[S0]) == []
    # Not a new round, the first round, or a spare that was a member of an earlier round already: no Event.
    assert takeovers(2, m2, record(), (), lost, warm=True) == []
    assert takeovers(None, m2, record(), (), lost, warm=True) == []
    promoted_before = progress("spare-0", round_=2, history=(RoundSummary(round=1, epoch=7),))
    assert takeovers(1, m2, record(), (promoted_before,), lost, warm=True) == []
    # A new round of workers only.
    assert takeovers(1, manifest("worker-0", "worker-1", round_=2), record(), (), lost, warm=True) == []
