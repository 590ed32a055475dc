"""The four PATCH flavours of the Kubernetes API, as pure functions over JSON objects.

- JSON merge patch (RFC 7386): maps merge recursively, ``null`` deletes, everything else replaces.
- JSON patch (RFC 6902): delegated to the ``jsonpatch`` library.
- Strategic merge patch: like a merge patch, but lists of the core kinds that declare a patch merge key
  (containers by ``name``, ports by ``containerPort``/``port``, conditions by ``type``, ...) merge element-wise;
  ``finalizers`` merge as a set; the directives ``$patch`` (replace/delete/merge), ``$retainKeys``,
  ``$deleteFromPrimitiveList/<field>`` and ``$setElementOrder/<field>`` are honoured.

Server-side apply merges like a strategic merge patch without directives; its field ownership is
:mod:`.fieldmanager`'s.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch

from stalwart.local.apiserver.errors import ApiError

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


def merge_key(field: str | None, items: list[Any]) -> str | None:
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
    key = merge_key(field, items + order)

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
    key = merge_key(field, patch + target)
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


def patch_object(current: JSON, patch_type: str, patch: Any, *, custom: bool) -> JSON:
    """``current`` with ``patch`` of ``patch_type`` (json, merge, strategic) applied, or the API's error
    (422 for a patch that does not apply, 415 for strategic merge on a ``custom`` resource)."""
    try:
        if patch_type == "json":
            new = json_patch(current, patch)
        elif patch_type == "merge":
            if not isinstance(patch, dict):
                raise PatchError("a merge patch must be a JSON object")
            new = merge_patch(current, patch)
        elif patch_type == "strategic":
            if custom:
                raise ApiError(415, "UnsupportedMediaType",
                               "the body of the request was in an unknown format - accepted media types include: "
                               "application/json-patch+json, application/merge-patch+json, "
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
    return new
