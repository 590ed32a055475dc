"""Which etcd the operator logs in to for a job, and with what: only its own, with credentials an administrator
gave it (issue 31, finding 1).

The operator holds rights a job's author may lack (it reads Secrets, it reaches etcd). So it never logs in
with anything a job names: ``spec.rendezvous.secretRef`` is the Secret the job's *pods* mount and use; the
operator neither reads it nor sends its contents anywhere. And it connects only to the etcd its administrator
named (``--etcd-endpoints``, with ``--etcd-secret-dir``): a job whose ``spec.rendezvous.endpoints`` name
another cluster cannot be run, since the operator must read and write the job's records there (the JobRecord,
fencing by lease revocation) and has no login of its own for it. Such a job fails with ``InvalidSpec`` naming
``spec.rendezvous.endpoints`` and one Event, as a spec the operator cannot honour does; the same thing an
experienced Kubernetes user expects of a namespaced object that points at infrastructure the cluster's
administrator has not registered (cf. a StorageClass or a ClusterIssuer, which only administrators make).

:func:`etcd_refusal` decides; it is pure and table-tested.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ENDPOINTS_FIELD", "etcd_refusal", "same_endpoints"]

ENDPOINTS_FIELD = "spec.rendezvous.endpoints"


def _bare(endpoint: str) -> str:
    for scheme in ("http://", "https://"):
        if endpoint.startswith(scheme):
            return endpoint[len(scheme):].rstrip("/")
    return endpoint.rstrip("/")


def same_endpoints(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two endpoint lists name the same servers (order and an http(s):// scheme aside)."""
    return bool(a) and {_bare(e) for e in a} == {_bare(e) for e in b}


def etcd_refusal(job_endpoints: Sequence[str] | None, default_endpoints: Sequence[str]) -> tuple[str, str] | None:
    """``(field, message)`` when the job names etcd endpoints other than the operator's own; None when the
    operator may serve the job (no endpoints named, or exactly the operator's)."""
    if not job_endpoints or same_endpoints(job_endpoints, default_endpoints):
        return None
    named = ",".join(job_endpoints)
    if not default_endpoints:
        why = "this operator has no etcd of its own (--etcd-endpoints)"
    else:
        why = f"this operator's etcd is {','.join(default_endpoints)}"
    return (ENDPOINTS_FIELD,
            f"{named} is not the etcd this operator's administrator gave it ({why}); the operator logs in to "
            "etcd only with its own credentials, never with a job's Secret (spec.rendezvous.secretRef is "
            "for the job's pods), so it cannot run a job on another etcd: leave endpoints empty, or ask an "
            "administrator to run an operator for that etcd")
