"""An object of a name the job needs (its Secret, its Service, a pod) that exists already is the job's only when
the job controls it (ownerReferences, by uid). Otherwise the job gets an ``OwnershipConflict`` condition naming
the object, and the operator neither reads nor changes it: on the local cluster, as the chart's ServiceAccount."""

from __future__ import annotations

from typing import Any

import pytest
from test_operator_cluster import SLEEP, Jobs, OperatorFactory, job_body, wait_for

from stalwart.api import naming

pytestmark = pytest.mark.integration


def _conflict(jobs: Jobs, name: str) -> dict[str, Any] | None:
    cond = next((c for c in jobs.status(name).get("conditions") or [] if c.get("type") == "OwnershipConflict"), None)
    return cond if cond is not None and cond.get("status") == "True" else None


def test_a_foreign_secret_holds_the_job_and_is_left_alone(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    name = "adopt-secret"
    jobs.core.create_namespaced_secret(jobs.ns, {"metadata": {"name": naming.secret_name(name)},
                                                 "stringData": {"rpc-token": "someone else's"}})
    before = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    jobs.create(job_body(name, replicas=1, command=SLEEP))
    cond = wait_for("the OwnershipConflict condition", lambda: _conflict(jobs, name), timeout=60)
    assert cond["reason"] == "NotOwned"
    assert cond["message"].startswith(f"Secret {naming.secret_name(name)} (no controller): exists and is not")
    # The Event is its own write after the status patch that carries the condition: waited for, not raced.
    wait_for("the NotOwned Event", lambda: "NotOwned" in jobs.events(name), timeout=30)
    assert jobs.pods(name) == []  # no pod may mount a Secret that is not the job's
    after = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    assert after.metadata.resource_version == before.metadata.resource_version and not after.metadata.owner_references
    # Once it is gone, the job makes its own and starts.
    jobs.core.delete_namespaced_secret(naming.secret_name(name), jobs.ns)
    wait_for("the job's pod", lambda: jobs.pods(name), timeout=60)
    secret = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    assert [o.uid for o in secret.metadata.owner_references] == [jobs.get(name)["metadata"]["uid"]]
    wait_for("the conflict to clear", lambda: _conflict(jobs, name) is None, timeout=60)


def test_a_foreign_service_holds_the_job_and_is_left_alone(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    name = "adopt-service"
    jobs.core.create_namespaced_service(jobs.ns, {"metadata": {"name": naming.service_name(name)}, "spec": {
        "selector": {"app": "web"}, "ports": [{"port": 80}]}})
    jobs.create(job_body(name, replicas=1, command=SLEEP))
    cond = wait_for("the OwnershipConflict condition", lambda: _conflict(jobs, name), timeout=60)
    assert cond["message"].startswith(f"Service {naming.service_name(name)} (no controller): exists")
    assert jobs.pods(name) == []
    service = jobs.core.read_namespaced_service(naming.service_name(name), jobs.ns)
    assert service.spec.selector == {"app": "web"} and not service.metadata.owner_references


def test_a_foreign_pod_of_a_workers_name_is_not_adopted(start_operator: OperatorFactory, jobs: Jobs) -> None:
    start_operator(jobs.ns, agent_command=())
    name = "adopt-pod"
    squatter = naming.worker_pod_name(name, 0)
    # With the job's very labels: only the owner reference makes a pod the job's.
    jobs.core.create_namespaced_pod(jobs.ns, {
        "metadata": {"name": squatter, "labels": naming.pod_labels(name, naming.ROLE_WORKER, 0)},
        "spec": {"containers": [{"name": "c", "image": "busybox", "command": SLEEP}]}})
    before = jobs.core.read_namespaced_pod(squatter, jobs.ns)
    jobs.create(job_body(name, replicas=1, command=SLEEP))
    cond = wait_for("the OwnershipConflict condition", lambda: _conflict(jobs, name), timeout=60)
    assert cond["message"].startswith(f"Pod {squatter} (no controller): exists and is not")
    uid = jobs.get(name)["metadata"]["uid"]
    mine = wait_for("the job's own pod", lambda: [p for p in jobs.pods(name) if p.metadata.owner_references
                                                  and p.metadata.owner_references[0].uid == uid], timeout=60)
    assert [p.metadata.name for p in mine] == [naming.spare_pod_name(name, 0)]
    after = jobs.core.read_namespaced_pod(squatter, jobs.ns)
    assert after.metadata.uid == before.metadata.uid and after.metadata.deletion_timestamp is None
    assert not after.metadata.owner_references


def test_a_secret_planted_with_the_jobs_owner_reference_is_not_adopted(start_operator: OperatorFactory,
                                                                        jobs: Jobs) -> None:
    # Whoever may create Secrets writes the job's Secret first, naming the job (by its uid) as controller, with
    # an RPC token of their choosing: without the operator's mark it is not the job's, and nothing reads it.
    name = "adopt-planted"
    created = jobs.create(job_body(name, replicas=1, command=SLEEP))  # no operator yet: the planter is first
    ref = {"apiVersion": created["apiVersion"], "kind": created["kind"], "name": name,
           "uid": created["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    jobs.core.create_namespaced_secret(jobs.ns, {
        "metadata": {"name": naming.secret_name(name), "ownerReferences": [ref],
                     "annotations": {"stalwart.dev/made-by": "v1:" + "0" * 64}},
        "stringData": {"rpc-token": "the planter's token, known to the planter"}})
    before = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    start_operator(jobs.ns, agent_command=())
    cond = wait_for("the OwnershipConflict condition", lambda: _conflict(jobs, name), timeout=60)
    assert cond["reason"] == "NotOwned"
    assert cond["message"].startswith(
        f"Secret {naming.secret_name(name)} (controlled by the job but not made by this operator: no valid "
        f"stalwart.dev/made-by mark)")
    assert jobs.pods(name) == []  # no pod mounts the planted token
    after = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    assert after.metadata.resource_version == before.metadata.resource_version


def test_the_operators_own_secret_is_adopted_again_after_a_restart(start_operator: OperatorFactory,
                                                                    jobs: Jobs) -> None:
    # The same mark's key (the chart's Secret; here the session's): a new run adopts what the last one made.
    first = start_operator(jobs.ns, agent_command=())
    name = "adopt-own"
    jobs.create(job_body(name, replicas=1, command=SLEEP))
    wait_for("the job's pods", lambda: jobs.pods(name), timeout=60)
    secret = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    assert secret.metadata.annotations["stalwart.dev/made-by"].startswith("v1:")
    first.stop()
    start_operator(jobs.ns, agent_command=())
    jobs.core.delete_namespaced_pod(jobs.pods(name)[0].metadata.name, jobs.ns, grace_period_seconds=0)
    wait_for("a replacement pod", lambda: any(p.metadata.deletion_timestamp is None
                                              for p in jobs.pods(name)), timeout=60)
    assert _conflict(jobs, name) is None
    again = jobs.core.read_namespaced_secret(naming.secret_name(name), jobs.ns)
    assert again.metadata.uid == secret.metadata.uid
