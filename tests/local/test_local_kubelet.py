"""The process kubelet: environment (values, secrets, config maps, downward API), working directory, restart
policies with restart counts, graceful deletion (SIGTERM, then SIGKILL after the grace period), node loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from local_helpers import get_json, phase_is, wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def pod_manifest(name: str, ns: str, script: str, *, restart: str = "Never", extra_container: str = "",
                 extra_spec: str = "", grace: int | None = None) -> str:
    grace_line = f"  terminationGracePeriodSeconds: {grace}\n" if grace is not None else ""
    return f"""
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, labels: {{app: {name}}}}}
spec:
  restartPolicy: {restart}
{grace_line}{extra_spec}  containers:
  - name: main
    image: local/python
    command: [python3, -c, {json.dumps(script)}]
{extra_container}"""


def test_environment_from_values_secrets_config_maps_and_downward_api(
        local_cluster: LocalCluster, k8s_namespace: str, tmp_path: Path) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("-n", ns, "create", "secret", "generic", "creds", "--from-literal", "token=s3cret")
    local_cluster.kubectl("-n", ns, "create", "configmap", "settings", "--from-literal", "mode=fast",
                          "--from-literal", "level=3")
    workdir = tmp_path / "work"
    script = ("import os, json; keys = ['A', 'B', 'TOKEN', 'MODE', 'CFG_level', 'NAME', 'NS', 'IP', 'NODE'];"
              "print(json.dumps({k: os.environ.get(k) for k in keys} | {'cwd': os.getcwd()}))")
    env = f"""    workingDir: {workdir}
    envFrom:
    - {{prefix: CFG_, configMapRef: {{name: settings}}}}
    env:
    - {{name: A, value: one}}
    - {{name: B, value: "$(A)-two"}}
    - {{name: TOKEN, valueFrom: {{secretKeyRef: {{name: creds, key: token}}}}}}
    - {{name: MODE, valueFrom: {{configMapKeyRef: {{name: settings, key: mode}}}}}}
    - {{name: NAME, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    - {{name: NS, valueFrom: {{fieldRef: {{fieldPath: metadata.namespace}}}}}}
    - {{name: IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
    - {{name: NODE, valueFrom: {{fieldRef: {{fieldPath: spec.nodeName}}}}}}
"""
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("envpod", ns, script, extra_container=env))
    pod = wait_until(lambda: phase_is(local_cluster, ns, "envpod", "Succeeded", "Failed"), "envpod to finish")
    assert pod["status"]["phase"] == "Succeeded"
    seen = json.loads(local_cluster.kubectl("-n", ns, "logs", "envpod").stdout)
    assert seen == {"A": "one", "B": "one-two", "TOKEN": "s3cret", "MODE": "fast", "CFG_level": "3",
                    "NAME": "envpod", "NS": ns, "IP": pod["status"]["podIP"], "NODE": pod["spec"]["nodeName"],
                    "cwd": str(workdir)}
    assert pod["spec"]["nodeName"] in local_cluster.nodes


def test_missing_secret_keeps_the_container_waiting_until_it_exists(
        local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    env = "    env:\n    - {name: T, valueFrom: {secretKeyRef: {name: later, key: t}}}\n"
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("waits", ns, "import os; print(os.environ['T'])",
                                                                 extra_container=env))

    def waiting() -> str | None:
        statuses = get_json(local_cluster, "-n", ns, "pod", "waits")["status"].get("containerStatuses") or []
        return (statuses[0]["state"].get("waiting") or {}).get("reason") if statuses else None

    assert wait_until(waiting, "CreateContainerConfigError") == "CreateContainerConfigError"
    local_cluster.kubectl("-n", ns, "create", "secret", "generic", "later", "--from-literal", "t=now")
    wait_until(lambda: phase_is(local_cluster, ns, "waits", "Succeeded"), "waits to succeed")
    assert local_cluster.kubectl("-n", ns, "logs", "waits").stdout == "now\n"


def test_restart_policy_on_failure_restarts_until_success(local_cluster: LocalCluster, k8s_namespace: str,
                                                          tmp_path: Path) -> None:
    ns = k8s_namespace
    counter = tmp_path / "count"
    script = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) + 1 "
              "if p.exists() else 1; p.write_text(str(n)); print('attempt', n); sys.exit(0 if n >= 3 else 1)")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("flaky", ns, script, restart="OnFailure"))
    pod = wait_until(lambda: phase_is(local_cluster, ns, "flaky", "Succeeded", "Failed"), "flaky to finish",
                     timeout=90)
    assert pod["status"]["phase"] == "Succeeded"
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 2
    assert status["state"]["terminated"]["exitCode"] == 0
    assert local_cluster.kubectl("-n", ns, "logs", "flaky").stdout == "attempt 3\n"
    assert local_cluster.kubectl("-n", ns, "logs", "flaky", "--previous").stdout == "attempt 2\n"


def test_restart_policy_never_leaves_a_failed_pod(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("once", ns, "raise SystemExit(7)"))
    pod = wait_until(lambda: phase_is(local_cluster, ns, "once", "Failed"), "once to fail")
    status = pod["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0 and status["state"]["terminated"]["exitCode"] == 7
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"


def test_running_pod_is_ready_and_deletion_sends_sigterm(local_cluster: LocalCluster, k8s_namespace: str,
                                                         tmp_path: Path) -> None:
    ns = k8s_namespace
    marker = tmp_path / "got-sigterm"
    script = ("import signal, sys, time, pathlib\n"
              f"def bye(*_):\n    pathlib.Path({str(marker)!r}).write_text('yes'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, bye)\nprint('up', flush=True)\nwhile True: time.sleep(0.1)\n")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("svc", ns, script, restart="Always", grace=30))

    def ready() -> dict[str, Any] | None:
        pod = get_json(local_cluster, "-n", ns, "pod", "svc")
        conds = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
        return pod if pod["status"].get("phase") == "Running" and conds.get("Ready") == "True" else None

    wait_until(ready, "svc to be Running and Ready")
    local_cluster.kubectl("-n", ns, "delete", "pod", "svc", "--wait=true", "--timeout=60s")
    assert marker.read_text() == "yes"
    assert local_cluster.kubectl("-n", ns, "get", "pod", "svc", check=False).returncode != 0


def test_deletion_kills_after_the_grace_period(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('stubborn', flush=True)\n"
              "while True: time.sleep(0.1)\n")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("stubborn", ns, script, restart="Always"))
    wait_until(lambda: phase_is(local_cluster, ns, "stubborn", "Running"), "stubborn to run")
    wait_until(lambda: local_cluster.kubectl("-n", ns, "logs", "stubborn").stdout, "stubborn to print")
    pid = int(get_json(local_cluster, "-n", ns, "pod", "stubborn")["status"]["containerStatuses"][0]
              ["containerID"].split("//")[1])
    local_cluster.kubectl("-n", ns, "delete", "pod", "stubborn", "--grace-period=1", "--wait=false")
    pod = get_json(local_cluster, "-n", ns, "pod", "stubborn")
    assert pod["metadata"]["deletionTimestamp"] and pod["metadata"]["deletionGracePeriodSeconds"] == 1
    wait_until(lambda: local_cluster.kubectl("-n", ns, "get", "pod", "stubborn", check=False).returncode != 0,
               "stubborn to be removed")
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_lose_node_fails_its_pods_and_others_keep_running(local_cluster: LocalCluster,
                                                          k8s_namespace: str) -> None:
    ns = k8s_namespace
    script = "import time\nprint('alive', flush=True)\nwhile True: time.sleep(0.1)\n"
    victim, survivor = local_cluster.nodes[-1], local_cluster.nodes[0]
    for name, node in (("on-victim", victim), ("on-survivor", survivor)):
        local_cluster.kubectl("apply", "-f", "-", input=pod_manifest(
            name, ns, script, restart="Always", extra_spec=f"  nodeName: {node}\n"))
    for name in ("on-victim", "on-survivor"):
        wait_until(lambda name=name: phase_is(local_cluster, ns, name, "Running"), f"{name} to run")
    try:
        failed = local_cluster.lose_node(victim)
        assert f"{ns}/on-victim" in failed
        pod = get_json(local_cluster, "-n", ns, "pod", "on-victim")
        assert pod["status"]["phase"] == "Failed" and pod["status"]["reason"] == "NodeLost"
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
        node = get_json(local_cluster, "node", victim)
        assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["Unknown"]
        assert phase_is(local_cluster, ns, "on-survivor", "Running")
        # A new pod is not scheduled onto the lost node.
        local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("fresh", ns, "print('hi')"))
        fresh = wait_until(lambda: phase_is(local_cluster, ns, "fresh", "Succeeded"), "fresh to succeed")
        assert fresh["spec"]["nodeName"] != victim
        # Deleting a pod of the lost node removes it at once.
        local_cluster.kubectl("-n", ns, "delete", "pod", "on-victim", "--wait=true", "--timeout=30s")
    finally:
        local_cluster.restore_node(victim)
    node = get_json(local_cluster, "node", victim)
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]


def test_pods_get_distinct_loopback_addresses(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    script = ("import socket, os\ns = socket.socket(); s.bind((os.environ['IP'], 0)); print('bound')\n")
    env = "    env:\n    - {name: IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}\n"
    for i in range(3):
        local_cluster.kubectl("apply", "-f", "-", input=pod_manifest(f"ip{i}", ns, script, extra_container=env))
    pods = [wait_until(lambda i=i: phase_is(local_cluster, ns, f"ip{i}", "Succeeded", "Failed"), f"ip{i}")
            for i in range(3)]
    assert [p["status"]["phase"] for p in pods] == ["Succeeded"] * 3
    assert len({p["status"]["podIP"] for p in pods}) == 3
    assert local_cluster.kubectl("-n", ns, "logs", "-l", "app=ip0").stdout == "bound\n"


def test_readiness_and_liveness_probes(local_cluster: LocalCluster, k8s_namespace: str, tmp_path: Path) -> None:
    ns = k8s_namespace
    flag = tmp_path / "ready"
    script = ("import http.server, os\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200 if self.path == '/ok' else 500); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer((os.environ['IP'], 8080), H).serve_forever()\n")
    probes = f"""    env:
    - {{name: IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
    ports: [{{name: http, containerPort: 8080}}]
    readinessProbe:
      exec: {{command: [test, -e, {flag}]}}
      periodSeconds: 1
      failureThreshold: 1
    livenessProbe:
      httpGet: {{path: /ok, port: http}}
      periodSeconds: 1
"""
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("probed", ns, script, restart="Always",
                                                                 extra_container=probes))

    def conditions() -> dict[str, str]:
        pod = get_json(local_cluster, "-n", ns, "pod", "probed")
        return {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}

    wait_until(lambda: phase_is(local_cluster, ns, "probed", "Running"), "probed to run")
    assert conditions()["Ready"] == "False"  # the readiness file does not exist yet
    flag.write_text("")
    wait_until(lambda: conditions().get("Ready") == "True", "the readiness probe to pass")
    flag.unlink()
    wait_until(lambda: conditions().get("Ready") == "False", "the readiness probe to fail again")
    pod = get_json(local_cluster, "-n", ns, "pod", "probed")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0  # the liveness probe passes


def test_processes_a_container_leaves_behind_end_with_it(local_cluster: LocalCluster, k8s_namespace: str,
                                                          tmp_path: Path) -> None:
    ns = k8s_namespace
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, pathlib\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "start_new_session=True)\n"
              f"pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))\n")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("leaver", ns, script))
    wait_until(lambda: phase_is(local_cluster, ns, "leaver", "Succeeded"), "leaver to finish")
    child = int(pid_file.read_text())

    def gone() -> bool:
        status = Path(f"/proc/{child}/status")
        try:
            return "zombie" in status.read_text()
        except OSError:
            return True

    wait_until(gone, "the detached child to be killed")


def test_scheduling_honours_cordon_taints_and_node_selectors(local_cluster: LocalCluster,
                                                             k8s_namespace: str) -> None:
    ns = k8s_namespace
    first, *others = local_cluster.nodes
    for node in others:
        local_cluster.kubectl("cordon", node)
    try:
        local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("a", ns, "print(1)"))
        assert wait_until(lambda: phase_is(local_cluster, ns, "a", "Succeeded"), "a")["spec"]["nodeName"] == first
        local_cluster.kubectl("taint", "node", first, "dedicated=x:NoSchedule")
        try:
            local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("b", ns, "print(1)"))
            pod = get_json(local_cluster, "-n", ns, "pod", "b")
            assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
            tolerant = ("  tolerations: [{key: dedicated, operator: Equal, value: x, effect: NoSchedule}]\n"
                        f"  nodeSelector: {{kubernetes.io/hostname: {first}}}\n")
            local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("c", ns, "print(1)", extra_spec=tolerant))
            assert wait_until(lambda: phase_is(local_cluster, ns, "c", "Succeeded"), "c")["spec"]["nodeName"] == first
        finally:
            local_cluster.kubectl("taint", "node", first, "dedicated=x:NoSchedule-")
    finally:
        for node in others:
            local_cluster.kubectl("uncordon", node)
    wait_until(lambda: phase_is(local_cluster, ns, "b", "Succeeded"), "b to run once a node is free")
