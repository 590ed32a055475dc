"""Issue 31, finding 11: a local cluster's pods were told the cluster's directory (the marker variable held
its path), and that directory holds the admin's kubeconfig."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.controlplane import KUBECONFIG_FILE
from stalwart.local.podenv import Placement, PodEnvironment
from stalwart.local.processes import CLUSTER_MARKER, cluster_id


def test_a_pods_environment_does_not_name_the_directory_of_the_admin_kubeconfig(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = tmp_path / "cluster"
    cluster.mkdir()
    (cluster / KUBECONFIG_FILE).write_text("admin")
    monkeypatch.setenv("KUBECONFIG", str(cluster / KUBECONFIG_FILE))  # the developer's shell points at it
    pod: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                           "spec": {"containers": [{"name": "c"}]}}
    where = Placement(uid="u1", node="node-0", ip="10.0.0.2", home=cluster / "pods" / "ns_p_u1")
    env = PodEnvironment(cast(ObjectStore, None), cluster, 6443).build(pod, where, pod["spec"]["containers"][0])
    assert env[CLUSTER_MARKER] == cluster_id(cluster) and len(env[CLUSTER_MARKER]) == 32
    assert "KUBECONFIG" not in env
    named = {k: v for k, v in env.items() if str(cluster.resolve()) in v or str(cluster) in v}
    assert named == {}, f"variables naming the cluster's directory: {sorted(named)}"


@pytest.mark.parametrize(("host", "manifest", "expected"), [
    ("1", None, "1"),  # the machine's cap reaches the pod
    (None, None, None),  # no cap: torch's own default, as on a node
    ("1", "4", "4"),  # the pod's own setting wins
])
def test_a_thread_cap_set_for_the_machine_holds_for_its_pods(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str | None, manifest: str | None,
        expected: str | None) -> None:
    """Every node of the local cluster is this machine: without the cap each rank of each pod would start a thread
    per core."""
    if host is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", host)
    container: dict[str, Any] = {"name": "c"}
    if manifest is not None:
        container["env"] = [{"name": "OMP_NUM_THREADS", "value": manifest}]
    pod: dict[str, Any] = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                           "spec": {"containers": [container]}}
    where = Placement(uid="u1", node="node-0", ip="10.0.0.2", home=tmp_path / "pods" / "ns_p_u1")
    env = PodEnvironment(cast(ObjectStore, None), tmp_path, 6443).build(pod, where, container)
    assert env.get("OMP_NUM_THREADS") == expected
