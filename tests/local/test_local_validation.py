"""Validation of built-in kinds on the local cluster, as kubectl and the kubernetes client see it: the published
OpenAPI schemas (unknown fields under Strict and Warn, types), metadata rules, resource quantities and limits,
container names, and the immutability of a pod's spec; 422 bodies with the field paths of a real API server."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from local_helpers import wait_until

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration


def pod(name: str = "p", **container: Any) -> dict[str, Any]:
    c = {"name": "main", "image": "busybox", "command": ["sleep", "300"], **container}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [c]}}


def refused(cluster: LocalCluster, ns: str, body: dict[str, Any]) -> str:
    result = cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(body), check=False)
    assert result.returncode == 1, result.stdout
    return str(result.stderr.strip())


def test_kubectl_sees_the_api_servers_refusals(local_cluster: LocalCluster, k8s_namespace: str) -> None:
    ns = k8s_namespace
    cases = {
        "cpu 1x": (pod(resources={"requests": {"cpu": "1x"}}),
                   'Pod in version "v1" cannot be handled as a Pod: quantities must match the regular expression '
                   "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"),
        "requests above limits": (pod(resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}),
                                  'The Pod "p" is invalid: spec.containers[0].resources.requests: Invalid value: "2": '
                                  "must be less than or equal to cpu limit of 1"),
        "a gpu requested but not limited": (pod(resources={"requests": {"nvidia.com/gpu": "1"}}),
                                            'The Pod "p" is invalid: spec.containers[0].resources.limits: Required '
                                            "value: Limit must be set for non overcommitable resources"),
        "unknown field": (pod(imagePullPolicyy="Always"),
                          'Pod in version "v1" cannot be handled as a Pod: strict decoding error: unknown field '
                          '"spec.containers[0].imagePullPolicyy"'),
        "wrong type": (pod(ports=[{"containerPort": "eighty"}]), "cannot unmarshal string into Go struct field "
                                                                 "spec.containers[0].ports[0].containerPort"),
    }
    for what, (body, message) in cases.items():
        assert message in refused(local_cluster, ns, body), what
    twins = pod()
    twins["spec"]["containers"].append({"name": "main", "image": "busybox", "command": ["true"]})
    assert refused(local_cluster, ns, twins).endswith(
        'The Pod "p" is invalid: spec.containers[1].name: Duplicate value: "main"')
    labelled = pod()
    labelled["metadata"]["labels"] = {"bad key!": "x", "app": "a value with spaces"}
    message = refused(local_cluster, ns, labelled)
    assert 'metadata.labels: Invalid value: "bad key!": name part must consist of alphanumeric characters' in message
    assert 'metadata.labels: Invalid value: "a value with spaces": a valid label must be an empty string' in message
    heavy = pod()
    heavy["metadata"]["annotations"] = {"blob": "x" * (300 * 1024)}
    assert "metadata.annotations: Too long: may not be more than 262144 bytes" in refused(local_cluster, ns, heavy)
    assert local_cluster.kubectl("get", "pods", "-n", ns, "-o", "name").stdout == ""  # nothing was stored


def test_the_client_gets_422_causes_and_warnings(local_cluster: LocalCluster, kube_api: Any,
                                                k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    bad = pod(resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}})
    bad["spec"]["containers"].append({"name": "Side_Car", "image": "busybox"})
    with pytest.raises(k8s.ApiException) as err:
        core.create_namespaced_pod(k8s_namespace, bad)
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["reason"] == "Invalid"
    assert status["details"]["kind"] == "Pod" and "group" not in status["details"]
    assert [(c["field"], c["reason"]) for c in status["details"]["causes"]] == [
        ("spec.containers[0].resources.requests", "FieldValueInvalid"),
        ("spec.containers[1].name", "FieldValueInvalid")]
    # Without fieldValidation (the client's default) an unknown field is dropped with a Warning header.
    body = json.dumps({"metadata": {"name": "cm"}, "data": {"a": "b"}, "extra": {"x": 1}}).encode()
    with local_cluster.open(f"/api/v1/namespaces/{k8s_namespace}/configmaps", method="POST", body=body,
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 201
        assert resp.headers["Warning"] == '299 - "unknown field \\"extra\\""'
        assert "extra" not in json.loads(resp.read())


def test_a_running_pods_spec_is_immutable_but_its_image_may_change(local_cluster: LocalCluster,
                                                                   k8s_namespace: str) -> None:
    ns = k8s_namespace
    local_cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(pod()))
    wait_until(lambda: json.loads(local_cluster.kubectl("get", "pod", "p", "-n", ns, "-o", "json").stdout)
               ["status"].get("phase") == "Running", "the pod running")
    changed = local_cluster.kubectl("patch", "pod", "p", "-n", ns, "--type=json", "-p",
                                    '[{"op": "replace", "path": "/spec/containers/0/command", "value": ["true"]}]',
                                    check=False)
    assert changed.returncode == 1
    assert ('The Pod "p" is invalid: spec: Forbidden: pod updates may not change fields other than '
            "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`") in changed.stderr
    assert "changed: spec.containers[0].command" in changed.stderr
    extra = local_cluster.kubectl("patch", "pod", "p", "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/containers/-", "value": {"name": "more", "image": "busybox"}}]), check=False)
    assert "pod updates may not change fields" in extra.stderr
    local_cluster.kubectl("set", "image", "pod/p", "-n", ns, "main=busybox:2")
    local_cluster.kubectl("patch", "pod", "p", "-n", ns, "-p", '{"spec": {"activeDeadlineSeconds": 600}}')
    local_cluster.kubectl("label", "pod", "p", "-n", ns, "team=a")
    after = json.loads(local_cluster.kubectl("get", "pod", "p", "-n", ns, "-o", "json").stdout)
    assert after["spec"]["containers"][0]["image"] == "busybox:2" and after["spec"]["activeDeadlineSeconds"] == 600
    node = local_cluster.kubectl("patch", "pod", "p", "-n", ns, "-p", '{"spec": {"nodeName": "elsewhere"}}',
                                 check=False)
    assert "pod updates may not change fields" in node.stderr


def test_limits_default_the_requests_and_set_the_qos_class(kube_api: Any, k8s_namespace: str) -> None:
    core = k8s.CoreV1Api(kube_api)
    created = core.create_namespaced_pod(k8s_namespace, pod(resources={"limits": {"cpu": "1", "memory": "1Gi"}}))
    assert created.spec.containers[0].resources.requests == {"cpu": "1", "memory": "1Gi"}
    assert created.status.qos_class == "Guaranteed"
