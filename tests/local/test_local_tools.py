"""kopf, the Helm library and the ``stalwart local`` commands against the local cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from local_helpers import ensure_widget_crd, get_json, phase_is, wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent


def test_kopf_operator_reacts_to_create_update_delete(local_cluster: LocalCluster, k8s_namespace: str,
                                                      tmp_path: Path) -> None:
    ensure_widget_crd(local_cluster)
    ns = k8s_namespace
    log = open(tmp_path / "kopf.log", "w")  # noqa: SIM115 - closed below
    op = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "-n", ns,
                           str(HERE / "kopf_widget_operator.py")], stdout=log, stderr=subprocess.STDOUT,
                          env={**os.environ, **local_cluster.env()})
    try:
        local_cluster.kubectl("apply", "-f", "-", input=(
            f"apiVersion: example.dev/v1\nkind: Widget\nmetadata: {{name: k, namespace: {ns}}}\n"
            "spec: {replicas: 2}\n"))

        def status_is(phase: str, replicas: int) -> dict[str, Any] | None:
            obj: dict[str, Any] = get_json(local_cluster, "-n", ns, "widget", "k")
            st = obj.get("status") or {}
            return obj if st.get("phase") == phase and st.get("replicas") == replicas else None

        obj = wait_until(lambda: status_is("Created", 2), "kopf to handle the creation", timeout=90)
        assert "widgets.example.dev/kopf-finalizer" in obj["metadata"]["finalizers"]
        local_cluster.kubectl("-n", ns, "patch", "widget", "k", "--type", "merge", "-p", '{"spec": {"replicas": 5}}')
        wait_until(lambda: status_is("Updated", 5), "kopf to handle the update", timeout=90)
        local_cluster.kubectl("-n", ns, "delete", "widget", "k", "--wait=true", "--timeout=90s")
        cm = get_json(local_cluster, "-n", ns, "configmap", "deleted-k")
        assert cm["data"] == {"by": "kopf"}
        assert local_cluster.kubectl("-n", ns, "get", "widget", "k", check=False).returncode != 0
    finally:
        op.terminate()
        try:
            op.wait(timeout=30)
        except subprocess.TimeoutExpired:
            op.kill()
            op.wait()
        log.close()
    text = (tmp_path / "kopf.log").read_text()
    assert "Traceback" not in text, text[-4000:]


CHART = {
    "Chart.yaml": "apiVersion: v2\nname: demo\nversion: 0.1.0\n",
    "values.yaml": "greeting: hello\nreplicas: 1\n",
    "templates/all.yaml": """apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ .Release.Name }}-config
data:
  greeting: {{ .Values.greeting | quote }}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ .Release.Name }}-sa
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}-op
spec:
  replicas: {{ .Values.replicas }}
  selector: {matchLabels: {app: demo}}
  template:
    metadata: {labels: {app: demo}}
    spec:
      serviceAccountName: {{ .Release.Name }}-sa
      containers:
      - {name: op, image: "demo:1", command: [sleep, "100"]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: {{ .Release.Name }}-role}
rules:
- {apiGroups: [""], resources: [pods], verbs: [get, list]}
""",
}


def test_helm_install_upgrade_uninstall(local_cluster: LocalCluster, k8s_namespace: str, tmp_path: Path) -> None:
    import helm_python as helm

    chart = tmp_path / "demo"
    for rel, text in CHART.items():
        (chart / rel).parent.mkdir(parents=True, exist_ok=True)
        (chart / rel).write_text(text)
    ns = k8s_namespace
    with helm.Config(kubeconfig_path=str(local_cluster.kubeconfig), namespace=ns) as cfg:
        cfg.install(str(chart), "rel", {"greeting": "hi"})
        assert cfg.status("rel")["status"] == "deployed"
        assert get_json(local_cluster, "-n", ns, "configmap", "rel-config")["data"] == {"greeting": "hi"}
        assert get_json(local_cluster, "-n", ns, "deployment", "rel-op")["spec"]["replicas"] == 1
        wait_until(lambda: ready_replicas(local_cluster, ns, "rel-op") == 1, "the Deployment's pod to be ready")
        cfg.upgrade(str(chart), "rel", {"greeting": "bye", "replicas": 2})
        assert cfg.status("rel")["revision"] == 2
        assert get_json(local_cluster, "-n", ns, "configmap", "rel-config")["data"] == {"greeting": "bye"}
        assert get_json(local_cluster, "-n", ns, "deployment", "rel-op")["spec"]["replicas"] == 2
        wait_until(lambda: ready_replicas(local_cluster, ns, "rel-op") == 2, "two ready pods after the upgrade")
        secrets = get_json(local_cluster, "-n", ns, "secrets", "-l", "owner=helm")["items"]
        assert sorted(s["metadata"]["name"] for s in secrets) == ["sh.helm.release.v1.rel.v1",
                                                                  "sh.helm.release.v1.rel.v2"]
        cfg.uninstall("rel")
        assert cfg.list() == []
    for kind in ("configmap/rel-config", "deployment/rel-op", "serviceaccount/rel-sa", "role/rel-role"):
        assert local_cluster.kubectl("-n", ns, "get", kind, check=False).returncode != 0, kind
    assert get_json(local_cluster, "-n", ns, "secrets", "-l", "owner=helm")["items"] == []
    wait_until(lambda: not get_json(local_cluster, "-n", ns, "pods", "-l", "app=demo")["items"],
               "the Deployment's pods to go with it")


def ready_replicas(cluster: LocalCluster, ns: str, name: str) -> int:
    status = get_json(cluster, "-n", ns, "deployment", name).get("status") or {}
    pods = get_json(cluster, "-n", ns, "pods", "-l", "app=demo")["items"]
    running = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    return int(status.get("readyReplicas", 0)) if len(running) == int(status.get("readyReplicas", 0)) else -1


def test_cli_up_status_down_leaves_no_process(tmp_path: Path) -> None:
    d = tmp_path / "cluster"
    env = {**os.environ}
    run = [sys.executable, "-m", "stalwart", "local"]
    bad = subprocess.run([*run, "up", "--dir", str(d), "--node-cpu", "1x"], capture_output=True, text=True,
                         env=env, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("--node-cpu: ") and "'1x'" in bad.stderr, bad.stderr
    assert bad.stdout == ""
    assert not (d / "state.json").exists()
    up = subprocess.run([*run, "up", "--dir", str(d), "--nodes", "1", "--node-cpu", "3", "--node-memory", "4Gi",
                         "--node-gpus", "2", "--node-monitor-grace-period", "5",
                         "--default-unreachable-toleration-seconds", "7"],
                        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"export KUBECONFIG={d.resolve() / 'kubeconfig'}" in up.stdout
    cluster = LocalCluster.attach(d)
    try:
        again = subprocess.run([*run, "up", "--dir", str(d)], capture_output=True, text=True, env=env,
                               timeout=120, check=False)
        assert again.returncode == 1 and "already runs" in again.stderr
        status = subprocess.run([*run, "status", "--dir", str(d), "-o", "json"], capture_output=True, text=True,
                                env=env, timeout=60, check=False)
        assert status.returncode == 0 and '"ready": true' in status.stdout
        cluster.kubectl("apply", "-f", "-", input=(
            "apiVersion: v1\nkind: Pod\nmetadata: {name: sleeper}\nspec:\n  containers:\n"
            "  - {name: c, image: x, command: [python3, -c, 'import time; time.sleep(600)']}\n"))
        pod = wait_until(lambda: phase_is(cluster, "default", "sleeper", "Running"), "sleeper to run")
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].split("//")[1])
        # The flags set the node's capacity and the pods' default toleration of an unreachable node.
        node = get_json(cluster, "node", "local-0")
        assert node["status"]["capacity"] | {"ephemeral-storage": "", "pods": ""} == {
            "cpu": "3", "memory": "4Gi", "nvidia.com/gpu": "2", "ephemeral-storage": "", "pods": ""}
        assert {t["key"]: t["tolerationSeconds"] for t in pod["spec"]["tolerations"]} == {
            "node.kubernetes.io/not-ready": 300, "node.kubernetes.io/unreachable": 7}
        assert cluster.settings.node_monitor_grace_period == 5
    finally:
        down = subprocess.run([*run, "down", "--dir", str(d)], capture_output=True, text=True, env=env,
                              timeout=120, check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    for gone in (cluster.pid, cluster.etcd_pid, pid):
        assert gone is not None
        assert not Path(f"/proc/{gone}").exists() or "zombie" in Path(f"/proc/{gone}/status").read_text().lower()
    status = subprocess.run([*run, "status", "--dir", str(d)], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    assert status.returncode == 1 and "not running" in status.stderr


def test_a_cluster_with_an_owner_stops_when_the_owner_is_gone(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        cluster = LocalCluster.up(tmp_path / "owned", nodes=1, owner_pid=owner.pid, timeout=120)
    finally:
        owner.kill()
        owner.wait()

    def gone(pid: int) -> bool:
        try:
            return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        except OSError:
            return True

    wait_until(lambda: gone(cluster.pid) and gone(cluster.etcd_pid or 0), "the cluster to stop", timeout=60)
