"""Lost nodes and lost agents in the operator's pure core: what a real cluster shows of them (a Running pod with
Ready=False on a node whose Ready is Unknown or that is tainted unreachable; an agent whose etcd lease is gone),
and what the reconcile does about it (fence, delete without grace where no kubelet can confirm, replace)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from opbuild import JOB, NOW, etcd, job, observe, of, pod, progress, status

from stalwart.api.status import Phase
from stalwart.operator.model import (
    CreatePod,
    DeletePod,
    EmitEvent,
    EtcdView,
    Observation,
    PodView,
    RevokeLease,
    WriteFence,
)
from stalwart.operator.node_loss import AGENT_SILENT_SECONDS, lost_pods, node_unreachable, recheck_in
from stalwart.operator.observe import pod_view
from stalwart.operator.reconcile import reconcile

STARTED = NOW - 100


def on(name: str, node: str, phase: str = "Running", **kw: Any) -> PodView:
    return pod(name, phase, node=node, started_at=STARTED, **kw)


def with_nodes(obs: Observation, *unreachable: str) -> Observation:
    return replace(obs, unreachable_nodes=frozenset(unreachable))


@pytest.mark.parametrize(("node", "lost"), [
    ({"status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}}, True),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
      "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, True),
    ({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, False),
    # NotReady: its kubelet still reports (and would report the pods' end); the agents' leases cover the rest.
    ({"status": {"conditions": [{"type": "Ready", "status": "False"}]},
      "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]}}, False),
    ({"spec": {"taints": [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]}}, False),
    ({}, False),
], ids=["ready-unknown", "unreachable-taint", "ready", "not-ready", "other-taint", "no-status"])
def test_node_unreachable(node: dict[str, Any], lost: bool) -> None:
    assert node_unreachable(node) is lost


def test_pod_view_carries_the_node_and_the_start_time_and_nothing_from_ready() -> None:
    body = {"metadata": {"name": f"{JOB}-worker-0", "labels": {"stalwart.dev/role": "worker",
                                                                "stalwart.dev/index": "0"}},
            "spec": {"nodeName": "local-1", "containers": [{"name": "trainer"}]},
            "status": {"phase": "Running", "startTime": "2027-01-01T00:00:00Z",
                       "conditions": [{"type": "Ready", "status": "False"}]}}
    view = pod_view(body)
    assert view is not None and view.node == "local-1" and not view.ready and view.phase == "Running"
    assert view.started_at == pytest.approx(1798761600.0)
    assert view.uid == ""  # none in the body
    assert (view.ip, view.host_ip) == (None, None)
    body["status"].update(podIP="10.7.2.5", hostIP="10.7.2.1")  # type: ignore[attr-defined]
    assert ((v := pod_view(body)) is not None) and (v.ip, v.host_ip) == ("10.7.2.5", "10.7.2.1")
    body["metadata"]["uid"] = "u-1"
    assert (pod_view(body) or on("worker-0", "n0")).uid == "u-1"


@pytest.mark.parametrize("lease", [9, None], ids=["lease-held", "lease-already-expired"])
def test_a_lost_pod_is_fenced_for_good_by_its_uid_before_its_lease_goes(lease: int | None) -> None:
    # Its fence record, not only the revocation: a lease that expired on its own (the node cut off from etcd
    # too) leaves nothing to revoke, and a zombie back from the partition would register again under a new one.
    leases = {"worker-0": 3, **({"worker-1": lease} if lease else {})}
    obs = with_nodes(observe(job(status(Phase.RUNNING)), [on("worker-0", "n0", uid="u-0"),
                                                          on("worker-1", "n1", ready=False, uid="u-1")],
                             etcd("worker-0", "worker-1", leases=leases)), "n1")
    d = reconcile(obs)
    assert of(d, WriteFence) == [WriteFence(f"{JOB}-worker-1", "u-1", "its node n1 is unreachable")]
    assert of(d, RevokeLease) == ([RevokeLease(f"{JOB}-worker-1", lease)] if lease else [])
    kinds = [type(a) for a in d.actions]
    assert kinds.index(WriteFence) < kinds.index(DeletePod) < kinds.index(CreatePod)
    if lease:
        assert kinds.index(WriteFence) < kinds.index(RevokeLease)


def test_a_fence_record_is_written_once_and_never_while_etcd_is_away() -> None:
    pods = [on("worker-0", "n0", uid="u-0"), on("worker-1", "n1", ready=False, uid="u-1")]
    view = etcd("worker-0", "worker-1", leases={"worker-0": 3})
    fenced = with_nodes(observe(job(status(Phase.RUNNING)), pods, replace(view, fenced=frozenset({"u-1"}))), "n1")
    assert of(reconcile(fenced), WriteFence) == []  # the reconcile its own write woke
    away = with_nodes(observe(job(status(Phase.RUNNING)), pods, EtcdView(reachable=False)), "n1")
    assert of(reconcile(away), WriteFence) == []


def test_a_pod_whose_uid_is_unknown_is_fenced_by_its_lease_alone() -> None:
    # A zombie of a pod already gone from the API: its uid is not known, its new lease is revoked whenever seen.
    view = etcd("worker-0", "spare-0", leases={"worker-0": 3, "spare-0": 5, "worker-1": 11})
    d = reconcile(observe(job(status(Phase.RUNNING, replacements=1), spares=1),
                          [on("worker-0", "n0", uid="u-0"), on("spare-0", "n2", uid="u-2")], view))
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 11)] and of(d, WriteFence) == []


def test_a_running_pod_on_an_unreachable_node_is_fenced_force_deleted_and_replaced() -> None:
    obs = with_nodes(observe(job(status(Phase.RUNNING)), [on("worker-0", "n0"), on("worker-1", "n1", ready=False)],
                             etcd("worker-0", "worker-1", leases={"worker-0": 3, "worker-1": 9})), "n1")
    d = reconcile(obs)
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 9)]
    assert of(d, DeletePod) == [DeletePod(f"{JOB}-worker-1", 0, "NodeLost")]
    assert [c.name for c in of(d, CreatePod)] == [f"{JOB}-spare-0"]
    assert d.status.restarts is not None and d.status.restarts.pod_replacements == 1
    assert d.status.last_failure is not None and d.status.last_failure.reason == "NodeLost"
    assert d.status.last_failure.message == "its node n1 is unreachable"
    assert d.status.phase == Phase.RESTARTING
    # The fence comes before the replacement can join.
    kinds = [type(a) for a in d.actions]
    assert kinds.index(RevokeLease) < kinds.index(DeletePod) < kinds.index(CreatePod)


def test_ready_false_alone_is_not_a_loss() -> None:
    # What the node lifecycle controller writes on the pods of a NotReady node; the kubelet writes it for a
    # failing readiness probe too. Neither is a lost pod while node and lease say otherwise.
    obs = observe(job(status(Phase.RUNNING)), [on("worker-0", "n0"), on("worker-1", "n1", ready=False)],
                  etcd("worker-0", "worker-1", leases={"worker-0": 3, "worker-1": 9}))
    d = reconcile(obs)
    assert not of(d, DeletePod) and not of(d, RevokeLease) and not of(d, CreatePod)


def test_an_evicted_pod_terminating_on_an_unreachable_node_is_force_deleted_at_once() -> None:
    evicted = on("worker-1", "n1", deleting_since=NOW - 1, deletion_grace=30)
    obs = with_nodes(observe(job(status(Phase.RESTARTING, replacements=1)),
                             [on("worker-0", "n0"), evicted, on("spare-0", "n2")],
                             etcd("worker-0", "spare-0", leases={"worker-1": 9})), "n1")
    d = reconcile(obs)
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 9)]
    assert of(d, DeletePod) == [DeletePod(f"{JOB}-worker-1", 0, "NodeUnreachable")]
    assert any(isinstance(e, EmitEvent) and e.reason == "ForceDeleted" for e in d.actions)
    # On a reachable node the same pod gets its grace period first (the kubelet confirms the deletion).
    d = reconcile(replace(obs, unreachable_nodes=frozenset()))
    assert not of(d, DeletePod)


def agent(node: str, *, silent: float, state: str = "running") -> Any:
    return progress(node, state=state, updated=NOW - silent)


@pytest.mark.parametrize(("case", "record", "leases", "lost"), [
    ("silent without a lease", agent("worker-1", silent=20), {}, True),
    # Paused right after its first report, before it registered: in the second its pod started.
    ("silent since its first report", progress("worker-1", state="joining", epoch=0, updated=STARTED + 0.2),
     {}, True),
    ("lease held", agent("worker-1", silent=20), {"worker-1": 9}, False),
    ("not silent long enough", agent("worker-1", silent=5), {}, False),
    ("finished its work", agent("worker-1", silent=20, state="failed"), {}, False),
    ("record of an earlier pod of that name", progress("worker-1", updated=STARTED - 30), {}, False),
    ("never reported", None, {}, False),
])
def test_an_agent_that_lost_its_lease_and_went_silent(case: str, record: Any, leases: dict[str, int],
                                                      lost: bool) -> None:
    records = (agent("worker-0", silent=1), *((record,) if record is not None else ()))
    view = replace(etcd("worker-0", "worker-1", leases={"worker-0": 3, **leases}), progress=records)
    obs = observe(job(status(Phase.RUNNING)), [on("worker-0", "n0"), on("worker-1", "n1")], view)
    assert (f"{JOB}-worker-1" in lost_pods(obs)) is lost, case
    d = reconcile(obs)
    if lost:
        # Its node is fine: the kubelet there confirms a graceful deletion.
        assert of(d, DeletePod) == [DeletePod(f"{JOB}-worker-1", 30, "PodLost")]
        assert [c.name for c in of(d, CreatePod)] == [f"{JOB}-spare-0"]
        assert d.status.last_failure is not None and "lease" in (d.status.last_failure.message or "")
    else:
        assert not of(d, DeletePod) and not of(d, CreatePod)


def test_the_reconcile_looks_again_when_a_silent_agent_would_count_as_lost() -> None:
    view = replace(etcd("worker-0", "worker-1", leases={"worker-0": 3}),
                   progress=(agent("worker-0", silent=1), agent("worker-1", silent=5)))
    obs = observe(job(status(Phase.RUNNING)), [on("worker-0", "n0"), on("worker-1", "n1")], view)
    assert recheck_in(obs) == pytest.approx(AGENT_SILENT_SECONDS - 5)
    assert reconcile(obs).requeue_after == pytest.approx(AGENT_SILENT_SECONDS - 5)


@pytest.mark.parametrize("etcd_state", ["unreachable", "closed"])
def test_no_lease_verdict_without_a_current_etcd_view(etcd_state: str) -> None:
    view = replace(etcd("worker-0", "worker-1", leases={"worker-0": 3}),
                   progress=(agent("worker-0", silent=1), agent("worker-1", silent=60)))
    view = replace(view, reachable=False) if etcd_state == "unreachable" else replace(view, closed=True)
    obs = observe(job(status(Phase.RUNNING)), [on("worker-0", "n0"), on("worker-1", "n1")], view)
    assert lost_pods(obs) == {}


def test_a_failure_rule_on_pod_lost_applies_to_a_lost_node() -> None:
    rules = [{"action": "FailJob", "onReasons": ["PodLost"]}]
    obs = with_nodes(observe(job(status(Phase.RUNNING), restartPolicy={"rules": rules}),
                             [on("worker-0", "n0"), on("worker-1", "n1")], etcd("worker-0", "worker-1")), "n1")
    d = reconcile(obs)
    assert d.status.phase == Phase.FAILED and not of(d, CreatePod)


def test_a_zombie_that_registers_again_is_fenced_again() -> None:
    # worker-1 was lost, force-deleted and replaced; its processes came back and registered under a new lease.
    view = etcd("worker-0", "spare-0", leases={"worker-0": 3, "spare-0": 5, "worker-1": 11, "spare-1": 12})
    pods = [on("worker-0", "n0"), on("spare-0", "n2"), pod("spare-1", "Pending")]
    d = reconcile(observe(job(status(Phase.RUNNING, replacements=1), spares=1), pods, view))
    assert of(d, RevokeLease) == [RevokeLease(f"{JOB}-worker-1", 11)]
    assert not of(d, CreatePod) and not of(d, DeletePod)
