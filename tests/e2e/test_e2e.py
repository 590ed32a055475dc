"""The user's path, end to end on the local cluster: the chart installed with Helm, TrainingJobs applied and
watched with kubectl, the operator and the agents doing the rest."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_jobs import (
    NAMESPACE,
    REPO,
    apply,
    delete,
    example_job,
    get_job,
    pods,
    status,
    training_events,
    wait_for,
    wait_phase,
)

from stalwart.demo import DemoOptions, run_demo
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.examples.train import FAIL_AT_STEP_ENV, FAIL_TIMES_ENV
from stalwart.local.cluster import ClusterError, LocalCluster

pytestmark = pytest.mark.e2e


def test_demo_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`stalwart demo`: the job survives a rank exception and a killed worker pod and ends Succeeded."""
    directory = tmp_path_factory.mktemp("demo")
    out = io.StringIO()
    # 940 steps (47 s and more) after the kill's step: the demo sees the recovery from the exception, then step
    # 60, by polling kubectl, and on a loaded machine that has lagged by more than 12 s (140 and 240 steps were
    # each once too few with four workers busy, 540 with two suites at once); a job that finished first leaves
    # nothing to recover from.
    result = run_demo(DemoOptions(directory=directory, steps=1000, step_delay=0.05, fail_at_step=20,
                                  kill_at_step=60, timeout=540.0), out)
    text = out.getvalue()
    assert result.phase == "Succeeded", text
    assert [r.what for r in result.recoveries] == ["a rank exception", "a worker pod killed"]
    assert all(r.seconds > 0 for r in result.recoveries)
    assert result.final_status["restarts"]["inProcess"] >= 1
    # kubectl get tj was shown as it went (its header, the job's rows) and the summary at the end.
    assert "PHASE" in text and "ROUND" in text and "RESTARTS" in text and "Succeeded" in text
    assert "recovery after a rank exception:" in text
    # It cleaned up after itself: the cluster is down.
    with pytest.raises(ClusterError):
        LocalCluster.attach(directory)


def test_suspend_and_resume(stalwart_cluster: LocalCluster) -> None:
    job = example_job("suspend", ["--steps", "100000", "--step-delay", "0.05", "--checkpoint-every", "10"])
    name = job["metadata"]["name"]
    apply(stalwart_cluster, job)
    try:
        wait_phase(stalwart_cluster, name, "Running")
        wait_for("progress", lambda: (status(stalwart_cluster, name).get("progress") or {}).get("step", 0) > 10)
        uid = get_job(stalwart_cluster, name)["metadata"]["uid"]

        stalwart_cluster.kubectl("patch", "tj", name, "-n", NAMESPACE, "--type=merge",
                                 "-p", '{"spec": {"runPolicy": {"suspend": true}}}')
        wait_phase(stalwart_cluster, name, "Suspended")
        wait_for("the pods to be deleted", lambda: pods(stalwart_cluster, name) == [])
        # Suspension keeps the job's etcd state (so that it resumes where it was).
        with Store([stalwart_cluster.etcd_endpoint], timeout=10.0) as store:
            assert store.count_prefix(JobKeys(NAMESPACE, uid).prefix) > 0

        stalwart_cluster.kubectl("patch", "tj", name, "-n", NAMESPACE, "--type=merge",
                                 "-p", '{"spec": {"runPolicy": {"suspend": false}}}')
        wait_phase(stalwart_cluster, name, "Running")
        # The new pods' ranks start from the checkpoint the suspended ones left, not from step 0.
        def resumed_from() -> int | None:
            for pod in pods(stalwart_cluster, name):
                starts = [e for e in training_events(stalwart_cluster, pod["metadata"]["name"])
                          if e.get("event") == "start"]
                if starts:
                    return int(starts[0]["step"])
            return None
        assert wait_for("a rank to start", resumed_from) >= 10
    finally:
        delete(stalwart_cluster, name)


def test_restart_budget_exhausted_fails_with_the_reason(stalwart_cluster: LocalCluster) -> None:
    job = example_job("budget", ["--steps", "100000", "--checkpoint-every", "1000"],
                      {FAIL_AT_STEP_ENV: "5", FAIL_TIMES_ENV: "1000"},
                      restartPolicy={"inProcess": {"maxRestarts": 2}, "backoffLimit": 0})
    name = job["metadata"]["name"]
    apply(stalwart_cluster, job)
    try:
        st = wait_phase(stalwart_cluster, name, "Failed", "Succeeded", timeout=300)
        assert st["phase"] == "Failed"
        failed = [c for c in st.get("conditions", []) if c["type"] == "Failed" and c["status"] == "True"]
        assert failed, st
        assert failed[0]["reason"] and failed[0]["message"]
        assert st["restarts"]["inProcess"] >= 2
        # The reason is visible to kubectl describe (an Event on the job).
        events = stalwart_cluster.kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                                          f"involvedObject.name={name}", "-o", "name").stdout
        assert events.strip()
    finally:
        delete(stalwart_cluster, name)


def test_delete_removes_pods_and_the_etcd_prefix(stalwart_cluster: LocalCluster) -> None:
    job = example_job("delete", ["--steps", "100000", "--step-delay", "0.05"])
    name = job["metadata"]["name"]
    apply(stalwart_cluster, job)
    wait_phase(stalwart_cluster, name, "Running")
    uid = get_job(stalwart_cluster, name)["metadata"]["uid"]
    prefix = JobKeys(NAMESPACE, uid).prefix
    with Store([stalwart_cluster.etcd_endpoint], timeout=10.0) as store:
        wait_for("the job's etcd records", lambda: store.count_prefix(prefix) > 0)
        stalwart_cluster.kubectl("delete", "tj", name, "-n", NAMESPACE, "--timeout=120s")
        wait_for("the job's pods to go", lambda: pods(stalwart_cluster, name) == [], timeout=120)
        # A pod that was still stopping when the finalizer ran may leave keys on its lease; they go with it.
        try:
            wait_for("the job's etcd prefix to be empty", lambda: store.count_prefix(prefix) == 0, timeout=60)
        except AssertionError:
            kvs, _ = store.get_prefix(prefix)
            raise AssertionError(f"left under {prefix}: {[(kv.key, kv.lease) for kv in kvs]}") from None
    assert get_job(stalwart_cluster, name) == {}


def test_invalid_manifest_is_refused_by_kubectl_apply_with_the_schema_message(
        stalwart_cluster: LocalCluster) -> None:
    bad = example_job("invalid", [], minReplicas=3)  # above replicas (2)
    result = stalwart_cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0
    assert "spec.minReplicas" in result.stderr and "must be less than or equal to replicas" in result.stderr, \
        result.stderr
    assert get_job(stalwart_cluster, bad["metadata"]["name"]) == {}
    typo = example_job("typo", [])
    typo["spec"]["replica"] = 2
    result = stalwart_cluster.kubectl("apply", "-f", "-", input=json.dumps(typo), check=False)
    assert result.returncode != 0 and 'unknown field "spec.replica"' in result.stderr, result.stderr


def test_every_example_manifest_is_accepted_by_the_api_server(stalwart_cluster: LocalCluster) -> None:
    for manifest in sorted((REPO / "examples").glob("*.yaml")):
        result = stalwart_cluster.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", str(manifest),
                                          check=False)
        assert result.returncode == 0, f"{manifest.name}: {result.stderr}"
        assert "(server dry run)" in result.stdout


def test_kubectl_explain_prints_the_field_docs(stalwart_cluster: LocalCluster) -> None:
    out = stalwart_cluster.kubectl("explain", "trainingjob.spec.restartPolicy").stdout
    assert "KIND:       TrainingJob" in out or "KIND:     TrainingJob" in out
    assert "How failures are handled" in out
    for field in ("backoffLimit", "inProcess", "rules"):
        assert field in out
    deeper = stalwart_cluster.kubectl("explain", "tj.spec.restartPolicy.inProcess.maxRestarts").stdout
    assert "maxRestarts" in deeper


def test_stalwart_demo_command_line_refuses_bad_options(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "stalwart", "demo", "--steps", "2"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "steps: expected at least 3" in result.stderr
    assert list(tmp_path.iterdir()) == [], "a refused demo must not leave a directory behind"
