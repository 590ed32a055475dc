"""What the local cluster's components (kubelet, scheduler, node lifecycle controller) write besides their own
objects: Events, and single pod conditions set the way Kubernetes components set them."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from stalwart.local.apiserver.objects import ApiError, ObjectStore, now_rfc3339

JSON = dict[str, Any]


def record_event(store: ObjectStore, obj: JSON, type_: str, reason: str, message: str, *, component: str) -> None:
    """An Event about ``obj`` (a pod or a node) from ``component``, as ``kubectl describe`` shows it. Events of
    cluster-scoped objects go to the ``default`` namespace, as on a real cluster."""
    meta = obj["metadata"]
    namespace = meta.get("namespace") or "default"
    now = now_rfc3339()
    event = {"metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
             "involvedObject": {"kind": obj.get("kind", "Pod"), "apiVersion": obj.get("apiVersion", "v1"),
                                "name": meta["name"], "namespace": meta.get("namespace", ""),
                                "uid": meta.get("uid", "")},
             "reason": reason, "message": message, "type": type_, "count": 1, "firstTimestamp": now,
             "lastTimestamp": now, "source": {"component": component}, "reportingComponent": component}
    with contextlib.suppress(ApiError):
        store.create(store.info("", "v1", "events"), namespace, event)


def with_condition(pod: JSON, type_: str, status: str, reason: str | None = None,
                   message: str | None = None) -> bool:
    """Set one condition in ``pod["status"]``; its lastTransitionTime moves only when its status does. Returns
    whether anything changed."""
    st = pod.setdefault("status", {})
    conds: list[JSON] = list(st.get("conditions") or [])
    old = next((c for c in conds if c.get("type") == type_), None)
    new: JSON = {"type": type_, "status": status, "lastProbeTime": None,
                 "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status
                 and old.get("lastTransitionTime") else now_rfc3339()}
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    if old == new:
        return False
    st["conditions"] = [new if c is old else c for c in conds] if old is not None else [*conds, new]
    return True
