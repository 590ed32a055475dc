"""Defaults and the semantic checks of the built-in kinds beyond their OpenAPI schema (:mod:`.core_schema`):
Secrets (``stringData``, base64), Namespaces, Services (cluster IPs, ports, status), Pods (:mod:`.podspec`) and
the pod templates of the workload kinds, Deployments."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from typing import Any

from stalwart.local.apiserver import podspec
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import bad_request
from stalwart.local.apiserver.schema import Problem

JSON = dict[str, Any]
#: Where the workload kinds keep their pod template's spec.
TEMPLATE_SPECS: dict[tuple[str, str], tuple[str, ...]] = {
    ("apps", "deployments"): ("spec", "template", "spec"),
    ("apps", "replicasets"): ("spec", "template", "spec"),
    ("apps", "statefulsets"): ("spec", "template", "spec"),
    ("apps", "daemonsets"): ("spec", "template", "spec"),
    ("batch", "jobs"): ("spec", "template", "spec"),
    ("", "replicationcontrollers"): ("spec", "template", "spec"),
    ("batch", "cronjobs"): ("spec", "jobTemplate", "spec", "template", "spec"),
}


def pod_specs(info: ResourceInfo, obj: JSON) -> Iterator[tuple[JSON, str]]:
    """The pod spec(s) of ``obj`` with their field paths: a pod's own, or a workload's template."""
    kind = (info.group, info.plural)
    if kind == ("", "pods"):
        spec = obj.setdefault("spec", {})
        if isinstance(spec, dict):
            yield spec, "spec"
        return
    path = TEMPLATE_SPECS.get(kind)
    cur: Any = obj
    for step in path or ():
        cur = cur.get(step) if isinstance(cur, dict) else None
    if path and isinstance(cur, dict):
        yield cur, ".".join(path)


def decode(info: ResourceInfo, obj: JSON) -> None:
    """Raise the 400 a real API server answers when a body does not decode (quantities that do not parse)."""
    for spec, _ in pod_specs(info, obj):
        errors = podspec.decode_problems(spec)
        if errors:
            raise bad_request(f'{info.kind} in version "{info.version}" cannot be handled as a {info.kind}: '
                              f"{errors[0]}")


def admit(info: ResourceInfo, obj: JSON, old: JSON | None, cluster_ip: Iterator[int]) -> list[Problem]:
    """Fill in the defaults of a built-in kind (in place) and return what its semantic checks refuse."""
    problems: list[Problem] = []
    kind = (info.group, info.plural)
    for spec, path in pod_specs(info, obj):
        if kind != ("", "pods"):
            problems += podspec.spec_problems(spec, path)
    if kind == ("", "secrets"):
        problems += _secret(obj)
    elif kind == ("", "namespaces"):
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif kind == ("", "services"):
        _service(obj, old, cluster_ip)
    elif kind == ("", "pods"):
        problems += _pod(obj, old)
    elif kind == ("apps", "deployments"):
        spec = obj.setdefault("spec", {})
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault("strategy", {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
    return problems


def _secret(obj: JSON) -> list[Problem]:
    problems = []
    obj.setdefault("type", "Opaque")
    data = dict(obj.get("data") or {})
    for k, v in (obj.pop("stringData", None) or {}).items():
        data[k] = base64.b64encode(str(v).encode()).decode()
    for k, v in data.items():
        try:
            base64.b64decode(str(v), validate=True)
        except (binascii.Error, ValueError):
            problems.append(Problem(f"data[{k}]", "FieldValueInvalid",
                                    'Invalid value: "<secret contents redacted>": illegal base64 data'))
    if data:
        obj["data"] = data
    return problems


def _service(obj: JSON, old: JSON | None, cluster_ip: Iterator[int]) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    if old is not None and (old.get("spec") or {}).get("clusterIP"):
        spec["clusterIP"] = old["spec"]["clusterIP"]
    if not spec.get("clusterIP"):
        n = next(cluster_ip)
        spec["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
    spec.setdefault("clusterIPs", [spec["clusterIP"]])
    spec.setdefault("sessionAffinity", "None")
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    obj.setdefault("status", {"loadBalancer": {}})


def _pod(obj: JSON, old: JSON | None) -> list[Problem]:
    spec = obj["spec"]
    podspec.default_spec(spec)
    problems = podspec.spec_problems(spec)
    if old is None:
        if not problems:
            obj["status"] = {"phase": "Pending", "qosClass": podspec.qos_class(spec)}
    else:
        problems += podspec.update_problems(spec, old.get("spec") or {})
    return problems

