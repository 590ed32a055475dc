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
