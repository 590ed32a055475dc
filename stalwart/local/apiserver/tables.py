"""Server-side Table output (``Accept: application/json;as=Table;g=meta.k8s.io;v=v1``), which is what
``kubectl get`` prints: a CRD's ``additionalPrinterColumns``, and for the built-in kinds the columns kubectl users
know (pods: READY, STATUS, RESTARTS, AGE, IP, NODE; ...)."""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any

JSON = dict[str, Any]


def age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """A Kubernetes-style short age ("12s", "5m3s", "3h", "2d")."""
    if not timestamp:
        return "<unknown>"
    try:
        t = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return "<invalid>"
    secs = int(((now or datetime.datetime.now(datetime.UTC)) - t).total_seconds())
    secs = max(secs, 0)
    if secs < 120:
        return f"{secs}s"
    mins = secs // 60
    if mins < 10:
        return f"{mins}m{secs % 60}s" if secs % 60 else f"{mins}m"
    if mins < 180:
        return f"{mins}m"
    hours = mins // 60
    if hours < 48:
        return f"{hours}h"
    return f"{hours // 24}d"


def json_path(obj: Any, path: str) -> Any:
    """Evaluate the JSONPath of printer columns: ``.a.b``, ``.a[0].b``, ``.a['k.x']`` and the filter
    ``.conditions[?(@.type=="Ready")].status`` (its first match)."""
    cur = obj
    pattern = (r"\.([A-Za-z0-9_\-]+)|\[(\d+)\]|\['([^']*)'\]|\[\"([^\"]*)\"\]"
               r"|\[\?\(@\.([A-Za-z0-9_\-]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")
    for m in re.finditer(pattern, path):
        name, idx, q1, q2, fkey, fval = m.groups()
        if fkey is not None:
            if not isinstance(cur, list):
                return None
            cur = next((x for x in cur if isinstance(x, dict) and str(x.get(fkey)) == fval), None)
            if cur is None:
                return None
            continue
        if idx is not None:
            if not isinstance(cur, list) or int(idx) >= len(cur):
                return None
            cur = cur[int(idx)]
        else:
            key = name if name is not None else (q1 if q1 is not None else q2)
            if not isinstance(cur, dict) or key not in cur:
                return None
            cur = cur[key]
    return cur


def _cell(value: Any, type_: str) -> Any:
    if value is None:
        return None
    if type_ == "date":
        return age(str(value))
    if type_ in ("integer", "number") and isinstance(value, (int, float)):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _col(name: str, type_: str = "string", priority: int = 0, description: str = "",
         fmt: str = "") -> JSON:
    return {"name": name, "type": type_, "format": fmt, "description": description, "priority": priority}


def _pod_row(pod: JSON) -> list[Any]:
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or []
    cstatuses = status.get("containerStatuses") or []
    ready = sum(1 for c in cstatuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount", 0)) for c in cstatuses)
    reason = status.get("reason") or status.get("phase") or "Pending"
    for c in cstatuses:
        state = c.get("state") or {}
        if "waiting" in state and state["waiting"].get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state and status.get("phase") not in ("Succeeded",):
            term = state["terminated"]
            reason = term.get("reason") or (f"Signal:{term['signal']}" if term.get("signal")
                                            else f"ExitCode:{term.get('exitCode')}")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        reason = "Terminating"
    return [f"{ready}/{len(containers)}", reason, restarts,
            status.get("podIP") or "<none>", (pod.get("spec") or {}).get("nodeName") or "<none>"]


_BUILTIN: dict[tuple[str, str], tuple[list[JSON], Callable[[JSON], list[Any]]]] = {
    ("", "pods"): ([_col("Ready"), _col("Status"), _col("Restarts", "string"), _col("IP", priority=1),
                    _col("Node", priority=1)], _pod_row),
    ("", "namespaces"): ([_col("Status")], lambda o: [(o.get("status") or {}).get("phase", "")]),
    ("", "nodes"): ([_col("Status"), _col("Roles"), _col("Version")], lambda o: [
        "Ready" if any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in (o.get("status") or {}).get("conditions") or []) else "NotReady",
        "<none>", ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", "")]),
    ("", "services"): ([_col("Type"), _col("Cluster-IP"), _col("External-IP"), _col("Port(s)")], lambda o: [
        (o.get("spec") or {}).get("type", ""), (o.get("spec") or {}).get("clusterIP", ""), "<none>",
        ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in (o.get("spec") or {}).get("ports") or [])
        or "<none>"]),
    ("", "secrets"): ([_col("Type"), _col("Data", "integer")], lambda o: [
        o.get("type", ""), len(o.get("data") or {})]),
    ("", "configmaps"): ([_col("Data", "integer")], lambda o: [len(o.get("data") or {})
                                                               + len(o.get("binaryData") or {})]),
    ("", "events"): ([_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Message")], lambda o: [
        age(o.get("lastTimestamp") or (o.get("metadata") or {}).get("creationTimestamp")),
        o.get("type", ""), o.get("reason", ""),
        f"{str((o.get('involvedObject') or {}).get('kind', '')).lower()}/"
        f"{(o.get('involvedObject') or {}).get('name', '')}", o.get("message", "")]),
    ("apps", "deployments"): ([_col("Ready"), _col("Up-to-date", "integer"), _col("Available", "integer")],
                              lambda o: [f"{(o.get('status') or {}).get('readyReplicas', 0)}/"
                                         f"{(o.get('spec') or {}).get('replicas', 0)}",
                                         (o.get("status") or {}).get("updatedReplicas", 0),
                                         (o.get("status") or {}).get("availableReplicas", 0)]),
    ("apiextensions.k8s.io", "customresourcedefinitions"): ([_col("Created At", "date")], lambda o: [
        (o.get("metadata") or {}).get("creationTimestamp")]),
}


def columns_for(group: str, plural: str, crd_version: JSON | None) -> tuple[list[JSON], Callable[[JSON], list[Any]]]:
    """Column definitions and a row function (cells after NAME) for one resource."""
    if crd_version is not None:
        printer = crd_version.get("additionalPrinterColumns") or []
        if printer:
            defs = [_col(str(c["name"]), str(c.get("type", "string")), int(c.get("priority", 0)),
                         str(c.get("description", "")), str(c.get("format", ""))) for c in printer]
            return defs, lambda o: [_cell(json_path(o, str(c["jsonPath"])), str(c.get("type", "string")))
                                    for c in printer]
        return [_col("Age", "string")], lambda o: [age((o.get("metadata") or {}).get("creationTimestamp"))]
    if (group, plural) in _BUILTIN:
        defs, row = _BUILTIN[(group, plural)]
        if (group, plural) in (("apiextensions.k8s.io", "customresourcedefinitions"), ("", "events")):
            return defs, row
        return ([*defs[:3], _col("Age"), *defs[3:]] if (group, plural) == ("", "pods") else [*defs, _col("Age")],
                (lambda o: [*row(o)[:3], age((o.get("metadata") or {}).get("creationTimestamp")), *row(o)[3:]])
                if (group, plural) == ("", "pods")
                else (lambda o: [*row(o), age((o.get("metadata") or {}).get("creationTimestamp"))]))
    return [_col("Age")], lambda o: [age((o.get("metadata") or {}).get("creationTimestamp"))]


def partial_metadata(obj: JSON) -> JSON:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata") or {}}


def table(objs: list[JSON], group: str, plural: str, crd_version: JSON | None, resource_version: str, *,
          include_object: str = "Metadata", with_columns: bool = True) -> JSON:
    """A ``meta.k8s.io/v1`` Table of ``objs``; ``include_object`` is None, Metadata or Object."""
    defs, row = columns_for(group, plural, crd_version)
    # Events lead with LAST SEEN and keep their generated names out of sight, as kube-apiserver prints them.
    name_last = (group, plural) == ("", "events")
    rows = []
    for obj in objs:
        name = (obj.get("metadata") or {}).get("name", "")
        entry: JSON = {"cells": [*row(obj), name] if name_last else [name, *row(obj)]}
        if include_object == "Object":
            entry["object"] = obj
        elif include_object != "None":
            entry["object"] = partial_metadata(obj)
        rows.append(entry)
    out: JSON = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
                 "rows": rows}
    name_col = _col("Name", description="Name must be unique within a namespace.", priority=1 if name_last else 0,
                    fmt="name")
    columns = [*defs, name_col] if name_last else [name_col, *defs]
    out["columnDefinitions"] = columns if with_columns else []
    return out
