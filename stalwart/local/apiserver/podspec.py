"""Pods as the API server admits them: defaults (restart policy, grace period, scheduler, requests from limits,
the QoS class), the checks of a pod spec (containers named once, RFC 1123 names, images, restart policy, resource
quantities, requests within limits, extended resources requested as much as limited) and the immutability of a
running pod's spec (only images, ``activeDeadlineSeconds``, added tolerations, removed scheduling gates and
``terminationGracePeriodSeconds`` from negative to 1 may change; ``spec.nodeName`` is set through binding).

The spec checks apply to the pod templates of the workload kinds too (``spec.template.spec...``).
"""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from stalwart.local.apiserver.metadata import is_dns_label
from stalwart.local.apiserver.schema import Problem
from stalwart.local.quantity import QuantityError, parse_quantity

JSON = dict[str, Any]
UPDATABLE = ("`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
             "`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` "
             "(allow it to be set to 1 if it was previously negative)")
_OVERCOMMITTABLE = {"cpu", "memory", "ephemeral-storage"}
#: What the API server answers (400) for a quantity that does not parse: its decoder's message.
QUANTITY_DECODE_ERROR = ("quantities must match the regular expression "
                         "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def _extended(resource: str) -> bool:
    return resource not in _OVERCOMMITTABLE and not resource.startswith("hugepages-") and (
        "/" in resource and not resource.startswith("kubernetes.io/"))


def default_spec(spec: JSON) -> None:
    """The defaults the API server fills into a pod spec."""
    for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        c.setdefault("imagePullPolicy", "Always" if str(c.get("image", "")).endswith(":latest") else "IfNotPresent")
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        resources = c.setdefault("resources", {})
        limits = resources.get("limits") or {}
        if limits:
            requests = resources.setdefault("requests", {})
            for name, value in limits.items():
                requests.setdefault(name, value)
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
    spec.setdefault("securityContext", {})
    spec.setdefault("enableServiceLinks", True)


def qos_class(spec: JSON) -> str:
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    requests = [(c.get("resources") or {}).get("requests") or {} for c in containers]
    limits = [(c.get("resources") or {}).get("limits") or {} for c in containers]
    if not any(requests) and not any(limits):
        return "BestEffort"
    guaranteed = all(set(lim) >= {"cpu", "memory"} and all(
        parse_quantity(req.get(k, v)) == parse_quantity(v) for k, v in lim.items() if k in ("cpu", "memory"))
        for req, lim in zip(requests, limits, strict=True))
    return "Guaranteed" if guaranteed else "Burstable"


def decode_problems(spec: JSON) -> list[str]:
    """Quantities that do not parse: decoding errors of the whole request (400)."""
    out = []
    for list_name in _CONTAINER_LISTS:
        for c in spec.get(list_name) or []:
            for kind in ("requests", "limits"):
                for value in ((c.get("resources") or {}).get(kind) or {}).values():
                    try:
                        parse_quantity(value)
                    except QuantityError:
                        out.append(QUANTITY_DECODE_ERROR)
    return out


def _resources_problems(resources: JSON, path: str) -> list[Problem]:
    out: list[Problem] = []
    limits = {k: parse_quantity(v) for k, v in (resources.get("limits") or {}).items()}
    requests = {k: parse_quantity(v) for k, v in (resources.get("requests") or {}).items()}
    for kind, values, raw in (("limits", limits, resources.get("limits") or {}),
                              ("requests", requests, resources.get("requests") or {})):
        for name, value in values.items():
            shown = str(raw[name]).strip()
            if value < 0:
                out.append(Problem(f"{path}.{kind}[{name}]", "FieldValueInvalid",
                                   f'Invalid value: "{shown}": must be greater than or equal to 0'))
            elif _extended(name) and value != value.to_integral_value():
                out.append(Problem(f"{path}.{kind}[{name}]", "FieldValueInvalid",
                                   f'Invalid value: "{shown}": must be an integer'))
    for name, value in requests.items():
        shown = str((resources.get("requests") or {})[name]).strip()
        limit: Decimal | None = limits.get(name)
        if _extended(name):
            if limit is None:
                out.append(Problem(f"{path}.limits", "FieldValueRequired",
                                   "Required value: Limit must be set for non overcommitable resources"))
            elif value != limit:
                out.append(Problem(f"{path}.requests", "FieldValueInvalid",
                                   f'Invalid value: "{shown}": must be equal to {name} limit of '
                                   f"{str(resources['limits'][name]).strip()}"))
        elif limit is not None and value > limit:
            out.append(Problem(f"{path}.requests", "FieldValueInvalid",
                               f'Invalid value: "{shown}": must be less than or equal to {name} limit of '
                               f"{str(resources['limits'][name]).strip()}"))
    return out


def spec_problems(spec: JSON, path: str = "spec") -> list[Problem]:
    """Everything the API server refuses in a pod spec (quantities must parse: see :func:`decode_problems`)."""
    out: list[Problem] = []
    if not spec.get("containers"):
        out.append(Problem(f"{path}.containers", "FieldValueRequired", "Required value"))
    seen: set[str] = set()
    for list_name in _CONTAINER_LISTS:
        for i, c in enumerate(spec.get(list_name) or []):
            where = f"{path}.{list_name}[{i}]"
            name = c.get("name")
            if not name:
                out.append(Problem(f"{where}.name", "FieldValueRequired", "Required value"))
            else:
                out += [Problem(f"{where}.name", "FieldValueInvalid", f'Invalid value: "{name}": {m}')
                        for m in is_dns_label(str(name))]
                if name in seen:
                    out.append(Problem(f"{where}.name", "FieldValueDuplicate", f'Duplicate value: "{name}"'))
                seen.add(str(name))
            if not c.get("image") and list_name != "ephemeralContainers":
                out.append(Problem(f"{where}.image", "FieldValueRequired", "Required value"))
            out += _resources_problems(c.get("resources") or {}, f"{where}.resources")
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        out.append(Problem(f"{path}.restartPolicy", "FieldValueNotSupported",
                           f'Unsupported value: "{policy}": supported values: "Always", "OnFailure", "Never"'))
    return out


def _munged(new: JSON, old: JSON) -> JSON:
    """``new`` with the fields a pod update may change taken back from ``old``, where the change is allowed."""
    out = copy.deepcopy(new)
    for list_name in ("containers", "initContainers"):
        olds = old.get(list_name) or []
        for i, c in enumerate(out.get(list_name) or []):
            if i < len(olds) and "image" in olds[i]:
                c["image"] = olds[i]["image"]
    old_ads, new_ads = old.get("activeDeadlineSeconds"), out.get("activeDeadlineSeconds")
    if new_ads is not None and (old_ads is None or 0 < new_ads <= old_ads):
        out["activeDeadlineSeconds"] = old_ads
        if old_ads is None:
            out.pop("activeDeadlineSeconds")
    old_tol, new_tol = old.get("tolerations") or [], out.get("tolerations") or []
    if all(t in new_tol for t in old_tol):
        if "tolerations" in old:
            out["tolerations"] = old["tolerations"]
        else:
            out.pop("tolerations", None)
    old_gates, new_gates = old.get("schedulingGates") or [], out.get("schedulingGates") or []
    if all(g in old_gates for g in new_gates):
        if "schedulingGates" in old:
            out["schedulingGates"] = old["schedulingGates"]
        else:
            out.pop("schedulingGates", None)
    if (old.get("terminationGracePeriodSeconds") or 0) < 0 and out.get("terminationGracePeriodSeconds") == 1:
        out["terminationGracePeriodSeconds"] = old["terminationGracePeriodSeconds"]
    return out


def _differences(a: Any, b: Any, path: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def update_problems(new_spec: JSON, old_spec: JSON) -> list[Problem]:
    """The immutability of a pod spec: one Forbidden on ``spec`` naming what changed."""
    munged = _munged(new_spec, old_spec)
    if munged == old_spec:
        return []
    changed = ", ".join(_differences(old_spec, munged, "spec"))
    return [Problem("spec", "FieldValueForbidden",
                    f"Forbidden: pod updates may not change fields other than {UPDATABLE}\n  changed: {changed}")]
