"""What the status, scale and finalize subresources change of an object, and the Scale object they show; pure
functions over JSON objects."""

from __future__ import annotations

import copy
from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError

JSON = dict[str, Any]


def get_path(obj: JSON, path: list[str]) -> Any:
    cur: Any = obj
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def set_path(obj: JSON, path: list[str], value: Any) -> None:
    cur = obj
    for p in path[:-1]:
        cur = cur.setdefault(p, {})
    cur[path[-1]] = value


def merge_write(info: ResourceInfo, old: JSON, new: JSON, subresource: str) -> JSON:
    """The object a write of ``new`` to ``subresource`` ("" for the main resource) makes of ``old``: a status
    write changes only the status, a main write never the status (where a status subresource exists), a
    finalize write only ``spec.finalizers``, a scale write only the replicas."""
    if subresource == "status":
        merged = copy.deepcopy(old)
        if "status" in new:
            merged["status"] = new["status"]
        else:
            merged.pop("status", None)
        return merged
    if subresource == "finalize":
        merged = copy.deepcopy(old)
        merged.setdefault("spec", {})["finalizers"] = list((new.get("spec") or {}).get("finalizers") or [])
        return merged
    if subresource == "scale":
        return apply_scale(info, old, new)
    if info.has_status:
        if "status" in old:
            new["status"] = copy.deepcopy(old["status"])
        else:
            new.pop("status", None)
    return new


def scale_paths(info: ResourceInfo) -> tuple[list[str], list[str]]:
    scale = ((info.crd or {}).get("subresources") or {}).get("scale") or {}
    spec_path = str(scale.get("specReplicasPath", ".spec.replicas")).lstrip(".").split(".")
    status_path = str(scale.get("statusReplicasPath", ".status.replicas")).lstrip(".").split(".")
    return spec_path, status_path


def apply_scale(info: ResourceInfo, old: JSON, scale: JSON) -> JSON:
    spec_path, _ = scale_paths(info)
    replicas = (scale.get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ApiError(422, "Invalid", "spec.replicas: Invalid value: must be a non-negative integer")
    new = copy.deepcopy(old)
    set_path(new, spec_path, replicas)
    return new


def scale_view(info: ResourceInfo, obj: JSON) -> JSON:
    """The ``autoscaling/v1`` Scale of ``obj``."""
    spec_path, status_path = scale_paths(info)
    scale = ((info.crd or {}).get("subresources") or {}).get("scale") or {}
    out: JSON = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                 "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                              "creationTimestamp") if k in obj["metadata"]},
                 "spec": {"replicas": get_path(obj, spec_path) or 0},
                 "status": {"replicas": get_path(obj, status_path) or 0}}
    if scale.get("labelSelectorPath"):
        out["status"]["selector"] = get_path(obj, str(scale["labelSelectorPath"]).lstrip(".").split("."))
    return out
