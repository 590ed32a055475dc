"""The real kubectl against the local cluster: apply (client- and server-side), get with printer columns,
describe, logs, patch, replace with a stale resourceVersion, delete, get -w, explain."""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from local_helpers import ensure_widget_crd, get_json, phase_is, wait_until

from stalwart.local.cluster import LocalCluster, kubectl_binary

pytestmark = pytest.mark.integration


def widget(name: str, ns: str, replicas: int = 2, extra: str = "") -> str:
    return (f"apiVersion: example.dev/v1\nkind: Widget\nmetadata: {{name: {name}, namespace: {ns}}}\n"
            f"spec: {{replicas: {replicas}{extra}}}\n")


def test_apply_client_side_creates_then_patches_with_defaults_and_generation(
        local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ensure_widget_crd(local_cluster)
    out = local_cluster.kubectl("apply", "-f", "-", input=widget("w1", k8s_namespace)).stdout
    assert "widget.example.dev/w1 created" in out
    obj = get_json(local_cluster, "-n", k8s_namespace, "widget", "w1")
    assert obj["spec"] == {"replicas": 2, "maxReplicas": 10, "restartPolicy": "Never"}  # schema defaults
    assert obj["metadata"]["generation"] == 1
    assert "kubectl.kubernetes.io/last-applied-configuration" in obj["metadata"]["annotations"]
    out = local_cluster.kubectl("apply", "-f", "-", input=widget("w1", k8s_namespace, 3)).stdout
    assert "configured" in out
    obj2 = get_json(local_cluster, "-n", k8s_namespace, "widget", "w1")
    assert obj2["spec"]["replicas"] == 3
    assert obj2["metadata"]["generation"] == 2
    assert obj2["metadata"]["uid"] == obj["metadata"]["uid"]
    assert int(obj2["metadata"]["resourceVersion"]) > int(obj["metadata"]["resourceVersion"])
    out = local_cluster.kubectl("apply", "-f", "-", input=widget("w1", k8s_namespace, 3)).stdout
    assert "unchanged" in out


def test_apply_server_side_and_field_removal(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ensure_widget_crd(local_cluster)
    doc = widget("ssa", k8s_namespace, 4, ", maxReplicas: 8")
    out = local_cluster.kubectl("apply", "--server-side", "-f", "-", input=doc).stdout
    assert "serverside-applied" in out
    obj = get_json(local_cluster, "-n", k8s_namespace, "widget", "ssa", "--show-managed-fields")
    assert obj["spec"]["maxReplicas"] == 8
    managers = [m["manager"] for m in obj["metadata"]["managedFields"]]
    assert managers == ["kubectl"]
    # The same manager applying without maxReplicas gives up the field: it goes (and defaults back to 10).
    local_cluster.kubectl("apply", "--server-side", "-f", "-", input=widget("ssa", k8s_namespace, 5))
    obj = get_json(local_cluster, "-n", k8s_namespace, "widget", "ssa")
    assert obj["spec"] == {"replicas": 5, "maxReplicas": 10, "restartPolicy": "Never"}


def test_schema_validation_errors_name_the_fields(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ensure_widget_crd(local_cluster)
    bad = widget("bad", k8s_namespace, 20, ", restartPolicy: Always")
    res = local_cluster.kubectl("apply", "-f", "-", input=bad, check=False)
    assert res.returncode != 0
    assert 'spec.restartPolicy: Unsupported value: "Always"' in res.stderr
    assert "replicas must not exceed maxReplicas" in res.stderr
    unknown = widget("bad", k8s_namespace, 1, ", bogus: 1")
    res = local_cluster.kubectl("apply", "-f", "-", input=unknown, check=False)
    assert res.returncode != 0
    assert 'unknown field "spec.bogus"' in res.stderr


def test_get_shows_printer_columns_and_status_patch(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ensure_widget_crd(local_cluster)
    local_cluster.kubectl("apply", "-f", "-", input=widget("cols", k8s_namespace, 3))
    local_cluster.kubectl("-n", k8s_namespace, "patch", "widget", "cols", "--subresource", "status", "--type",
                          "merge", "-p", '{"status": {"phase": "Running", "replicas": 3}}')
    out = local_cluster.kubectl("-n", k8s_namespace, "get", "wd").stdout.splitlines()
    assert out[0].split() == ["NAME", "REPLICAS", "PHASE", "AGE"]
    assert out[1].split()[:3] == ["cols", "3", "Running"]
    obj = get_json(local_cluster, "-n", k8s_namespace, "widget", "cols")
    assert obj["metadata"]["generation"] == 1  # a status write does not bump generation


def test_patch_kinds_scale_and_replace_with_stale_resource_version(
        local_cluster: LocalCluster, k8s_namespace: str, tmp_path: os.PathLike[str]) -> None:
    ensure_widget_crd(local_cluster)
    local_cluster.kubectl("apply", "-f", "-", input=widget("p", k8s_namespace, 1))
    stale = local_cluster.kubectl("-n", k8s_namespace, "get", "widget", "p", "-o", "yaml").stdout
    local_cluster.kubectl("-n", k8s_namespace, "patch", "widget", "p", "--type", "json", "-p",
                          '[{"op": "replace", "path": "/spec/replicas", "value": 2}]')
    local_cluster.kubectl("-n", k8s_namespace, "scale", "widget", "p", "--replicas", "4")
    assert get_json(local_cluster, "-n", k8s_namespace, "widget", "p")["spec"]["replicas"] == 4
    res = local_cluster.kubectl("replace", "-f", "-", input=stale, check=False)
    assert res.returncode != 0
    assert "Conflict" in res.stderr and "the object has been modified" in res.stderr
    # Strategic merge patch on a core kind merges containers by name.
    local_cluster.kubectl("-n", k8s_namespace, "create", "configmap", "cm", "--from-literal", "a=1")
    local_cluster.kubectl("-n", k8s_namespace, "patch", "configmap", "cm", "-p", '{"data": {"b": "2"}}')
    assert get_json(local_cluster, "-n", k8s_namespace, "configmap", "cm")["data"] == {"a": "1", "b": "2"}


def test_delete_and_get_watch(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ensure_widget_crd(local_cluster)
    env = {**os.environ, **local_cluster.env()}
    watch = subprocess.Popen([kubectl_binary(), "-n", k8s_namespace, "get", "widgets", "-w", "-o", "json",
                              "--output-watch-events"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        wait_until(lambda: local_cluster.kubectl("-n", k8s_namespace, "get", "widgets").returncode == 0,
                   "widgets listable")
        local_cluster.kubectl("apply", "-f", "-", input=widget("wx", k8s_namespace, 1))
        local_cluster.kubectl("-n", k8s_namespace, "patch", "widget", "wx", "--type", "merge", "-p",
                              '{"spec": {"replicas": 2}}')
        out = local_cluster.kubectl("-n", k8s_namespace, "delete", "widget", "wx").stdout
        assert 'widget.example.dev "wx" deleted' in out
        assert local_cluster.kubectl("-n", k8s_namespace, "get", "widget", "wx", check=False).returncode != 0
        seen: list[str] = []
        decoder = json.JSONDecoder()
        buf = ""
        assert watch.stdout is not None
        while "DELETED" not in seen:
            line = watch.stdout.readline()
            if not line:
                break
            buf += line
            try:
                ev, _ = decoder.raw_decode(buf.strip())
            except ValueError:
                continue
            buf = ""
            seen.append(ev["type"])
        assert seen[0] == "ADDED" and "MODIFIED" in seen and seen[-1] == "DELETED"
    finally:
        watch.kill()
        watch.wait()


def test_explain_reads_the_crd_schema(local_cluster: LocalCluster) -> None:
    ensure_widget_crd(local_cluster)
    out = local_cluster.kubectl("explain", "widget.spec.restartPolicy").stdout
    assert "FIELD: restartPolicy <string>" in out
    assert "When to restart a widget" in out
    assert "OnFailure" in out


def test_pod_logs_exit_code_and_describe(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    pod = f"""
apiVersion: v1
kind: Pod
metadata: {{name: hello, namespace: {k8s_namespace}}}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: python:3.11
    command: [python3, -c, "import os, sys; print('hello from', os.environ['POD'], os.environ['IP']); sys.exit(3)"]
    env:
    - {{name: POD, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    - {{name: IP, valueFrom: {{fieldRef: {{fieldPath: status.podIP}}}}}}
"""
    local_cluster.kubectl("apply", "-f", "-", input=pod)
    done = wait_until(lambda: phase_is(local_cluster, k8s_namespace, "hello", "Failed"), "pod hello to fail")
    state = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert state["exitCode"] == 3 and state["reason"] == "Error"
    ip = done["status"]["podIP"]
    if local_cluster.network["mode"] == "netns":  # one of its node's /24 on the cluster's network
        node = local_cluster.nodes.index(done["spec"]["nodeName"])
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(local_cluster.network["subnet"])
        assert ip.split(".")[2] == str(node + 1)
    else:
        assert ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8") and not ip.startswith("127.0.0.")
    logs = local_cluster.kubectl("-n", k8s_namespace, "logs", "hello").stdout
    assert logs == f"hello from hello {ip}\n"
    described = local_cluster.kubectl("-n", k8s_namespace, "describe", "pod", "hello").stdout
    assert "Exit Code:    3" in described
    assert "Started container main" in described
    table = local_cluster.kubectl("-n", k8s_namespace, "get", "pods").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert table[1].split()[:4] == ["hello", "0/1", "Error", "0"]


def test_the_repository_crd_and_examples_apply_and_explain(local_cluster: LocalCluster,
                                                           k8s_namespace: str) -> None:
    root = Path(__file__).resolve().parents[2]
    local_cluster.kubectl("apply", "-f", str(root / "crds" / "trainingjob.yaml"))
    wait_until(lambda: local_cluster.kubectl("get", "tj", "-A", check=False).returncode == 0, "tj served")
    out = local_cluster.kubectl("explain", "trainingjob.spec.restartPolicy").stdout
    assert "FIELD: restartPolicy" in out
    for example in sorted((root / "examples").glob("*.yaml")):
        local_cluster.kubectl("-n", k8s_namespace, "apply", "-f", str(example))
    table = local_cluster.kubectl("-n", k8s_namespace, "get", "tj").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "READY", "WORLD", "ROUND", "RESTARTS", "STALLED", "AGE"]
    assert len(table) - 1 == len(list((root / "examples").glob("*.yaml")))
    # A stalled job shows as one in `kubectl get tj` (and -o wide), its phase still Running (issue 35).
    name = table[1].split()[0]
    local_cluster.kubectl("-n", k8s_namespace, "patch", "tj", name, "--subresource", "status", "--type", "merge",
                          "-p", '{"status": {"phase": "Running", "totalRestarts": 0, "conditions": [{"type": '
                                '"Stalled", "status": "True", "reason": "NoProgress", "message": "rank 1", '
                                '"lastTransitionTime": "2026-01-01T00:00:00Z"}]}}')
    for wide in ((), ("-o", "wide")):
        rows = local_cluster.kubectl("-n", k8s_namespace, "get", "tj", name, *wide).stdout.splitlines()
        starts = [m.start() for m in re.finditer(r"\S+", rows[0])] + [None]
        cells = {rows[0][a:b].strip(): rows[1][a:b].strip() for a, b in itertools.pairwise(starts)}
        assert (cells["PHASE"], cells["STALLED"]) == ("Running", "True")
