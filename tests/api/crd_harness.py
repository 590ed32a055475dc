"""What the API server does with a CRD's openAPIV3Schema, done with independent libraries for the tests:
structural defaulting, OpenAPI v3.0 validation (``jsonschema``'s Draft 4 validator, whose boolean
``exclusiveMinimum`` is OpenAPI 3.0's; unknown fields rejected as with kubectl's strict field validation;
``x-kubernetes-list-type: set`` items unique), and the ``x-kubernetes-validations`` CEL rules (``cel-python``,
with values typed by the schema as the API server types them: ``number`` fields are doubles).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from functools import cache
from typing import Any

import celpy
import jsonschema
from celpy import celtypes

from stalwart.api.crd import openapi_schema
from stalwart.api.validation import format_path

Path = tuple[int | str, ...]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with unknown fields forbidden wherever fields are declared and unknown ones not kept."""
    out = copy.deepcopy(schema)

    def visit(node: dict[str, Any]) -> None:
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for sub in node.get("properties", {}).values():
            visit(sub)
        if isinstance(node.get("items"), dict):
            visit(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            visit(node["additionalProperties"])

    visit(out)
    return out


def walk(schema: dict[str, Any], value: Any, path: Path = ()) -> Iterator[tuple[dict[str, Any], Any, Path]]:
    """Every (schema node, value, path) where the value is present, depth first."""
    yield schema, value, path
    if isinstance(value, dict):
        for key, sub in value.items():
            props = schema.get("properties", {})
            if key in props:
                yield from walk(props[key], sub, (*path, key))
            elif isinstance(schema.get("additionalProperties"), dict):
                yield from walk(schema["additionalProperties"], sub, (*path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, sub in enumerate(value):
            yield from walk(schema["items"], sub, (*path, index))


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: absent fields with a ``default`` get it, recursively (defaults included)."""
    if isinstance(value, dict):
        out = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def schema_errors(document: dict[str, Any], schema: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """OpenAPI v3.0 errors of ``document`` as (path, message)."""
    schema = schema if schema is not None else openapi_schema()
    validator = jsonschema.Draft4Validator(strict(schema))
    found = [(format_path(tuple(e.absolute_path)), e.message) for e in validator.iter_errors(document)]
    for node, value, path in walk(schema, document):
        if (node.get("x-kubernetes-list-type") == "set" and isinstance(value, list)
                and len({repr(v) for v in value}) != len(value)):
            found.append((format_path(path), "duplicate items in a list of type set"))
    return found


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """``value`` as the API server hands it to CEL, typed by ``schema``."""
    kind = schema.get("type")
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if kind == "number" and isinstance(value, int | float):
        return celtypes.DoubleType(float(value))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) \
            else {}
        return celtypes.MapType({celtypes.StringType(k): to_cel(props.get(k, extra), v)
                                 for k, v in value.items()})
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return celtypes.ListType([to_cel(items, v) for v in value])
    return celpy.json_to_cel(value)


# Building celpy's Environment raises the interpreter's recursion limit (to 2,500) the first time. Built once here,
# at import, the change is not made inside a hypothesis test, which warns that it cannot restore the limit.
celpy.Environment()


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_rules(schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, str]]]:
    """Every (schema path, x-kubernetes-validations entry) of ``schema``."""
    def visit(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, str]]]:
        for rule in node.get("x-kubernetes-validations", []):
            yield path, rule
        for key, sub in node.get("properties", {}).items():
            yield from visit(sub, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            yield from visit(node["items"], f"{path}[]")

    yield from visit(schema, "")


def cel_failures(document: dict[str, Any], schema: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """The CEL rules that ``document`` (defaulted first) breaks, as (path of the field, rule message)."""
    schema = schema if schema is not None else openapi_schema()
    defaulted = apply_defaults(schema, document)
    failures = []
    for node, value, path in walk(schema, defaulted):
        for rule in node.get("x-kubernetes-validations", []):
            try:
                result = _program(rule["rule"]).evaluate({"self": to_cel(node, value)})
                ok = bool(result) if isinstance(result, celtypes.BoolType) else False
            except celpy.CELEvalError:
                ok = False
            if not ok:
                where = format_path(path) + rule.get("fieldPath", "")
                failures.append((where.lstrip("."), rule["message"]))
    return failures
