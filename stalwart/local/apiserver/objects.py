"""The object store of the API emulator: the write semantics of kube-apiserver that clients rely on, over
:mod:`.storage` (revisions, history, watches, snapshots).

- Metadata: ``uid``, ``resourceVersion`` (one cluster-wide counter, as etcd's revision), ``generation`` (bumped
  when anything but metadata and status changes, and when deletion starts), ``creationTimestamp``,
  ``generateName``; ``managedFields`` for every writer (:mod:`.fieldmanager`).
- Optimistic concurrency: an update or patch that carries a stale ``metadata.resourceVersion`` is a 409.
- Subresources: status, scale, finalize (:mod:`.subresources`); pods are bound to nodes through ``binding``
  (:mod:`.podlife`).
- Admission (:mod:`.admission`): defaults, validation, immutability, pruning of unknown fields.
- Deletion: objects with finalizers get ``deletionTimestamp`` and stay until the last finalizer goes; pods on a
  node get a grace period (the kubelet stops them, then :func:`.podlife.finish_pod` removes them);
  ``propagationPolicy``
  Orphan and Foreground add the ``orphan`` and ``foregroundDeletion`` finalizers and Background (the default)
  removes the object at once: dependents are then handled by the garbage collector, asynchronously, as on a
  real cluster (:mod:`stalwart.local.garbage`). A namespace is marked Terminating and goes once the namespace
  controller has emptied it and cleared ``spec.finalizers``; nothing is created in it meanwhile
  (:mod:`.namespaces`).
- CustomResourceDefinitions: storing one serves its resource, removing it ends the resource (:mod:`.crds`).

Semantics of one kind live beside the kind's other rules (:mod:`.podlife`, :mod:`.namespaces`, :mod:`.crds`);
this module holds what every kind shares.

All methods run on one asyncio loop and never await, so each call is atomic with respect to the others.
"""

from __future__ import annotations

import copy
import itertools
import string
import uuid
from collections.abc import Callable
from typing import Any

from stalwart.jitter import RNG
from stalwart.local.apiserver import crds, deletion, fieldmanager, namespaces
from stalwart.local.apiserver.admission import WriteOptions, admit
from stalwart.local.apiserver.catalog import Registry, ResourceInfo
from stalwart.local.apiserver.errors import (
    STALE,
    ApiError,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
)
from stalwart.local.apiserver.patches import patch_object
from stalwart.local.apiserver.schema import Problem
from stalwart.local.apiserver.selectors import FieldRequirement, Requirement
from stalwart.local.apiserver.storage import Event, Key, Page, Storage, Watcher, now_rfc3339
from stalwart.local.apiserver.subresources import merge_write, scale_view

__all__ = ["ApiError", "Event", "ObjectStore", "Watcher", "WriteOptions", "conflict", "not_found", "now_rfc3339"]

JSON = dict[str, Any]
_SERVER_SET = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace",
               "generation")


class ObjectStore:
    """See the module docstring. ``history`` bounds how many changes watches and paged lists can reach back."""

    def __init__(self, registry: Registry | None = None, history: int = 50_000) -> None:
        self.registry = registry or Registry()
        self.storage = Storage(history)
        self.graceful_pods: Callable[[JSON], bool] = lambda pod: False
        #: Mutating admission plugins run on every create, before validation (see ``stalwart.local.admission``).
        self.admission: list[Callable[[ResourceInfo, JSON], None]] = []
        self.cluster_ips = itertools.count(1)
        for ns in namespaces.INITIAL:
            self.create(self.info("", "v1", "namespaces"), "", {"metadata": {"name": ns}})

    # The storage's state, for readers that only observe.
    @property
    def rv(self) -> int:
        return self.storage.rv

    @property
    def compacted_rv(self) -> int:
        return self.storage.compacted_rv

    @property
    def objects(self) -> dict[Key, JSON]:
        return self.storage.objects

    @property
    def listeners(self) -> list[Callable[[Event], None]]:
        return self.storage.listeners

    def compact(self) -> None:
        self.storage.compact()

    def info(self, group: str, version: str, plural: str) -> ResourceInfo:
        """The resource served at group/version/plural, or a 404 ApiError."""
        info = self.registry.get(group, version, plural)
        if info is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({plural})")
        return info

    def any_info(self, group: str, plural: str) -> ResourceInfo | None:
        infos = self.registry.versions_of(group, plural)
        return infos[0] if infos else None

    @staticmethod
    def key(info: ResourceInfo, namespace: str, name: str) -> Key:
        return (info.group, info.plural, namespace if info.namespaced else "", name)

    @staticmethod
    def serve(info: ResourceInfo, obj: JSON) -> JSON:
        out = copy.deepcopy(obj)
        out["apiVersion"] = info.api_version
        out["kind"] = info.kind
        return out

    # --- reads ---------------------------------------------------------------------------------------------------

    def get(self, info: ResourceInfo, namespace: str, name: str) -> JSON:
        obj = self.storage.objects.get(self.key(info, namespace, name))
        if obj is None:
            raise not_found(info, name)
        return self.serve(info, obj)

    def list_page(self, info: ResourceInfo, namespace: str | None, labels: list[Requirement] | None = None,  # noqa: PLR0917
                  fields: list[FieldRequirement] | None = None, limit: int = 0, token: str = "",
                  exact_rv: int | None = None) -> Page:
        """A list (or a page of one, see :meth:`Storage.page`), items served with apiVersion and kind."""
        page = self.storage.page(info.group, info.plural, namespace if info.namespaced else None, labels or [],
                                 fields or [], limit=limit, token=token, exact_rv=exact_rv)
        return Page([self.serve(info, o) for o in page.items], page.rv, page.continue_token, page.remaining)

    def list_objects(self, info: ResourceInfo, namespace: str | None, labels: list[Requirement] | None = None,
                     fields: list[FieldRequirement] | None = None) -> tuple[list[JSON], str]:
        page = self.list_page(info, namespace, labels, fields)
        return page.items, str(page.rv)

    def watch(self, info: ResourceInfo, namespace: str | None, resource_version: str | None,
              labels: list[Requirement], fields: list[FieldRequirement]) -> Watcher:
        """Register a watch. No version or "0": synthetic ADDED events for the current state first; a version:
        every later event (410 Gone if it is older than the history)."""
        ns = namespace if info.namespaced else None
        if resource_version in (None, "", "0"):
            items = [o for _, o in self.storage.select(self.storage.of_resource(info.group, info.plural), ns, labels,
                                                       fields)]
            return self.storage.watch(info.group, info.plural, ns, labels, fields, None, items)
        try:
            since = int(str(resource_version))
        except ValueError:
            raise bad_request(f"invalid resourceVersion {resource_version!r}: expected an integer") from None
        return self.storage.watch(info.group, info.plural, ns, labels, fields, since)

    def unwatch(self, w: Watcher) -> None:
        self.storage.watchers.discard(w)

    def scale_of(self, info: ResourceInfo, namespace: str, name: str) -> JSON:
        return scale_view(info, self.get(info, namespace, name))

    # --- writes --------------------------------------------------------------------------------------------------

    def create(self, info: ResourceInfo, namespace: str, body: JSON, opts: WriteOptions | None = None) -> JSON:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise bad_request("the body of a create must be a JSON object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata: expected an object")
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(info, "", [Problem("metadata.name", "FieldValueRequired",
                                                 "Required value: name or generateName is required")])
            suffix = "".join(RNG.choices(string.ascii_lowercase + string.digits, k=5))
            meta["name"] = f"{meta['generateName']}{suffix}"
        if info.namespaced:
            namespace = namespaces.creatable(self.storage, info, namespace, meta)
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        key = self.key(info, namespace, meta["name"])
        if key in self.storage.objects:
            raise already_exists(info, meta["name"])
        for k in (*_SERVER_SET, "resourceVersion"):
            if k != "namespace":
                meta.pop(k, None)
        if info.has_status and (info.crd is not None or info.plural == "pods"):
            obj.pop("status", None)
        obj["apiVersion"], obj["kind"] = info.api_version, info.kind
        for mutate in self.admission:
            mutate(info, obj)
        obj = admit(self, info, obj, None, opts)
        meta = obj["metadata"]
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        fieldmanager.record_update(None, obj, opts.field_manager if opts.record_fields else "", "", now_rfc3339())
        if opts.dry_run:
            meta["resourceVersion"] = str(self.rv)
            return self.serve(info, obj)
        if crds.is_crd(info):
            crds.serve(self.registry, obj)
        meta["resourceVersion"] = self.storage.next_rv()
        self.storage.put(key, obj, "ADDED")
        return self.serve(info, obj)

    def update(self, info: ResourceInfo, namespace: str, name: str, body: JSON, subresource: str = "",  # noqa: PLR0917
               opts: WriteOptions | None = None) -> JSON:
        """PUT: replace the object (or its status with ``subresource="status"``)."""
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise bad_request("the body of an update must be a JSON object")
        key = self.key(info, namespace, name)
        old = self.storage.objects.get(key)
        if old is None:
            raise not_found(info, name)
        new = copy.deepcopy(body)
        meta = new.setdefault("metadata", {})
        if meta.get("name") not in (None, name):
            raise bad_request(f'the name of the object ({meta.get("name")}) does not match the name on the URL '
                              f"({name})")
        given_rv = meta.get("resourceVersion")
        if given_rv not in (None, "") and str(given_rv) != old["metadata"]["resourceVersion"]:
            raise conflict(info, name, STALE)
        if given_rv in (None, "") and info.crd is not None:
            raise invalid(info, name, [Problem("metadata.resourceVersion", "FieldValueInvalid",
                                               "Invalid value: 0x0: must be specified for an update")])
        return self.replace(info, key, old, new, subresource, opts)

    def replace(self, info: ResourceInfo, key: Key, old: JSON, new: JSON, subresource: str,  # noqa: PLR0917
                opts: WriteOptions) -> JSON:
        """Store ``new`` in place of ``old`` after the subresource's merge and admission; a no-op keeps the
        resourceVersion, as the API server does."""
        name = key[3]
        old_meta = old["metadata"]
        new = merge_write(info, old, new, subresource)
        meta = new.setdefault("metadata", {})
        for k in _SERVER_SET:
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
                raise invalid(info, name, [Problem(
                    "metadata.finalizers", "FieldValueForbidden",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new "
                    f"finalizers {sorted(added)!r}")])
        new["apiVersion"], new["kind"] = info.api_version, info.kind
        new = admit(self, info, new, old, opts)
        meta = new["metadata"]
        skip = ("metadata", "status", "apiVersion", "kind")
        if {k: v for k, v in new.items() if k not in skip} != {k: v for k, v in old.items() if k not in skip}:
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if opts.record_fields:
            fieldmanager.record_update(old, new, opts.field_manager, subresource, now_rfc3339())
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if opts.dry_run:
            return self.serve(info, new)
        if fieldmanager.same_object(new, old):
            return self.serve(info, old)
        if crds.is_crd(info):
            crds.serve(self.registry, new)
        meta["resourceVersion"] = self.storage.next_rv()
        self.storage.put(key, new, "MODIFIED")
        if deletion.releasable(info, new, self._running_pod(info, new)):
            self.remove(info, key)
        return self.serve(info, new)

    def patch(self, info: ResourceInfo, namespace: str, name: str, patch_type: str, patch: Any,  # noqa: PLR0917
              subresource: str = "", opts: WriteOptions | None = None, *, force: bool = False) -> JSON:
        """PATCH with one of the content types json-patch, merge-patch, strategic-merge-patch, apply-patch."""
        opts = opts or WriteOptions()
        opts.force = opts.force or force
        key = self.key(info, namespace, name)
        old = self.storage.objects.get(key)
        if patch_type == "apply":
            return self._apply(info, key, old, patch, subresource, opts)
        if old is None:
            raise not_found(info, name)
        current = self.serve(info, old)
        if subresource == "scale":
            current = scale_view(info, current)
        new = patch_object(current, patch_type, patch, custom=info.crd is not None)
        rv = (new.get("metadata") or {}).get("resourceVersion")
        if rv not in (None, "") and str(rv) != old["metadata"]["resourceVersion"]:
            raise conflict(info, name, STALE)
        return self.replace(info, key, old, new, subresource, opts)

    def _apply(self, info: ResourceInfo, key: Key, old: JSON | None, patch: Any, subresource: str,  # noqa: PLR0917
               opts: WriteOptions) -> JSON:
        if not isinstance(patch, dict):
            raise bad_request("an apply patch must be an object")
        if not opts.field_manager:
            raise ApiError(422, "Invalid", "fieldManager: Required value: is required for apply patch")
        name = key[3]
        if old is None:
            if subresource:
                raise not_found(info, name)
            body = copy.deepcopy(patch)
            body.setdefault("metadata", {})["name"] = name
            created = fieldmanager.apply(info, {}, body, opts.field_manager, opts.force, "", now_rfc3339())
            created["metadata"]["name"] = name
            for k in ("apiVersion", "kind"):
                created.setdefault(k, patch.get(k))
            return self.create(info, key[2], created, opts.without_record())
        current = self.serve(info, old)
        new = fieldmanager.apply(info, current, patch, opts.field_manager, opts.force, subresource, now_rfc3339())
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        return self.replace(info, key, old, new, subresource, opts.without_record())

    # --- deletion ------------------------------------------------------------------------------------------------

    def delete(self, info: ResourceInfo, namespace: str, name: str, options: JSON | None = None,
               dry_run: bool = False) -> JSON:
        """DELETE with DeleteOptions (gracePeriodSeconds, propagationPolicy, preconditions). Returns the object
        as it is after the call (with deletionTimestamp if it stays for finalizers or a grace period)."""
        options = options or {}
        key = self.key(info, namespace, name)
        obj = self.storage.objects.get(key)
        if obj is None:
            raise not_found(info, name)
        deletion.check_preconditions(info, name, obj, options.get("preconditions") or {})
        new = deletion.marked(info, obj, options, self._running_pod(info, obj))
        if dry_run:
            return self.serve(info, obj)
        if new is None:
            return self.remove(info, key)
        if new != obj:
            new["metadata"]["resourceVersion"] = self.storage.next_rv()
            self.storage.put(key, new, "MODIFIED")
        return self.serve(info, new)

    def _running_pod(self, info: ResourceInfo, obj: JSON) -> bool:
        """A pod whose kubelet must stop it before it goes (:attr:`graceful_pods`)."""
        return info.plural == "pods" and not info.group and self.graceful_pods(obj)

    def remove(self, info: ResourceInfo, key: Key) -> JSON:
        """Remove the object at ``key`` now: the end of its deletion (finalizers and grace are over)."""
        gone = self.storage.pop(key)
        if gone is None:
            raise not_found(info, key[3])
        if crds.is_crd(info):
            crds.unserve(self.registry, self.storage, gone)
        return self.serve(info, gone)
