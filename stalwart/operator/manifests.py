"""The Kubernetes objects the operator creates for a job: worker/spare pods, the headless Service, the
Secret holding the RPC token. Pure functions from the job to plain dicts (the API's JSON form).
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping, Sequence
from typing import Any

from stalwart.api import naming, pod_env
from stalwart.api.pod_env import worker_env
from stalwart.api.spec import TrainingJobSpec
from stalwart.api.trainingjob import API_VERSION, KIND
from stalwart.operator.pod_defaults import with_defaults

#: Key of the RPC token in the job's Secret.
RPC_TOKEN_KEY = naming.RPC_TOKEN_KEY
#: Where the etcd credentials Secret (spec.rendezvous.secretRef) is mounted in the trainer container.
ETCD_SECRET_DIR = "/etc/stalwart/etcd"
ETCD_SECRET_VOLUME = "stalwart-etcd-credentials"
#: What only the trainer container (the first, the agent's) gets: the RPC token and the etcd credentials'
#: directory. Sidecars get the rest of the stalwart environment and no credential.
TRAINER_ONLY_ENV = frozenset({pod_env.RPC_TOKEN, pod_env.ETCD_SECRET_DIR, pod_env.ETCD_TLS})
#: The agent entrypoint that wraps the user's command.
AGENT_COMMAND = ("stalwart", "agent", "--")
#: Port name of the headless Service (no port is needed for DNS, but Services want one).
SERVICE_PORT = 29500


#: The name of the trainer container's port the agent serves its metrics on (what a PodMonitor scrapes).
AGENT_METRICS_PORT_NAME = "agent-metrics"


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """The controller owner reference to the TrainingJob: its pods, Service and Secret are garbage collected
    with it."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid, "controller": True,
            "blockOwnerDeletion": True}


def etcd_secret(spec: TrainingJobSpec) -> tuple[str, bool] | None:
    """The Secret with the job's etcd credentials that the user named, and whether to use TLS."""
    ref = spec.rendezvous.secret_ref
    return None if ref is None else (ref.name, spec.rendezvous.tls)


def stalwart_env(*, job: str, namespace: str, uid: str, spec: TrainingJobSpec, spare: bool,
                 endpoints: Sequence[str], credentials: tuple[str, bool] | None = None,
                 metrics_port: int | None = None) -> list[dict[str, Any]]:
    """The environment every worker/spare container gets (design: "What a worker pod gets"; the pod contract,
    :mod:`stalwart.api.pod_env`)."""
    return worker_env(job=job, namespace=namespace, uid=uid, spare=spare, nproc_per_node=spec.nproc_per_node,
                      min_nodes=spec.min_nodes, max_nodes=spec.max_nodes, endpoints=endpoints,
                      token_secret=naming.secret_name(job), token_key=RPC_TOKEN_KEY,
                      etcd_secret_dir=None if credentials is None else ETCD_SECRET_DIR,
                      etcd_tls=credentials is not None and credentials[1], metrics_port=metrics_port)


#: Gang schedulers the operator can make a PodGroup for: (apiVersion, plural, pod scheduler name or None).
GANG_SCHEDULERS: dict[str, tuple[str, str, str | None]] = {
    "volcano": ("scheduling.volcano.sh/v1beta1", "podgroups", "volcano"),
    "coscheduling": ("scheduling.x-k8s.io/v1alpha1", "podgroups", None),
}


def _check_gang(gang: str | None) -> None:
    if gang is not None and gang not in GANG_SCHEDULERS:
        raise ValueError(f"gang scheduler: expected one of {sorted(GANG_SCHEDULERS)}, got {gang!r}")


def pod_group_manifest(*, gang: str, job: str, namespace: str, uid: str, min_member: int) -> dict[str, Any]:
    """The PodGroup that makes ``gang`` (``volcano`` or ``coscheduling``) schedule the job's pods all or
    nothing: none is bound until ``min_member`` (spec.minReplicas) of them fit."""
    _check_gang(gang)
    api_version, _, _ = GANG_SCHEDULERS[gang]
    if min_member < 1:
        raise ValueError(f"min_member: must be >= 1, got {min_member}")
    return {"apiVersion": api_version, "kind": "PodGroup",
            "metadata": {"name": job, "namespace": namespace, "labels": {naming.LABEL_JOB_NAME: job},
                         "ownerReferences": [owner_reference(job, uid)]},
            "spec": {"minMember": min_member}}


def pod_manifest(*, job: str, namespace: str, uid: str, spec: TrainingJobSpec, name: str, role: str,
                 index: int, endpoints: Sequence[str], agent_command: Sequence[str] = AGENT_COMMAND,
                 gang: str | None = None, credentials: tuple[str, bool] | None = None,
                 queue: str | None = None, metrics_port: int | None = None) -> dict[str, Any]:
    """The pod ``name`` of the job: the template, with the first container's command wrapped by the agent,
    the stalwart environment on every container (the RPC token and the etcd credentials' mount on the first,
    the trainer, only), the job's labels, hostname/subdomain for DNS through the
    headless Service, the owner reference, and ``restartPolicy: Never`` (the agent restarts rank processes
    itself; a pod that exits is replaced by the operator). ``agent_command`` is the entrypoint prefix (an
    empty one runs the user's command bare, for scale tests of the operator alone). With ``gang``, the pod
    names the job's PodGroup the way that scheduler expects (and its scheduler, for Volcano). ``credentials``:
    the etcd credentials Secret to mount and whether etcd speaks TLS (default: the one the spec names).
    ``queue``: the Kueue queue of the job; the pod then joins the job's Kueue pod group (every worker and
    spare pod, replacements included, under the job's name). ``metrics_port``: the agent serves its metrics
    there (the trainer's container port named :data:`AGENT_METRICS_PORT_NAME`)."""
    _check_gang(gang)
    if not endpoints:
        raise ValueError("endpoints: the job has no etcd endpoints (spec.rendezvous.endpoints) and the "
                         "operator has no default (--etcd-endpoints / STALWART_DEFAULT_ETCD_ENDPOINTS)")
    template = spec.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    meta: Mapping[str, Any] = template.get("metadata") or {}
    pod_spec: dict[str, Any] = copy.deepcopy(template["spec"])
    labels = {**(meta.get("labels") or {}), **naming.pod_labels(job, role, index)}
    annotations = dict(meta.get("annotations") or {})
    credentials = credentials or etcd_secret(spec)
    env = stalwart_env(job=job, namespace=namespace, uid=uid, spec=spec, spare=role == naming.ROLE_SPARE,
                       endpoints=endpoints, credentials=credentials, metrics_port=metrics_port)
    ours = {e["name"] for e in env}
    sidecar_env = [e for e in env if e["name"] not in TRAINER_ONLY_ENV]
    for i, container in enumerate(pod_spec["containers"]):
        if i == 0:
            command = [*agent_command, *(container.get("command") or []), *(container.get("args") or [])]
            container["command"] = command
            container.pop("args", None)
            if metrics_port is not None:
                ports = [p for p in container.get("ports") or [] if p.get("name") != AGENT_METRICS_PORT_NAME]
                container["ports"] = [*ports, {"name": AGENT_METRICS_PORT_NAME, "containerPort": metrics_port,
                                               "protocol": "TCP"}]
        user_env = [e for e in container.get("env") or [] if e.get("name") not in ours]
        container["env"] = [*(env if i == 0 else sidecar_env), *user_env]
        if credentials is not None and i == 0:
            mounts = list(container.get("volumeMounts") or [])
            mounts.append({"name": ETCD_SECRET_VOLUME, "mountPath": ETCD_SECRET_DIR, "readOnly": True})
            container["volumeMounts"] = mounts
    if credentials is not None:
        volumes = list(pod_spec.get("volumes") or [])
        volumes.append({"name": ETCD_SECRET_VOLUME, "secret": {"secretName": credentials[0]}})
        pod_spec["volumes"] = volumes
    if gang == "volcano":
        annotations["scheduling.k8s.io/group-name"] = job
        pod_spec["schedulerName"] = GANG_SCHEDULERS[gang][2]
    elif gang == "coscheduling":
        labels["scheduling.x-k8s.io/pod-group"] = job
    if queue is not None:
        labels[naming.KUEUE_QUEUE_NAME] = queue
        labels[naming.KUEUE_POD_GROUP_NAME] = job
        annotations[naming.KUEUE_POD_GROUP_TOTAL_COUNT] = str(spec.replicas + spec.spares)
    pod_spec = with_defaults(pod_spec, shm_size=spec.shm_size)
    pod_spec["restartPolicy"] = "Never"
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = naming.service_name(job)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations,
                     "ownerReferences": [owner_reference(job, uid)]},
        "spec": pod_spec,
    }


def service_manifest(*, job: str, namespace: str, uid: str) -> dict[str, Any]:
    """The headless Service that gives every pod of the job a DNS name (``<pod>.<job>.<ns>.svc``).
    Unready pods are published too: ranks must find each other before any is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": naming.service_name(job), "namespace": namespace,
                     "labels": {naming.LABEL_JOB_NAME: job}, "ownerReferences": [owner_reference(job, uid)]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {naming.LABEL_JOB_NAME: job},
                 "ports": [{"name": "rendezvous", "port": SERVICE_PORT, "targetPort": SERVICE_PORT}]},
    }


def secret_manifest(*, job: str, namespace: str, uid: str, token: str, made_by: str,
                    extra: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """The job's Secret holding the RPC token that authenticates RPC between the job's processes, and
    ``extra`` keys (the job's etcd login, when the operator gives each job an etcd user); ``made_by`` is the
    operator's mark (``stalwart.operator.provenance``), without which it would not adopt this Secret again."""
    if len(token) < 32:
        raise ValueError("token: an RPC token needs at least 32 characters")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": naming.secret_name(job), "namespace": namespace,
                     "labels": {naming.LABEL_JOB_NAME: job}, "annotations": {naming.ANNOTATION_MADE_BY: made_by},
                     "ownerReferences": [owner_reference(job, uid)]},
        "data": {RPC_TOKEN_KEY: base64.b64encode(token.encode()).decode(),
                 **{k: base64.b64encode(v).decode() for k, v in (extra or {}).items()}},
    }
