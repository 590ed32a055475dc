"""The four PATCH flavours of the Kubernetes API, as pure functions over JSON objects.

- JSON merge patch (RFC 7386): maps merge recursively, ``null`` deletes, everything else replaces.
- JSON patch (RFC 6902): delegated to the ``jsonpatch`` library.
- Strategic merge patch: like a merge patch, but lists of the core kinds that declare a patch merge key
  (containers by ``name``, ports by ``containerPort``/``port``, conditions by ``type``, ...) merge element-wise;
  ``finalizers`` merge as a set; the directives ``$patch`` (replace/delete/merge), ``$retainKeys``,
  ``$deleteFromPrimitiveList/<field>`` and ``$setElementOrder/<field>`` are honoured.
- Server-side apply: the applied configuration is merged like a strategic merge patch without directives; each
  field manager's applied field set is recorded in ``metadata.managedFields`` (``FieldsV1``), and fields that a
  manager applied before and omits now are removed unless another manager applied them too. Ownership
  conflicts with non-apply writers are not detected (``force`` is accepted and changes nothing).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch

JSON = dict[str, Any]

# Patch merge keys of list fields in the core API types (from the Kubernetes types' patchMergeKey tags).
MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "imagePullSecrets": "name",
    "conditions": "type", "ownerReferences": "uid", "hostAliases": "ip", "readinessGates": "conditionType",
    "topologySpreadConstraints": "topologyKey", "resourceClaims": "name", "secrets": "name",
    "containerStatuses": "name", "initContainerStatuses": "name", "addresses": "type",
}
SET_LISTS = frozenset({"finalizers"})


class PatchError(ValueError):
    """A patch that cannot be applied; the message says why."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: return ``target`` with ``patch`` merged in (inputs are not modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: JSON, ops: Any) -> JSON:
    """RFC 6902: apply a list of operations; raise :class:`PatchError` on a malformed or failing op."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    try:
        result = jsonpatch.JsonPatch(ops).apply(copy.deepcopy(target))
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, TypeError, KeyError,
            IndexError) as exc:
        raise PatchError(f"JSON patch failed: {exc}") from exc
    if not isinstance(result, dict):
        raise PatchError("a JSON patch must leave an object")
    return result


def _merge_key(field: str | None, items: list[Any]) -> str | None:
    if field == "ports":
        for item in items:
            if isinstance(item, dict):
                return "containerPort" if "containerPort" in item else "port"
        return None
    return MERGE_KEYS.get(field or "")


def strategic_merge(target: Any, patch: Any, *, field: str | None = None, directives: bool = True) -> Any:
    """Return ``target`` with a strategic merge ``patch`` applied (inputs are not modified).

    ``field`` is the name of the field holding ``target`` (to find list merge keys); ``directives=False`` treats
    ``$``-keys as plain data (server-side apply never sends them)."""
    if isinstance(patch, dict):
        if not isinstance(target, dict):
            target = {}
        if directives:
            mode = patch.get("$patch")
            if mode == "replace":
                return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
            if mode == "delete":
                return None
        result = copy.deepcopy(target)
        retain: list[str] | None = None
        for key, value in patch.items():
            if directives and key.startswith("$"):
                if key == "$retainKeys":
                    retain = list(value or [])
                elif key.startswith("$deleteFromPrimitiveList/"):
                    name = key.split("/", 1)[1]
                    if isinstance(result.get(name), list):
                        result[name] = [x for x in result[name] if x not in (value or [])]
                elif key.startswith("$setElementOrder/"):
                    pass  # ordering is applied after the merge below
                continue
            if value is None:
                result.pop(key, None)
                continue
            merged = strategic_merge(result.get(key), value, field=key, directives=directives)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        if directives:
            for key, order in patch.items():
                if key.startswith("$setElementOrder/"):
                    name = key.split("/", 1)[1]
                    result[name] = _apply_order(result.get(name), order, name)
        if retain is not None:
            result = {k: v for k, v in result.items() if k in retain}
        return result
    if isinstance(patch, list):
        return _merge_list(target if isinstance(target, list) else [], patch, field, directives)
    return copy.deepcopy(patch)


def _apply_order(items: Any, order: Any, field: str) -> Any:
    if not isinstance(items, list) or not isinstance(order, list):
        return items
    key = _merge_key(field, items + order)

    def ident(x: Any) -> str:
        return json.dumps(x.get(key) if key and isinstance(x, dict) else x, sort_keys=True)

    rank = {ident(o): i for i, o in enumerate(order)}
    return sorted(items, key=lambda x: rank.get(ident(x), len(rank)))


def _merge_list(target: list[Any], patch: list[Any], field: str | None, directives: bool) -> list[Any]:
    if field in SET_LISTS:
        out = list(target)
        for item in patch:
            if item not in out:
                out.append(item)
        return out
    key = _merge_key(field, patch + target)
    if key is None or not all(isinstance(x, dict) for x in patch):
        if directives and any(isinstance(x, dict) and x.get("$patch") == "replace" for x in patch):
            return [copy.deepcopy(x) for x in patch if not (isinstance(x, dict) and "$patch" in x)]
        return copy.deepcopy(patch)
    if directives and any(x.get("$patch") == "replace" for x in patch):
        return [copy.deepcopy(x) for x in patch if "$patch" not in x]
    out = [copy.deepcopy(x) for x in target]
    for item in patch:
        idx = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == item.get(key)), None)
        if directives and item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
            continue
        if idx is None:
            out.append(strategic_merge({}, item, directives=directives))
        else:
            out[idx] = strategic_merge(out[idx], item, directives=directives)
    return out


# --- server-side apply -------------------------------------------------------------------------------------------

Path = tuple[str, ...]


def field_paths(obj: Any, field: str | None = None, prefix: Path = ()) -> set[Path]:
    """The leaf field paths of an applied configuration, in FieldsV1 step notation (``f:name``,
    ``k:{"name":"x"}`` for keyed list elements, ``v:value`` for set elements)."""
    out: set[Path] = set()
    if isinstance(obj, dict):
        if not obj and prefix:
            out.add(prefix)
        for key, value in obj.items():
            out |= field_paths(value, key, (*prefix, f"f:{key}"))
        return out
    if isinstance(obj, list):
        key = _merge_key(field, obj)
        if field in SET_LISTS:
            for item in obj:
                out.add((*prefix, "v:" + json.dumps(item)))
        elif key is not None and all(isinstance(x, dict) and key in x for x in obj):
            for item in obj:
                step = "k:" + json.dumps({key: item[key]}, separators=(",", ":"))
                out.add((*prefix, step))
                out |= field_paths(item, None, (*prefix, step))
        else:
            out.add(prefix)
        return out
    out.add(prefix)
    return out


def paths_to_fieldsv1(paths: set[Path]) -> JSON:
    """Encode paths as a FieldsV1 tree; a path that is also a prefix of others is marked with ``"."``."""
    root: JSON = {}
    for path in sorted(paths):
        node = root
        for step in path:
            node = node.setdefault(step, {})
    for path in paths:
        node = root
        for step in path:
            node = node[step]
        if node:
            node["."] = {}
    return root


def fieldsv1_to_paths(fields: JSON, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    if prefix and (not fields or "." in fields):
        out.add(prefix)
    for step, sub in fields.items():
        if step != ".":
            out |= fieldsv1_to_paths(sub if isinstance(sub, dict) else {}, (*prefix, step))
    return out


def remove_path(obj: JSON, path: Path) -> None:
    """Remove the field at a FieldsV1 path from ``obj`` in place, if present."""
    cur: Any = obj
    for i, step in enumerate(path):
        last = i == len(path) - 1
        kind, _, rest = step.partition(":")
        if kind == "f" and isinstance(cur, dict):
            if last:
                cur.pop(rest, None)
                return
            cur = cur.get(rest)
        elif kind == "k" and isinstance(cur, list):
            want = json.loads(rest)
            idx = next((j for j, x in enumerate(cur)
                        if isinstance(x, dict) and all(x.get(k) == v for k, v in want.items())), None)
            if idx is None:
                return
            if last:
                cur.pop(idx)
                return
            cur = cur[idx]
        elif kind == "v" and isinstance(cur, list):
            value = json.loads(rest)
            if last and value in cur:
                cur.remove(value)
            return
        else:
            return


def _lookup(obj: Any, path: Path) -> Any:
    cur = obj
    for step in path:
        kind, _, rest = step.partition(":")
        if kind != "f" or not isinstance(cur, dict) or rest not in cur:
            return None
        cur = cur[rest]
    return cur


def server_side_apply(live: JSON, applied: JSON, manager: str, now: str) -> JSON:
    """Merge an applied configuration into the live object for field manager ``manager`` (see module doc)."""
    managed: list[JSON] = [dict(m) for m in (live.get("metadata") or {}).get("managedFields") or []]
    body = {k: v for k, v in applied.items() if k not in ("status",)}
    meta = {k: v for k, v in (body.get("metadata") or {}).items()
            if k in ("labels", "annotations", "finalizers", "ownerReferences")}
    body["metadata"] = meta
    new_paths = field_paths({k: v for k, v in body.items() if k not in ("apiVersion", "kind")})
    old_paths: set[Path] = set()
    others: set[Path] = set()
    for entry in managed:
        paths = fieldsv1_to_paths(entry.get("fieldsV1") or {})
        if entry.get("manager") == manager and entry.get("operation") == "Apply":
            old_paths = paths
        elif entry.get("operation") == "Apply":
            others |= paths
    result = strategic_merge(live, body, directives=False)
    kept = new_paths | others
    for path in sorted(old_paths - kept, key=len, reverse=True):
        remove_path(result, path)
        # A map this manager owned only through the removed field goes too once it is empty.
        for cut in range(len(path) - 1, 0, -1):
            parent = path[:cut]
            if any(p[:cut] == parent for p in kept) or _lookup(result, parent) != {}:
                break
            remove_path(result, parent)
    entry = {"manager": manager, "operation": "Apply", "apiVersion": applied.get("apiVersion", ""),
             "time": now, "fieldsType": "FieldsV1", "fieldsV1": paths_to_fieldsv1(new_paths)}
    managed = [m for m in managed if not (m.get("manager") == manager and m.get("operation") == "Apply")]
    managed.append(entry)
    result.setdefault("metadata", {})["managedFields"] = managed
    return dict(result)
