"""The object store of the API emulator: every write semantic of kube-apiserver that clients rely on.

- Metadata: ``uid``, ``resourceVersion`` (one cluster-wide counter, as etcd's revision), ``generation`` (bumped
  when anything but metadata and status changes), ``creationTimestamp``, ``generateName``.
- Optimistic concurrency: an update or patch that carries a stale ``metadata.resourceVersion`` is a 409.
- The status subresource: writes to the main resource keep the stored status, writes to ``/status`` change only
  the status.
- Deletion: objects with finalizers get ``deletionTimestamp`` and stay until the last finalizer goes; pods on a
  node get a grace period (the kubelet stops them and then removes them); ``propagationPolicy`` Background,
  Foreground (the ``foregroundDeletion`` finalizer, released when no dependents remain) and Orphan; dependents
  whose owners are all gone are collected; a namespace empties before it goes.
- Watch: a bounded history of events; a watch from a version older than the history gets 410 Gone.
- CustomResourceDefinitions: storing one serves its resource (``on_crd``), with defaulting, pruning and
  validation from its schema.

All methods run on one asyncio loop and never await, so each call is atomic with respect to the others.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import datetime
import itertools
import random
import re
import string
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stalwart.local.apiserver import schema as schemas
from stalwart.local.apiserver.catalog import Registry, ResourceInfo
from stalwart.local.apiserver.patches import (
    PatchError,
    json_patch,
    merge_patch,
    server_side_apply,
    strategic_merge,
)
from stalwart.local.apiserver.selectors import FieldRequirement, Requirement, fields_match, labels_match

JSON = dict[str, Any]
Key = tuple[str, str, str, str]  # group, plural, namespace ("" if cluster-scoped), name

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
CRD_GROUP, CRD_PLURAL = "apiextensions.k8s.io", "customresourcedefinitions"


def now_rfc3339(offset: float = 0.0) -> str:
    t = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error the API answers with a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: JSON | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> JSON:
        out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            out["details"] = self.details
        return out


def _qualified(info: ResourceInfo) -> str:
    return f"{info.plural}.{info.group}" if info.group else info.plural


def not_found(info: ResourceInfo, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{_qualified(info)} "{name}" not found',
                    {"name": name, "group": info.group, "kind": info.plural})


def conflict(info: ResourceInfo, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {_qualified(info)} "{name}": {why}',
                    {"name": name, "group": info.group, "kind": info.plural})


def invalid(info: ResourceInfo, name: str, problems: list[schemas.Problem]) -> ApiError:
    kind_group = f"{info.kind}.{info.group}" if info.group else info.kind
    rendered = [p.render() for p in problems]
    text = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    return ApiError(422, "Invalid", f'{kind_group} "{name}" is invalid: {text}',
                    {"name": name, "group": info.group, "kind": info.kind,
                     "causes": [{"reason": p.reason, "message": p.message, "field": p.field} for p in problems]})


@dataclass
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    rv: int
    group: str
    plural: str
    obj: JSON


@dataclass(eq=False)
class Watcher:
    """A registered watch: matching events are put on ``queue``; ``None`` marks the end."""
    group: str
    plural: str
    namespace: str | None
    labels: list[Requirement]
    fields: list[FieldRequirement]
    queue: asyncio.Queue[Event | None] = field(default_factory=asyncio.Queue)

    def wants(self, ev: Event) -> bool:
        meta = ev.obj.get("metadata") or {}
        return (ev.group == self.group and ev.plural == self.plural
                and (self.namespace is None or meta.get("namespace", "") == self.namespace)
                and labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, ev.obj))


@dataclass
class WriteOptions:
    dry_run: bool = False
    field_validation: str = "Strict"  # Ignore | Warn | Strict
    field_manager: str = ""
    warnings: list[str] = field(default_factory=list)


class ObjectStore:
    """See the module docstring. ``history`` bounds how many events a watch can resume from."""

    def __init__(self, registry: Registry | None = None, history: int = 50_000) -> None:
        self.registry = registry or Registry()
        self.rv = 1
        self.objects: dict[Key, JSON] = {}
        self.history: deque[Event] = deque(maxlen=history)
        self.compacted_rv = 0
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[Event], None]] = []
        self.graceful_pods: Callable[[JSON], bool] = lambda pod: False
        #: Mutating admission plugins run on every create, before validation (see ``stalwart.local.admission``).
        self.admission: list[Callable[[ResourceInfo, JSON], None]] = []
        self._cluster_ip = itertools.count(1)
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self.create(self._info("", "v1", "namespaces"), "", {"metadata": {"name": ns}})

    # --- helpers -----------------------------------------------------------------------------------------------

    def _info(self, group: str, version: str, plural: str) -> ResourceInfo:
        info = self.registry.get(group, version, plural)
        if info is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({plural})")
        return info

    def info(self, group: str, version: str, plural: str) -> ResourceInfo:
        """The resource served at group/version/plural, or a 404 ApiError."""
        return self._info(group, version, plural)

    @staticmethod
    def _key(info: ResourceInfo, namespace: str, name: str) -> Key:
        return (info.group, info.plural, namespace if info.namespaced else "", name)

    def _serve(self, info: ResourceInfo, obj: JSON) -> JSON:
        out = copy.deepcopy(obj)
        out["apiVersion"] = info.api_version
        out["kind"] = info.kind
        return out

    def _emit(self, type_: str, info: ResourceInfo, obj: JSON) -> None:
        ev = Event(type_, int(obj["metadata"]["resourceVersion"]), info.group, info.plural, copy.deepcopy(obj))
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        self.history.append(ev)
        for w in list(self.watchers):
            if w.wants(ev):
                w.queue.put_nowait(ev)
        for listener in list(self.listeners):
            listener(ev)

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def compact(self) -> None:
        """Forget the watch history (as etcd compaction does): older resourceVersions now get 410."""
        self.compacted_rv = self.rv
        self.history.clear()

    # --- reads -------------------------------------------------------------------------------------------------

    def get(self, info: ResourceInfo, namespace: str, name: str) -> JSON:
        obj = self.objects.get(self._key(info, namespace, name))
        if obj is None:
            raise not_found(info, name)
        return self._serve(info, obj)

    def list_objects(self, info: ResourceInfo, namespace: str | None, labels: list[Requirement] | None = None,
             fields: list[FieldRequirement] | None = None) -> tuple[list[JSON], str]:
        items = []
        for (g, p, ns, _), obj in sorted(self.objects.items()):
            if (g, p) != info.storage_key or (namespace is not None and info.namespaced and ns != namespace):
                continue
            meta = obj.get("metadata") or {}
            if labels and not labels_match(labels, meta.get("labels")):
                continue
            if fields and not fields_match(fields, obj):
                continue
            items.append(self._serve(info, obj))
        return items, str(self.rv)

    def watch(self, info: ResourceInfo, namespace: str | None, resource_version: str | None,
              labels: list[Requirement], fields: list[FieldRequirement]) -> Watcher:
        """Register a watch. No version or "0": synthetic ADDED events for the current state first; a version:
        every later event (410 Gone if it is older than the history)."""
        w = Watcher(info.group, info.plural, namespace if info.namespaced else None, labels, fields)
        if resource_version in (None, "", "0"):
            items, _ = self.list_objects(info, w.namespace, labels, fields)
            for obj in items:
                w.queue.put_nowait(Event("ADDED", int(obj["metadata"]["resourceVersion"]), info.group,
                                         info.plural, obj))
        else:
            try:
                since = int(str(resource_version))
            except ValueError:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {resource_version!r}: expected "
                                                  "an integer") from None
            if since < self.compacted_rv:
                raise ApiError(410, "Expired", f"too old resource version: {since} ({self.compacted_rv + 1})")
            for ev in self.history:
                if ev.rv > since and w.wants(ev):
                    w.queue.put_nowait(ev)
        self.watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self.watchers.discard(w)

    # --- admission: defaults, validation -----------------------------------------------------------------------

    def _admit(self, info: ResourceInfo, obj: JSON, old: JSON | None, opts: WriteOptions) -> JSON:
        name = str(obj["metadata"].get("name", ""))
        problems: list[schemas.Problem] = []
        pattern = _DNS_LABEL if info.plural in ("namespaces", "services") else _DNS_SUBDOMAIN
        # RBAC and a few other groups allow ':' in names; the kinds checked here do not.
        checked = info.crd is not None or info.group in {"", "apps", CRD_GROUP}
        if checked and (not pattern.match(name) or len(name) > 253):
            problems.append(schemas.Problem(
                "metadata.name", "FieldValueInvalid",
                f"Invalid value: {name!r}: a lowercase RFC 1123 "
                f"{'label' if pattern is _DNS_LABEL else 'subdomain'} must consist of lower case "
                "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"))
        schema = info.schema
        if schema is not None:
            obj = schemas.apply_defaults(schema, obj)
            pruned, dropped = schemas.prune(schema, obj)
            if dropped and opts.field_validation == "Strict":
                raise ApiError(400, "BadRequest", "strict decoding error: " + ", ".join(
                    f'unknown field "{d}"' for d in dropped))
            if dropped and opts.field_validation == "Warn":
                opts.warnings += [f'unknown field "{d}"' for d in dropped]
            obj = pruned
            # CEL rules at the root see only metadata.name and metadata.generateName, as on a real API.
            body = {**obj, "metadata": _cel_metadata(obj)}
            old_body = {**(old or {}), "metadata": _cel_metadata(old or {})}
            problems += schemas.validate(schema, body, old=old_body, has_old=old is not None)
        else:
            obj = _builtin_defaults(self, info, obj, old, problems)
        if info.group == CRD_GROUP and info.plural == CRD_PLURAL:
            for version in (obj.get("spec") or {}).get("versions") or []:
                root = ((version.get("schema") or {}).get("openAPIV3Schema")) or {}
                for rule in schemas.unsupported_rules(root):
                    opts.warnings.append(f"{name} {version.get('name')}: x-kubernetes-validations rule not "
                                         f"enforced by the local cluster: {rule}")
        if problems:
            raise invalid(info, name, problems)
        return obj

    # --- writes ------------------------------------------------------------------------------------------------

    def create(self, info: ResourceInfo, namespace: str, body: JSON, opts: WriteOptions | None = None) -> JSON:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "BadRequest", "metadata: expected an object")
        if not meta.get("name"):
            if meta.get("generateName"):
                suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
                meta["name"] = f"{meta['generateName']}{suffix}"
            else:
                raise invalid(info, "", [schemas.Problem("metadata.name", "FieldValueRequired",
                                                         "Required value: name or generateName is required")])
        if info.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and namespace and body_ns != namespace:
                raise ApiError(400, "BadRequest", "the namespace of the provided object does not match the "
                                                  "namespace sent on the request")
            namespace = namespace or body_ns or "default"
            ns_obj = self.objects.get(("", "namespaces", "", namespace))
            if ns_obj is None:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                               {"name": namespace, "kind": "namespaces"})
            if ns_obj["metadata"].get("deletionTimestamp"):
                raise ApiError(403, "Forbidden", f'{info.plural} "{meta["name"]}" is forbidden: unable to '
                                                 f"create new content in namespace {namespace} because it is "
                                                 "being terminated")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        key = self._key(info, namespace, meta["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f'{_qualified(info)} "{meta["name"]}" already exists',
                           {"name": meta["name"], "group": info.group, "kind": info.plural})
        for k in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "uid",
                  "creationTimestamp", "generation"):
            meta.pop(k, None)
        if info.has_status and (info.crd is not None or info.plural == "pods"):
            obj.pop("status", None)
        obj["apiVersion"], obj["kind"] = info.api_version, info.kind
        for admit in self.admission:
            admit(info, obj)
        obj = self._admit(info, obj, None, opts)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if opts.dry_run:
            meta["resourceVersion"] = str(self.rv)
            return self._serve(info, obj)
        if info.group == CRD_GROUP and info.plural == CRD_PLURAL:
            self._serve_crd(obj)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = obj
        self._emit("ADDED", info, obj)
        return self._serve(info, obj)

    def update(self, info: ResourceInfo, namespace: str, name: str, body: JSON, subresource: str = "",  # noqa: PLR0917
               opts: WriteOptions | None = None) -> JSON:
        """PUT: replace the object (or its status with ``subresource="status"``)."""
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of an update must be a JSON object")
        key = self._key(info, namespace, name)
        old = self.objects.get(key)
        if old is None:
            raise not_found(info, name)
        new = copy.deepcopy(body)
        meta = new.setdefault("metadata", {})
        if meta.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", f'the name of the object ({meta.get("name")}) does not match the '
                                              f"name on the URL ({name})")
        given_rv = meta.get("resourceVersion")
        if given_rv not in (None, "") and str(given_rv) != old["metadata"]["resourceVersion"]:
            raise conflict(info, name, "the object has been modified; please apply your changes to the latest "
                                       "version and try again")
        if given_rv in (None, "") and info.crd is not None:
            raise invalid(info, name, [schemas.Problem(
                "metadata.resourceVersion", "FieldValueInvalid",
                "Invalid value: 0x0: must be specified for an update")])
        return self._replace(info, key, old, new, subresource, opts)

    def _replace(self, info: ResourceInfo, key: Key, old: JSON, new: JSON, subresource: str,  # noqa: PLR0917
                 opts: WriteOptions) -> JSON:
        name = key[3]
        old_meta = old["metadata"]
        if subresource == "status":
            merged = copy.deepcopy(old)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        elif subresource == "scale":
            new = self._apply_scale(info, old, new)
        elif info.has_status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for k in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace",
                  "generation"):
            if k in old_meta:
                meta[k] = old_meta[k]
            else:
                meta.pop(k, None)
        meta["name"] = name
        if "managedFields" not in meta and "managedFields" in old_meta:
            meta["managedFields"] = old_meta["managedFields"]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise invalid(info, name, [schemas.Problem(
                    "metadata.finalizers", "FieldValueForbidden",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new "
                    f"finalizers {sorted(added)!r}")])
        new["apiVersion"], new["kind"] = info.api_version, info.kind
        new = self._admit(info, new, old, opts)
        meta = new["metadata"]
        body_changed = ({k: v for k, v in new.items() if k not in ("metadata", "status", "apiVersion", "kind")}
                        != {k: v for k, v in old.items() if k not in ("metadata", "status", "apiVersion", "kind")})
        if body_changed:
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if opts.dry_run:
            return self._serve(info, new)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return self._serve(info, old)  # a no-op write keeps the resourceVersion, as the API server does
        if info.group == CRD_GROUP and info.plural == CRD_PLURAL:
            self._serve_crd(new)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        self._emit("MODIFIED", info, new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and not self._graceful_pending(info, new):
            self._remove(info, key)
        self._collect()
        return self._serve(info, new)

    def _apply_scale(self, info: ResourceInfo, old: JSON, scale: JSON) -> JSON:
        spec_path, _ = self._scale_paths(info)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ApiError(422, "Invalid", "spec.replicas: Invalid value: must be a non-negative integer")
        new = copy.deepcopy(old)
        _set_path(new, spec_path, replicas)
        return new

    def _scale_paths(self, info: ResourceInfo) -> tuple[list[str], list[str]]:
        scale = ((info.crd or {}).get("subresources") or {}).get("scale") or {}
        spec_path = str(scale.get("specReplicasPath", ".spec.replicas")).lstrip(".").split(".")
        status_path = str(scale.get("statusReplicasPath", ".status.replicas")).lstrip(".").split(".")
        return spec_path, status_path

    def scale_of(self, info: ResourceInfo, namespace: str, name: str) -> JSON:
        obj = self.get(info, namespace, name)
        spec_path, status_path = self._scale_paths(info)
        scale = ((info.crd or {}).get("subresources") or {}).get("scale") or {}
        out: JSON = {"apiVersion": "autoscaling/v1", "kind": "Scale",
                     "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                                  "creationTimestamp") if k in obj["metadata"]},
                     "spec": {"replicas": _get_path(obj, spec_path) or 0},
                     "status": {"replicas": _get_path(obj, status_path) or 0}}
        if scale.get("labelSelectorPath"):
            out["status"]["selector"] = _get_path(obj, str(scale["labelSelectorPath"]).lstrip(".").split("."))
        return out

    def patch(self, info: ResourceInfo, namespace: str, name: str, patch_type: str, patch: Any,  # noqa: PLR0917
              subresource: str = "", opts: WriteOptions | None = None, *, force: bool = False) -> JSON:
        """PATCH with one of the content types json-patch, merge-patch, strategic-merge-patch, apply-patch."""
        opts = opts or WriteOptions()
        key = self._key(info, namespace, name)
        old = self.objects.get(key)
        if patch_type == "apply":
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "an apply patch must be an object")
            if not opts.field_manager:
                raise ApiError(422, "Invalid", "fieldManager: Required value: is required for apply patch")
            if old is None:
                if subresource:
                    raise not_found(info, name)
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = name
                created = server_side_apply({}, body, opts.field_manager, now_rfc3339())
                created["metadata"]["name"] = name
                for k in ("apiVersion", "kind"):
                    created.setdefault(k, patch.get(k))
                return self.create(info, namespace, created, opts)
            current = self._serve(info, old)
            if subresource == "status":
                new = merge_patch(current, {"status": patch.get("status")})
            else:
                new = server_side_apply(current, patch, opts.field_manager, now_rfc3339())
            new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self._replace(info, key, old, new, subresource, opts)
        if old is None:
            raise not_found(info, name)
        current = self._serve(info, old)
        if subresource == "scale":
            current = self.scale_of(info, namespace, name)
        try:
            if patch_type == "json":
                new = json_patch(current, patch)
            elif patch_type == "merge":
                if not isinstance(patch, dict):
                    raise PatchError("a merge patch must be a JSON object")
                new = merge_patch(current, patch)
            elif patch_type == "strategic":
                if info.crd is not None:
                    raise ApiError(415, "UnsupportedMediaType",
                                   "the body of the request was in an unknown format - accepted media types "
                                   "include: application/json-patch+json, application/merge-patch+json, "
                                   "application/apply-patch+yaml")
                if not isinstance(patch, dict):
                    raise PatchError("a strategic merge patch must be a JSON object")
                new = strategic_merge(current, patch)
            else:
                raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {patch_type!r}")
        except PatchError as exc:
            raise ApiError(422, "Invalid", str(exc)) from exc
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patch must leave an object")
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if subresource == "scale":
            if rv not in (None, "") and str(rv) != old["metadata"]["resourceVersion"]:
                raise conflict(info, name, "the object has been modified; please apply your changes to the "
                                           "latest version and try again")
            return self._replace(info, key, old, new, "scale", opts)
        if rv not in (None, "") and str(rv) != old["metadata"]["resourceVersion"]:
            raise conflict(info, name, "the object has been modified; please apply your changes to the latest "
                                       "version and try again")
        return self._replace(info, key, old, new, subresource, opts)

    # --- deletion ----------------------------------------------------------------------------------------------

    def delete(self, info: ResourceInfo, namespace: str, name: str, options: JSON | None = None,
               dry_run: bool = False) -> JSON:
        """DELETE with DeleteOptions (gracePeriodSeconds, propagationPolicy, preconditions). Returns the object
        as it is after the call (with deletionTimestamp if it stays for finalizers or a grace period)."""
        options = options or {}
        key = self._key(info, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise not_found(info, name)
        pre = options.get("preconditions") or {}
        meta = obj["metadata"]
        if pre.get("uid") and pre["uid"] != meta.get("uid"):
            raise conflict(info, name, f"Precondition failed: UID in precondition: {pre['uid']}, UID in object "
                                       f"meta: {meta.get('uid')}")
        if pre.get("resourceVersion") and str(pre["resourceVersion"]) != meta.get("resourceVersion"):
            raise conflict(info, name, "Precondition failed: resourceVersion in precondition: "
                                       f"{pre['resourceVersion']}, resourceVersion in object meta: "
                                       f"{meta.get('resourceVersion')}")
        if dry_run:
            return self._serve(info, obj)
        policy = options.get("propagationPolicy") or ("Orphan" if options.get("orphanDependents") else None)
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise ApiError(400, "BadRequest", f"propagationPolicy: Unsupported value: {policy!r}: supported "
                                              'values: "Background", "Foreground", "Orphan"')
        if policy == "Orphan":
            self._orphan(meta["uid"])
        grace = options.get("gracePeriodSeconds")
        new = copy.deepcopy(obj)
        nmeta = new["metadata"]
        finalizers = list(nmeta.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers and self._dependents(meta["uid"]):
            finalizers.append("foregroundDeletion")
        if info.plural == "namespaces" and not info.group:
            return self._delete_namespace(info, key, new)
        graceful = False
        if info.plural == "pods" and not info.group and self.graceful_pods(obj):
            spec_grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            grace = int(spec_grace if grace is None else grace)
            prior = nmeta.get("deletionGracePeriodSeconds")
            graceful = grace > 0 and (prior is None or grace < int(prior) or bool(nmeta.get("deletionTimestamp")))
            if grace <= 0:
                graceful = False
            elif prior is None or grace < int(prior):
                nmeta["deletionGracePeriodSeconds"] = grace
                nmeta["deletionTimestamp"] = now_rfc3339(grace)
        if not finalizers and not graceful:
            return self._remove(info, key)
        if nmeta.get("deletionTimestamp") and finalizers == list(meta.get("finalizers") or []) and new == obj:
            return self._serve(info, obj)
        if finalizers or "finalizers" in nmeta:
            nmeta["finalizers"] = finalizers
        if not nmeta.get("deletionTimestamp"):
            nmeta["deletionTimestamp"] = now_rfc3339()
            nmeta.setdefault("deletionGracePeriodSeconds", 0)
            if int(nmeta.get("generation", 0)) > 0:
                nmeta["generation"] = int(nmeta["generation"]) + 1
        nmeta["resourceVersion"] = self._next_rv()
        self.objects[key] = new
        self._emit("MODIFIED", info, new)
        if "foregroundDeletion" in finalizers:
            for dep_info, dep_key in self._dependents(meta["uid"]):
                if dep_key in self.objects:
                    self.delete(dep_info, dep_key[2], dep_key[3], {"propagationPolicy": "Background"})
        self._collect()
        return self._serve(info, self.objects.get(key, new))

    def _graceful_pending(self, info: ResourceInfo, obj: JSON) -> bool:
        """A pod whose grace period the kubelet is still running out."""
        return (info.plural == "pods" and not info.group and self.graceful_pods(obj)
                and int(obj["metadata"].get("deletionGracePeriodSeconds") or 0) > 0)

    def finish_pod(self, namespace: str, name: str) -> None:
        """The kubelet's last word on a deleted pod: its processes are gone; remove it (finalizers allowing)."""
        info = self._info("", "v1", "pods")
        key = self._key(info, namespace, name)
        obj = self.objects.get(key)
        if obj is None or not obj["metadata"].get("deletionTimestamp"):
            return
        if obj["metadata"].get("finalizers"):
            new = copy.deepcopy(obj)
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[key] = new
            self._emit("MODIFIED", info, new)
            return
        self._remove(info, key)

    def _delete_namespace(self, info: ResourceInfo, key: Key, new: JSON) -> JSON:
        name = key[3]
        meta = new["metadata"]
        if not meta.get("deletionTimestamp"):
            meta["deletionTimestamp"] = now_rfc3339()
            meta["deletionGracePeriodSeconds"] = 0
            new.setdefault("spec", {})["finalizers"] = ["kubernetes"]
            new.setdefault("status", {})["phase"] = "Terminating"
            meta["resourceVersion"] = self._next_rv()
            self.objects[key] = new
            self._emit("MODIFIED", info, new)
        for (g, p, ns, n) in list(self.objects):
            if ns == name and (g, p, ns, n) in self.objects:
                obj = self.objects[(g, p, ns, n)]
                if not obj["metadata"].get("deletionTimestamp"):
                    sub_info = self._any_info(g, p)
                    if sub_info is not None:
                        self.delete(sub_info, ns, n, {"propagationPolicy": "Background"})
        self._collect()
        return self._serve(info, self.objects.get(key, new))

    def _any_info(self, group: str, plural: str) -> ResourceInfo | None:
        infos = self.registry.versions_of(group, plural)
        return infos[0] if infos else None

    def _remove(self, info: ResourceInfo, key: Key) -> JSON:
        obj = self.objects.pop(key, None)
        if obj is None:
            raise not_found(info, key[3])
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._emit("DELETED", info, obj)
        if info.group == CRD_GROUP and info.plural == CRD_PLURAL:
            self._unserve_crd(obj)
        self._collect()
        return self._serve(info, obj)

    def _dependents(self, uid: str) -> list[tuple[ResourceInfo, Key]]:
        out = []
        for key, obj in self.objects.items():
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                info = self._any_info(key[0], key[1])
                if info is not None:
                    out.append((info, key))
        return out

    def _orphan(self, uid: str) -> None:
        for info, key in self._dependents(uid):
            obj = copy.deepcopy(self.objects[key])
            refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
            if refs:
                obj["metadata"]["ownerReferences"] = refs
            else:
                obj["metadata"].pop("ownerReferences", None)
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[key] = obj
            self._emit("MODIFIED", info, obj)

    def _collect(self) -> None:
        """Garbage collection, to a fixed point: dependents of vanished owners go (Background), foreground
        owners without dependents lose their ``foregroundDeletion`` finalizer, emptied namespaces go."""
        changed = True
        while changed:
            changed = False
            live_uids = {o["metadata"].get("uid") for o in self.objects.values()}
            for key, obj in list(self.objects.items()):
                if key not in self.objects:
                    continue
                meta = obj["metadata"]
                refs = meta.get("ownerReferences") or []
                if refs and not any(r.get("uid") in live_uids for r in refs) and not meta.get("deletionTimestamp"):
                    info = self._any_info(key[0], key[1])
                    if info is not None:
                        self.delete(info, key[2], key[3], {"propagationPolicy": "Background"})
                        changed = True
                        break
                if (meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or [])
                        and not self._dependents(meta["uid"])):
                    info = self._any_info(key[0], key[1])
                    if info is not None:
                        new = copy.deepcopy(obj)
                        new["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != "foregroundDeletion"]
                        new["metadata"]["resourceVersion"] = self._next_rv()
                        self.objects[key] = new
                        self._emit("MODIFIED", info, new)
                        if not new["metadata"]["finalizers"]:
                            self._remove(info, key)
                        changed = True
                        break
                if (key[1] == "namespaces" and not key[0] and meta.get("deletionTimestamp")
                        and not any(k[2] == key[3] for k in self.objects)):
                    info = self._any_info("", "namespaces")
                    if info is not None:
                        self._remove(info, key)
                        changed = True
                        break

    # --- CRDs --------------------------------------------------------------------------------------------------

    def _serve_crd(self, crd: JSON) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        group, plural = spec.get("group"), names.get("plural")
        if not group or not plural or not names.get("kind"):
            raise ApiError(422, "Invalid", "spec.group, spec.names.plural and spec.names.kind are required")
        if crd["metadata"]["name"] != f"{plural}.{group}":
            raise ApiError(422, "Invalid", f'metadata.name: Invalid value: "{crd["metadata"]["name"]}": must be '
                                           f"spec.names.plural+\".\"+spec.group")
        versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
        self.registry.remove_group_resource(group, plural)
        for v in sorted(versions, key=lambda v: not v.get("storage", False)):
            subs: dict[str, str] = {}
            if "status" in (v.get("subresources") or {}):
                subs["status"] = names["kind"]
            if "scale" in (v.get("subresources") or {}):
                subs["scale"] = "Scale"
            self.registry.add(ResourceInfo(
                group=group, version=v["name"], plural=plural, singular=names.get("singular") or plural,
                kind=names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
                subresources=subs, crd=v))
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in versions if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now_rfc3339()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now_rfc3339()},
            ],
        }

    def _unserve_crd(self, crd: JSON) -> None:
        spec = crd.get("spec") or {}
        group, plural = spec.get("group", ""), (spec.get("names") or {}).get("plural", "")
        infos = self.registry.versions_of(group, plural)
        for key in [k for k in self.objects if k[0] == group and k[1] == plural]:
            obj = copy.deepcopy(self.objects.pop(key))
            if infos:
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self._emit("DELETED", infos[0], obj)
        for w in [w for w in self.watchers if (w.group, w.plural) == (group, plural)]:
            w.queue.put_nowait(None)  # the resource is gone: end its watches, as the API server does
            self.watchers.discard(w)
        self.registry.remove_group_resource(group, plural)


def _cel_metadata(obj: JSON) -> JSON:
    meta = obj.get("metadata") or {}
    return {k: meta[k] for k in ("name", "generateName") if k in meta}


def _get_path(obj: JSON, path: list[str]) -> Any:
    cur: Any = obj
    for p in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(p)
    return cur


def _set_path(obj: JSON, path: list[str], value: Any) -> None:
    cur = obj
    for p in path[:-1]:
        cur = cur.setdefault(p, {})
    cur[path[-1]] = value


def _builtin_defaults(store: ObjectStore, info: ResourceInfo, obj: JSON, old: JSON | None,
                      problems: list[schemas.Problem]) -> JSON:
    """Defaults and the few validations of the built-in kinds that clients observe."""
    kind = (info.group, info.plural)
    if kind == ("", "secrets"):
        obj.setdefault("type", "Opaque")
        data = dict(obj.get("data") or {})
        for k, v in (obj.pop("stringData", None) or {}).items():
            data[k] = base64.b64encode(str(v).encode()).decode()
        for k, v in data.items():
            try:
                base64.b64decode(str(v), validate=True)
            except (binascii.Error, ValueError):
                problems.append(schemas.Problem(f"data[{k}]", "FieldValueInvalid",
                                                "Invalid value: \"<secret contents redacted>\": illegal base64 data"))
        if data:
            obj["data"] = data
    elif kind == ("", "namespaces"):
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif kind == ("", "services"):
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        if old is not None and (old.get("spec") or {}).get("clusterIP"):
            spec["clusterIP"] = old["spec"]["clusterIP"]
        if not spec.get("clusterIP"):
            n = next(store._cluster_ip)
            spec["clusterIP"] = f"10.96.{n // 250}.{n % 250 + 1}"
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("sessionAffinity", "None")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind == ("", "pods"):
        spec = obj.setdefault("spec", {})
        containers = spec.get("containers")
        if not containers:
            problems.append(schemas.Problem("spec.containers", "FieldValueRequired", "Required value"))
        for i, c in enumerate(containers or []):
            if not c.get("name"):
                problems.append(schemas.Problem(f"spec.containers[{i}].name", "FieldValueRequired",
                                                "Required value"))
            if not c.get("image"):
                problems.append(schemas.Problem(f"spec.containers[{i}].image", "FieldValueRequired",
                                                "Required value"))
            c.setdefault("imagePullPolicy", "IfNotPresent")
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
            c.setdefault("resources", {})
        for c in spec.get("initContainers") or []:
            c.setdefault("imagePullPolicy", "IfNotPresent")
        if spec.get("restartPolicy", "Always") not in ("Always", "OnFailure", "Never"):
            problems.append(schemas.Problem("spec.restartPolicy", "FieldValueNotSupported",
                                            f'Unsupported value: "{spec["restartPolicy"]}": supported values: '
                                            '"Always", "OnFailure", "Never"'))
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", "default")
        spec.setdefault("securityContext", {})
        spec.setdefault("enableServiceLinks", True)
        if old is None:
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        else:
            old_spec = old.get("spec") or {}
            for fld in ("restartPolicy", "nodeName"):
                if old_spec.get(fld) and spec.get(fld) != old_spec.get(fld):
                    problems.append(schemas.Problem(f"spec.{fld}", "FieldValueForbidden",
                                                    "Forbidden: pod updates may not change fields other than "
                                                    "`spec.containers[*].image`, `spec.activeDeadlineSeconds`, "
                                                    "`spec.tolerations`, `spec.terminationGracePeriodSeconds`"))
    elif kind == ("apps", "deployments"):
        spec = obj.setdefault("spec", {})
        spec.setdefault("replicas", 1)
        spec.setdefault("revisionHistoryLimit", 10)
        spec.setdefault("progressDeadlineSeconds", 600)
        spec.setdefault("strategy", {"type": "RollingUpdate",
                                     "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}})
    return obj
