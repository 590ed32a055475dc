"""The operator's process on SIGTERM (what a Deployment's rollout sends): it ends its own way, every etcd stream
closed, within its bound, which is inside the chart's grace period (stalwart/exits.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chart_rbac import OperatorAccount
from test_operator_cluster import Jobs, free_port, job_body, wait_for

from stalwart.cli.operator import OPERATOR_EXIT_BOUND
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

#: Scheduling slack on a loaded two-core machine, beyond the bound the operator itself keeps.
SLACK = 5.0
CHART_GRACE = 30.0


def test_the_operator_ends_within_its_grace_period_on_sigterm(
        local_cluster: LocalCluster, trainingjob_crd: None, operator_account: OperatorAccount, jobs: Jobs,
        tmp_path: Path) -> None:
    assert OPERATOR_EXIT_BOUND + SLACK <= CHART_GRACE
    k8s_namespace = jobs.ns
    operator_account.grant(k8s_namespace)
    log = (tmp_path / "operator.log").open("w+")
    cmd = [sys.executable, "-m", "stalwart", "operator", "--namespace", k8s_namespace, "--kubeconfig",
           str(operator_account.kubeconfig), "--etcd-endpoints", str(local_cluster.etcd_endpoint),
           "--health-host", "127.0.0.1", "--health-port", str(free_port()), "--agent-command", ""]
    operator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        # A job whose status the operator keeps: writing its record in etcd opened an etcd client with a
        # watch on the jobs' keys and a keep-alive thread.
        jobs.create(job_body("exit", replicas=1, command=["sleep", "300"]))
        wait_for("the operator to write the job's status", lambda: jobs.status("exit").get("phase"), timeout=120)
        operator.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = operator.wait(timeout=OPERATOR_EXIT_BOUND + SLACK)
        took = time.monotonic() - sent
    finally:
        if operator.poll() is None:
            operator.kill()
        operator.wait(timeout=10)
        jobs.delete("exit")
    log.seek(0)
    text = log.read()
    assert code == 0, text[-4000:]
    assert took <= OPERATOR_EXIT_BOUND + SLACK
    assert "leaving with exit code 0" in text, text[-4000:]
    # Nothing overran: every Store (and so every watch and keep-alive stream) closed before the exit.
    assert "had to leave" not in text, text[-4000:]
