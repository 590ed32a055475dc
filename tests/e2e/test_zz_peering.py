"""Several operator replicas: the chart turns kopf peering on, one replica handles TrainingJobs and the others
stand by. Runs after the other e2e tests (file order) and puts the single replica back."""

from __future__ import annotations

import json

import pytest
from e2e_jobs import apply, delete, example_job, wait_for, wait_phase

from stalwart.demo import Installation
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.e2e


def test_two_operator_replicas_share_the_work_through_peering(
        stalwart_cluster: LocalCluster, stalwart_install: Installation) -> None:
    release = stalwart_install.set_operator_replicas(2)
    try:
        assert release["status"] == "deployed"
        wait_for("two Ready operator pods", lambda: stalwart_install.operator_ready(count=2)
                 and len(stalwart_install.operator_pods()) == 2, timeout=180)
        # Both replicas registered in the peering object the chart created.
        def peers() -> list[str]:
            got = json.loads(stalwart_cluster.kubectl("get", "clusterkopfpeering", stalwart_install.release,
                                                      "-o", "json").stdout)
            return sorted((got.get("status") or {}).keys())
        pod_names = sorted(p["metadata"]["name"] for p in stalwart_install.operator_pods())
        assert wait_for("both peers in the peering object", lambda: peers() == pod_names and peers(), 120)
        # And jobs are still served.
        job = example_job("peered", ["--steps", "20"])
        apply(stalwart_cluster, job)
        try:
            wait_phase(stalwart_cluster, job["metadata"]["name"], "Succeeded", timeout=240)
        finally:
            delete(stalwart_cluster, job["metadata"]["name"])
    finally:
        stalwart_install.set_operator_replicas(1)
        wait_for("one Ready operator pod", lambda: len(stalwart_install.operator_pods()) == 1
                 and stalwart_install.operator_ready(), timeout=180)
