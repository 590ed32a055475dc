"""CRD structural schemas (``openAPIV3Schema``): defaulting, pruning and validation of custom resources, with
the error wording of kube-apiserver so messages read the same as on a real cluster.

Supported keywords: type (with nullable), properties, required, items, additionalProperties (bool or schema),
enum, minimum/maximum (and exclusive*), multipleOf, minLength/maxLength, pattern, minItems/maxItems, uniqueItems,
minProperties/maxProperties, allOf/anyOf/oneOf/not (validation only), default, format (int32, int64, date-time,
accepted), x-kubernetes-preserve-unknown-fields, x-kubernetes-int-or-string, x-kubernetes-embedded-resource and
x-kubernetes-validations (the CEL subset of :mod:`.cel`; rules outside it are skipped, see
:func:`unsupported_rules`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stalwart.local.apiserver.cel import CelError, CelEvalError, compile_rule

JSON = dict[str, Any]
_ROOT_IMPLICIT = ("apiVersion", "kind", "metadata")


@dataclass(frozen=True)
class Problem:
    """One field error: ``reason`` is the Kubernetes cause type (FieldValueRequired, FieldValueInvalid...)."""
    field: str
    reason: str
    message: str

    def render(self) -> str:
        return f"{self.field}: {self.message}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (dict, list)):
        return '"object"' if isinstance(value, dict) else '"array"'
    return json.dumps(value)


# --- defaulting ---------------------------------------------------------------------------------------------------

def apply_defaults(schema: JSON, value: Any) -> Any:
    """Return ``value`` with the schema's ``default``s filled in for absent properties (recursively)."""
    if isinstance(value, dict):
        out = dict(value)
        props: JSON = schema.get("properties") or {}
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in out.items():
                if key not in props:
                    out[key] = apply_defaults(extra, item)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


# --- pruning ------------------------------------------------------------------------------------------------------

def prune(schema: JSON, value: Any, path: str = "", root: bool = True) -> tuple[Any, list[str]]:
    """Drop fields the schema does not know (as the API server prunes); return the result and the dropped
    field paths (for ``fieldValidation=Strict``/``Warn``)."""
    dropped: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
        return value, dropped
    if isinstance(value, dict):
        props: JSON = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep_all = bool(schema.get("x-kubernetes-preserve-unknown-fields")) or extra is True
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        out: JSON = {}
        for key, sub in value.items():
            if (root or embedded) and key in _ROOT_IMPLICIT:
                out[key] = sub  # object metadata is never pruned by a CRD schema
            elif key in props:
                out[key], more = prune(props[key], sub, _join(path, key), False)
                dropped += more
            elif isinstance(extra, dict):
                out[key], more = prune(extra, sub, _join(path, key), False)
                dropped += more
            elif keep_all:
                out[key] = sub
            else:
                dropped.append(_join(path, key))
        return out, dropped
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        out_list = []
        for i, item in enumerate(value):
            pruned, more = prune(schema["items"], item, f"{path}[{i}]", False)
            out_list.append(pruned)
            dropped += more
        return out_list, dropped
    return value, dropped


# --- validation ---------------------------------------------------------------------------------------------------

def _type_ok(schema: JSON, value: Any) -> bool:
    t = schema.get("type")
    if value is None:
        return bool(schema.get("nullable"))
    if schema.get("x-kubernetes-int-or-string"):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    if t is None:
        return True
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def validate(schema: JSON, value: Any, path: str = "", old: Any = None, *, has_old: bool = False,
             root: bool = True) -> list[Problem]:
    """All problems of ``value`` against ``schema``; ``old`` (with ``has_old``) enables transition rules."""
    problems: list[Problem] = []
    if not _type_ok(schema, value):
        problems.append(Problem(path, "FieldValueTypeInvalid",
                                f"Invalid value: {_fmt(value)}: {path or 'body'} in body must be of type "
                                f"{schema.get('type')}: {_fmt(value)}"))
        return problems
    if value is None:
        return problems
    where = f"{path or 'body'} in body"
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(v) for v in schema["enum"])
        problems.append(Problem(path, "FieldValueNotSupported",
                                f"Unsupported value: {_fmt(value)}: supported values: {supported}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema:
            lo = schema["minimum"]
            if value < lo or (schema.get("exclusiveMinimum") is True and value == lo):
                word = "greater than" if schema.get("exclusiveMinimum") is True else "greater than or equal to"
                problems.append(Problem(path, "FieldValueInvalid",
                                        f"Invalid value: {_fmt(value)}: {where} should be {word} {lo}"))
        if "maximum" in schema:
            hi = schema["maximum"]
            if value > hi or (schema.get("exclusiveMaximum") is True and value == hi):
                word = "less than" if schema.get("exclusiveMaximum") is True else "less than or equal to"
                problems.append(Problem(path, "FieldValueInvalid",
                                        f"Invalid value: {_fmt(value)}: {where} should be {word} {hi}"))
        if schema.get("multipleOf") and value % schema["multipleOf"] != 0:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: {where} should be a multiple of "
                                    f"{schema['multipleOf']}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: {where} should be at least "
                                    f"{schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            problems.append(Problem(path, "FieldValueTooLong",
                                    f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: {where} should match "
                                    f"'{schema['pattern']}'"))
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {len(value)}: {where} should have at least "
                                    f"{schema['minItems']} items"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(Problem(path, "FieldValueTooMany",
                                    f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
        if schema.get("uniqueItems"):
            seen = [json.dumps(v, sort_keys=True) for v in value]
            if len(set(seen)) != len(seen):
                problems.append(Problem(path, "FieldValueDuplicate", "Duplicate value"))
        if isinstance(schema.get("items"), dict):
            olds = old if has_old and isinstance(old, list) else []
            for i, item in enumerate(value):
                problems += validate(schema["items"], item, f"{path}[{i}]",
                                     olds[i] if i < len(olds) else None, has_old=i < len(olds), root=False)
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                problems.append(Problem(_join(path, key), "FieldValueRequired", "Required value"))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {len(value)}: {where} should have at least "
                                    f"{schema['minProperties']} properties"))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            problems.append(Problem(path, "FieldValueTooMany",
                                    f"Too many: {len(value)}: must have at most {schema['maxProperties']} "
                                    "properties"))
        props: JSON = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        olds_map = old if has_old and isinstance(old, dict) else {}
        for key, sub in value.items():
            if root and key in _ROOT_IMPLICIT:
                continue
            sub_schema = props.get(key, extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                problems += validate(sub_schema, sub, _join(path, key), olds_map.get(key),
                                     has_old=key in olds_map, root=False)
    for keyword in ("allOf", "anyOf", "oneOf"):
        subs = schema.get(keyword) or []
        if not subs:
            continue
        results = [validate({**s, "type": s.get("type")}, value, path, root=False) for s in subs]
        ok = [not r for r in results]
        if keyword == "allOf":
            for r in results:
                problems += r
        elif keyword == "anyOf" and not any(ok):
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: {where} must validate at least one schema "
                                    "(anyOf)"))
        elif keyword == "oneOf" and sum(ok) != 1:
            problems.append(Problem(path, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: {where} must validate one and only one "
                                    "schema (oneOf)"))
    if isinstance(schema.get("not"), dict) and not validate(schema["not"], value, path, root=False):
        problems.append(Problem(path, "FieldValueInvalid",
                                f"Invalid value: {_fmt(value)}: {where} must not validate the schema (not)"))
    problems += _run_rules(schema, value, path, old, has_old)
    return problems


def _run_rules(schema: JSON, value: Any, path: str, old: Any, has_old: bool) -> list[Problem]:
    problems: list[Problem] = []
    for spec in schema.get("x-kubernetes-validations") or []:
        source = str(spec.get("rule", ""))
        try:
            rule = compile_rule(source)
        except CelError:
            continue  # reported once, when the CRD is stored (see unsupported_rules)
        if rule.uses_old_self and not has_old:
            continue  # a transition rule only runs on updates
        env = {"self": value, "oldSelf": old}
        field = path
        if spec.get("fieldPath"):
            field = _join(path, str(spec["fieldPath"]).lstrip("."))
        try:
            ok = rule.evaluate(env)
        except CelEvalError as exc:
            problems.append(Problem(field, "FieldValueInvalid",
                                    f"Invalid value: {_fmt(value)}: rule {source!r} failed to evaluate: {exc}"))
            continue
        if ok is True:
            continue
        message = str(spec.get("message") or f"failed rule: {source}")
        if spec.get("messageExpression"):
            with contextlib.suppress(CelError, CelEvalError):
                message = str(compile_rule(str(spec["messageExpression"])).evaluate(env))
        reason = {"FieldValueRequired": "FieldValueRequired", "FieldValueForbidden": "FieldValueForbidden",
                  "FieldValueDuplicate": "FieldValueDuplicate"}.get(str(spec.get("reason")), "FieldValueInvalid")
        if reason == "FieldValueRequired":
            problems.append(Problem(field, reason, f"Required value: {message}"))
        elif reason == "FieldValueForbidden":
            problems.append(Problem(field, reason, f"Forbidden: {message}"))
        else:
            problems.append(Problem(field, reason, f"Invalid value: {_fmt(value)}: {message}"))
    return problems


def iter_rules(schema: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every ``(field path, rule)`` declared in a schema tree."""
    if not isinstance(schema, dict):
        return
    for spec in schema.get("x-kubernetes-validations") or []:
        yield path, str(spec.get("rule", ""))
    for key, sub in (schema.get("properties") or {}).items():
        yield from iter_rules(sub, _join(path, key))
    if isinstance(schema.get("items"), dict):
        yield from iter_rules(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from iter_rules(schema["additionalProperties"], f"{path}[*]")


def unsupported_rules(schema: JSON) -> list[str]:
    """Rules this emulator cannot evaluate, as ``"<path>: <rule>: <why>"`` (sent back as warnings)."""
    out = []
    for path, source in iter_rules(schema):
        try:
            compile_rule(source)
        except CelError as exc:
            out.append(f"{path or '<root>'}: {source}: {exc}")
    return out
