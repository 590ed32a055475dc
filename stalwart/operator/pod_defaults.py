"""Safe defaults for the pods the operator creates from a job's template: what the template leaves unsaid
is locked down, what it says is kept.

* ``automountServiceAccountToken: false`` -- training code has no business with the Kubernetes API;
* each container: ``allowPrivilegeEscalation: false`` and every capability dropped;
* ``/dev/shm`` backed by memory (an ``emptyDir`` with ``medium: Memory``, sized by ``spec.shmSize``): a
  container runtime gives 64 MiB, too little for the RPC layer's shared-memory rings and for DataLoader workers.

:func:`privilege_problems` names what an operator run with ``--restrict-pod-security`` (the chart's default)
refuses in a template: privileged containers, the host's namespaces, hostPath volumes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["SHM_VOLUME", "privilege_problems", "with_defaults"]

SHM_VOLUME = "stalwart-shm"
#: Where the problems of :func:`privilege_problems` are (the pod spec inside a TrainingJob).
TEMPLATE_SPEC = "spec.template.spec"
_HOST_NAMESPACES = ("hostNetwork", "hostPID", "hostIPC")


def _container_defaults(container: dict[str, Any], shm: bool) -> None:
    context = container.setdefault("securityContext", {})
    context.setdefault("allowPrivilegeEscalation", False)
    if "capabilities" not in context:
        context["capabilities"] = {"drop": ["ALL"]}
    if shm:
        mounts = list(container.get("volumeMounts") or [])
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
        container["volumeMounts"] = mounts


def with_defaults(pod_spec: dict[str, Any], *, shm_size: str) -> dict[str, Any]:
    """A copy of ``pod_spec`` with the module's defaults wherever it sets nothing; ``/dev/shm`` is limited to
    ``shm_size`` (a Kubernetes quantity). A privileged container keeps what privilege implies (no escalation
    default); a template that mounts its own ``/dev/shm`` keeps it."""
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
                           {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}]
    return spec


def privilege_problems(pod_spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What of the host a pod of ``pod_spec`` (a template's pod spec, the API's JSON form) would get, as
    ``(field path in the TrainingJob, message)``: privileged containers (init and ephemeral ones too), the
    host's network, PID or IPC namespace, and hostPath volumes. Empty for a template that asks for none."""
    problems: list[tuple[str, str]] = []
    why = "refused: the operator runs with --restrict-pod-security (the chart's operator.restrictPodSecurity)"
    for name in _HOST_NAMESPACES:
        if pod_spec.get(name) is True:
            problems.append((f"{TEMPLATE_SPEC}.{name}", f"the host's namespace is {why}"))
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for index, container in enumerate(pod_spec.get(kind) or []):
            if ((container or {}).get("securityContext") or {}).get("privileged") is True:
                problems.append((f"{TEMPLATE_SPEC}.{kind}[{index}].securityContext.privileged",
                                 f"a privileged container is {why}"))
    for index, volume in enumerate(pod_spec.get("volumes") or []):
        if (volume or {}).get("hostPath") is not None:
            problems.append((f"{TEMPLATE_SPEC}.volumes[{index}].hostPath", f"a volume from the host's disk is {why}"))
    return problems
