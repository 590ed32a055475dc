"""The imperative shell around :func:`~stalwart.operator.reconcile.reconcile`: gather one observation of a job,
decide, apply the actions, remember what was done.

:class:`JobRunner` holds the little a reconcile must remember between two looks at the API, because watches
lag behind writes: the status it last wrote (the operator is the status' only writer), the pods it created
or deleted that the watch has not shown yet, when it last patched the status (the rate limit), and whether
the job's Service and Secret exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from stalwart.api import naming
from stalwart.api.job_record import JobRecord
from stalwart.api.rendezvous import FenceRecord
from stalwart.api.status import TrainingJobStatus
from stalwart.api.trainingjob import TrainingJob
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.outage import Backoff, Outage
from stalwart.etcd.store import StoreError
from stalwart.operator import metrics, provenance
from stalwart.operator.etcd_access import EtcdAccess, EtcdTarget
from stalwart.operator.etcd_policy import etcd_refusal
from stalwart.operator.guards import BLOCKING_KINDS, MARKED_KINDS, conflict_of, etcd_problem
from stalwart.operator.job_login import JobClient, job_secret_data, provision
from stalwart.operator.kube import Existing, Kube, KubeError, new_rpc_token
from stalwart.operator.manifests import (
    AGENT_COMMAND,
    GANG_SCHEDULERS,
    pod_group_manifest,
    pod_manifest,
    secret_manifest,
    service_manifest,
)
from stalwart.operator.model import (
    CloseRendezvous,
    Conflict,
    CreatePod,
    Decision,
    DeleteJob,
    DeletePod,
    EmitEvent,
    EnsureOwnedObjects,
    EtcdProblem,
    EtcdView,
    JobView,
    Observation,
    PatchStatus,
    PodView,
    ReconcileSettings,
    RevokeLease,
    SyncPodGroup,
    WriteFence,
    WriteJobRecord,
)
from stalwart.operator.observe import job_view, overlay
from stalwart.operator.reconcile import reconcile

log = logging.getLogger(__name__)


@dataclass
class OperatorContext:
    """What every job's runner shares: the API and etcd adapters, settings, and the wake-up registry."""

    kube: Kube
    etcd: EtcdAccess
    settings: ReconcileSettings = field(default_factory=ReconcileSettings)
    default_endpoints: tuple[str, ...] = ()
    #: How the operator logs in to its default etcd (TLS, user); an administrator with ``job_logins``.
    default_credentials: EtcdCredentials = field(default_factory=EtcdCredentials)
    #: Give each job on the default etcd an etcd user of its own (:mod:`stalwart.operator.job_login`).
    job_logins: bool = False
    #: The client certificate jobs present to etcd when it demands one (never the operator's own).
    job_client: JobClient | None = None
    agent_command: tuple[str, ...] = AGENT_COMMAND
    #: "volcano" or "coscheduling": create a PodGroup per job and point its pods at it; None: no gang scheduler.
    gang_scheduler: str | None = None
    #: The port every job's agents serve their metrics on; None: they serve none.
    agent_metrics_port: int | None = None
    #: The key of this operator's mark on the Secrets it makes (:mod:`.provenance`).
    adoption_key: bytes = field(default_factory=provenance.new_key, repr=False)
    wakers: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    names_by_uid: dict[str, tuple[str, str]] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None

    def wake(self, namespace: str, name: str) -> None:
        event = self.wakers.get((namespace, name))
        if event is not None:
            event.set()

    def wake_uid_threadsafe(self, namespace: str, uid: str) -> None:
        """Called from the etcd watch thread when a job's records change."""
        target = self.names_by_uid.get(uid)
        if target is not None and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.wake, *target)


async def etcd_target(ctx: OperatorContext, namespace: str, job: JobView) -> EtcdTarget | None:
    """The etcd the operator uses for the job and how it logs in there: always its own etcd, with the
    credentials its administrator gave it (:mod:`.etcd_policy`). The job's ``spec.rendezvous.secretRef`` is
    for its pods: the operator never reads it. None when the operator has no etcd, or the job names another
    one (the job is then refused, :func:`~.etcd_policy.etcd_refusal`). Async for its callers' sake."""
    spec = job.spec
    if not ctx.default_endpoints:
        return None
    if spec is not None and etcd_refusal(spec.rendezvous.endpoints, ctx.default_endpoints) is not None:
        return None
    return EtcdTarget(ctx.default_endpoints, ctx.default_credentials)


def uses_job_login(ctx: OperatorContext, job: JobView) -> bool:
    """Whether the operator gives this job an etcd user of its own (it uses the operator's etcd)."""
    return ctx.job_logins and job.spec is not None and job.spec.rendezvous.endpoints is None \
        and job.spec.rendezvous.secret_ref is None


class JobRunner:
    """Reconciles one TrainingJob: :meth:`step` = observe, decide, apply."""

    def __init__(self, ctx: OperatorContext, namespace: str, name: str) -> None:
        self.ctx = ctx
        self.namespace = namespace
        self.name = name
        self.decided_status: TrainingJobStatus | None = None
        self.written_status: TrainingJobStatus | None = None
        self.last_patch: float | None = None
        self.owned_ready = False
        self.pod_group_min_member: int | None = None
        self.created: dict[str, tuple[PodView, float]] = {}
        self.deleted: dict[str, tuple[int, float]] = {}
        self.phase: str | None = None
        self._target: tuple[int, EtcdTarget | None] | None = None  # (generation, target)
        #: Why the job's etcd cannot be used with its credentials (kept until a read succeeds).
        self.etcd_problem: EtcdProblem | None = None
        #: Objects of the names the job needs that are not the job's, by (kind, name); re-checked every look.
        self.conflicts: dict[tuple[str, str], Conflict] = {}
        #: The resourceVersion of the object the decided status was computed from (sent with every status
        #: patch: a conflict means someone else wrote, and the next reconcile starts again from the API).
        self.resource_version: str | None = None
        self._conflict = False
        # An unreachable etcd is tried with back-off and logged once when it goes and once when it is back.
        self.etcd_outage = Outage("etcd", logger=log, context=f"job {namespace}/{name}",
                                  backoff=Backoff(initial=0.5, cap=10.0))

    async def target(self, job: JobView) -> EtcdTarget | None:
        """The job's etcd target, resolved once per spec generation (and again after an etcd error)."""
        if self._target is None or self._target[0] != job.generation:
            self._target = (job.generation, await etcd_target(self.ctx, self.namespace, job))
        return self._target[1]

    async def observe(self, body: Mapping[str, Any], pods: Sequence[PodView],
                      unreachable_nodes: frozenset[str] = frozenset()) -> Observation:
        now = time.time()
        job = job_view(body)
        if job.spec is not None and (refused := etcd_refusal(job.spec.rendezvous.endpoints,
                                                               self.ctx.default_endpoints)) is not None:
            job = replace(job, spec=None, spec_problem=refused)  # InvalidSpec naming the field, and one Event
        if self.decided_status is not None:
            job = replace(job, status=self.decided_status)
        else:
            self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "") or None
        etcd = EtcdView(reachable=False)
        if job.uid and not job.deleting and self.etcd_outage.due():
            try:
                target = await self.target(job)
                if target is not None:
                    etcd = await asyncio.to_thread(self.ctx.etcd.read, target, JobKeys(self.namespace, job.uid))
                    self.etcd_outage.ok()
                self.etcd_problem = None
            except (StoreError, KubeError, ValueError) as e:
                self._target = None
                self.etcd_problem = etcd_problem(e, job)
                self.etcd_outage.failed(e)
        if job.uid and not job.deleting:
            await self._recheck_conflicts(job.uid)
        # Forget overlay entries the watch has caught up with.
        watched = {p.name: p for p in pods}
        for pod_name in [n for n in self.created if n in watched]:
            del self.created[pod_name]
        for pod_name in [n for n, _ in self.deleted.items() if n not in watched or watched[n].deleting]:
            del self.deleted[pod_name]
        return Observation(job=job, pods=overlay(pods, self.created, self.deleted, now), etcd=etcd, now=now,
                           last_status_patch=self.last_patch, owned_objects_ready=self.owned_ready,
                           written_status=self.written_status, unreachable_nodes=unreachable_nodes,
                           etcd_problem=self.etcd_problem, conflicts=tuple(self.conflicts.values()),
                           gang_scheduled=self.ctx.gang_scheduler is not None,
                           pod_group_min_member=self.pod_group_min_member)

    async def step(self, body: Mapping[str, Any], pods: Sequence[PodView],
                   unreachable_nodes: frozenset[str] = frozenset()) -> Decision:
        """One reconcile. Raises only on bugs; API and etcd failures are logged and retried next time."""
        started = time.perf_counter()
        obs = await self.observe(body, pods, unreachable_nodes)
        decision = reconcile(obs, self.ctx.settings)
        log.debug("job %s/%s: observed in %.3fs; %d action(s)", self.namespace, self.name,
                  time.perf_counter() - started, len(decision.actions))
        self._conflict = False
        if await self.apply(obs, decision, body):
            self.decided_status = decision.status
            if self.written_status is None:
                self.written_status = obs.job.status
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
        if self._conflict:
            # Someone else wrote the job since the status was computed: decide again from what the API holds
            # (the counters are recomputed from the written position and etcd, so nothing is lost or doubled).
            self.decided_status = self.written_status = None
            self.resource_version = None
            return replace(decision, requeue_after=0.2)
        return decision

    # -- applying ------------------------------------------------------------------------------------------

    async def apply(self, obs: Observation, decision: Decision, body: Mapping[str, Any]) -> bool:
        """Apply the actions in order; False when the decision must be taken again from the previous decided
        status. A failed fence stops everything after it (no replacement may join while a lost pod may still
        act); a failed pod creation withholds the status patch and Events (its counters assumed the pod
        exists). A status patch that conflicts (the job changed since) stops everything after it, and so does
        a failed one that comes before pod creations (it carries the count of the replacements they are). Any
        other failed status patch or Event only logs: the next reconcile retries it."""
        job = obs.job
        target: EtcdTarget | None = None
        try:
            target = await self.target(job) if job.spec is not None else None
        except (KubeError, ValueError) as e:
            # The decision knows (EtcdAccess, from the observation); what needs etcd fails below and stops.
            self._target = None
            log.warning("job %s/%s: cannot resolve its etcd: %s", self.namespace, self.name, e)
        endpoints = target.endpoints if target is not None else ()
        keys = JobKeys(self.namespace, job.uid) if job.uid else None
        ns, kube = self.namespace, self.ctx.kube
        actions = list(decision.actions)
        ok = True
        i = 0
        while i < len(actions):
            action = actions[i]
            # Runs of the same kind go together, concurrently where the kind allows.
            j = i
            while j < len(actions) and type(actions[j]) is type(action):
                j += 1
            batch = actions[i:j]
            i = j
            if not ok and isinstance(action, (PatchStatus, EmitEvent)):
                continue  # they describe pods that were not created; the next reconcile decides again
            t0 = time.perf_counter()
            try:
                if isinstance(action, EnsureOwnedObjects):
                    await self._ensure_owned(job)
                    if any(c.kind in BLOCKING_KINDS for c in self.conflicts.values()) \
                            and set(self.conflicts.values()) != set(obs.conflicts):
                        return False  # decide again, knowing the conflict: no pod may use a foreign object
                elif isinstance(action, SyncPodGroup):
                    if not await self._sync_pod_group(job, action.min_member):
                        return False  # decide again, knowing the conflict
                elif isinstance(action, WriteFence):
                    assert keys is not None
                    for a in batch:
                        assert isinstance(a, WriteFence)
                        fence = FenceRecord(node_id=a.node_id, pod_uid=a.pod_uid, reason=a.reason[:1024])
                        await asyncio.to_thread(self.ctx.etcd.write_fence, _need(target), keys, fence)
                        log.info("job %s/%s: fenced pod %s (uid %s)", ns, self.name, a.node_id, a.pod_uid)
                elif isinstance(action, RevokeLease):
                    for a in batch:
                        assert isinstance(a, RevokeLease)
                        await asyncio.to_thread(self.ctx.etcd.revoke, _need(target), a.lease_id)
                        log.info("job %s/%s: fenced node %s (revoked lease %x)", ns, self.name, a.node_id,
                                 a.lease_id)
                elif isinstance(action, DeletePod):
                    await self._gather([self._delete(a) for a in batch if isinstance(a, DeletePod)])
                elif isinstance(action, WriteJobRecord):
                    assert keys is not None
                    for a in batch:
                        assert isinstance(a, WriteJobRecord)
                        record = self._record(body, job, a)
                        await asyncio.to_thread(self.ctx.etcd.write_record, _need(target), keys, record,
                                                a.expected)
                elif isinstance(action, CreatePod):
                    if not await self._gather([self._create(job, endpoints, a) for a in batch
                                               if isinstance(a, CreatePod)]):
                        ok = False
                    metrics.POD_BATCH_SECONDS.observe(time.perf_counter() - t0)
                elif isinstance(action, CloseRendezvous):
                    assert keys is not None
                    await asyncio.to_thread(self.ctx.etcd.close_rendezvous, _need(target), keys,
                                            action.reason)
                elif isinstance(action, PatchStatus):
                    if not await self._patch_status(obs, action.status):
                        return False
                elif isinstance(action, EmitEvent):
                    for a in batch:  # a Warning is worth the operator's own log too (an Event expires)
                        if isinstance(a, EmitEvent) and a.type == "Warning":
                            log.warning("job %s/%s: %s: %s", ns, self.name, a.reason, a.message)
                    await self._gather([kube.event(ns, self.name, job.uid, type_=a.type, reason=a.reason,
                                                   message=a.message)
                                        for a in batch if isinstance(a, EmitEvent)])
                elif isinstance(action, DeleteJob):
                    log.info("job %s/%s: ttlSecondsAfterFinished passed; deleting it", ns, self.name)
                    await kube.delete_job(ns, self.name)
                log.debug("job %s/%s: %s x%d in %.3fs", ns, self.name, type(action).__name__, len(batch),
                          time.perf_counter() - t0)
            except (KubeError, StoreError, ValueError) as e:
                log.warning("job %s/%s: %s failed: %s", ns, self.name, type(action).__name__, e)
                if isinstance(action, (WriteFence, RevokeLease, EnsureOwnedObjects, SyncPodGroup, WriteJobRecord)):
                    return False  # what follows depends on it
                if isinstance(action, PatchStatus) and any(isinstance(a, CreatePod) for a in actions[i:]):
                    return False  # the replacements' count must be written before they are created
                # A failed status patch or Event is retried by the next reconcile (decided != written).
        return ok

    async def _gather(self, calls: Sequence[Any]) -> bool:
        results = await asyncio.gather(*calls, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for err in failed[:3]:
            log.warning("job %s/%s: %s", self.namespace, self.name, err)
        for err in failed:
            if not isinstance(err, (KubeError, StoreError, ValueError)):
                raise err
        return not failed

    async def _ensure_owned(self, job: JobView) -> None:
        ns = self.namespace
        secret = naming.secret_name(self.name)
        extra: dict[str, bytes] = {}
        if uses_job_login(self.ctx, job):
            # A Secret of that name that is not the job's is neither read nor written.
            if await self._conflicting("secrets", "Secret", secret, job.uid):
                return
            existing = await self.ctx.kube.get_secret_data(ns, secret, missing_ok=True)
            store = self.ctx.etcd.store(_need(await self.target(job)))
            login = await asyncio.to_thread(provision, store, JobKeys(ns, job.uid), existing)
            extra = job_secret_data(login, self.ctx.default_credentials, self.ctx.job_client)
        service = naming.service_name(self.name)
        made = await asyncio.gather(
            self.ctx.kube.create_service(ns, service_manifest(job=self.name, namespace=ns, uid=job.uid)),
            self.ctx.kube.create_secret(ns, secret_manifest(
                job=self.name, namespace=ns, uid=job.uid, token=new_rpc_token(), extra=extra,
                made_by=provenance.mark(self.ctx.adoption_key, "Secret", ns, secret, job.uid))))
        found = [await self._conflicting(resource, kind, name, job.uid)
                 for created, (resource, kind, name) in zip(made, [("services", "Service", service),
                                                                   ("secrets", "Secret", secret)], strict=True)
                 if not created]
        if any(found):
            return
        self.owned_ready = True

    async def _sync_pod_group(self, job: JobView, min_member: int) -> bool:
        """Create the job's PodGroup, or patch the job's own to ``min_member``; False when one of that name
        is not the job's (then a conflict: it is left alone)."""
        assert self.ctx.gang_scheduler is not None
        body = pod_group_manifest(gang=self.ctx.gang_scheduler, job=self.name, namespace=self.namespace,
                                  uid=job.uid, min_member=min_member)
        if not await self.ctx.kube.create_pod_group(self.namespace, body):
            if await self._conflicting("podgroups", "PodGroup", self.name, job.uid):
                return False
            await self.ctx.kube.patch_pod_group(self.namespace, body)
        self.pod_group_min_member = min_member
        log.info("job %s/%s: PodGroup minMember %d", self.namespace, self.name, min_member)
        return True

    async def _existing(self, resource: str, name: str) -> Existing | None:
        if resource == "podgroups":
            assert self.ctx.gang_scheduler is not None
            api_version = GANG_SCHEDULERS[self.ctx.gang_scheduler][0]
            return await self.ctx.kube.pod_group_owner_references(api_version, self.namespace, name)
        return await self.ctx.kube.owner_references(resource, self.namespace, name)

    async def _conflicting(self, resource: str, kind: str, name: str, uid: str) -> bool:
        """Whether the existing ``kind``/``name`` is not the job's (then remembered as a conflict). A Secret
        must also carry this operator's mark: it holds the job's RPC token and etcd login."""
        existing = await self._existing(resource, name)
        made_here = None if kind not in MARKED_KINDS or existing is None else provenance.verifies(
            self.ctx.adoption_key, kind, self.namespace, name, uid, shown=existing.made_by)
        conflict = conflict_of(kind, name, uid, None if existing is None else existing.owner_references, made_here)
        if conflict is None:
            self.conflicts.pop((kind, name), None)
            return False
        if (kind, name) not in self.conflicts:
            log.warning("job %s/%s: %s %s exists and is not the job's (%s); leaving it alone", self.namespace,
                        self.name, kind, name, conflict.owner)
        self.conflicts[(kind, name)] = conflict
        return True

    async def _recheck_conflicts(self, uid: str) -> None:
        """Drop the conflicts that are gone (the object deleted, or now the job's)."""
        resources = {"Pod": "pods", "Service": "services", "Secret": "secrets", "PodGroup": "podgroups"}
        for kind, name in list(self.conflicts):
            try:
                await self._conflicting(resources[kind], kind, name, uid)
            except KubeError as e:
                log.warning("job %s/%s: cannot check %s %s: %s", self.namespace, self.name, kind, name, e)

    async def _create(self, job: JobView, endpoints: Sequence[str], action: CreatePod) -> None:
        assert job.spec is not None
        body = pod_manifest(job=self.name, namespace=self.namespace, uid=job.uid, spec=job.spec,
                            name=action.name, role=action.role, index=action.index, endpoints=endpoints,
                            agent_command=self.ctx.agent_command, gang=self.ctx.gang_scheduler,
                            queue=job.queue_name, metrics_port=self.ctx.agent_metrics_port,
                            credentials=(naming.secret_name(self.name), self.ctx.default_credentials.tls)
                            if uses_job_login(self.ctx, job) else None)
        self.deleted.pop(action.name, None)
        if not await self.ctx.kube.create_pod(self.namespace, body) \
                and await self._conflicting("pods", "Pod", action.name, job.uid):
            return  # the name is taken by a pod that is not the job's; the next decision picks another
        self.created[action.name] = (PodView(name=action.name, role=action.role, index=action.index,
                                             phase="Pending"), time.time())

    async def _delete(self, action: DeletePod) -> None:
        # Every deletion is a decision with a reason (a failure, a clean-up, a lingering pod...): say which.
        log.info("job %s/%s: deleting pod %s (%s, grace %ds)", self.namespace, self.name, action.name,
                 action.reason, action.grace)
        await self.ctx.kube.delete_pod(self.namespace, action.name, action.grace)
        self.deleted[action.name] = (action.grace, time.time())
        self.created.pop(action.name, None)

    def _record(self, body: Mapping[str, Any], job: JobView, action: WriteJobRecord) -> JobRecord:
        tj = TrainingJob.model_validate({"apiVersion": body.get("apiVersion", "stalwart.dev/v1alpha1"),
                                         "kind": "TrainingJob",
                                         "metadata": {"name": self.name, "namespace": self.namespace,
                                                      "uid": job.uid, "generation": job.generation},
                                         "spec": body.get("spec") or {}})
        return JobRecord.from_job(tj, list(action.members), list(action.spares))

    async def _patch_status(self, obs: Observation, status: TrainingJobStatus) -> bool:
        """Patch the status, on condition that the job is still the version it was computed from. False on a
        conflict (someone else wrote in between): the decision is dropped and taken again."""
        written = obs.written_status if obs.written_status is not None else obs.job.status
        patch = status_patch(written.to_wire(), status.to_wire())
        try:
            result = await self.ctx.kube.patch_status(self.namespace, self.name, patch,
                                                      resource_version=self.resource_version)
        except KubeError as e:
            if e.status != 409:
                raise
            log.info("job %s/%s: the job changed since its status was computed; computing it again",
                     self.namespace, self.name)
            self._conflict = True
            return False
        self.resource_version = str((result.get("metadata") or {}).get("resourceVersion") or "") or None
        self._count(written, status)
        self.written_status = status
        self.last_patch = time.time()
        return True

    def _count(self, old: TrainingJobStatus, new: TrainingJobStatus) -> None:
        before = old.restarts.model_copy() if old.restarts else None
        after = new.restarts
        if after is not None:
            dip = after.in_process - (before.in_process if before else 0)
            dproc = after.process_restarts - (before.process_restarts if before else 0)
            dpr = after.pod_replacements - (before.pod_replacements if before else 0)
            if dip > 0:
                metrics.RESTARTS.labels("in_process").inc(dip)
            if dproc > 0:
                metrics.RESTARTS.labels("process").inc(dproc)
            if dpr > 0:
                metrics.POD_REPLACEMENTS.inc(dpr)
        if new.phase is not None and new.phase.value != self.phase:
            if self.phase is not None:
                metrics.JOBS.labels(self.phase).dec()
            self.phase = new.phase.value
            metrics.JOBS.labels(self.phase).inc()

    def forget(self) -> None:
        """The job is gone from this operator: take it out of the phase gauge."""
        if self.phase is not None:
            metrics.JOBS.labels(self.phase).dec()
            self.phase = None


def status_patch(written: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns the ``written`` status into ``new``: every field that went
    away, at any depth, is set to null. So an object such as ``lastFailure`` is replaced whole and can never
    mix the fields of two failures. Lists are replaced whole by merge patches anyway."""
    out: dict[str, Any] = {}
    for key, value in new.items():
        before = written.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            out[key] = status_patch(before, value)
        else:
            out[key] = value
    for key in written:
        if key not in new:
            out[key] = None
    return out


def _need(target: EtcdTarget | None) -> EtcdTarget:
    if target is None:
        raise ValueError("no etcd endpoints: the operator has no --etcd-endpoints")
    return target
