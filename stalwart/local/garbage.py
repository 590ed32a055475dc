"""The garbage collector and the namespace controller of the local cluster: what kube-controller-manager does
after a deletion, asynchronously, through the object store's own API (deletes and patches, as a real controller
makes them).

Garbage collection, by owner references (owners found by uid):
- a dependent none of whose owners exists any more is deleted (Background); one that still has an owner loses
  its references to the owners that are gone;
- an owner deleted with ``propagationPolicy=Foreground`` (the ``foregroundDeletion`` finalizer) has its
  dependents deleted and goes once no dependent with ``blockOwnerDeletion: true`` is left;
- an owner deleted with ``propagationPolicy=Orphan`` (the ``orphan`` finalizer) has its reference removed from
  its dependents, then goes.

Namespaces: a Terminating namespace has everything in it deleted; once it is empty, its ``spec.finalizers`` are
cleared through the ``finalize`` subresource and the API removes it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from stalwart.api.base import positive_seconds
from stalwart.local.apiserver.errors import ApiError
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.apiserver.storage import Event, Key
from stalwart.local.loop import ControlLoop

log = logging.getLogger(__name__)
JSON = dict[str, Any]
_MAX_PASSES = 100


class GarbageCollector(ControlLoop):
    """See the module docstring. ``sweep()`` runs every pending collection to a fixed point; ``start()`` runs
    it on the store's loop whenever something changed (and every ``period`` seconds), until ``stop()``."""

    def __init__(self, store: ObjectStore, period: float = 5.0) -> None:
        super().__init__("garbage collector", positive_seconds("period", period))
        self.store = store
        store.listeners.append(self._on_event)

    def _on_event(self, ev: Event) -> None:
        meta = ev.obj.get("metadata") or {}
        if ev.type == "DELETED" or meta.get("deletionTimestamp") or meta.get("ownerReferences"):
            self.wake()

    def step(self) -> None:
        self.sweep()

    # --- one pass ------------------------------------------------------------------------------------------------

    def sweep(self) -> int:
        """Collect until nothing is left to do; returns how many changes were made."""
        total = 0
        for _ in range(_MAX_PASSES):
            done = self._pass()
            total += done
            if not done:
                break
        return total

    def _pass(self) -> int:
        objects = dict(self.store.objects)
        by_uid = {o["metadata"].get("uid"): o for o in objects.values()}
        dependents: dict[str, list[tuple[Key, JSON, JSON]]] = defaultdict(list)
        for key, obj in objects.items():
            for ref in obj["metadata"].get("ownerReferences") or []:
                dependents[str(ref.get("uid"))].append((key, obj, ref))
        done = 0
        for key, obj in objects.items():
            meta = obj["metadata"]
            finalizers = meta.get("finalizers") or []
            if meta.get("deletionTimestamp") and "orphan" in finalizers:
                done += self._orphan(key, obj, dependents.get(meta["uid"], []))
            elif meta.get("deletionTimestamp") and "foregroundDeletion" in finalizers:
                done += self._foreground(key, obj, dependents)
            elif meta.get("ownerReferences"):
                done += self._dependent(key, obj, by_uid, bool(dependents.get(meta["uid"])))
            if key[1] == "namespaces" and not key[0] and meta.get("deletionTimestamp"):
                done += self._namespace(key, obj, objects)
        return done

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> int:
        try:
            fn(*args, **kwargs)
        except ApiError as exc:
            if exc.code not in (404, 409):
                log.warning("garbage collector: %s", exc.message)
            return 0
        return 1

    def _delete(self, key: Key, policy: str = "Background") -> int:
        info = self.store.any_info(key[0], key[1])
        if info is None:
            return 0
        return self._call(self.store.delete, info, key[2], key[3], {"propagationPolicy": policy})

    def _patch_meta(self, key: Key, meta: JSON) -> int:
        info = self.store.any_info(key[0], key[1])
        if info is None:
            return 0
        return self._call(self.store.patch, info, key[2], key[3], "merge", {"metadata": meta})

    def _dependent(self, key: Key, obj: JSON, by_uid: dict[Any, JSON], has_dependents: bool) -> int:
        if obj["metadata"].get("deletionTimestamp"):
            return 0
        refs = obj["metadata"]["ownerReferences"]
        alive = [r for r in refs if r.get("uid") in by_uid]
        if not alive:
            waiting = any("foregroundDeletion" in (by_uid.get(r.get("uid"), {}).get("metadata", {}).get("finalizers")
                                                   or []) for r in refs)
            # Under an owner that waits for its dependents, one with dependents of its own waits for them too.
            return self._delete(key, "Foreground" if waiting and has_dependents else "Background")
        if len(alive) < len(refs):
            return self._patch_meta(key, {"ownerReferences": alive})
        return 0

    def _orphan(self, key: Key, obj: JSON, deps: list[tuple[Key, JSON, JSON]]) -> int:
        uid = obj["metadata"]["uid"]
        done = 0
        for dep_key, dep, _ in deps:
            left = [r for r in dep["metadata"].get("ownerReferences") or [] if r.get("uid") != uid]
            done += self._patch_meta(dep_key, {"ownerReferences": left or None})
        finalizers = [f for f in obj["metadata"]["finalizers"] if f != "orphan"]
        return done + self._patch_meta(key, {"finalizers": finalizers or None})

    def _foreground(self, key: Key, obj: JSON, dependents: dict[str, list[tuple[Key, JSON, JSON]]]) -> int:
        done = 0
        deps = dependents.get(obj["metadata"]["uid"], [])
        for dep_key, dep, _ in deps:
            if not dep["metadata"].get("deletionTimestamp"):
                policy = "Foreground" if dependents.get(dep["metadata"]["uid"]) else "Background"
                done += self._delete(dep_key, policy)
        if any(ref.get("blockOwnerDeletion") for _, _, ref in deps):
            return done
        finalizers = [f for f in obj["metadata"]["finalizers"] if f != "foregroundDeletion"]
        return done + self._patch_meta(key, {"finalizers": finalizers or None})

    def _namespace(self, key: Key, obj: JSON, objects: dict[Key, JSON]) -> int:
        name = key[3]
        inside = [k for k in objects if k[2] == name and not (k[1] == "namespaces" and not k[0])]
        done = sum(self._delete(k) for k in inside if not objects[k]["metadata"].get("deletionTimestamp"))
        if inside or not (obj.get("spec") or {}).get("finalizers"):
            return done
        info = self.store.info("", "v1", "namespaces")
        body = {**obj, "spec": {**(obj.get("spec") or {}), "finalizers": []}}
        return done + self._call(self.store.update, info, "", name, body, "finalize")
