"""What stops a job before any pod is made: credentials its etcd refuses or its Secret lacks, and objects that
hold the names the job needs without being the job's. Pure functions over the reconcile's
:class:`~stalwart.operator.work.Work`, and the pure classification of what an existing object is.

Both are conditions, not only Events, so ``kubectl get tj -o yaml`` shows them for as long as they hold:
``EtcdAccess`` False names the missing key or etcd's refusal; ``OwnershipConflict`` True names the object
(kind and name) and its owner. Each is said once by an Event when it starts and when it ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from stalwart.api import naming
from stalwart.api.status import ConditionStatus, ConditionType, Phase
from stalwart.etcd.client import CredentialsError
from stalwart.etcd.store import StorePermissionDenied, StoreSecurityError
from stalwart.operator.kube import KubeError
from stalwart.operator.model import Conflict, EtcdProblem, JobView
from stalwart.operator.work import Work, condition

__all__ = ["BLOCKING_KINDS", "MARKED_KINDS", "conflict_of", "etcd_access", "etcd_problem", "ownership"]

#: Kinds whose conflict stops the job: its pods would mount a foreign Secret, be named by a foreign
#: Service, or be gang-scheduled by a foreign PodGroup's minimum. A pod's conflict only takes that pod's name
#: out of use.
BLOCKING_KINDS = frozenset({"Secret", "Service", "PodGroup"})
REASON_NOT_OWNED = "NotOwned"
#: Kinds adopted only with the operator's mark as well as the job's controller reference (:mod:`.provenance`):
#: the Secret holds the job's RPC token and etcd login, so one planted with a forged owner reference would
#: give the job credentials its planter knows.
MARKED_KINDS = frozenset({"Secret"})


def conflict_of(kind: str, name: str, uid: str, owner_references: Iterable[Mapping[str, Any]] | None,
                made_here: bool | None = None) -> Conflict | None:
    """The conflict an existing object ``kind``/``name`` is for the job of ``uid`` (None when it is the job's:
    a controller owner reference with that uid, or when it does not exist: ``owner_references`` None).
    ``made_here``: whether the object carries this operator's mark (:mod:`.provenance`), for the kinds that
    must (the Secret); None for those adopted by their owner reference alone."""
    if owner_references is None:
        return None
    refs = list(owner_references)
    if any(r.get("uid") == uid and r.get("controller") for r in refs):
        if made_here is False:
            return Conflict(kind, name, f"controlled by the job but not made by this operator: no valid "
                                        f"{naming.ANNOTATION_MADE_BY} mark")
        return None
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is not None:
        owner = f"controlled by {controller.get('kind', '?')} {controller.get('name', '?')}"
    elif any(r.get("uid") == uid for r in refs):
        owner = "the job is an owner but not its controller"
    else:
        owner = "no controller"
    return Conflict(kind, name, owner)


def etcd_problem(error: Exception, job: JobView) -> EtcdProblem | None:
    """The :class:`EtcdProblem` an error of resolving or reading a job's etcd is, when retrying cannot help
    ``job``; None for a passing failure (etcd down, a timeout)."""
    ref = job.spec.rendezvous.secret_ref if job.spec is not None else None
    secret = ref.name if ref is not None else error.name if isinstance(error, KubeError) else "?"
    if isinstance(error, CredentialsError):
        return EtcdProblem("EtcdCredentialsInvalid", str(error))
    if isinstance(error, KubeError) and error.resource == "secrets" and error.status in (403, 404):
        what = "does not exist" if error.status == 404 else "cannot be read by the operator (403)"
        return EtcdProblem("EtcdCredentialsInvalid", f"Secret {secret} (spec.rendezvous.secretRef) {what}")
    if isinstance(error, StorePermissionDenied):
        return EtcdProblem("EtcdPermissionDenied",
                           f"etcd refused the job's keys to the operator's login: {error}")
    if isinstance(error, StoreSecurityError):
        return EtcdProblem("EtcdAuthFailed", f"etcd refused the operator's credentials for the job: {error}")
    return None


def etcd_access(w: Work) -> bool:
    """The ``EtcdAccess`` condition; True when the job must wait for credentials that work (nothing is made:
    pods could not log in either)."""
    problem = w.obs.etcd_problem
    existing = condition(w.status, ConditionType.ETCD_ACCESS)
    if problem is None:
        if existing is not None and existing.status != ConditionStatus.TRUE and w.obs.etcd.reachable:
            w.cond(ConditionType.ETCD_ACCESS, ConditionStatus.TRUE, "Authenticated",
                   "the operator reads and writes the job's etcd keys")
            w.event("Normal", "EtcdAccessRestored", "the job's etcd accepts its credentials again")
        return False
    if existing is None or existing.status != ConditionStatus.FALSE or existing.reason != problem.reason \
            or existing.message != problem.message:
        w.event("Warning", problem.reason, problem.message)
    w.cond(ConditionType.ETCD_ACCESS, ConditionStatus.FALSE, problem.reason, problem.message)
    if w.status.phase is None:
        w.status.phase = Phase.PENDING
    w.wake_in(w.settings.resync_interval)
    return True


def ownership(w: Work) -> bool:
    """The ``OwnershipConflict`` condition; True when a conflict stops the job (see :data:`BLOCKING_KINDS`)."""
    conflicts = sorted(w.obs.conflicts, key=lambda c: (c.kind, c.name))
    existing = condition(w.status, ConditionType.OWNERSHIP_CONFLICT)
    if not conflicts:
        if existing is not None and existing.status == ConditionStatus.TRUE:
            w.cond(ConditionType.OWNERSHIP_CONFLICT, ConditionStatus.FALSE, "Resolved",
                   "every object the job needs is the job's")
            w.event("Normal", "OwnershipConflictResolved", "every object the job needs is the job's")
        return False
    message = ("; ".join(str(c) for c in conflicts)
               + ": exists and is not this job's; the operator leaves it alone (delete or rename it)")
    if existing is None or existing.status != ConditionStatus.TRUE or existing.message != message:
        w.event("Warning", REASON_NOT_OWNED, message)
    w.cond(ConditionType.OWNERSHIP_CONFLICT, ConditionStatus.TRUE, REASON_NOT_OWNED, message)
    blocked = any(c.kind in BLOCKING_KINDS for c in conflicts)
    if blocked and w.status.phase is None:
        w.status.phase = Phase.PENDING
    if blocked:
        w.wake_in(w.settings.resync_interval)
    return blocked
