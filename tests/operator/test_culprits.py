"""Whom a survivor's collective error is about (the pure :mod:`stalwart.operator.culprits`), and the incident it
opens through the reconcile: the lost peer is named from the first report, the confirmation of the loss updates
the same incident (one Fault, one count), and the Event of the spare that took over names the lost pod."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opbuild import JOB, NOW, etcd, job, manifest, observe, of, pod, progress, rank_report, status

from stalwart.api.job_record import JobRecord
from stalwart.api.restart import FaultRecord, RoundSummary
from stalwart.api.status import Phase, Position, RestartCounts
from stalwart.operator.culprits import PEER_SILENT_SECONDS, Peer, at_address, link_facts, peer_facts, silent_limit
from stalwart.operator.failures import Fact, compose
from stalwart.operator.model import Decision, EmitEvent, EtcdView
from stalwart.operator.reconcile import reconcile
from stalwart.operator.takeover import REASON_SPARE_TOOK_OVER

T = 1_800_000_000.0
AT = Position(round=2, iteration=3)
CLOSED = "[pair.cc:553] Connection closed by peer [127.0.0.1]:33515. This is typically caused by a remote worker"


def symptom(message: str, *, pod: str = "p0", rank: int = 0, reason: str = "Exception") -> Fact:
    return Fact("Rank", reason, T, AT, 10, rank, pod, rank, message, "RuntimeError", symptom=True)


def peer(name: str, *, rank: int, progress: float | None = T - 1, **kw: object) -> Peer:
    return Peer(name, node=f"n-{name}", ip=f"10.0.0.{rank}", ranks=((rank, progress),), **kw)  # type: ignore[arg-type]


TWO = [peer("p0", rank=0), peer("p1", rank=1)]
THREE = [*TWO, peer("p2", rank=2)]


@pytest.mark.parametrize(("nodes", "soft_timeout", "limit"), [
    (2, 60.0, PEER_SILENT_SECONDS),  # agents that report every second: the limit as it always was
    (256, 60.0, PEER_SILENT_SECONDS),
    (512, 60.0, PEER_SILENT_SECONDS + 1.0),  # every 2 s: one second more
    (2048, 60.0, PEER_SILENT_SECONDS + 4.0),  # every 5 s (the longest)
    (2048, 6.0, PEER_SILENT_SECONDS + 1.0),  # every 2 s: a third of the soft timeout
    (0, 60.0, PEER_SILENT_SECONDS),  # no round known
])
def test_a_members_agent_counts_as_gone_after_its_rounds_interval_and_the_same_margin(
        nodes: int, soft_timeout: float, limit: float) -> None:
    assert silent_limit(nodes, soft_timeout) == pytest.approx(limit)


@pytest.mark.parametrize(("facts", "peers", "expected"), [
    # Gloo's closed connection in a two-pod world: the only peer, from the first report.
    ([symptom(CLOSED)], TWO, ("p1", 1, "PeerLost")),
    # Three pods, nothing known yet about either peer: nobody is blamed (the survivor's record stands).
    ([symptom(CLOSED)], THREE, None),
    # ... until one of them is seen lost: its node unreachable, the pod gone, or its agent silent.
    ([symptom(CLOSED)], [*TWO, peer("p2", rank=2, unreachable=True)], ("p2", 2, "NodeLost")),
    ([symptom(CLOSED)], [*TWO, peer("p2", rank=2, gone=True)], ("p2", 2, "PeerLost")),
    ([symptom(CLOSED)], [peer("p0", rank=0), peer("p1", rank=1, silent_for=1.0),
                         peer("p2", rank=2, silent_for=PEER_SILENT_SECONDS + 1)], ("p2", 2, "PeerLost")),
    # In a round of 2,048 pods an agent writes every 5 s (stalwart.api.pacing): silent for 6 s it is not lost...
    ([symptom(CLOSED)], [peer("p0", rank=0), peer("p1", rank=1),
                         peer("p2", rank=2, silent_for=6.0, silent_limit=silent_limit(2048, 60.0))], None),
    # ... silent past its interval and the same margin it is.
    ([symptom(CLOSED)], [peer("p0", rank=0), peer("p1", rank=1),
                         peer("p2", rank=2, silent_for=9.0, silent_limit=silent_limit(2048, 60.0))],
     ("p2", 2, "PeerLost")),
    # The error names its peer by address (a pod IP): that one, whatever else is known.
    ([symptom("Read error [10.0.0.2]:4242: Connection reset by peer")], THREE, ("p2", 2, "PeerLost")),
    # A timeout: the rank that stopped progressing first, when it is not the survivor.
    ([symptom("no progress for 5.1s (soft timeout 5s)", reason="Hang")],
     [peer("p0", rank=0, progress=T - 5), peer("p1", rank=1, progress=T - 5.3)], ("p1", 1, "Hang")),
    # ... and none when the survivor stopped first: it hung itself, and its record stands.
    ([symptom("no progress for 5.1s (soft timeout 5s)", reason="Hang")],
     [peer("p0", rank=0, progress=T - 5.3), peer("p1", rank=1, progress=T - 5)], None),
    # A timeout in a two-pod world with nothing known of the progress: no guess.
    ([symptom("no progress for 5.1s (soft timeout 5s)", reason="Hang")],
     [peer("p0", rank=0, progress=None), peer("p1", rank=1, progress=None)], None),
    # Someone spoke for itself at that position (an exception of its own): no suspicion needed.
    ([symptom(CLOSED), Fact("Rank", "Exception", T, AT, 9, 1, "p1", 1, "boom", "DrillFault")], TWO, None),
    # A lost heartbeat is the Heartbeat fact's to tell.
    ([symptom("the heartbeat lease of slot 1 ended", reason="PeerLost")], TWO, None),
], ids=["only-peer", "three-unknown", "unreachable", "gone", "silent", "paced-not-silent", "paced-silent", "address",
        "stopped-first",
        "survivor-stopped-first", "timeout-unknown", "spoke-for-itself", "heartbeat"])
def test_the_peer_a_symptom_points_at(facts: list[Fact], peers: list[Peer],
                                      expected: tuple[str, int, str] | None) -> None:
    out = peer_facts(facts, peers)
    if expected is None:
        assert out == []
        return
    (fact,) = out
    assert (fact.pod, fact.rank, fact.reason, fact.detected_by) == (*expected, "Peer")
    assert fact.position == AT and f"n-{expected[0]}" in fact.message  # the message names the peer's node
    record = compose([*facts, *out])
    assert record is not None and (record.pod, record.reason) == (expected[0], expected[2])
    assert record.secondary is not None and [s.pod for s in record.secondary] == ["p0"]  # the survivor's error


# -- a link that carries nothing ------------------------------------------------------------------------------

STALL = "no progress for 4.1s (soft timeout 4.0s)"


def hang(pod: str, rank: int, order: int, *unreachable: str) -> Fact:
    return Fact("Rank", "Hang", T, AT, order, rank, pod, rank, STALL, None, symptom=True,
                unreachable=tuple(unreachable))


@pytest.mark.parametrize(("facts", "expected"), [
    # One end saw its sends to the other's pod IP retransmitted unacknowledged: the link between them.
    ([hang("p0", 0, 10, "10.0.0.1:4242")], ("p0", "p1")),
    # Both ends report; the first record is the culprit, and the other end's record names it: the same link.
    ([hang("p0", 0, 10), hang("p1", 1, 11, "10.0.0.0:5151")], ("p0", "p1")),
    ([hang("p1", 1, 10, "10.0.0.0:5151"), hang("p0", 0, 11, "10.0.0.1:4242")], ("p1", "p0")),
    # An address that is no member's (or the reporter's own) says nothing about a link.
    ([hang("p0", 0, 10, "10.9.9.9:4242")], ("p0", None)),
    ([hang("p0", 0, 10, "10.0.0.0:4242")], ("p0", None)),
    # No bytes left unacknowledged: a hang as before.
    ([hang("p0", 0, 10)], ("p0", None)),
], ids=["one-end", "other-end-names-it", "reversed", "no-member", "own-address", "no-link"])
def test_a_hang_on_a_link_that_carries_nothing_names_both_ends(facts: list[Fact],
                                                              expected: tuple[str, str | None]) -> None:
    linked = link_facts(facts, TWO)
    record = compose([*linked, *peer_facts(linked, TWO)])
    assert record is not None and (record.pod, record.peer) == expected, record
    assert record.reason == "Hang"
    if expected[1] is not None:
        assert f"the link between pod {min(expected)} and {max(expected)}" in (record.message or "") or \
            f"the link between pod {max(expected)} and {min(expected)}" in (record.message or ""), record.message


ON_NODES = [peer("p0", rank=0, host_ip="10.0.1.1"), peer("p1", rank=1, host_ip="10.0.2.1"),
            peer("p2", rank=2, host_ip="10.0.2.1")]


@pytest.mark.parametrize(("address", "expected"), [
    ("10.0.0.1", "p1"),  # its pod IP
    ("10.0.1.1", "p0"),  # its node's address, and the only member pod on that node
    ("10.0.2.1", None),  # a node two member pods share: the address does not say which
    ("10.9.9.9", None),  # no member's
], ids=["pod-ip", "node-of-one", "node-of-two", "foreign"])
def test_an_address_names_the_pod_with_it_else_the_only_member_pod_on_its_node(address: str,
                                                                                expected: str | None) -> None:
    hit = at_address(address, ON_NODES)
    assert (hit.pod if hit else None) == expected


def test_bytes_to_the_node_address_of_a_peer_name_the_link_to_it() -> None:
    # The accepting end of a connection from a pod that shares its node's network namespace sees the node's
    # address: on node n-p1, p1 is the only member, so the link is to p1.
    peers = [peer("p0", rank=0, host_ip="10.0.1.1"), peer("p1", rank=1, host_ip="10.0.2.1")]
    linked = link_facts([hang("p0", 0, 10, "10.0.2.1:54346")], peers)
    assert [(f.pod, f.peer) for f in linked] == [("p0", "p1")]
    # A gloo error naming the peer's node address points at that pod too.
    suspects = peer_facts([symptom("Connection reset by peer [10.0.2.1]:54346")], [*peers, peer("p2", rank=2)])
    assert [f.pod for f in suspects] == ["p1"]


def test_a_link_down_blames_no_peer_that_stopped_first() -> None:
    # Without the link, p1 stopping first would be blamed for p0's timeout (a Peer fact outranks the Rank's).
    peers = [peer("p0", rank=0, progress=T - 5), peer("p1", rank=1, progress=T - 5.3)]
    plain = [hang("p0", 0, 10)]
    assert [f.pod for f in peer_facts(plain, peers)] == ["p1"]
    linked = link_facts([hang("p0", 0, 10), hang("p1", 1, 11, "10.0.0.0:5151")], peers)
    assert peer_facts(linked, peers) == []


# -- through the reconcile ----------------------------------------------------------------------------------

W0, W1, S0 = (f"{JOB}-{n}" for n in ("worker-0", "worker-1", "spare-0"))
R1 = RoundSummary(round=1, epoch=7, stepped=0)


def job_record() -> JobRecord:
    return JobRecord(job_name=JOB, namespace="ns", uid="uid-1", members=[W0, W1], spares=[S0], min_nodes=2,
                     max_nodes=2, nproc_per_node=1, join_timeout_seconds=600, last_call_seconds=1,
                     leaseTTLSeconds=10, max_restarts=10, soft_timeout_seconds=60, hard_timeout_seconds=90,
                     barrier_timeout_seconds=120, backoff_limit=5)


def linked_reconcile(*faults: FaultRecord) -> Decision:
    """One reconcile of a running job of two workers (pod IPs 10.1.0.1 and .2, on nodes with addresses 10.1.10.1
    and 10.1.11.1, both leases alive) and a spare,
    with ``faults`` written in round 1 in that order."""
    st = status(Phase.RUNNING, position=Position(round=1, iteration=0), round=1, world_size=2,
                tracked_pods=sorted([W0, W1, S0]))
    pods = [pod("worker-0", node="n0", ip="10.1.0.1", host_ip="10.1.10.1"),
            pod("worker-1", node="n1", ip="10.1.0.2", host_ip="10.1.11.1"),
            pod("spare-0", node="n2", ip="10.1.0.3", host_ip="10.1.12.1")]
    records = (progress("worker-0", step=50, history=(R1,), ranks=(rank_report(0, step=50, first_step=0),)),
               progress("worker-1", step=50, history=(R1,), ranks=(rank_report(1, step=50, first_step=0),)))
    view = replace(etcd("worker-0", "worker-1", faults=tuple(enumerate(faults, 100)), progress=records,
                        leases={"worker-0": 9, "worker-1": 9}), record=job_record())
    return reconcile(observe(job(st, spares=1), pods, view))


def test_a_link_cut_between_two_live_pods_is_the_status_failure_with_both_ends() -> None:
    # Both agents report and both leases live (a cut from one peer only): the soft-timeout record of worker-0
    # names worker-1's pod IP as unreachable.
    stall = FaultRecord(slot=0, rank=0, node_id=W0, iteration=0, kind="soft_timeout", time=NOW - 0.5,
                        reason=f"{STALL}; bytes sent to 10.1.0.2:40001 are retransmitted unacknowledged",
                        unreachable=["10.1.0.2:40001"])
    d = linked_reconcile(stall)
    lf = d.status.last_failure
    assert lf is not None and (lf.pod, lf.peer, lf.reason, lf.detected_by) == (W0, W1, "Hang", "Rank"), lf
    assert f"the link between pod {W0} and {W1} carries nothing" in (lf.message or "")
    faults = [e.message for e in of(d, EmitEvent) if e.reason == "Fault"]
    assert len(faults) == 1 and f"link to pod {W1}" in faults[0], faults
    assert d.status.restarts == RestartCounts()  # nobody was fenced or replaced for it


@pytest.mark.parametrize("address", ["10.1.0.1:40001", "10.1.10.1:54346"], ids=["pod-ip", "node-address"])
def test_the_end_a_hang_interrupted_names_the_link_when_the_reporter_saw_nothing_in_flight(address: str) -> None:
    # worker-0's soft timeout fired first, with every byte it sent acknowledged (it was waiting to receive); the
    # interrupt found worker-1's bytes to worker-0 retransmitted unacknowledged: its link_down record says so.
    # Where worker-0 made the connection, worker-1 sees it from worker-0's node's address.
    stall = FaultRecord(slot=0, rank=0, node_id=W0, iteration=0, kind="soft_timeout", time=NOW - 0.5,
                        reason=STALL)
    other_end = FaultRecord(slot=1, rank=1, node_id=W1, iteration=0, kind="link_down", time=NOW - 0.4,
                            reason=f"interrupted by the hang of slot 0 (rank 0); bytes sent to {address} are "
                                   "retransmitted unacknowledged: the link to it carries nothing",
                            unreachable=[address])
    alone = linked_reconcile(stall).status.last_failure  # without the other end's word: a hang of worker-0, no link
    assert alone is not None and (alone.pod, alone.peer, alone.reason) == (W0, None, "Hang"), alone
    lf = linked_reconcile(stall, other_end).status.last_failure
    assert lf is not None and (lf.pod, lf.peer, lf.reason, lf.detected_by) == (W0, W1, "Hang", "Rank"), lf
    assert [(s.pod, s.reason) for s in lf.secondary or []] == [(W1, "Hang")], lf.secondary


def test_a_lost_node_is_named_from_the_first_report_and_its_confirmation_updates_the_same_incident() -> None:
    survivor = FaultRecord(slot=0, rank=0, node_id=W0, iteration=0, kind="exception", exception="RuntimeError",
                           message=CLOSED, reason=f"RuntimeError('{CLOSED}')", time=NOW - 0.2)
    st = status(Phase.RUNNING, position=Position(round=1, iteration=0), round=1, world_size=2,
                tracked_pods=sorted([W0, W1, S0]))
    pods = [pod("worker-0", node="n0"), pod("worker-1", node="n1"), pod("spare-0", node="n2")]
    records = (progress("worker-0", step=50, history=(R1,), ranks=(rank_report(0, step=50, first_step=0),)),
               progress("worker-1", step=50, history=(R1,), updated=NOW - 0.3,
                        ranks=(rank_report(1, step=50, first_step=0),)))
    round1 = replace(etcd("worker-0", "worker-1", faults=((100, survivor),), progress=records,
                          leases={"worker-1": 9}), record=job_record())
    # 1. The survivor's error is the first word: the lost pod is named at once, with its node.
    d1 = reconcile(observe(job(st, spares=1), pods, round1))
    lf = d1.status.last_failure
    assert lf is not None and (lf.pod, lf.rank, lf.reason) == (W1, 1, "PeerLost") and "node n1" in (lf.message or "")
    assert [(s.pod, s.reason) for s in lf.secondary or []] == [(W0, "Exception")]
    assert [e.reason for e in of(d1, EmitEvent)].count("Fault") == 1
    # 2. Three seconds on its node is unreachable: the same incident, now NodeLost from the pod; no second Fault.
    # The pod is fenced, force-deleted and replaced (one replacement).
    d2 = reconcile(replace(observe(job(d1.status, spares=1), pods, round1, now=NOW + 3),
                           unreachable_nodes=frozenset({"n1"})))
    lf = d2.status.last_failure
    assert lf is not None and (lf.pod, lf.reason, lf.detected_by) == (W1, "NodeLost", "Pod"), lf
    assert [(s.pod, s.reason) for s in lf.secondary or []] == [(W0, "Exception")]
    assert "Fault" not in [e.reason for e in of(d2, EmitEvent)]
    assert d2.status.restarts == RestartCounts(pod_replacements=1)
    # 3. The spare takes over in round 2: its Event names the lost pod. Round 2 steps: one recovery, counted once.
    r2 = RoundSummary(round=2, epoch=9, stepped=0)
    round2 = EtcdView(manifest=manifest("worker-0", "spare-0", round_=2), epoch=9, record=job_record(),
                      progress=(progress("worker-0", epoch=9, round_=2, step=60, history=(R1, r2),
                                         ranks=(rank_report(0, step=60, first_step=51),)),
                                progress("spare-0", epoch=9, round_=2, step=60, history=(r2,),
                                         ranks=(rank_report(1, step=60, first_step=51),))))
    pods3 = [pod("worker-0", node="n0"), pod("spare-0", node="n2"), pod("spare-1", node="n0")]
    d3 = reconcile(observe(job(d2.status, spares=1), pods3, round2, now=NOW + 10))
    took = [e.message for e in of(d3, EmitEvent) if e.reason == REASON_SPARE_TOOK_OVER]
    assert len(took) == 1 and f"replacing pod {W1} (NodeLost)" in took[0], took
    assert d3.status.phase == Phase.RUNNING
    assert d3.status.restarts == RestartCounts(process_restarts=1, pod_replacements=1)
    assert d3.status.last_failure is not None and d3.status.last_failure.pod == W1
