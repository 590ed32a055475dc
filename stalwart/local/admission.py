"""kube-apiserver's DefaultTolerationSeconds admission plugin: every pod created gets the tolerations
``node.kubernetes.io/not-ready:NoExecute`` and ``node.kubernetes.io/unreachable:NoExecute`` (operator Exists,
``tolerationSeconds`` 300 by default: ``--default-not-ready-toleration-seconds`` and
``--default-unreachable-toleration-seconds``) unless it already tolerates that taint with effect NoExecute or
any effect. So a pod on a lost node is evicted that long after the node controller taints the node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo

JSON = dict[str, Any]
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"


def _tolerates_no_execute(tolerations: list[JSON], key: str) -> bool:
    return any((not t.get("key") or t.get("key") == key) and t.get("effect") in (None, "", "NoExecute")
               for t in tolerations)


def add_default_tolerations(spec: JSON, not_ready_seconds: int, unreachable_seconds: int) -> None:
    """Add the two default tolerations to a pod spec, each unless the pod already has its own."""
    tolerations: list[JSON] = list(spec.get("tolerations") or [])
    for key, seconds in ((NOT_READY_TAINT, not_ready_seconds), (UNREACHABLE_TAINT, unreachable_seconds)):
        if not _tolerates_no_execute(tolerations, key):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute",
                                "tolerationSeconds": seconds})
    spec["tolerations"] = tolerations


def default_toleration_seconds(not_ready_seconds: int, unreachable_seconds: int
                               ) -> Callable[[ResourceInfo, JSON], None]:
    """The plugin, for the object store's mutating admission on create."""

    def admit(info: ResourceInfo, obj: JSON) -> None:
        if info.group == "" and info.plural == "pods" and isinstance(obj.get("spec"), dict):
            add_default_tolerations(obj["spec"], not_ready_seconds, unreachable_seconds)

    return admit
