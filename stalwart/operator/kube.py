"""The operator's adapter to the Kubernetes API: the few calls it makes, each counted, each with a timeout.

It wraps the official ``kubernetes`` client (synchronous) in a bounded thread pool so that the asyncio
operator can issue many calls at once: creating the pods of a 64-pod job is one ``asyncio.gather`` over
at most ``concurrency`` calls in flight, not 64 calls one after another. Every call is listed in
:mod:`stalwart.operator.rbac` with the permission it needs.

Creating something that exists (409) and deleting something that is gone (404) are successes: reconciles
repeat, and the API is the source of truth.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from stalwart.api import naming
from stalwart.api.trainingjob import API_VERSION, GROUP, KIND, PLURAL, VERSION
from stalwart.operator import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds before any single API call is abandoned.
DEFAULT_REQUEST_TIMEOUT = 30.0


class KubeError(Exception):
    """An API call failed (other than the 404/409 cases treated as success)."""

    def __init__(self, verb: str, resource: str, name: str, status: int | None, reason: str) -> None:
        self.verb, self.resource, self.name, self.status = verb, resource, name, status
        super().__init__(f"{verb} {resource} {name}: {status or ''} {reason}".strip())


class Kube:
    """The Kubernetes calls of the operator. ``api_client`` is a configured ``kubernetes.client.ApiClient``;
    at most ``concurrency`` calls run at once. ``calls`` counts calls by ``(verb, resource)``."""

    def __init__(self, api_client: k8s.ApiClient, *, concurrency: int = 16,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout: must be > 0 seconds, got {request_timeout}")
        self.api_client = api_client
        # The client's connection pool must allow as many connections as calls in flight.
        api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = concurrency
        # Typed as Any: bodies are plain dicts (the API's JSON form), which the client accepts as they are.
        self.core: Any = k8s.CoreV1Api(api_client)
        self.custom: Any = k8s.CustomObjectsApi(api_client)
        self.timeout = request_timeout
        self.concurrency = concurrency
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kube")
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self.calls: Counter[tuple[str, str]] = Counter()

    def close(self) -> None:
        """Stop the worker threads (calls in flight finish first). Idempotent."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def _call(self, verb: str, resource: str, name: str, fn: Callable[[], T], *,
                    ok_status: tuple[int, ...] = ()) -> T | None:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            # A semaphore belongs to one event loop; the adapter may be used from another (tests, tools).
            self._slots, self._slots_loop = asyncio.Semaphore(self.concurrency), loop
        async with self._slots:
            self.calls[(verb, resource)] += 1
            metrics.API_CALLS.labels(verb, resource).inc()
            try:
                return await loop.run_in_executor(self._pool, fn)
            except ApiException as e:
                if e.status in ok_status:
                    return None
                metrics.API_ERRORS.labels(verb, resource).inc()
                raise KubeError(verb, resource, name, e.status, str(e.reason)) from e
            except Exception as e:  # transport errors: refused, reset, timed out
                metrics.API_ERRORS.labels(verb, resource).inc()
                raise KubeError(verb, resource, name, None, f"{type(e).__name__}: {e}") from e

    # -- pods ----------------------------------------------------------------------------------------------

    async def create_pod(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create the pod; False when one of that name exists already (see :meth:`owner_references`)."""
        name = str(body["metadata"]["name"])
        return await self._call("create", "pods", name, lambda: self.core.create_namespaced_pod(
            namespace, body, _request_timeout=self.timeout, _preload_content=False), ok_status=(409,)) is not None

    async def delete_pod(self, namespace: str, name: str, grace: int) -> None:
        opts = k8s.V1DeleteOptions(grace_period_seconds=grace, propagation_policy="Background")
        await self._call("delete", "pods", name, lambda: self.core.delete_namespaced_pod(
            name, namespace, body=opts, grace_period_seconds=grace, _request_timeout=self.timeout,
            _preload_content=False), ok_status=(404,))

    async def get_secret_data(self, namespace: str, name: str, *, missing_ok: bool = False) -> dict[str, bytes]:
        """The decoded ``data`` of a Secret (for the etcd credentials a job names); ``{}`` for a missing one
        with ``missing_ok``."""
        result = await self._call("get", "secrets", name, lambda: self.core.read_namespaced_secret(
            name, namespace, _request_timeout=self.timeout, _preload_content=False),
            ok_status=(404,) if missing_ok else ())
        if result is None:
            return {}
        data = json.loads(result.data).get("data") or {}
        return {str(k): base64.b64decode(v) for k, v in data.items()}

    # -- owned objects -------------------------------------------------------------------------------------

    async def create_service(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create the Service; False when one of that name exists already."""
        return await self._call("create", "services", str(body["metadata"]["name"]),
                                lambda: self.core.create_namespaced_service(
                                    namespace, body, _request_timeout=self.timeout, _preload_content=False),
                                ok_status=(409,)) is not None

    async def create_secret(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create the Secret; False when one of that name exists already."""
        return await self._call("create", "secrets", str(body["metadata"]["name"]),
                                lambda: self.core.create_namespaced_secret(
                                    namespace, body, _request_timeout=self.timeout, _preload_content=False),
                                ok_status=(409,)) is not None

    async def owner_references(self, resource: str, namespace: str, name: str) -> Existing | None:
        """The owner references and the operator's mark of the pod, Service or Secret ``name`` (``resource``:
        pods, services or secrets); None when it does not exist. Checked before the operator adopts an object it
        found in place of one it meant to create."""
        read = {"pods": self.core.read_namespaced_pod, "services": self.core.read_namespaced_service,
                "secrets": self.core.read_namespaced_secret}[resource]
        result = await self._call("get", resource, name, lambda: read(
            name, namespace, _request_timeout=self.timeout, _preload_content=False), ok_status=(404,))
        return None if result is None else _owner_references(result.data)

    async def create_pod_group(self, namespace: str, body: Mapping[str, Any]) -> bool:
        """Create the PodGroup; False when one of that name exists already."""
        group, _, version = str(body["apiVersion"]).partition("/")
        return await self._call("create", "podgroups", str(body["metadata"]["name"]),
                                lambda: self.custom.create_namespaced_custom_object(
                                    group, version, namespace, "podgroups", body, _request_timeout=self.timeout,
                                    _preload_content=False), ok_status=(409,)) is not None

    async def patch_pod_group(self, namespace: str, body: Mapping[str, Any]) -> None:
        """Merge-patch the existing PodGroup's ``spec`` to ``body``'s."""
        group, _, version = str(body["apiVersion"]).partition("/")
        name = str(body["metadata"]["name"])
        await self._call("patch", "podgroups", name, lambda: self.custom.patch_namespaced_custom_object(
            group, version, namespace, "podgroups", name, {"spec": dict(body["spec"])},
            _request_timeout=self.timeout, _preload_content=False))

    async def pod_group_owner_references(self, api_version: str, namespace: str,
                                         name: str) -> Existing | None:
        """As :meth:`owner_references`, for the PodGroup ``name`` of ``api_version`` (``group/version``)."""
        group, _, version = api_version.partition("/")
        result = await self._call("get", "podgroups", name, lambda: self.custom.get_namespaced_custom_object(
            group, version, namespace, "podgroups", name, _request_timeout=self.timeout,
            _preload_content=False), ok_status=(404,))
        return None if result is None else _owner_references(result.data)

    # -- the TrainingJob ------------------------------------------------------------------------------------

    async def patch_status(self, namespace: str, name: str, status: Mapping[str, Any], *,
                           resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch ``status`` (fields set to None are removed); returns the job as written. With
        ``resource_version`` the patch applies only to that version of the job (else 409, a KubeError)."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        result = await self._call("patch", "trainingjobs/status", name,
                                  lambda: self.custom.patch_namespaced_custom_object_status(
                                      GROUP, VERSION, namespace, PLURAL, name, body,
                                      _request_timeout=self.timeout, _preload_content=False))
        if result is None:
            return {}
        try:
            written: dict[str, Any] = json.loads(result.data)
        except (ValueError, AttributeError):
            return {}
        return written

    async def delete_job(self, namespace: str, name: str) -> None:
        await self._call("delete", "trainingjobs", name, lambda: self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background",
            _request_timeout=self.timeout), ok_status=(404,))

    async def event(self, namespace: str, job: str, uid: str, *, type_: str, reason: str, message: str) -> None:
        """Record an Event on the TrainingJob (what ``kubectl describe tj`` shows)."""
        now = datetime.now(UTC)
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{job}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": job, "namespace": namespace,
                               "uid": uid},
            "type": type_, "reason": reason[:128], "message": message[:1024],
            "source": {"component": "stalwart-operator"}, "reportingComponent": "stalwart-operator",
            "reportingInstance": "stalwart-operator", "action": reason[:128],
            "firstTimestamp": now.isoformat().replace("+00:00", "Z"),
            "lastTimestamp": now.isoformat().replace("+00:00", "Z"), "count": 1,
        }
        await self._call("create", "events", job, lambda: self.core.create_namespaced_event(
            namespace, body, _request_timeout=self.timeout, _preload_content=False))


@dataclass(frozen=True, slots=True)
class Existing:
    """What decides whether an object found in place of one the operator meant to create is the job's: its
    ``metadata.ownerReferences`` and its :data:`~stalwart.api.naming.ANNOTATION_MADE_BY` mark (None: none)."""

    owner_references: tuple[dict[str, Any], ...]
    made_by: str | None = None


def new_rpc_token() -> str:
    """A fresh random RPC token (256 bits, hex)."""
    return secrets.token_hex(32)


def _owner_references(data: bytes) -> Existing:
    """The ``metadata.ownerReferences`` and the operator's mark of an object read as raw JSON."""
    meta = json.loads(data).get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    mark = (meta.get("annotations") or {}).get(naming.ANNOTATION_MADE_BY)
    return Existing(tuple(dict(r) for r in refs if isinstance(r, Mapping)), mark if isinstance(mark, str) else None)
