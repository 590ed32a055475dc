"""The kopf side of the operator: thin handlers that gather observations and hand them to a
:class:`~stalwart.operator.runner.JobRunner`.

- an index of the job's pods (from kopf's own pod watch: no list call per reconcile) and one of the nodes
  that are unreachable (:mod:`~stalwart.operator.node_loss`); a node turning unreachable or back wakes the jobs
  with pods on it;
- one daemon per TrainingJob that reconciles whenever the job, one of its pods or its etcd records change,
  and at least every ``resync_interval`` seconds;
- a deletion handler (kopf's finalizer, named ``stalwart.dev/finalizer``) that deletes the job's etcd prefix
  and nothing else; the pods, Service and Secret go with the job through their owner references.

:func:`build_registry` makes a fresh registry, so the operator can be embedded (tests, benchmarks) next to
others in one process; :func:`run` runs kopf with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import kopf

from stalwart.api import naming
from stalwart.api.spec import managed_here
from stalwart.api.trainingjob import GROUP, PLURAL, VERSION
from stalwart.etcd.client import EtcdCredentials
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import StoreError
from stalwart.jitter import RNG
from stalwart.operator import provenance
from stalwart.operator.etcd_access import EtcdAccess
from stalwart.operator.job_login import JobClient, retire
from stalwart.operator.kube import Kube, KubeError
from stalwart.operator.manifests import AGENT_COMMAND
from stalwart.operator.model import DeleteJob, PodView, ReconcileSettings
from stalwart.operator.node_loss import node_unreachable
from stalwart.operator.observe import job_view, pod_view
from stalwart.operator.runner import JobRunner, OperatorContext, etcd_target, uses_job_login

log = logging.getLogger(__name__)

FINALIZER = "stalwart.dev/finalizer"
#: How long the finalizer keeps trying to delete the etcd prefix before it lets the job go anyway (the keys
#: are then left for an operator to remove by hand; an Event says so). Bounded so a dead etcd cannot pin a
#: job forever.
ETCD_CLEANUP_SECONDS = 300.0
#: How long the finalizer waits for the job's pods to terminate gracefully before it force-deletes them.
POD_DRAIN_SECONDS = 60.0


@dataclass
class OperatorRunConfig:
    """How to run the operator (the ``stalwart operator`` flags)."""

    namespaces: tuple[str, ...] = ()  # empty: every namespace
    default_endpoints: tuple[str, ...] = ()
    #: How to log in to the default etcd (TLS, user); with ``job_etcd_users`` an etcd administrator.
    etcd_credentials: EtcdCredentials = field(default_factory=EtcdCredentials)
    #: One etcd user per job on the default etcd, limited to the job's prefix (needs etcd auth on).
    job_etcd_users: bool = False
    #: The client certificate the jobs' pods present to etcd (never the operator's; ``job-tls.crt``/``.key``).
    job_client: JobClient | None = None
    #: Turn etcd authentication on (creating root) where it is off, when the operator logs in as root.
    etcd_enable_auth: bool = False
    settings: ReconcileSettings = field(default_factory=ReconcileSettings)
    concurrency: int = 16
    peering: str | None = None  # None: standalone
    priority: int | None = None
    health_endpoint: str | None = None  # e.g. http://0.0.0.0:8080/healthz
    etcd_timeout: float = 5.0
    #: The pods' entrypoint prefix before the user's command (see ``manifests.pod_manifest``).
    agent_command: tuple[str, ...] = AGENT_COMMAND
    #: "volcano" or "coscheduling" to gang-schedule each job's pods through a PodGroup; None: none.
    gang_scheduler: str | None = None
    #: The port every job's agents serve their metrics on (``manifests.pod_manifest``); None: none.
    agent_metrics_port: int | None = None
    #: This replica's name among its peers (default: kopf's, from $POD_ID or host and process).
    identity: str | None = None
    #: The key of the operator's mark on the Secrets it makes (:mod:`.provenance`), the same for every replica
    #: and run; None: one drawn for this run (what an earlier run made is then not adopted).
    adoption_key: bytes | None = field(default=None, repr=False)


def _index_pod(body: kopf.Body, namespace: str | None, **_: Any) -> dict[tuple[str, str], tuple[str, PodView]]:
    labels = body.get("metadata", {}).get("labels") or {}
    job = labels.get(naming.LABEL_JOB_NAME)
    view = pod_view(body)
    if not job or view is None or namespace is None:
        return {}
    owner = next((o.get("uid", "") for o in body.get("metadata", {}).get("ownerReferences") or []
                  if o.get("controller")), "")
    return {(namespace, job): (str(owner), view)}


def _index_node(body: kopf.Body, name: str | None, **_: Any) -> dict[str, bool]:
    return {name: node_unreachable(body)} if name else {}


def _managed_here(spec: kopf.Spec, **_: Any) -> bool:
    # A job another controller manages (spec.managedBy) gets no daemon, no finalizer and no status from us.
    return managed_here(spec.get("managedBy"))


def _unreachable(nodes: kopf.Index[str, bool]) -> frozenset[str]:
    return frozenset(name for name, flags in nodes.items() if any(flags))


def build_registry(config: OperatorRunConfig, kube: Kube) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers, calling the API through ``kube`` (kopf logs in with the
    same credentials)."""
    registry = kopf.OperatorRegistry()
    state: dict[str, OperatorContext] = {}
    runners: dict[tuple[str, str], JobRunner] = {}

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="stalwart.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="stalwart.dev", key="last-handled-configuration")
        settings.posting.level = logging.WARNING
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.networking.request_timeout = 60
        if config.peering is not None:
            settings.peering.name = config.peering
            settings.peering.mandatory = True
            settings.peering.clusterwide = not config.namespaces
        adoption_key = config.adoption_key
        if adoption_key is None:
            adoption_key = provenance.new_key()
            log.warning("no adoption key (--adoption-key-file): Secrets made by an earlier run or another replica "
                        "of the operator will not be adopted (OwnershipConflict)%s",
                        "; with peering, every replica needs the same key" if config.peering else "")
        ctx = OperatorContext(kube=kube, etcd=EtcdAccess(timeout=config.etcd_timeout,
                                                         enable_auth=config.etcd_enable_auth),
                              settings=config.settings, default_endpoints=config.default_endpoints,
                              default_credentials=config.etcd_credentials, job_logins=config.job_etcd_users,
                              job_client=config.job_client,
                              agent_command=config.agent_command, gang_scheduler=config.gang_scheduler,
                              agent_metrics_port=config.agent_metrics_port, adoption_key=adoption_key,
                              loop=asyncio.get_running_loop())
        ctx.etcd.on_change = ctx.wake_uid_threadsafe
        state["ctx"] = ctx

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        ctx = state.pop("ctx", None)
        if ctx is not None:
            await asyncio.to_thread(ctx.etcd.close)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(kube.api_client.configuration)

    @kopf.on.probe(id="jobs", registry=registry)
    def probe_jobs(**_: Any) -> int:
        return len(runners)

    kopf.index("v1", "pods", labels={naming.LABEL_JOB_NAME: kopf.PRESENT}, id="stalwart_pods",
               registry=registry)(_index_pod)
    kopf.index("v1", "nodes", id="stalwart_nodes", registry=registry)(_index_node)
    node_seen: dict[str, bool] = {}

    @kopf.on.event("v1", "nodes", registry=registry)
    def node_changed(name: str | None, body: kopf.Body, event: kopf.RawEvent, **kwargs: Any) -> None:
        ctx = state.get("ctx")
        if ctx is None or not name:
            return
        lost = node_unreachable(body) and event.get("type") != "DELETED"
        if node_seen.get(name, False) == lost:
            return
        node_seen[name] = lost
        stalwart_pods: kopf.Index[tuple[str, str], tuple[str, PodView]] = kwargs["stalwart_pods"]
        for key, views in stalwart_pods.items():
            if any(view.node == name for _, view in views):
                ctx.wake(*key)

    @kopf.on.event("v1", "pods", labels={naming.LABEL_JOB_NAME: kopf.PRESENT}, registry=registry)
    def pod_changed(body: kopf.Body, namespace: str | None, **_: Any) -> None:
        ctx = state.get("ctx")
        job = (body.get("metadata", {}).get("labels") or {}).get(naming.LABEL_JOB_NAME)
        if ctx is not None and namespace and job:
            ctx.wake(namespace, job)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def job_changed(name: str | None, namespace: str | None, **_: Any) -> None:
        ctx = state.get("ctx")
        if ctx is not None and name and namespace:
            ctx.wake(namespace, name)

    @kopf.daemon(GROUP, VERSION, PLURAL, id="reconcile", cancellation_timeout=15.0, when=_managed_here,
                 registry=registry)
    async def reconcile_job(*, body: kopf.Body, name: str, namespace: str | None, uid: str,
                            stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
        ctx = state["ctx"]
        namespace = namespace or "default"
        stalwart_pods: kopf.Index[tuple[str, str], tuple[str, PodView]] = kwargs["stalwart_pods"]
        stalwart_nodes: kopf.Index[str, bool] = kwargs["stalwart_nodes"]
        runner = JobRunner(ctx, namespace, name)
        key = (namespace, name)
        wake = asyncio.Event()
        ctx.wakers[key] = wake
        ctx.names_by_uid[uid] = key
        runners[key] = runner
        failures = 0
        try:
            while not stopped:
                wake.clear()
                # Only the pods the job controls: one with its label and another owner, or none, is not adopted.
                pods = [view for owner, view in stalwart_pods.get(key, []) if owner == uid]
                try:
                    decision = await runner.step(body, pods, _unreachable(stalwart_nodes))
                    failures = 0
                except Exception:
                    failures += 1
                    log.exception("job %s/%s: reconcile failed (%d in a row)", namespace, name, failures)
                    decision = None
                if decision is not None and any(isinstance(a, DeleteJob) for a in decision.actions):
                    return
                if decision is None:
                    timeout = min(30.0, 0.5 * 2 ** min(failures, 6)) * RNG.uniform(0.8, 1.2)
                else:
                    timeout = min(decision.requeue_after if decision.requeue_after is not None
                                  else ctx.settings.resync_interval, ctx.settings.resync_interval)
                await _wait(wake, stopped, timeout)
                # Let a burst of pod events land before looking again.
                await asyncio.sleep(0.05)
        finally:
            ctx.wakers.pop(key, None)
            ctx.names_by_uid.pop(uid, None)
            runners.pop(key, None)
            runner.forget()

    @kopf.on.delete(GROUP, VERSION, PLURAL, when=_managed_here, registry=registry)
    async def delete_job(*, body: kopf.Body, name: str, namespace: str | None, uid: str,
                         runtime: datetime.timedelta, **kwargs: Any) -> None:
        ctx = state["ctx"]
        namespace = namespace or "default"
        stalwart_pods: kopf.Index[tuple[str, str], tuple[str, PodView]] = kwargs["stalwart_pods"]
        elapsed = runtime.total_seconds()
        # The pods go first: an agent still running would write its progress again after the prefix is gone.
        # (Owner references would delete them only once the job itself is gone, after this finalizer.)
        pods = [view for owner, view in stalwart_pods.get((namespace, name), []) if owner == uid]
        if pods:
            force = elapsed > POD_DRAIN_SECONDS
            grace = 0 if force else ctx.settings.delete_grace_seconds
            await asyncio.gather(*[ctx.kube.delete_pod(namespace, p.name, grace) for p in pods
                                   if force or not p.deleting], return_exceptions=True)
            raise kopf.TemporaryError(f"waiting for {len(pods)} pod(s) to terminate before deleting the "
                                      "job's etcd keys", delay=1.0)
        job = job_view(body)
        keys = JobKeys(namespace, uid)
        try:
            target = await etcd_target(ctx, namespace, job)
            if target is None:
                log.warning("job %s/%s: no etcd of the operator's serves it (none configured, or the job named "
                            "other endpoints); nothing to clean up in etcd", namespace, name)
                return
            deleted = await asyncio.to_thread(ctx.etcd.delete_job, target, keys)
            if uses_job_login(ctx, job):
                await asyncio.to_thread(retire, ctx.etcd.store(target), keys)
                log.info("job %s/%s: deleted its etcd user", namespace, name)
        except (StoreError, KubeError, ValueError) as e:
            if elapsed > ETCD_CLEANUP_SECONDS:
                message = (f"could not delete etcd prefix {keys.prefix} for {elapsed:.0f}s ({e}); "
                           "leaving the keys behind")
                log.error("job %s/%s: %s", namespace, name, message)
                kopf.warn(body, reason="EtcdCleanupFailed", message=message)
                return
            raise kopf.TemporaryError(f"etcd prefix deletion failed: {e}",
                                      delay=RNG.uniform(2.0, 6.0)) from e
        log.info("job %s/%s: deleted %d etcd key(s) under %s", namespace, name, deleted, keys.prefix)

    return registry


async def _wait(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Until woken, stopped, or ``seconds`` pass; checks ``stopped`` at least twice a second."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max(0.0, seconds)
    while not stopped and not wake.is_set():
        left = deadline - loop.time()
        if left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=min(0.5, left))


def _scope(config: OperatorRunConfig) -> dict[str, Any]:
    if config.namespaces:
        return {"namespaces": list(config.namespaces), "clusterwide": False}
    return {"clusterwide": True}


async def operate(config: OperatorRunConfig, kube: Kube, *,
                  stop_flag: asyncio.Event | threading.Event | None = None,
                  ready_flag: asyncio.Event | threading.Event | None = None) -> None:
    """Run the operator until ``stop_flag`` is set (or the task is cancelled)."""
    registry = build_registry(config, kube)
    if not log.isEnabledFor(logging.DEBUG):
        # kopf logs every handler call at INFO: one line per pod event is noise at scale.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    standalone = config.peering is None
    # kopf lets the peer with the highest priority work and pauses the others; equal priorities would all
    # work at once, so each replica draws its own unless told.
    priority = config.priority if config.priority is not None else RNG.randint(1, 2**31 - 1)
    extra: dict[str, Any] = {}
    if config.identity is not None:
        extra["identity"] = config.identity  # kopf's Identity is a NewType of str
    await kopf.operator(registry=registry, standalone=standalone, peering_name=config.peering, **extra,
                        priority=priority, liveness_endpoint=config.health_endpoint, stop_flag=stop_flag,
                        ready_flag=ready_flag, **_scope(config))


def kube_from_config(kubeconfig: str | None, concurrency: int) -> Kube:
    """A :class:`Kube` adapter from a kubeconfig file, else the in-cluster service account, else the default
    kubeconfig (``KUBECONFIG``, ``~/.kube/config``)."""
    from kubernetes import client
    from kubernetes import config as kconfig

    config: Any = kconfig  # its loaders are untyped
    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(client_configuration=cfg)
    cfg.connection_pool_maxsize = concurrency
    return Kube(client.ApiClient(cfg), concurrency=concurrency)


def connection_info(cfg: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a ``kubernetes.client.Configuration``, so both clients talk to the same
    server the same way."""
    token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    scheme = None
    if token:
        scheme, _, token = token.partition(" ") if " " in token else ("Bearer", "", token)
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl, username=cfg.username or None,
        password=cfg.password or None, scheme=scheme, token=token or None, certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file, expiration=None)
