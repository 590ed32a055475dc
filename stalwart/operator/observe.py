"""Turning raw objects into the reconcile's observations: Kubernetes pod and TrainingJob bodies (plain
dicts as kopf and the API give them) and the key-values of a job's etcd prefix. Pure functions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from stalwart.api import naming
from stalwart.api.base import RuleViolation
from stalwart.api.job_record import JobRecord
from stalwart.api.manifest import MANIFEST_PARTS, decode_manifest
from stalwart.api.rendezvous import ExpectedNodes, Manifest
from stalwart.api.restart import FaultRecord, ProgressRecord
from stalwart.api.spec import TrainingJobSpec
from stalwart.api.status import TrainingJobStatus
from stalwart.api.trainingjob import API_VERSION, KIND
from stalwart.api.validation import document_problems
from stalwart.etcd.keys import FENCED, NODES, JobKeys
from stalwart.etcd.store import KeyValue
from stalwart.operator.model import EtcdView, JobView, PodPhase, PodView

log = logging.getLogger(__name__)

_PHASES: tuple[PodPhase, ...] = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


def parse_time(value: Any) -> float | None:
    """A Kubernetes timestamp (RFC 3339 string or datetime) as Unix seconds; None when absent or bad."""
    if isinstance(value, datetime):
        return value.timestamp()
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """The :class:`PodView` of a pod body; None for a pod without stalwart's role/index labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(naming.LABEL_ROLE)
    index_text = labels.get(naming.LABEL_INDEX, "")
    if role not in (naming.ROLE_WORKER, naming.ROLE_SPARE) or not str(index_text).isdigit():
        return None
    status = pod.get("status") or {}
    phase_text = status.get("phase") or "Pending"
    phase: PodPhase = phase_text if phase_text in _PHASES else "Unknown"
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    reason = status.get("reason")
    message = str(status.get("message") or "")
    exit_code = None
    # The trainer is the first container of the template; its terminated state carries the agent's exit code.
    statuses = status.get("containerStatuses") or []
    spec_containers = (pod.get("spec") or {}).get("containers") or []
    trainer = spec_containers[0].get("name") if spec_containers else None
    for cs in statuses:
        if trainer is not None and cs.get("name") != trainer:
            continue
        state = cs.get("state") or {}
        terminated = state.get("terminated") or (cs.get("lastState") or {}).get("terminated")
        if terminated:
            exit_code = terminated.get("exitCode")
            if reason is None and terminated.get("reason") in ("OOMKilled",):
                reason = terminated.get("reason")
            message = message or str(terminated.get("message") or "")
        break
    grace = meta.get("deletionGracePeriodSeconds")
    deleting_at = parse_time(meta.get("deletionTimestamp"))
    deleting_since = None
    if deleting_at is not None:
        # deletionTimestamp is when the grace period ends; the deletion was asked for `grace` earlier.
        deleting_since = deleting_at - float(grace or 0)
    return PodView(
        name=str(meta.get("name")), role=str(role), index=int(index_text), phase=phase, ready=ready,
        deleting_since=deleting_since, deletion_grace=float(grace if grace is not None else 30),
        exit_code=int(exit_code) if isinstance(exit_code, int) else None, reason=reason, message=message[:1024],
        unschedulable=unschedulable and phase == "Pending", node=(pod.get("spec") or {}).get("nodeName") or None,
        started_at=parse_time(status.get("startTime")), ip=str(status.get("podIP") or "") or None,
        host_ip=str(status.get("hostIP") or "") or None, uid=str(meta.get("uid") or ""))


def _problem_of(e: ValidationError | RuleViolation) -> tuple[str, str]:
    if isinstance(e, RuleViolation):
        field, message = e.problems[0]
        return field, message
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return loc or "spec", str(err.get("msg", "invalid"))


def job_view(body: Mapping[str, Any]) -> JobView:
    """The :class:`JobView` of a TrainingJob body. An invalid spec gives ``spec=None`` and the first problem
    as ``(field path under spec, message)``; an unreadable status is treated as empty (the operator
    rewrites it)."""
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    spec: TrainingJobSpec | None = None
    problem: tuple[str, str] | None = None
    # Checked as `stalwart validate` checks a manifest (strict, the API server's view), so the field path
    # and message are the ones users already know.
    document = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
                "spec": body.get("spec") or {}}
    problems = document_problems(document)
    if problems:
        problem = problems[0]
    else:
        try:
            spec = TrainingJobSpec.model_validate(body.get("spec") or {})
        except (ValidationError, RuleViolation) as e:
            field, message = _problem_of(e)
            problem = (f"spec.{field}", message)
    try:
        status = TrainingJobStatus.model_validate(body.get("status") or {})
    except (ValidationError, ValueError):
        log.warning("job %s/%s: ignoring an unreadable status", meta.get("namespace"), name)
        status = TrainingJobStatus()
    return JobView(name=name, namespace=str(meta.get("namespace") or "default"), uid=str(meta.get("uid") or ""),
                   generation=int(meta.get("generation") or 0), spec=spec, status=status, spec_problem=problem,
                   deleting=bool(meta.get("deletionTimestamp")),
                   queue_name=(meta.get("labels") or {}).get(naming.KUEUE_QUEUE_NAME) or None)


def etcd_view(keys: JobKeys, kvs: Iterable[KeyValue]) -> EtcdView:
    """The :class:`EtcdView` of the key-values under a job's prefix. A record that does not parse is
    skipped with a warning: a corrupt key must not stop the operator from reconciling the job."""
    rdzv = keys.rendezvous
    record: JobRecord | None = None
    expected: tuple[str, ...] | None = None
    manifest: Manifest | None = None
    epoch = 0
    leases: dict[str, int] = {}
    progress: list[ProgressRecord] = []
    closed = False
    fenced: set[str] = set()
    kvs = list(kvs)
    parts = {kv.key[len(rdzv):]: (kv.value, kv.mod_revision) for kv in kvs
             if kv.key.startswith(rdzv + MANIFEST_PARTS)}
    for kv in kvs:
        try:
            if kv.key == keys.job:
                record = JobRecord.from_json_bytes(kv.value)
            elif kv.key == keys.manifest:
                manifest, epoch = decode_manifest(kv.value, kv.mod_revision, parts), kv.mod_revision
            elif kv.key == keys.expected:
                expected = tuple(ExpectedNodes.from_json_bytes(kv.value).node_ids)
            elif kv.key == keys.closed:
                closed = True
            elif kv.key.startswith(rdzv + NODES):
                if kv.lease:
                    leases[kv.key[len(rdzv + NODES):]] = kv.lease
            elif kv.key.startswith(keys.progress):
                progress.append(ProgressRecord.from_json_bytes(kv.value))
            elif kv.key.startswith(keys.prefix + FENCED):
                fenced.add(kv.key[len(keys.prefix + FENCED):])
        except (ValidationError, ValueError) as e:
            log.warning("skipping unreadable etcd record %s: %s", kv.key, e)
    return EtcdView(reachable=True, record=record, expected=expected, manifest=manifest, epoch=epoch,
                    leases=leases, progress=tuple(progress), closed=closed, fenced=frozenset(fenced))


def fault_entries(kvs: Iterable[KeyValue]) -> tuple[tuple[int, FaultRecord], ...]:
    """The fault records under a round's ``fault/`` prefix as ``(mod_revision, record)``, in revision order
    (the order the restart protocol reads them in). Unreadable records are skipped with a warning."""
    out: list[tuple[int, FaultRecord]] = []
    for kv in kvs:
        try:
            out.append((kv.mod_revision, FaultRecord.from_json_bytes(kv.value)))
        except (ValidationError, ValueError) as e:
            log.warning("skipping unreadable fault record %s: %s", kv.key, e)
    return tuple(sorted(out, key=lambda f: f[0]))


def overlay(pods: Iterable[PodView], created: Mapping[str, tuple[PodView, float]],
            deleted: Mapping[str, tuple[int, float]], now: float, horizon: float = 60.0) -> tuple[PodView, ...]:
    """The pods as the operator knows them: the watched ones, plus pods it created that the watch has not
    delivered yet (as Pending, ``assumed``), with pods it deleted marked deleting until the watch says so.
    Entries older than ``horizon`` seconds are dropped (the watch is trusted again by then)."""
    seen: dict[str, PodView] = {}
    for seen_pod in pods:
        mark = deleted.get(seen_pod.name)
        view = seen_pod
        if mark is not None and not seen_pod.deleting and now - mark[1] < horizon:
            view = replace(seen_pod, deleting_since=mark[1], deletion_grace=float(mark[0]))
        seen[view.name] = view
    for name, (pod, at) in created.items():
        if name not in seen and now - at < horizon and name not in deleted:
            seen[name] = replace(pod, assumed=True)
    return tuple(sorted(seen.values(), key=lambda p: (p.role != naming.ROLE_WORKER, p.index)))
