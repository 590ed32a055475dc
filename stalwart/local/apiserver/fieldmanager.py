"""Field ownership (``metadata.managedFields``) and server-side apply, as kube-apiserver's field manager keeps
them; pure functions over JSON objects.

- Every write names a manager (the ``fieldManager`` parameter, else the client's user agent). An update, patch
  or create by manager M makes M the owner of the fields it changed (an ``Update`` entry) and takes them from
  every other manager; fields it removed are owned by nobody.
- An apply by M (an ``Apply`` entry) sets the fields of its configuration. Setting a field that another manager
  owns to a different value is a conflict: 409 naming each manager and field, unless ``force`` moves the fields
  to M. Setting it to the value it already has shares the ownership. Fields M applied before and omits now are
  removed from the object unless another manager owns them too.
- Paths use FieldsV1 steps: ``f:name`` for a field, ``k:{"name":"x"}`` for an element of a list merged by key
  (the core types' patch merge keys), ``v:value`` for an element of a set (``finalizers``); other lists are
  atomic (owned whole). Status belongs to writes of the status subresource where one exists.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError
from stalwart.local.apiserver.patches import SET_LISTS, merge_key, strategic_merge

JSON = dict[str, Any]
Path = tuple[str, ...]
_APPLIED_METADATA = ("labels", "annotations", "finalizers", "ownerReferences")


# --- paths ---------------------------------------------------------------------------------------------------------

def field_paths(obj: Any, field: str | None = None, prefix: Path = ()) -> set[Path]:
    """The leaf field paths of an object, in FieldsV1 steps (keyed list elements are paths themselves too)."""
    out: set[Path] = set()
    if isinstance(obj, dict):
        if not obj and prefix:
            out.add(prefix)
        for key, value in obj.items():
            out |= field_paths(value, key, (*prefix, f"f:{key}"))
        return out
    if isinstance(obj, list):
        key = merge_key(field, obj)
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


_ABSENT = object()


def _step(cur: Any, step: str) -> Any:
    kind, _, rest = step.partition(":")
    if kind == "f" and isinstance(cur, dict):
        return cur.get(rest, _ABSENT)
    if kind == "k" and isinstance(cur, list):
        want = json.loads(rest)
        return next((x for x in cur if isinstance(x, dict) and all(x.get(k) == v for k, v in want.items())),
                    _ABSENT)
    if kind == "v" and isinstance(cur, list):
        value = json.loads(rest)
        return value if value in cur else _ABSENT
    return _ABSENT


def lookup(obj: Any, path: Path) -> Any:
    """The value at a FieldsV1 path (a private marker if absent)."""
    cur = obj
    for step in path:
        cur = _step(cur, step)
        if cur is _ABSENT:
            return _ABSENT
    return cur


def remove_path(obj: JSON, path: Path) -> None:
    """Remove the field at a FieldsV1 path from ``obj`` in place, if present."""
    parent = lookup(obj, path[:-1]) if len(path) > 1 else obj
    kind, _, rest = path[-1].partition(":")
    if kind == "f" and isinstance(parent, dict):
        parent.pop(rest, None)
    elif kind in ("k", "v") and isinstance(parent, list):
        item = _step(parent, path[-1])
        if item is not _ABSENT:
            parent.remove(item)


def render_path(path: Path) -> str:
    """A path as the API server prints it in conflicts: ``.spec.containers[name="app"].image``."""
    out = ""
    for step in path:
        kind, _, rest = step.partition(":")
        if kind == "f":
            out += f".{rest}"
        elif kind == "k":
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in json.loads(rest).items()) + "]"
        elif kind == "v":
            out += f"[={rest}]"
        else:
            out += f"[{rest}]"
    return out


# --- ownership -----------------------------------------------------------------------------------------------------

def tracked(obj: JSON | None, subresource: str, has_status: bool) -> JSON:
    """The part of an object whose fields a write to ``subresource`` owns."""
    if not obj:
        return {}
    if subresource == "status":
        return {"status": obj["status"]} if "status" in obj else {}
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")
           and not (k == "status" and has_status)}
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k in _APPLIED_METADATA}
    if meta:
        out["metadata"] = meta
    return out


def _entry(manager: str, operation: str, api_version: str, now: str, paths: set[Path],  # noqa: PLR0917
           subresource: str) -> JSON:
    out: JSON = {"manager": manager, "operation": operation, "apiVersion": api_version, "time": now,
                 "fieldsType": "FieldsV1", "fieldsV1": paths_to_fieldsv1(paths)}
    if subresource:
        out["subresource"] = subresource
    return out


def _paths(entry: JSON) -> set[Path]:
    return fieldsv1_to_paths(entry.get("fieldsV1") or {})


def _element(path: Path) -> bool:
    """A path to a keyed list element or set member: owning it means wanting it present, never a value."""
    return path[-1][:2] in ("k:", "v:")


def _key_field(path: Path) -> bool:
    """A field that identifies its keyed list element (``name`` in ``k:{"name":...}``)."""
    return len(path) > 1 and path[-2].startswith("k:") and path[-1][2:] in json.loads(path[-2][2:])


def _is(entry: JSON, manager: str, operation: str, subresource: str) -> bool:
    return (entry.get("manager") == manager and entry.get("operation") == operation
            and entry.get("subresource", "") == subresource)


def _without(entries: list[JSON], drop: set[Path]) -> list[JSON]:
    out = []
    for e in entries:
        left = _paths(e) - drop
        if left:
            out.append({**e, "fieldsV1": paths_to_fieldsv1(left)})
    return out


def record_update(old: JSON | None, new: JSON, manager: str, subresource: str, now: str,  # noqa: PLR0917
                  has_status: bool = True) -> None:
    """Record a non-apply write of ``new`` (over ``old``) by ``manager`` in ``new``'s managedFields."""
    if not manager:
        return
    before, after = tracked(old, subresource, has_status), tracked(new, subresource, has_status)
    old_paths, new_paths = field_paths(before), field_paths(after)
    changed = {p for p in new_paths
               if p not in old_paths or (not _element(p) and lookup(before, p) != lookup(after, p))}
    removed = old_paths - new_paths
    meta = new.setdefault("metadata", {})
    entries: list[JSON] = list(meta.get("managedFields") or (old or {}).get("metadata", {}).get("managedFields")
                               or [])
    mine = next((e for e in entries if _is(e, manager, "Update", subresource)), None)
    owned = ((_paths(mine) if mine else set()) | changed) - removed
    entries = _without([e for e in entries if e is not mine], changed | removed)
    if owned:
        entries.append(_entry(manager, "Update", str(new.get("apiVersion", "")), now, owned, subresource))
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)


def same_object(a: JSON, b: JSON) -> bool:
    """Equal but for the times in managedFields (a write that changes nothing keeps its resourceVersion)."""
    def strip(o: JSON) -> JSON:
        meta = dict(o.get("metadata") or {})
        meta["managedFields"] = [{k: v for k, v in e.items() if k != "time"} for e in meta.get("managedFields") or []]
        return {**o, "metadata": meta}
    return strip(a) == strip(b)


def _describe(entry: JSON) -> str:
    text = json.dumps(entry.get("manager", ""))
    if entry.get("subresource"):
        text += f' with subresource "{entry["subresource"]}"'
    if entry.get("operation") == "Update":
        text += f" using {entry.get('apiVersion', '')}"
        if entry.get("time"):
            text += f" at {entry['time']}"
    return text


def conflict_error(conflicts: list[tuple[JSON, Path]]) -> ApiError:
    """409 as the API server words an apply conflict (one line for one, a list per manager for several)."""
    causes = [{"reason": "FieldManagerConflict", "message": f"conflict with {_describe(e)}", "field": render_path(p)}
              for e, p in conflicts]
    if len(conflicts) == 1:
        entry, path = conflicts[0]
        message = f"Apply failed with 1 conflict: conflict with {_describe(entry)}: {render_path(path)}"
    else:
        by_manager: dict[str, list[str]] = {}
        for entry, path in conflicts:
            by_manager.setdefault(_describe(entry), []).append(render_path(path))
        lines = []
        for who in sorted(by_manager):
            lines.append(f"conflicts with {who}:")
            lines += [f"- {p}" for p in by_manager[who]]
        message = f"Apply failed with {len(conflicts)} conflicts: " + "\n".join(lines)
    return ApiError(409, "Conflict", message, {"causes": causes})


def apply(info: ResourceInfo, live: JSON, applied: JSON, manager: str, force: bool,  # noqa: PLR0917
          subresource: str, now: str) -> JSON:
    """Server-side apply of ``applied`` by ``manager`` onto ``live`` (see the module docstring); raises the 409
    of :func:`conflict_error` on conflicts unless ``force``."""
    body = tracked(applied, subresource, info.has_status)
    if subresource != "status" and "metadata" in body:
        body["metadata"] = {k: v for k, v in body["metadata"].items() if k in _APPLIED_METADATA}
    new_paths = field_paths(body)
    result = strategic_merge(live, body, directives=False)
    entries: list[JSON] = [dict(e) for e in (live.get("metadata") or {}).get("managedFields") or []]
    mine = next((e for e in entries if _is(e, manager, "Apply", subresource)), None)
    others = [e for e in entries if e is not mine]
    # The scale subresource writes the main resource's fields; only status is apart.
    conflicts = [(e, p) for e in others if (e.get("subresource", "") == "status") == (subresource == "status")
                 for p in sorted(new_paths & _paths(e)) if not _element(p) and lookup(live, p) != lookup(result, p)]
    if conflicts and not force:
        raise conflict_error(conflicts)
    if conflicts:
        others = _without(others, {p for _, p in conflicts})
    kept = new_paths.union(*(_paths(e) for e in others))
    given_up = (_paths(mine) if mine else set()) - kept
    # Outermost first: a list element goes whole (its key fields identify it); what is inside a removed part is
    # gone with it, and a kept element keeps its key.
    removed: set[Path] = set()
    for path in sorted(given_up, key=len):
        if any(path[:i] in removed for i in range(1, len(path))) or _key_field(path):
            continue
        remove_path(result, path)
        removed.add(path)
        # A map this manager owned only through the removed field goes too once it is empty.
        for cut in range(len(path) - 1, 0, -1):
            parent = path[:cut]
            if any(p[:cut] == parent for p in kept) or lookup(result, parent) != {}:
                break
            remove_path(result, parent)
    result = copy.deepcopy(result)
    result.setdefault("metadata", {})["managedFields"] = [
        *others, _entry(manager, "Apply", str(applied.get("apiVersion", "")), now, new_paths, subresource)]
    return dict(result)
