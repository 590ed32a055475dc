"""The built-in kinds checked against their published OpenAPI schemas, as the ``kubernetes-validate`` package
ships them (JSON Schema per kind and version, generated from the Kubernetes OpenAPI document, in its strict form
where every object lists its fields).

What a failed schema check becomes follows the API server, which decodes a body into typed structs first:
- a value of the wrong type: 400, ``<Kind> in version "<v>" cannot be handled as a <Kind>: json: cannot
  unmarshal ...``;
- an unknown field: with ``fieldValidation=Strict`` a 400 ``strict decoding error: unknown field "<path>"``,
  with ``Warn`` a warning and the field dropped, with ``Ignore`` the field dropped;
- a missing required field (outside ``status``) or a value outside an enum: a 422 problem
  (:class:`~.schema.Problem`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jsonschema
from kubernetes_validate import utils as kv
from referencing import Registry, Resource

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError
from stalwart.local.apiserver.schema import Problem

JSON = dict[str, Any]
_GO_TYPES = {"string": "string", "integer": "int64", "number": "float64", "boolean": "bool", "object": "object",
             "array": "array"}


@functools.cache
def _schema_dir() -> str:
    return f"kubernetes-json-schema/v{kv.latest_version()}-local-strict"


@functools.cache
def _definitions() -> Registry:
    defs = kv.schema_contents(f"{_schema_dir()}/_definitions.json", kv.latest_version())
    return Resource.from_contents(defs) @ Registry()


@functools.cache
def validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """The strict schema validator of a built-in kind, or None where the package has no schema for it."""
    short = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = kv.schema_contents(f"{_schema_dir()}/{kind.lower()}-{short}.json", kv.latest_version())
    except (FileNotFoundError, kv.VersionNotSupportedError):
        return None
    registry = Resource.from_contents(schema) @ _definitions()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def render(path: Sequence[Any]) -> str:
    out = ""
    for step in path:
        if isinstance(step, int) or "." in step or "/" in step:
            out += f"[{step}]"
        else:
            out += f".{step}" if out else step
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", dict: "object", list: "array"}
    return names.get(type(value), "null")


def _wanted(schema: JSON) -> str:
    types = schema.get("type")
    if not types and schema.get("oneOf"):
        types = [t for s in schema["oneOf"] for t in ([s.get("type")] if isinstance(s.get("type"), str)
                                                     else s.get("type") or [])]
    names = [types] if isinstance(types, str) else list(types or [])
    names = [t for t in names if t != "null"]
    return " or ".join(_GO_TYPES.get(t, t) for t in names) or "value"


def check(info: ResourceInfo, obj: JSON, field_validation: str) -> tuple[list[Problem], list[str]]:
    """Check ``obj`` against its kind's schema: raise the 400s, drop unknown fields unless Strict (in place) and
    return the 422 problems and the warnings."""
    v = validator(info.api_version, info.kind)
    if v is None:
        return [], []
    decoding = f'{info.kind} in version "{info.version}" cannot be handled as a {info.kind}'
    problems: list[Problem] = []
    unknown: list[tuple[JSON, str, str]] = []
    for err in v.iter_errors(obj):
        where = render(err.absolute_path)
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            declared = err.schema.get("properties") or {}
            unknown += [(err.instance, k, render([*err.absolute_path, k])) for k in err.instance if k not in declared]
        elif err.validator in ("type", "oneOf"):
            raise ApiError(400, "BadRequest", f"{decoding}: json: cannot unmarshal {_json_type(err.instance)} into Go "
                                              f"struct field {where or info.kind} of type {_wanted(err.schema)}")
        elif err.validator == "required":
            # A status is written by controllers and validated by the API server only where it says so: the
            # schema's required fields there are what clients may expect, not what the server enforces.
            if isinstance(err.instance, dict) and list(err.absolute_path)[:1] != ["status"]:
                problems += [Problem(render([*err.absolute_path, k]), "FieldValueRequired", "Required value")
                             for k in err.validator_value if k not in err.instance]
        elif err.validator == "enum":
            supported = ", ".join(f'"{x}"' for x in err.validator_value if x is not None)
            problems.append(Problem(where, "FieldValueNotSupported",
                                    f'Unsupported value: "{err.instance}": supported values: {supported}'))
        else:
            problems.append(Problem(where, "FieldValueInvalid", f"Invalid value: {err.message}"))
    if unknown and field_validation == "Strict":
        names = ", ".join(f'unknown field "{path}"' for _, _, path in unknown)
        raise ApiError(400, "BadRequest", f"{decoding}: strict decoding error: {names}")
    for parent, key, _ in unknown:
        parent.pop(key, None)
    warnings = [f'unknown field "{path}"' for _, _, path in unknown] if field_validation == "Warn" else []
    return problems, warnings
