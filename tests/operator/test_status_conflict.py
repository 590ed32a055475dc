"""The operator writes a job's status only onto the version it computed it from: when someone else wrote in
between (another operator replica, an operator that restarted, a user), the patch is refused (409) and the status
is computed again from what the API holds, so no count is lost or made twice. Against the local cluster's API."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from stalwart.local.cluster import LocalCluster
from stalwart.operator.etcd_access import EtcdAccess
from stalwart.operator.handlers import kube_from_config
from stalwart.operator.model import PodView, ReconcileSettings
from stalwart.operator.runner import JobRunner, OperatorContext

pytestmark = pytest.mark.integration

GROUP, VERSION, PLURAL = "stalwart.dev", "v1alpha1", "trainingjobs"


def get(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl("get", "tj", name, "-n", ns, "-o", "json").stdout)
    return out


def test_a_status_written_by_someone_else_is_not_overwritten(local_cluster: LocalCluster, k8s_namespace: str,
                                                               trainingjob_crd: None) -> None:
    ns = k8s_namespace
    job = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": "cas", "namespace": ns},
           "spec": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "trainer", "image": "img", "command": ["sleep", "600"]}]}}}}
    local_cluster.kubectl("apply", "-f", "-", input=json.dumps(job))
    kube = kube_from_config(str(local_cluster.kubeconfig), 4)
    etcd = EtcdAccess()
    ctx = OperatorContext(kube=kube, etcd=etcd, settings=ReconcileSettings(status_interval=0.01),
                          default_endpoints=(str(local_cluster.etcd_endpoint),), agent_command=())
    runner = JobRunner(ctx, ns, "cas")

    async def scenario() -> None:
        first = await runner.step(get(local_cluster, ns, "cas"), [])
        assert first.requeue_after != 0.2 and runner.resource_version is not None
        written = get(local_cluster, ns, "cas")["status"]
        assert written["restarts"] == {"inProcess": 0, "processRestarts": 0, "podReplacements": 0}
        # Someone else writes the status (here: a replica that replaced a pod and counted it).
        other = {**written, "restarts": {**written["restarts"], "podReplacements": 3}}
        local_cluster.kubectl("patch", "tj", "cas", "-n", ns, "--subresource=status", "--type=merge",
                              "-p", json.dumps({"status": other}))
        # This runner has something new to say (its pod runs), computed from the version before that write.
        running = [PodView(name="cas-worker-0", role="worker", index=0, phase="Running", ready=True)]
        stale = await runner.step(get(local_cluster, ns, "cas"), running)
        assert stale.requeue_after == 0.2  # refused: it looks again at once
        assert get(local_cluster, ns, "cas")["status"]["restarts"]["podReplacements"] == 3
        # Computed again from what the API holds: the other writer's count stays, and is not counted again.
        await runner.step(get(local_cluster, ns, "cas"), running)
        status = get(local_cluster, ns, "cas")["status"]
        assert status["restarts"]["podReplacements"] == 3 and status["replicas"] == 1

    try:
        asyncio.run(scenario())
    finally:
        etcd.close()
        kube.close()
        local_cluster.kubectl("delete", "tj", "cas", "-n", ns, "--wait=false", check=False)
