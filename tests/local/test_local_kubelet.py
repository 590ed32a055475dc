"""The process kubelet: environment (values, secrets, config maps, downward API), working directory, restart
policies with restart counts, graceful deletion as a container runtime does it (SIGTERM to the main process
only, SIGKILL to all of the container's processes after the grace period), and the agent passing SIGTERM on to
its ranks under those rules. Node loss: test_local_nodes.py."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from local_helpers import get_json, phase_is, wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


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


def test_deletion_kills_after_the_grace_period(local_cluster: LocalCluster, kube_api: Any,
                                               k8s_namespace: str) -> None:
    ns = k8s_namespace
    script = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('stubborn', flush=True)\n"
              "while True: time.sleep(0.1)\n")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("stubborn", ns, script, restart="Always"))
    wait_until(lambda: phase_is(local_cluster, ns, "stubborn", "Running"), "stubborn to run")
    wait_until(lambda: local_cluster.kubectl("-n", ns, "logs", "stubborn").stdout, "stubborn to print")
    pid = int(get_json(local_cluster, "-n", ns, "pod", "stubborn")["status"]["containerStatuses"][0]
              ["containerID"].split("//")[1])
    # The API's answer to the deletion is the pod as it stays meanwhile (a kubectl get afterwards could come
    # after the grace period on a busy machine).
    deleted = k8s.CoreV1Api(kube_api).delete_namespaced_pod("stubborn", ns, grace_period_seconds=1)
    assert deleted.metadata.deletion_timestamp and deleted.metadata.deletion_grace_period_seconds == 1
    wait_until(lambda: local_cluster.kubectl("-n", ns, "get", "pod", "stubborn", check=False).returncode != 0,
               "stubborn to be removed")
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_sigterm_goes_to_the_main_process_only_and_sigkill_to_all_at_the_end_of_the_grace_period(
        local_cluster: LocalCluster, k8s_namespace: str, tmp_path: Path) -> None:
    # The main process starts a child in its own process group and does not pass SIGTERM on; both note
    # whatever SIGTERM they get. A runtime signals the main process only, and SIGKILLs the rest at the end.
    ns = k8s_namespace
    child = ("import pathlib, signal, time\n"
             f"signal.signal(signal.SIGTERM, lambda *_: pathlib.Path({str(tmp_path / 'child.term')!r}).touch())\n"
             "while True: time.sleep(0.1)\n")
    script = ("import pathlib, signal, subprocess, sys, time\n"
              f"d = pathlib.Path({str(tmp_path)!r})\n"
              "signal.signal(signal.SIGTERM, lambda *_: (d / 'main.term').touch())\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
              "(d / 'child.pid').write_text(str(c.pid))\n"
              "while True: time.sleep(0.1)\n")
    local_cluster.kubectl("apply", "-f", "-", input=pod_manifest("parent", ns, script, restart="Always"))
    pod = wait_until(lambda: phase_is(local_cluster, ns, "parent", "Running"), "parent to run")
    main_pid = int(pod["status"]["containerStatuses"][0]["containerID"].split("//")[1])
    wait_until((tmp_path / "child.pid").exists, "the child to start")
    child_pid = int((tmp_path / "child.pid").read_text())
    assert os.getpgid(child_pid) == os.getpgid(main_pid)  # a killpg would reach it
    local_cluster.kubectl("-n", ns, "delete", "pod", "parent", "--grace-period=2", "--wait=false")
    wait_until((tmp_path / "main.term").exists, "the main process to get SIGTERM")
    wait_until(lambda: local_cluster.kubectl("-n", ns, "get", "pod", "parent", check=False).returncode != 0,
               "the pod to be removed after its grace period")
    assert not (tmp_path / "child.term").exists()
    assert not alive(main_pid) and not alive(child_pid)


def test_the_agent_passes_sigterm_on_to_its_ranks(local_cluster: LocalCluster, k8s_namespace: str,
                                                  tmp_path: Path) -> None:
    # `stalwart agent` is the container's main process, its ranks are its children: they hear of the pod's
    # deletion only if the agent passes SIGTERM on, which they note before they exit.
    ns = k8s_namespace
    rank = ("import os, pathlib, signal, sys, time\n"
            f"d = pathlib.Path({str(tmp_path)!r})\n"
            "def term(*_):\n    (d / f\"rank{os.environ['RANK']}.term\").touch(); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, term)\n"
            "(d / f\"rank{os.environ['RANK']}.up\").touch()\n"
            "while True: time.sleep(0.1)\n")
    env = {"STALWART_JOB": f"{ns}/fwd", "STALWART_JOB_UID": uuid.uuid4().hex, "STALWART_SPARE": "false",
           "STALWART_ETCD_ENDPOINTS": str(local_cluster.etcd_endpoint), "STALWART_NPROC_PER_NODE": "2",
           "STALWART_MIN_NODES": "1", "STALWART_MAX_NODES": "1"}
    env_yaml = "".join(f"    - {{name: {k}, value: {json.dumps(v)}}}\n" for k, v in env.items())
    env_yaml += ("    - {name: STALWART_NODE_ID, valueFrom: {fieldRef: {fieldPath: metadata.name}}}\n"
                 "    - {name: STALWART_POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}\n")
    manifest = f"""
apiVersion: v1
kind: Pod
metadata: {{name: agent, namespace: {ns}}}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 60
  containers:
  - name: trainer
    image: local/python
    command: [stalwart, agent, --last-call, "0.1", --, python3, -c, {json.dumps(rank)}]
    env:
{env_yaml}"""
    local_cluster.kubectl("apply", "-f", "-", input=manifest)
    wait_until(lambda: (tmp_path / "rank0.up").exists() and (tmp_path / "rank1.up").exists(),
               "both ranks to run", timeout=120)
    local_cluster.kubectl("-n", ns, "delete", "pod", "agent", "--wait=false")
    wait_until(lambda: (tmp_path / "rank0.term").exists() and (tmp_path / "rank1.term").exists(),
               "both ranks to get SIGTERM from the agent", timeout=50)


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
    hits = tmp_path / "liveness-hits"
    script = ("import http.server, os\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              f"        open({str(hits)!r}, 'a').write('.')\n"
              "        self.send_response(200 if self.path == '/ok' else 500); self.end_headers()\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer((os.environ['IP'], 8080), H).serve_forever()\n")
    # A loaded machine may take seconds to start the server or to answer: the liveness probe allows for it, as
    # a real pod's would (a server that answers must not be restarted).
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
      timeoutSeconds: 10
      initialDelaySeconds: 5
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
    # The liveness probe ran (the server counted its requests) and passed: the container was never restarted.
    wait_until(lambda: hits.exists() and len(hits.read_text()) >= 3, "three liveness probes")
    pod = get_json(local_cluster, "-n", ns, "pod", "probed")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0


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
            scheduled = wait_until(lambda: next((c for c in get_json(local_cluster, "-n", ns, "pod", "b")[
                "status"].get("conditions") or [] if c["type"] == "PodScheduled"), None), "b's PodScheduled")
            assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
            assert scheduled["message"] == (
                "0/3 nodes are available: 1 node(s) had untolerated taint {dedicated: x}, 2 node(s) were "
                "unschedulable. preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling..")
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
