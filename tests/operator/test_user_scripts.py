"""Scripts written for torchrun, on the local cluster with the operator and real agents: the training function
initialises its own process group (and may destroy it at its end). A fault restarts it in process; a fault
that comes back every time ends the job Failed, with the reason."""

from __future__ import annotations

from typing import Any

import pytest
from test_operator_cluster import GROUP, VERSION, Jobs, OperatorFactory, phase_is, wait_for

from stalwart.api.restart import ProgressRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.examples.torchrun_style import FAIL_ALWAYS_ENV, FAIL_AT_STEP_ENV, FAIL_RANK_ENV
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

SCRIPT = ["python", "-m", "stalwart.examples.torchrun_style"]


@pytest.fixture
def jobs(kube_api: Any, k8s_namespace: str) -> Jobs:
    return Jobs(kube_api, k8s_namespace)


def body(name: str, args: list[str], env: dict[str, str], **spec: Any) -> dict[str, Any]:
    container = {"name": "trainer", "image": "stalwart/trainer", "command": [*SCRIPT, *args],
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"replicas": 2, "template": {"spec": {"containers": [container]}},
                     "rendezvous": {"lastCallSeconds": 1}, **spec}}


@pytest.mark.parametrize("destroy", [False, True], ids=["init", "init-and-destroy"])
def test_a_script_that_initialises_its_own_group_recovers_in_process(start_operator: OperatorFactory, jobs: Jobs,
                                                                     destroy: bool) -> None:
    start_operator(jobs.ns)
    name = "own-group-destroy" if destroy else "own-group"
    jobs.create(body(name, ["--steps", "30", *(["--destroy"] if destroy else [])],
                     {FAIL_AT_STEP_ENV: "10", FAIL_RANK_ENV: "1"}))
    pods = wait_for("two pods", lambda: len(jobs.pods(name)) == 2 and jobs.pods(name))
    uids = sorted(p.metadata.uid for p in pods)
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=240)
    assert st["phase"] == "Succeeded", st
    restarts = st["restarts"]
    assert (restarts.get("inProcess"), restarts.get("processRestarts", 0), restarts.get("podReplacements", 0)) \
        == (1, 0, 0), st
    assert sorted(p.metadata.uid for p in jobs.pods(name)) == uids  # the same pods, none replaced
    assert all(p.status.phase == "Succeeded" for p in jobs.pods(name))


def test_a_step_that_always_raises_fails_the_job_with_the_reason(start_operator: OperatorFactory, jobs: Jobs,
                                                                 local_cluster: LocalCluster) -> None:
    start_operator(jobs.ns)
    name = "always-raises"
    jobs.create(body(name, ["--steps", "30"], {FAIL_AT_STEP_ENV: "5", FAIL_RANK_ENV: "1", FAIL_ALWAYS_ENV: "1"},
                     restartPolicy={"inProcess": {"maxRestarts": 2}, "backoffLimit": 0}))
    st = wait_for("Failed", phase_is(jobs, name, "Succeeded", "Failed"), timeout=240)
    assert st["phase"] == "Failed", st
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "RestartsExhausted", failed
    assert "ValueError: step 5: the loss is NaN (injected on rank 1)" in failed["message"]
    last = st["lastFailure"]
    assert (last["reason"], last["rank"], last["detectedBy"], last["exitCode"]) == ("Exception", 1, "Rank", 90), last
    assert (last["exceptionType"], last["message"]) == ("ValueError", "step 5: the loss is NaN (injected on rank 1)")
    assert st["restarts"]["podReplacements"] == 0
    # The spec's budget reached the ranks (the script's decorator sets none; its default is 10): each agent
    # recorded two in-process restarts before its ranks gave up (an agent whose round ended first may be
    # rejoining by now).
    keys = JobKeys(jobs.ns, jobs.get(name)["metadata"]["uid"])
    with Store([str(local_cluster.etcd_endpoint)], timeout=10.0) as store:
        records = [ProgressRecord.from_json_bytes(kv.value) for kv in store.get_prefix(keys.progress)[0]]
    assert [r.restarts_in_process for r in records] == [2, 2] and "failed" in {r.state for r in records}
    # The operator posts the job's Events after its status patch (the two events of this decision at once), so
    # the status can be read before them.
    wait_for("the RestartsExhausted event", lambda: "RestartsExhausted" in jobs.events(name), timeout=60)
    described = local_cluster.kubectl("describe", "tj", name, "-n", jobs.ns).stdout
    assert "RestartsExhausted" in described and "the loss is NaN" in described
