"""Names of the Kubernetes objects derived from a TrainingJob, and the rules job names follow.

The operator names everything through these functions, and the API validates ``metadata.name`` against the
same limits, so a job that is accepted can always have its pods created.

A pod's name is also its hostname and the label value that selects it, so every derived name must be a
DNS-1123 label of at most 63 characters. The longest derived name is ``<job>-worker-<index>``; indices have at
most :data:`INDEX_DIGITS` digits, which gives :data:`MAX_JOB_NAME_LENGTH`. The job's headless Service is named
like the job, and Service names must be DNS-1035 labels (starting with a letter), so job names are too.
"""

from __future__ import annotations

import re

#: Kubernetes' limit on a DNS-1123 / DNS-1035 label (hostnames, label values, Service names).
MAX_LABEL_LENGTH = 63
#: Pod indices run from 0 to ``10**INDEX_DIGITS - 1``.
INDEX_DIGITS = 5
MAX_POD_INDEX = 10**INDEX_DIGITS - 1
WORKER_INFIX = "-worker-"
SPARE_INFIX = "-spare-"
#: ``<job>-worker-99999`` must still fit in a label.
MAX_JOB_NAME_LENGTH = MAX_LABEL_LENGTH - len(WORKER_INFIX) - INDEX_DIGITS

#: DNS-1035 label: lower case letters, digits and '-', starting with a letter, ending alphanumeric.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: DNS-1123 label: like DNS-1035 but may start with a digit (container names, Secret names).
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: DNS-1123 subdomain: dot-separated labels, at most 253 characters (Secret names, namespaces' objects).
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_SUBDOMAIN_LENGTH = 253

#: Labels the operator puts on every object it creates for a job.
LABEL_JOB_NAME = "stalwart.dev/job-name"
#: The operator's mark on a Secret it made for a job (``stalwart.operator.provenance``): adopted only with it.
ANNOTATION_MADE_BY = "stalwart.dev/made-by"
#: ``worker`` or ``spare``.
LABEL_ROLE = "stalwart.dev/role"
#: The pod's index within its role.
LABEL_INDEX = "stalwart.dev/index"
ROLE_WORKER = "worker"
ROLE_SPARE = "spare"

#: Kueue's plain-pod groups: a TrainingJob labelled with a queue has its pods queued as one group, each pod
#: carrying the queue, the group's name and its size; Kueue's webhook gates them until the group is admitted.
KUEUE_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
KUEUE_POD_GROUP_NAME = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"


def job_name_problem(name: str) -> str | None:
    """``None`` when ``name`` is a valid TrainingJob name, else what is wrong with it."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_JOB_NAME_LENGTH:
        return (f"must be at most {MAX_JOB_NAME_LENGTH} characters so that pod names "
                f"'<name>{WORKER_INFIX}<index>' fit in {MAX_LABEL_LENGTH}, got {len(name)}")
    if not DNS1035_LABEL.fullmatch(name):
        return ("must be a DNS-1035 label: lower case letters, digits and '-', starting with a letter "
                f"and ending with a letter or digit, got {name!r}")
    return None


def check_job_name(name: str) -> str:
    """Return ``name`` when valid; raise ``ValueError`` naming the problem otherwise."""
    problem = job_name_problem(name)
    if problem is not None:
        raise ValueError(f"TrainingJob name {problem}")
    return name


def _check_index(index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_POD_INDEX:
        raise ValueError(f"pod index must be an integer in 0..{MAX_POD_INDEX}, got {index!r}")
    return index


def worker_pod_name(job_name: str, index: int) -> str:
    """The name of worker pod ``index`` of job ``job_name``: ``<job>-worker-<index>``."""
    return f"{check_job_name(job_name)}{WORKER_INFIX}{_check_index(index)}"


def spare_pod_name(job_name: str, index: int) -> str:
    """The name of spare pod ``index`` of job ``job_name``: ``<job>-spare-<index>``."""
    return f"{check_job_name(job_name)}{SPARE_INFIX}{_check_index(index)}"


def service_name(job_name: str) -> str:
    """The job's headless Service, which gives every pod a stable DNS name: named like the job."""
    return check_job_name(job_name)


def secret_name(job_name: str) -> str:
    """The job's Secret (the RPC token): ``<job>-stalwart``."""
    return f"{check_job_name(job_name)}-stalwart"


#: Key of the job's token in its Secret: it authenticates RPC between the job's processes and fault drills.
RPC_TOKEN_KEY = "rpc-token"


def selector(job_name: str) -> str:
    """The label selector of the job's pods, as the scale subresource's ``status.selector`` wants it."""
    return f"{LABEL_JOB_NAME}={check_job_name(job_name)}"


def pod_labels(job_name: str, role: str, index: int) -> dict[str, str]:
    """The labels of one of the job's pods (``role`` is ``worker`` or ``spare``)."""
    if role not in (ROLE_WORKER, ROLE_SPARE):
        raise ValueError(f"role must be {ROLE_WORKER!r} or {ROLE_SPARE!r}, got {role!r}")
    return {LABEL_JOB_NAME: check_job_name(job_name), LABEL_ROLE: role, LABEL_INDEX: str(_check_index(index))}
