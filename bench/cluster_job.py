"""The benchmarks' TrainingJobs on a local cluster with the operator: the cluster brought up (and down), a job
applied, its status read and waited on, every pod's log kept, the rank events parsed from them, and the agents'
progress records (the marks of the recoveries: :mod:`stalwart.api.recovery`) read before the job goes.

Shared by bench/podloss.py and bench/sharded.py, whose cases differ only in the job and the fault.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stalwart.api.restart import ProgressRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError
from stalwart.local.cluster import LocalCluster
from stalwart.local.settings import LocalClusterSettings, network_from_env

ROOT = Path(__file__).resolve().parent.parent
Events = list[dict[str, Any]]


def parse(text: str) -> Events:
    """The JSON event lines of a log (a rank's ``{"event": ...}`` lines among the agent's own)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


@contextlib.contextmanager
def operated_cluster(namespace: str, prefix: str) -> Iterator[LocalCluster]:
    """A local cluster of three nodes with the CRD, ``namespace`` and an embedded operator watching it (its
    status every 0.5 s); all of it stopped at the end. ``$STALWART_LOCAL_NETWORK`` picks the nodes' network as
    the tests' sessions take it (auto: a namespace per node when run as root, its traffic over veth pairs and a
    bridge; loopback: every pod on the host's loopback, as an anchor that runs outside the cluster is)."""
    from stalwart.operator.embedded import EmbeddedOperator
    from stalwart.operator.handlers import OperatorRunConfig
    from stalwart.operator.model import ReconcileSettings

    cluster = LocalCluster.up(Path(tempfile.mkdtemp(prefix=prefix)), nodes=3, timeout=120.0,
                              settings=LocalClusterSettings(network=network_from_env()))
    try:
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "trainingjob.yaml"))
        cluster.kubectl("create", "namespace", namespace)
        op = EmbeddedOperator(OperatorRunConfig(namespaces=(namespace,),
                                                default_endpoints=(str(cluster.etcd_endpoint),),
                                                settings=ReconcileSettings(status_interval=0.5)),
                              str(cluster.kubeconfig)).start()
        try:
            yield cluster
        finally:
            op.stop()
    finally:
        cluster.down()


class ClusterJob:
    """One TrainingJob, applied at construction; the logs of its pods as :meth:`keep_log` and :meth:`finish`
    took them (a pod's log is gone with the pod, so the victim's is kept before the fault)."""

    def __init__(self, cluster: LocalCluster, namespace: str, body: dict[str, Any]) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, str(body["metadata"]["name"])
        self.logs: dict[str, str] = {}
        #: The agents' progress records as :meth:`finish` read them, before the job was deleted.
        self.records: list[ProgressRecord] = []
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))

    def status(self) -> dict[str, Any]:
        got = self.cluster.kubectl("get", "tj", self.name, "-n", self.namespace, "-o", "json", check=False)
        return (json.loads(got.stdout).get("status") or {}) if got.returncode == 0 else {}

    def wait(self, what: str, check: Callable[[], Any], timeout: float) -> Any:
        """``check()``'s first truthy result, polled every 0.2 s; RuntimeError naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not (result := check()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: timed out waiting for {what}; status {self.status()}")
            time.sleep(0.2)
        return result

    def wait_for_step(self, step: int, timeout: float) -> None:
        self.wait(f"step {step}", lambda: (self.status().get("progress") or {}).get("step", 0) >= step, timeout)

    def keep_log(self, pod: str) -> None:
        got = self.cluster.kubectl("logs", pod, "-n", self.namespace, check=False)
        if got.returncode == 0:
            self.logs[pod] = got.stdout

    def finish(self, timeout: float) -> dict[str, Any]:
        """Wait for the job to end, keep every pod's log and delete the job; its final status. RuntimeError
        when it failed."""
        st: dict[str, Any] = self.wait(
            "the end", lambda: (s := self.status()).get("phase") in ("Succeeded", "Failed") and s, timeout)
        if st["phase"] != "Succeeded":
            raise RuntimeError(f"{self.name} failed: {st}")
        pods = json.loads(self.cluster.kubectl("get", "pods", "-n", self.namespace, "-o", "json").stdout)["items"]
        for p in pods:
            if p["metadata"]["name"].startswith(self.name):
                self.keep_log(p["metadata"]["name"])
        self.records = self.progress()
        self.cluster.kubectl("delete", "tj", self.name, "-n", self.namespace, "--wait=false", check=False)
        return st

    def progress(self) -> list[ProgressRecord]:
        """Every agent's progress record of the job, read from the cluster's etcd now."""
        got = self.cluster.kubectl("get", "tj", self.name, "-n", self.namespace, "-o", "json")
        keys = JobKeys(self.namespace, str(json.loads(got.stdout)["metadata"]["uid"]))
        try:
            with Store([str(self.cluster.etcd_endpoint)], timeout=5.0) as store:
                kvs, _ = store.get_prefix(keys.progress)
        except StoreError as e:  # the rows say that the marks are missing; the run's other figures stand
            print(f"{self.name}: cannot read the progress records: {e}", file=sys.stderr)
            return []
        return [ProgressRecord.from_json_bytes(kv.value) for kv in kvs]

    def events(self, pod: str | None = None) -> Events:
        """The rank events of one pod's log, or of every kept log."""
        if pod is not None:
            return parse(self.logs.get(pod, ""))
        return [e for text in self.logs.values() for e in parse(text)]
