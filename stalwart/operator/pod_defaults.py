"""Safe defaults for the pods the operator creates from a job's template: what the template leaves unsaid
is locked down, what it says is kept.

* ``automountServiceAccountToken: false`` -- training code has no business with the Kubernetes API;
* each container: ``allowPrivilegeEscalation: false`` and every capability dropped;
* ``/dev/shm`` backed by memory (an ``emptyDir`` with ``medium: Memory``): a container runtime gives 64 MiB,
  too little for the RPC layer's shared-memory rings and for DataLoader workers.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["SHM_SIZE", "SHM_VOLUME", "with_defaults"]

SHM_VOLUME = "stalwart-shm"
#: The memory-backed /dev/shm's size limit (it counts against the pod's memory).
SHM_SIZE = "2Gi"


def _container_defaults(container: dict[str, Any], shm: bool) -> None:
    context = container.setdefault("securityContext", {})
    context.setdefault("allowPrivilegeEscalation", False)
    if "capabilities" not in context:
        context["capabilities"] = {"drop": ["ALL"]}
    if shm:
        mounts = list(container.get("volumeMounts") or [])
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        container["volumeMounts"] = mounts


def with_defaults(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``pod_spec`` with the module's defaults wherever it sets nothing. A privileged container keeps
    what privilege implies (no escalation default); a template that mounts its own ``/dev/shm`` keeps it."""
    spec = copy.deepcopy(pod_spec)
    spec.setdefault("automountServiceAccountToken", False)
    containers = [*spec.get("initContainers", []), *spec.get("containers", [])]
    shm = not any(m.get("mountPath", "").rstrip("/") == "/dev/shm"
                  for c in containers for m in c.get("volumeMounts") or [])
    for container in spec.get("containers", []):
        if (container.get("securityContext") or {}).get("privileged"):
            if shm:
                container["volumeMounts"] = [*(container.get("volumeMounts") or []),
                                             {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
            continue
        _container_defaults(container, shm)
    if shm:
        spec["volumes"] = [*(spec.get("volumes") or []),
                           {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}}]
    return spec
