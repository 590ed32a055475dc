"""Authentication and RBAC on the local cluster, through the real kubectl and kubernetes client: the admin
kubeconfig, ServiceAccount tokens (``kubectl create token``, ``stalwart local kubeconfig``), Roles and bindings,
``kubectl auth can-i``, the 401 and 403 bodies, and the record of every decision."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as kconfig

from stalwart.local.cluster import LocalCluster, kubectl_binary

pytestmark = pytest.mark.integration


def as_account(cluster: LocalCluster, namespace: str, name: str, tmp_path: Path) -> Path:
    """A kubeconfig for ServiceAccount ``namespace/name`` printed by ``stalwart local kubeconfig``."""
    out = subprocess.run([sys.executable, "-m", "stalwart", "local", "kubeconfig", "--dir", str(cluster.dir),
                          "--service-account", f"{namespace}/{name}", "--duration", "900"],
                         capture_output=True, text=True, check=True, timeout=60)
    path = tmp_path / f"{name}.kubeconfig"
    path.write_text(out.stdout)
    return path


def kubectl_as(cluster: LocalCluster, config: Path, *args: str, stdin: str | None = None) -> Any:
    return subprocess.run([kubectl_binary(), "--kubeconfig", str(config), "--cache-dir", str(cluster.dir / "kc"),
                           *args], capture_output=True, text=True, timeout=60, input=stdin, check=False)


def client_as(config: Path) -> k8s.CoreV1Api:
    cfg = k8s.Configuration()
    kconfig.load_kube_config(config_file=str(config), client_configuration=cfg)
    return k8s.CoreV1Api(k8s.ApiClient(cfg))


def test_the_admin_kubeconfig_is_a_cluster_admin_over_https(local_cluster: LocalCluster) -> None:
    host = local_cluster.network.get("api_ip", "127.0.0.1")  # the bridge's address with a network per node
    assert local_cluster.api_url.startswith(f"https://{host}:")
    config = yaml.safe_load(local_cluster.kubeconfig.read_text())
    assert config["clusters"][0]["cluster"]["certificate-authority-data"]
    who = json.loads(local_cluster.kubectl("auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == "kubernetes-admin"
    assert "system:masters" in who["status"]["userInfo"]["groups"]
    assert local_cluster.kubectl("auth", "can-i", "delete", "nodes").stdout.strip() == "yes"


def test_anonymous_and_bad_tokens(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    with local_cluster.open("/healthz", token="") as resp:  # no token at all: anonymous may check health
        assert resp.read() == b"ok"
    with pytest.raises(urllib.error.HTTPError) as err:
        local_cluster.open(f"/api/v1/namespaces/{k8s_namespace}/pods", token="")
    body = json.loads(err.value.read())
    assert err.value.code == 403 and body == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'pods is forbidden: User "system:anonymous" cannot list resource "pods" in API group "" in '
                   f'the namespace "{k8s_namespace}"',
        "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403}
    with pytest.raises(urllib.error.HTTPError) as err:
        local_cluster.open("/api/v1/pods", token="made-up")
    assert err.value.code == 401 and json.loads(err.value.read()) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "Unauthorized",
        "reason": "Unauthorized", "code": 401}


def test_a_service_account_gets_what_its_roles_grant(local_cluster: LocalCluster, k8s_namespace: str,
                                                     tmp_path: Path) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("create", "serviceaccount", "bob", "-n", ns)
    bob = as_account(local_cluster, ns, "bob", tmp_path)
    who = json.loads(kubectl_as(local_cluster, bob, "auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:bob"

    denied = kubectl_as(local_cluster, bob, "get", "pods", "-n", ns)
    assert denied.returncode == 1
    assert denied.stderr.strip() == (f'Error from server (Forbidden): pods is forbidden: User '
                                     f'"system:serviceaccount:{ns}:bob" cannot list resource "pods" in API group "" '
                                     f'in the namespace "{ns}"')
    local_cluster.kubectl("create", "role", "reader", "-n", ns, "--verb=get,list,watch", "--resource=pods,configmaps")
    local_cluster.kubectl("create", "rolebinding", "bob-reads", "-n", ns, "--role=reader",
                          f"--serviceaccount={ns}:bob")
    assert kubectl_as(local_cluster, bob, "get", "pods", "-n", ns).returncode == 0
    assert kubectl_as(local_cluster, bob, "auth", "can-i", "list", "pods", "-n", ns).stdout.strip() == "yes"
    assert kubectl_as(local_cluster, bob, "auth", "can-i", "delete", "pods", "-n", ns).stdout.strip() == "no"
    assert kubectl_as(local_cluster, bob, "auth", "can-i", "list", "pods", "-n", "default").stdout.strip() == "no"

    # The kubernetes client sees the same 403 as an ApiException with the Status body.
    core = client_as(bob)
    core.list_namespaced_config_map(ns)
    with pytest.raises(k8s.ApiException) as err:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "x"}})
    assert err.value.status == 403
    assert json.loads(err.value.body)["message"] == (
        f'configmaps is forbidden: User "system:serviceaccount:{ns}:bob" cannot create resource "configmaps" in API '
        f'group "" in the namespace "{ns}"')

    # A ClusterRole bound in the namespace by a RoleBinding, restricted to one name.
    local_cluster.kubectl("create", "clusterrole", f"{ns}-one-cm", "--verb=delete", "--resource=configmaps",
                          "--resource-name=allowed")
    local_cluster.kubectl("create", "rolebinding", "bob-deletes-one", "-n", ns, f"--clusterrole={ns}-one-cm",
                          f"--serviceaccount={ns}:bob")
    for name in ("allowed", "other"):
        local_cluster.kubectl("create", "configmap", name, "-n", ns)
    assert kubectl_as(local_cluster, bob, "delete", "configmap", "allowed", "-n", ns).returncode == 0
    refused = kubectl_as(local_cluster, bob, "delete", "configmap", "other", "-n", ns)
    assert 'configmaps "other" is forbidden' in refused.stderr
    local_cluster.kubectl("delete", "clusterrole", f"{ns}-one-cm")

    # Deleting the account revokes its tokens.
    local_cluster.kubectl("delete", "serviceaccount", "bob", "-n", ns)
    gone = kubectl_as(local_cluster, bob, "get", "pods", "-n", ns)
    assert "Unauthorized" in gone.stderr


def test_kubectl_create_token_and_cluster_scope(local_cluster: LocalCluster, k8s_namespace: str,
                                                tmp_path: Path) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("create", "serviceaccount", "viewer", "-n", ns)
    token = local_cluster.kubectl("create", "token", "viewer", "-n", ns, "--duration=10m").stdout.strip()
    assert token.count(".") == 2
    with pytest.raises(urllib.error.HTTPError) as err:
        local_cluster.open("/api/v1/nodes", token=token)
    assert err.value.code == 403 and json.loads(err.value.read())["message"] == (
        f'nodes is forbidden: User "system:serviceaccount:{ns}:viewer" cannot list resource "nodes" in API group "" '
        "at the cluster scope")
    local_cluster.kubectl("create", "clusterrolebinding", f"{ns}-viewer", "--clusterrole=cluster-admin",
                          f"--serviceaccount={ns}:viewer")
    try:
        with local_cluster.open("/api/v1/nodes", token=token) as resp:
            assert json.loads(resp.read())["items"]
    finally:
        local_cluster.kubectl("delete", "clusterrolebinding", f"{ns}-viewer")
    too_short = local_cluster.kubectl("create", "token", "viewer", "-n", ns, "--duration=5m", check=False)
    assert "may not specify a duration less than 10 minutes" in too_short.stderr


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(local_cluster: LocalCluster,
                                                                  k8s_namespace: str, tmp_path: Path) -> None:
    ns = k8s_namespace
    owner = local_cluster.kubectl("create", "configmap", "owner", "-n", ns, "-o", "json").stdout
    uid = json.loads(owner)["metadata"]["uid"]
    local_cluster.kubectl("create", "serviceaccount", "maker", "-n", ns)
    local_cluster.kubectl("create", "role", "maker", "-n", ns, "--verb=create", "--resource=configmaps")
    local_cluster.kubectl("create", "rolebinding", "maker", "-n", ns, "--role=maker", f"--serviceaccount={ns}:maker")
    maker = as_account(local_cluster, ns, "maker", tmp_path)

    def dependent(name: str, block: bool) -> str:
        return yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": name, "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid,
                                               "blockOwnerDeletion": block}]}})

    assert kubectl_as(local_cluster, maker, "create", "-n", ns, "-f", "-", stdin=dependent("loose", False)
                      ).returncode == 0
    refused = kubectl_as(local_cluster, maker, "create", "-n", ns, "-f", "-", stdin=dependent("blocking", True))
    assert refused.stderr.strip().endswith(
        'configmaps "blocking" is forbidden: cannot set blockOwnerDeletion if an ownerReference refers to a resource '
        "you can't set finalizers on: , <nil>")
    local_cluster.kubectl("create", "role", "finalizers", "-n", ns, "--verb=update", "--resource=configmaps/finalizers")
    local_cluster.kubectl("create", "rolebinding", "finalizers", "-n", ns, "--role=finalizers",
                          f"--serviceaccount={ns}:maker")
    assert kubectl_as(local_cluster, maker, "create", "-n", ns, "-f", "-", stdin=dependent("blocking", True)
                      ).returncode == 0
    decisions = {(a["verb"], a["resource"], a["subresource"], a["allowed"])
                 for a in local_cluster.access(f"system:serviceaccount:{ns}:maker")}
    assert {("create", "configmaps", "", True), ("update", "configmaps", "finalizers", False),
            ("update", "configmaps", "finalizers", True)} <= decisions
