"""Install, upgrade and uninstall the chart with the real Helm library on the local cluster, and check what the
API server then holds with the real kubectl."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
from helm_render import CHART_DIR

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def get(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return out


def names(cluster: LocalCluster, kind: str, namespace: str | None = None) -> set[str]:
    scope = ["-n", namespace] if namespace else []
    return {item["metadata"]["name"] for item in get(cluster, kind, *scope)["items"]}


@pytest.fixture
def release(local_cluster: LocalCluster) -> Iterator[tuple[helm_python.Config, str, str]]:
    """A Helm configuration bound to the local cluster, a fresh release name and namespace; uninstalled after."""
    suffix = uuid.uuid4().hex[:6]
    name, namespace = f"sw-{suffix}", f"stalwart-{suffix}"
    with helm_python.Config(kubeconfig_path=str(local_cluster.kubeconfig), namespace=namespace) as config:
        try:
            yield config, name, namespace
        finally:
            config.uninstall(name, ignore_not_found=True, timeout=60)
            local_cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found",
                                  check=False)


def test_install_upgrade_uninstall(local_cluster: LocalCluster,
                                   release: tuple[helm_python.Config, str, str]) -> None:
    config, name, namespace = release
    fullname = f"{name}-stalwart"
    installed = config.install(CHART_DIR, name, {"etcd": {"enabled": True}, "metrics": {"enabled": True}},
                               namespace=namespace, create_namespace=True, timeout=120)
    assert installed["status"] == "deployed" and installed["revision"] == 1
    assert "kubectl get tj" in installed["notes"]

    # The CRDs from crds/ are served: kubectl knows the short name and explains the fields. As a user would on a
    # cluster, wait for the CRD to be established and refresh kubectl's discovery cache, which another test on
    # this cluster may have filled before the CRD existed.
    assert {"trainingjobs.stalwart.dev", "clusterkopfpeerings.kopf.dev"} <= names(local_cluster, "crd")
    local_cluster.kubectl("wait", "--for=condition=Established", "crd/trainingjobs.stalwart.dev", "--timeout=60s")
    local_cluster.kubectl("api-resources")
    explain = local_cluster.kubectl("explain", "tj.spec.restartPolicy").stdout
    assert "backoffLimit" in explain
    # The templates' objects exist as rendered.
    deployment = get(local_cluster, "deployment", f"{fullname}-operator", "-n", namespace)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert names(local_cluster, "statefulset", namespace) == {f"{fullname}-etcd"}
    assert names(local_cluster, "service", namespace) == {f"{fullname}-etcd", f"{fullname}-operator-metrics"}
    assert names(local_cluster, "serviceaccount", namespace) >= {f"{fullname}-operator"}
    assert {f"{fullname}-operator", f"{fullname}-operator-cluster"} <= names(local_cluster, "clusterrole")
    binding = get(local_cluster, "clusterrolebinding", f"{fullname}-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{fullname}-operator",
                                    "namespace": namespace}]
    # Helm keeps the release in the cluster (its Secret storage), so another client sees it.
    with helm_python.Config(kubeconfig_path=str(local_cluster.kubeconfig), namespace=namespace) as other:
        assert [r["name"] for r in other.list()] == [name]

    upgraded = config.upgrade(CHART_DIR, name, {"operator": {"replicas": 2}, "etcd": {"enabled": True}},
                              namespace=namespace, timeout=120)
    assert upgraded["revision"] == 2 and upgraded["status"] == "deployed"
    deployment = get(local_cluster, "deployment", f"{fullname}-operator", "-n", namespace)
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert f"--peering={fullname}" in container["args"]
    assert fullname in names(local_cluster, "clusterkopfpeering")
    # What the upgrade no longer renders is gone.
    assert names(local_cluster, "service", namespace) == {f"{fullname}-etcd"}
    assert [h["revision"] for h in config.history(name)] == [1, 2]

    config.uninstall(name, timeout=120)
    assert names(local_cluster, "deployment", namespace) == set()
    assert names(local_cluster, "statefulset", namespace) == set()
    assert not {f"{fullname}-operator", f"{fullname}-operator-cluster"} & names(local_cluster, "clusterrole")
    assert fullname not in names(local_cluster, "clusterkopfpeering")
    # Helm never deletes CRDs on uninstall (their objects would go with them); TrainingJobs stay served.
    assert "trainingjobs.stalwart.dev" in names(local_cluster, "crd")


def test_schema_errors_stop_an_install_before_anything_is_created(
        local_cluster: LocalCluster, release: tuple[helm_python.Config, str, str]) -> None:
    config, name, namespace = release
    with pytest.raises(helm_python.HelmError, match=r"/etcd/replicas"):
        config.install(CHART_DIR, name, {"etcd": {"enabled": True, "replicas": 2}}, namespace=namespace,
                       create_namespace=True, timeout=60)
    assert config.list(all_states=True) == []
