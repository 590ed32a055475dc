"""The operator end to end on the local cluster: kopf unmodified, the real kubernetes client and kubectl, a real
etcd, and (for the lifecycle tests) real agents running real torch ranks.

Scale tests (a 64-pod job, 50 concurrent jobs) run the pods' command bare (``agent_command=()``, ``sleep``):
64 agents each importing torch would not fit on a 2-core machine next to the other suites; what they
exercise is the operator (concurrent creation, the pod index, status, deletion), not the agents.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from prometheus_client import REGISTRY

from stalwart.api import naming
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.cluster import LocalCluster
from stalwart.net import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

GROUP, VERSION, PLURAL = "stalwart.dev", "v1alpha1", "trainingjobs"
TRAIN = ["python", "-m", "stalwart.examples.train", "--log-every", "5"]
SLEEP = ["sleep", "900"]
#: start_operator(namespace, **OperatorRunConfig fields) -> the embedded operator (tests/operator/conftest.py).
OperatorFactory = Callable[..., Any]


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 180.0, interval: float = 0.5) -> Any:
    """Poll ``fn`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(k8s.ApiException):
            last = fn()
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")


def job_body(name: str, *, replicas: int, command: list[str], spares: int = 0,
             **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "spares": spares,
                 "template": {"spec": {"containers": [{"name": "trainer", "image": "stalwart/trainer",
                                                       "command": command}]}},
                 "rendezvous": {"lastCallSeconds": 1}, **spec},
    }


class Jobs:
    """Small helpers over the API for one namespace."""

    def __init__(self, api: Any, namespace: str) -> None:
        self.ns = namespace
        self.custom = k8s.CustomObjectsApi(api)
        self.core = k8s.CoreV1Api(api)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        created: dict[str, Any] = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                                             body)
        return created

    def get(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        return got

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name, {"spec": spec})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)

    def gone(self, name: str) -> bool:
        try:
            self.get(name)
        except k8s.ApiException as e:
            return e.status == 404
        return False

    def pods(self, job: str) -> list[Any]:
        items: list[Any] = self.core.list_namespaced_pod(self.ns, label_selector=naming.selector(job)).items
        return items

    def live_pods(self, job: str) -> list[Any]:
        return [p for p in self.pods(job) if p.metadata.deletion_timestamp is None
                and p.status.phase in ("Pending", "Running")]

    def events(self, job: str) -> list[str]:
        items = self.core.list_namespaced_event(self.ns).items
        return [e.reason for e in items if e.involved_object.kind == "TrainingJob"
                and e.involved_object.name == job]


def phase_is(jobs: Jobs, name: str, *phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        st = jobs.status(name)
        return st if st.get("phase") in phases else None
    return check


# -- real agents -----------------------------------------------------------------------------------------------


def test_lifecycle_of_a_small_job_with_real_agents(start_operator: OperatorFactory, jobs: Jobs,
                                                   etcd_store: Store) -> None:
    port = free_port()
    start_operator(jobs.ns, health_endpoint=f"http://127.0.0.1:{port}/healthz")
    created = jobs.create(job_body("life", replicas=2, spares=1, command=[*TRAIN, "--steps", "40"]))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])

    pods = wait_for("three pods", lambda: len(jobs.pods("life")) == 3 and jobs.pods("life"))
    names = sorted(p.metadata.name for p in pods)
    assert names == ["life-spare-0", "life-worker-0", "life-worker-1"]
    pod = next(p for p in pods if p.metadata.name == "life-worker-0")
    container = pod.spec.containers[0]
    assert container.command[:3] == ["stalwart", "agent", "--"] and container.command[3:5] == TRAIN[:2]
    env = {e.name: e for e in container.env}
    assert env["STALWART_JOB"].value == f"{jobs.ns}/life" and env["STALWART_SPARE"].value == "false"
    assert env["STALWART_RPC_TOKEN"].value_from.secret_key_ref.name == naming.secret_name("life")
    assert pod.metadata.owner_references[0].uid == created["metadata"]["uid"]
    assert pod.metadata.labels[naming.LABEL_ROLE] == "worker" and pod.spec.restart_policy == "Never"
    assert jobs.core.read_namespaced_service("life", jobs.ns).spec.cluster_ip == "None"
    assert jobs.core.read_namespaced_secret(naming.secret_name("life"), jobs.ns).data["rpc-token"]

    st = wait_for("Succeeded", phase_is(jobs, "life", "Succeeded", "Failed"), timeout=240)
    assert st["phase"] == "Succeeded", st
    assert st["worldSize"] == 2 and st["round"] >= 1 and st["progress"]["step"] == 40
    assert st["observedGeneration"] == 1 and st["completionTime"] and st["startTime"]
    assert {c["type"]: c["status"] for c in st["conditions"]}["Succeeded"] == "True"
    # The Event is posted after the status patch (kopf's event queue): wait for it, then count it.
    wait_for("the PhaseSucceeded Event", lambda: "PhaseSucceeded" in jobs.events("life"), timeout=60)
    reasons = jobs.events("life")
    assert reasons.count("PhaseSucceeded") == 1, reasons
    assert etcd_store.get(keys.job) is not None  # the record stays until the job is deleted

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
        assert r.status == 200 and "jobs" in json.loads(r.read())
    assert (REGISTRY.get_sample_value("stalwart_operator_api_calls_total",
                                      {"verb": "create", "resource": "pods"}) or 0) >= 3

    jobs.delete("life")
    wait_for("the job to go", lambda: jobs.gone("life"), timeout=60)
    wait_for("its pods to go", lambda: not jobs.pods("life"), timeout=60)
    assert etcd_store.count_prefix(keys.prefix) == 0


def test_force_deleted_pod_counts_once_as_a_replacement(start_operator: OperatorFactory, jobs: Jobs,
                                                        etcd_store: Store, local_cluster: LocalCluster) -> None:
    # Real agents running a bare command as their ranks: the rendezvous seals rounds, no torch is imported.
    start_operator(jobs.ns)
    created = jobs.create(job_body("vanish", replicas=2, command=SLEEP))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    wait_for("Running", phase_is(jobs, "vanish", "Running"), timeout=240)
    wait_for("both workers tracked", lambda: jobs.status("vanish").get("trackedPods") == [
        "vanish-worker-0", "vanish-worker-1"])
    before = REGISTRY.get_sample_value("stalwart_operator_pod_replacements_total") or 0.0

    # Gone at once: the operator never sees the pod with a deletionTimestamp.
    local_cluster.kubectl("delete", "pod", "vanish-worker-1", "-n", jobs.ns, "--grace-period=0", "--force",
                          "--wait=false")
    st = wait_for("the replacement counted", lambda: (s := jobs.status("vanish")).get("restarts", {}).get(
        "podReplacements", 0) >= 1 and s)
    assert st["restarts"]["podReplacements"] == 1
    assert st["lastFailure"]["pod"] == "vanish-worker-1" and st["lastFailure"]["reason"] == "PodLost"
    assert etcd_store.get(keys.rendezvous + "nodes/vanish-worker-1") is None  # fenced
    wait_for("the replacement spare", lambda: any(p.metadata.name == "vanish-spare-0"
                                                  for p in jobs.live_pods("vanish")))
    st = wait_for("Running again with the replacement", lambda: (s := jobs.status("vanish")).get(
        "phase") == "Running" and s.get("round", 0) >= 2 and s, timeout=240)
    # The replacement counted once, and the recovery (every rank started again in the new round) once.
    st = wait_for("the recovery counted", lambda: (s := jobs.status("vanish")).get("totalRestarts") == 1 and s)
    assert st["restarts"] == {"inProcess": 0, "processRestarts": 1, "podReplacements": 1} and st["worldSize"] == 2
    assert sorted(st["trackedPods"]) == ["vanish-spare-0", "vanish-worker-0"]
    assert sorted(p.metadata.name for p in jobs.live_pods("vanish")) == ["vanish-spare-0", "vanish-worker-0"]
    reasons = jobs.events("vanish")
    assert reasons.count("PodDisappeared") == 1 and "PodReplaced" in reasons
    assert (REGISTRY.get_sample_value("stalwart_operator_pod_replacements_total") or 0.0) == before + 1
    # One metric per fact: a replacement is not also a restart kind.
    assert REGISTRY.get_sample_value("stalwart_operator_restarts_total", {"kind": "pod_replacement"}) is None
    jobs.delete("vanish")
    wait_for("the job to go", lambda: jobs.gone("vanish"), timeout=90)


def test_suspend_deletes_pods_keeps_etcd_and_resume_recreates(start_operator: OperatorFactory, jobs: Jobs,
                                                              etcd_store: Store) -> None:
    start_operator(jobs.ns)
    created = jobs.create(job_body("pause", replicas=2, command=[*TRAIN, "--steps", "100000",
                                                                  "--step-delay", "0.05"]))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    wait_for("Running", phase_is(jobs, "pause", "Running"), timeout=240)

    jobs.patch_spec("pause", {"runPolicy": {"suspend": True}})
    wait_for("Suspended", phase_is(jobs, "pause", "Suspended"))
    wait_for("no pods", lambda: not jobs.pods("pause"), timeout=90)
    assert etcd_store.get(keys.job) is not None
    st = jobs.status("pause")
    assert {c["type"]: c["status"] for c in st["conditions"]}["Suspended"] == "True"
    assert "startTime" not in st

    jobs.patch_spec("pause", {"runPolicy": {"suspend": False}})
    st = wait_for("Running again", phase_is(jobs, "pause", "Running"), timeout=240)
    assert sorted(p.metadata.name for p in jobs.live_pods("pause")) == ["pause-worker-0", "pause-worker-1"]
    assert st.get("restarts", {}).get("podReplacements", 0) == 0
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Suspended"] == "Resumed"


# -- the operator alone, at scale ------------------------------------------------------------------------------


def test_64_pod_job(start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster,
                    etcd_store: Store) -> None:
    start_operator(jobs.ns, agent_command=(), concurrency=16)
    created = jobs.create(job_body("big", replicas=60, spares=4, command=SLEEP))
    pods = wait_for("64 pods", lambda: len(p := jobs.pods("big")) == 64 and p, timeout=240)
    assert {p.metadata.labels[naming.LABEL_ROLE] for p in pods} == {"worker", "spare"}
    assert sum(p.metadata.labels[naming.LABEL_ROLE] == "spare" for p in pods) == 4
    st = wait_for("64 pods running", lambda: (s := jobs.status("big")).get("phase") == "Starting"
                  and s.get("readyReplicas", 0) + s.get("spareReplicas", 0) == 64 and s, timeout=240)
    assert st["replicas"] == 60 and st["selector"] == naming.selector("big")
    # The record for the agents lists every pod.
    record = json.loads(etcd_store.get(JobKeys(jobs.ns, created["metadata"]["uid"]).job).value)  # type: ignore[union-attr]
    assert len(record["members"]) == 60 and len(record["spares"]) == 4

    # The scale subresource: kubectl scale tj/big --replicas=62 adds two workers.
    local_cluster.kubectl("scale", "-n", jobs.ns, "trainingjob/big", "--replicas=62")
    wait_for("66 pods", lambda: len(jobs.live_pods("big")) == 66, timeout=120)
    assert {"big-worker-60", "big-worker-61"} <= {p.metadata.name for p in jobs.pods("big")}

    jobs.delete("big")
    wait_for("the job and its pods to go", lambda: jobs.gone("big") and not jobs.pods("big"), timeout=180)


def test_50_concurrent_jobs(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=(), concurrency=16)
    names = [f"many-{i}" for i in range(50)]
    for name in names:
        jobs.create(job_body(name, replicas=1, command=SLEEP))

    def all_started() -> bool:
        items = jobs.custom.list_namespaced_custom_object(GROUP, VERSION, jobs.ns, PLURAL)["items"]
        return len(items) == 50 and all((i.get("status") or {}).get("phase") == "Starting" for i in items)

    wait_for("50 jobs Starting", all_started, timeout=300, interval=1.0)
    pods = jobs.core.list_namespaced_pod(jobs.ns).items
    assert sorted(p.metadata.name for p in pods) == sorted(f"{n}-worker-0" for n in names)
    for name in names:
        jobs.delete(name)
    wait_for("every job gone", lambda: not jobs.custom.list_namespaced_custom_object(
        GROUP, VERSION, jobs.ns, PLURAL)["items"], timeout=180, interval=1.0)


def test_finalizer_deletes_the_job_prefix_and_nothing_else(start_operator: OperatorFactory, jobs: Jobs,
                                                           etcd_store: Store) -> None:
    start_operator(jobs.ns, agent_command=())
    created = jobs.create(job_body("fin", replicas=1, command=SLEEP))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    wait_for("the job record", lambda: etcd_store.get(keys.job) is not None)
    neighbour = JobKeys(jobs.ns, created["metadata"]["uid"] + "x")  # a prefix that shares the uid's start
    etcd_store.put(neighbour.job, b"{}")
    etcd_store.put(keys.progress + "fin-worker-0", b"{}")
    try:
        assert jobs.get("fin")["metadata"]["finalizers"] == ["stalwart.dev/finalizer"]
        jobs.delete("fin")
        wait_for("the job to go", lambda: jobs.gone("fin"), timeout=60)
        assert etcd_store.count_prefix(keys.prefix) == 0
        assert etcd_store.get(neighbour.job) is not None
    finally:
        etcd_store.delete_prefix(neighbour.prefix)


PODGROUP_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: podgroups.scheduling.x-k8s.io
spec:
  group: scheduling.x-k8s.io
  scope: Namespaced
  names: {kind: PodGroup, plural: podgroups, singular: podgroup, listKind: PodGroupList}
  versions:
    - name: v1alpha1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              properties:
                minMember: {type: integer}
"""


def test_gang_scheduler_pod_group(start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster) -> None:
    local_cluster.kubectl("apply", "-f", "-", input=PODGROUP_CRD)
    start_operator(jobs.ns, agent_command=(), gang_scheduler="coscheduling")
    jobs.create(job_body("gang", replicas=3, minReplicas=2, command=SLEEP))
    wait_for("three pods", lambda: len(jobs.pods("gang")) == 3)
    group = jobs.custom.get_namespaced_custom_object("scheduling.x-k8s.io", "v1alpha1", jobs.ns, "podgroups",
                                                     "gang")
    assert group["spec"]["minMember"] == 2
    assert all(p.metadata.labels["scheduling.x-k8s.io/pod-group"] == "gang" for p in jobs.pods("gang"))
    # The gang's minimum follows spec.minReplicas as the user edits it.
    jobs.patch_spec("gang", {"minReplicas": 3})
    wait_for("minMember 3", lambda: jobs.custom.get_namespaced_custom_object(
        "scheduling.x-k8s.io", "v1alpha1", jobs.ns, "podgroups", "gang")["spec"]["minMember"] == 3)


def test_kueue_gated_pods_wait_and_a_job_managed_elsewhere_is_left_alone(start_operator: OperatorFactory,
                                                                         jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    elsewhere = jobs.create(job_body("elsewhere", replicas=1, command=SLEEP, managedBy="kueue.x-k8s.io/multikueue"))
    queued = job_body("queued", replicas=2, spares=1, command=SLEEP)
    queued["metadata"]["labels"] = {naming.KUEUE_QUEUE_NAME: "team-a"}
    # Kueue's webhook adds this gate to the pods of a queue; here the template carries it, as the webhook would.
    queued["spec"]["template"]["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    jobs.create(queued)
    pods = wait_for("three pods", lambda: ps if len(ps := jobs.pods("queued")) == 3 else None)
    for pod in pods:
        assert pod.metadata.labels[naming.KUEUE_QUEUE_NAME] == "team-a"
        assert pod.metadata.labels[naming.KUEUE_POD_GROUP_NAME] == "queued"
        assert pod.metadata.annotations[naming.KUEUE_POD_GROUP_TOTAL_COUNT] == "3"
    # Gated, they stay unbound and Pending, and the job waits for them (it neither fails nor replaces them).
    until = time.monotonic() + 4
    while time.monotonic() < until:
        assert all(p.spec.node_name is None and p.status.phase == "Pending" for p in jobs.pods("queued"))
        assert jobs.status("queued").get("phase") in (None, "Pending")
        time.sleep(0.5)
    # Admitted: the gates go (as Kueue removes them) and the same pods run.
    for pod in jobs.pods("queued"):
        pod.spec.scheduling_gates = []
        jobs.core.replace_namespaced_pod(pod.metadata.name, jobs.ns, pod)
    wait_for("the same three pods running", lambda: sorted(p.metadata.name for p in jobs.live_pods("queued")
                                                           if p.status.phase == "Running") == sorted(
        p.metadata.name for p in pods))
    # The job another controller manages got nothing from this operator: no pod, no status, no finalizer.
    got = jobs.get("elsewhere")
    assert jobs.pods("elsewhere") == [] and "status" not in got and not got["metadata"].get("finalizers")
    assert got["metadata"]["resourceVersion"] == elsewhere["metadata"]["resourceVersion"]
    with pytest.raises(k8s.ApiException) as refused:
        jobs.patch_spec("elsewhere", {"managedBy": "stalwart.dev/trainingjob-controller"})
    assert refused.value.status == 422 and "managedBy is immutable" in str(refused.value.body)
    jobs.delete("elsewhere")
    wait_for("elsewhere deleted without a finalizer", lambda: jobs.gone("elsewhere"), timeout=30)


def test_a_foreign_pod_group_holds_the_job_and_is_left_alone(
        start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster) -> None:
    local_cluster.kubectl("apply", "-f", "-", input=PODGROUP_CRD)
    jobs.custom.create_namespaced_custom_object("scheduling.x-k8s.io", "v1alpha1", jobs.ns, "podgroups", {
        "apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup", "metadata": {"name": "squat"},
        "spec": {"minMember": 7}})
    start_operator(jobs.ns, agent_command=(), gang_scheduler="coscheduling")
    jobs.create(job_body("squat", replicas=2, command=SLEEP))

    def conflict() -> dict[str, Any] | None:
        return next((c for c in jobs.status("squat").get("conditions") or []
                     if c.get("type") == "OwnershipConflict" and c.get("status") == "True"), None)

    cond = wait_for("the OwnershipConflict condition", conflict, timeout=60)
    assert cond["message"].startswith("PodGroup squat (no controller): exists")
    # No pod joins a gang whose minimum is someone else's, and that PodGroup is not changed.
    assert jobs.pods("squat") == []
    group = jobs.custom.get_namespaced_custom_object("scheduling.x-k8s.io", "v1alpha1", jobs.ns, "podgroups",
                                                     "squat")
    assert group["spec"]["minMember"] == 7 and not group["metadata"].get("ownerReferences")


def test_two_replicas_with_peering_one_works_and_the_other_takes_over(
        start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster) -> None:
    local_cluster.kubectl("apply", "-f", str(REPO / "helm" / "stalwart" / "crds" / "kopfpeering.yaml"))
    local_cluster.kubectl("apply", "-n", jobs.ns, "-f", "-",
                          input="apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: stalwart}\n")
    active = start_operator(jobs.ns, agent_command=(), peering="stalwart", priority=200, identity="replica-a")
    standby = start_operator(jobs.ns, agent_command=(), peering="stalwart", priority=100, identity="replica-b")

    def both_peers_announced() -> bool:
        peering = jobs.custom.get_namespaced_custom_object("kopf.dev", "v1", jobs.ns, "kopfpeerings", "stalwart")
        return {"replica-a", "replica-b"} <= set((peering.get("status") or {}).keys())

    # the standby must have seen its higher-priority peer before there is work to do (under load it can
    # otherwise act on a new job in the moment before peering freezes it)
    wait_for("both replicas in the peering", both_peers_announced)
    jobs.create(job_body("first", replicas=2, command=SLEEP))
    wait_for("the first job's pods", lambda: len(jobs.pods("first")) == 2)
    wait_for("the first job Starting", phase_is(jobs, "first", "Starting"))
    # Only the active replica acted: the standby made no API call at all.
    assert sum(active.kube.calls.values()) > 0 and sum(standby.kube.calls.values()) == 0

    active.stop()
    jobs.create(job_body("second", replicas=1, command=SLEEP))
    wait_for("the standby to take over", lambda: len(jobs.pods("second")) == 1, timeout=240)
    assert sum(standby.kube.calls.values()) > 0


# -- failure paths and life-cycle policies, with bare commands ---------------------------------------------------


def test_ttl_after_success_deletes_the_job(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    jobs.create(job_body("ttl", replicas=2, command=["true"], runPolicy={"ttlSecondsAfterFinished": 1}))
    wait_for("the job to succeed and be deleted", lambda: jobs.gone("ttl"), timeout=120)
    wait_for("the PhaseSucceeded Event", lambda: "PhaseSucceeded" in jobs.events("ttl"), timeout=60)


def test_deadline_and_exit_code_rules_fail_the_job(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    jobs.create(job_body("late", replicas=1, command=SLEEP, runPolicy={"activeDeadlineSeconds": 2}))
    rules = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}]
    jobs.create(job_body("rule", replicas=1, command=["sh", "-c", "exit 3"], restartPolicy={"rules": rules}))
    jobs.create(job_body("flaky", replicas=1, command=["sh", "-c", "exit 1"], restartPolicy={"backoffLimit": 2}))

    def reason(name: str) -> str | None:
        st = jobs.status(name)
        if st.get("phase") != "Failed":
            return None
        return next(c["reason"] for c in st["conditions"] if c["type"] == "Failed")

    assert wait_for("late fails", lambda: reason("late")) == "DeadlineExceeded"
    wait_for("late's pod to go", lambda: not jobs.live_pods("late"), timeout=90)
    assert wait_for("rule fails", lambda: reason("rule")) == "FailJobRule"
    assert wait_for("flaky fails", lambda: reason("flaky")) == "BackoffLimitExceeded"
    assert jobs.status("flaky")["restarts"]["podReplacements"] == 2
    assert "PodReplaced" in jobs.events("flaky")
