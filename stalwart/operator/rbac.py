"""Every Kubernetes permission the operator uses, and why: the list the Helm chart's RBAC is tested against.

Keep it exact: a call the operator makes that is missing here fails in a least-privilege cluster, and a verb
listed here that nothing calls is a permission granted for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Permission:
    """``verbs`` on ``resource`` of ``api_group`` (``""`` = core). ``scope``: ``cluster`` for cluster-scoped
    resources, ``namespace`` for those in the namespaces the operator serves. ``when``: ``always``, or
    ``peering`` (only with more than one replica), or the gang scheduler it needs (``--gang-scheduler``)."""

    api_group: str
    resource: str
    verbs: tuple[str, ...]
    scope: Literal["cluster", "namespace"]
    when: Literal["always", "peering", "volcano", "coscheduling"]
    why: str


PERMISSIONS: tuple[Permission, ...] = (
    Permission("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "cluster", "always",
               "kopf discovers the TrainingJob resource and notices CRD changes"),
    Permission("", "namespaces", ("list", "watch"), "cluster", "always",
               "kopf follows the namespaces it serves as they appear and go"),
    Permission("", "nodes", ("list", "watch"), "cluster", "always",
               "kopf's node index: a pod on a node whose Ready is Unknown or that is tainted unreachable is lost "
               "(fenced, force-deleted, replaced) long before it would be evicted"),
    Permission("stalwart.dev", "trainingjobs", ("list", "watch"), "namespace", "always",
               "kopf's watch of TrainingJobs (daemons, deletion handler)"),
    Permission("stalwart.dev", "trainingjobs", ("patch",), "namespace", "always",
               "kopf adds/removes the finalizer stalwart.dev/finalizer and its progress annotations"),
    Permission("stalwart.dev", "trainingjobs", ("delete",), "namespace", "always",
               "ttlSecondsAfterFinished deletes a finished job"),
    Permission("stalwart.dev", "trainingjobs/status", ("patch",), "namespace", "always",
               "the rate-limited status patches"),
    Permission("stalwart.dev", "trainingjobs/finalizers", ("update",), "namespace", "always",
               "pods, Service and Secret carry blockOwnerDeletion owner references to the job, which the "
               "OwnerReferencesPermissionEnforcement admission plugin allows only with this"),
    Permission("", "pods", ("list", "watch"), "namespace", "always",
               "kopf's pod index (the job's pods, without a list call per reconcile)"),
    Permission("", "pods", ("create", "delete"), "namespace", "always",
               "creating workers/spares/replacements; deleting on suspend, clean-up, scale-down, loss"),
    Permission("", "pods", ("get",), "namespace", "always",
               "a pod of the name the operator meant to create exists: adopted only if the job controls it"),
    Permission("", "services", ("create",), "namespace", "always", "the job's headless Service"),
    Permission("", "services", ("get",), "namespace", "always",
               "the job's Service exists already: adopted only if the job controls it"),
    Permission("", "secrets", ("create",), "namespace", "always", "the job's Secret with the RPC token"),
    Permission("", "secrets", ("get",), "namespace", "always",
               "the etcd credentials (TLS, user) a job names in spec.rendezvous.secretRef"),
    Permission("", "events", ("create",), "namespace", "always",
               "Events on the TrainingJob (restarts, replacements, phase changes) and kopf's own"),
    Permission("scheduling.volcano.sh", "podgroups", ("create",), "namespace", "volcano",
               "the job's PodGroup for Volcano (--gang-scheduler=volcano)"),
    Permission("scheduling.volcano.sh", "podgroups", ("get", "patch"), "namespace", "volcano",
               "the job's PodGroup exists already: adopted only if the job controls it, then its minMember "
               "kept equal to spec.minReplicas as that is edited"),
    Permission("scheduling.x-k8s.io", "podgroups", ("create",), "namespace", "coscheduling",
               "the job's PodGroup for the coscheduling plugin (--gang-scheduler=coscheduling)"),
    Permission("scheduling.x-k8s.io", "podgroups", ("get", "patch"), "namespace", "coscheduling",
               "the job's PodGroup exists already: adopted only if the job controls it, then its minMember "
               "kept equal to spec.minReplicas as that is edited"),
    Permission("kopf.dev", "clusterkopfpeerings", ("list", "watch", "patch"), "cluster", "peering",
               "kopf peering between replicas serving every namespace"),
    Permission("kopf.dev", "kopfpeerings", ("list", "watch", "patch"), "namespace", "peering",
               "kopf peering between replicas serving some namespaces"),
)


def required(*, peering: bool, clusterwide: bool, gang: str | None = None) -> dict[tuple[str, str], set[str]]:
    """The verbs needed per ``(api_group, resource)`` for a deployment with (or without) peering, serving
    every namespace (``clusterwide``) or a list of them, with ``gang`` scheduler (or none)."""
    out: dict[tuple[str, str], set[str]] = {}
    for p in PERMISSIONS:
        if (p.when == "peering" and not peering) or (p.when in ("volcano", "coscheduling") and p.when != gang):
            continue
        if p.resource == "clusterkopfpeerings" and not clusterwide:
            continue
        if p.resource == "kopfpeerings" and clusterwide:
            continue
        out.setdefault((p.api_group, p.resource), set()).update(p.verbs)
    return out
