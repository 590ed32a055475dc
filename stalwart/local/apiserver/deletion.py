"""What a DELETE does to an object, as pure decisions: preconditions, the propagation policy, whether the object
goes at once or stays marked (``deletionTimestamp``) for its finalizers, a pod's grace period or, for a
namespace, the namespace controller; and when a marked object is finally released."""

from __future__ import annotations

import copy
from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import bad_request, conflict
from stalwart.local.apiserver.storage import now_rfc3339

JSON = dict[str, Any]
POLICY_FINALIZERS = {"Orphan": "orphan", "Foreground": "foregroundDeletion"}


def _core(info: ResourceInfo, plural: str) -> bool:
    return info.plural == plural and not info.group


def check_preconditions(info: ResourceInfo, name: str, obj: JSON, pre: JSON) -> None:
    meta = obj["metadata"]
    if pre.get("uid") and pre["uid"] != meta.get("uid"):
        raise conflict(info, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: "
                                   f"{meta.get('uid')}")
    if pre.get("resourceVersion") and str(pre["resourceVersion"]) != meta.get("resourceVersion"):
        raise conflict(info, name, f"Precondition failed: resourceVersion in precondition: {pre['resourceVersion']}, "
                                   f"resourceVersion in object meta: {meta.get('resourceVersion')}")


def policy_of(options: JSON) -> str | None:
    policy = options.get("propagationPolicy") or ("Orphan" if options.get("orphanDependents") else None)
    if policy not in (None, "Background", "Foreground", "Orphan"):
        raise bad_request(f"propagationPolicy: Unsupported value: {policy!r}: supported values: "
                          '"Background", "Foreground", "Orphan"')
    return policy


def _start_grace(obj: JSON, meta: JSON, requested: Any) -> bool:
    """Set (or shorten) a running pod's grace period; whether the pod stays for the kubelet to stop it."""
    spec_grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
    grace = int(spec_grace if requested is None else requested)
    if grace <= 0:
        return False
    prior = meta.get("deletionGracePeriodSeconds")
    if prior is None or grace < int(prior):
        meta["deletionGracePeriodSeconds"] = grace
        meta["deletionTimestamp"] = now_rfc3339(grace)
    return True


def marked(info: ResourceInfo, obj: JSON, options: JSON, running_pod: bool) -> JSON | None:
    """The object as a DELETE leaves it (deletionTimestamp set, the policy's finalizer added), or None if it
    goes at once. ``running_pod``: a pod a kubelet runs, which stays for its grace period."""
    policy = policy_of(options)
    new = copy.deepcopy(obj)
    meta = new["metadata"]
    finalizers = list(meta.get("finalizers") or [])
    wanted = POLICY_FINALIZERS.get(policy or "")
    if not meta.get("deletionTimestamp") and wanted and wanted not in finalizers:
        finalizers.append(wanted)
    holds = bool(finalizers)
    if _core(info, "namespaces"):
        holds = True  # spec.finalizers: the namespace controller empties it first
        new.setdefault("status", {})["phase"] = "Terminating"
    elif _core(info, "pods") and running_pod:
        holds = _start_grace(obj, meta, options.get("gracePeriodSeconds")) or holds
    if not holds:
        return None
    if finalizers or "finalizers" in meta:
        meta["finalizers"] = finalizers
    if not meta.get("deletionTimestamp"):
        meta["deletionTimestamp"] = now_rfc3339()
        meta.setdefault("deletionGracePeriodSeconds", 0)
        if int(meta.get("generation", 0)) > 0:
            meta["generation"] = int(meta["generation"]) + 1
    return new


def releasable(info: ResourceInfo, obj: JSON, running_pod: bool) -> bool:
    """A marked object whose last finalizer (and grace period, and namespace content) is gone."""
    meta = obj["metadata"]
    if not meta.get("deletionTimestamp") or meta.get("finalizers"):
        return False
    if _core(info, "namespaces"):
        return not (obj.get("spec") or {}).get("finalizers")
    return not (_core(info, "pods") and running_pod and int(meta.get("deletionGracePeriodSeconds") or 0) > 0)
