"""CustomResourceDefinitions: the checks the API server makes when one is stored (names, versions, structural
schema, rules that compile) and serving its resource once stored.

The structural-schema rules are kube-apiserver's: every field, array item and the root has a ``type`` (unless
``x-kubernetes-int-or-string`` or ``x-kubernetes-preserve-unknown-fields``), the root is an object without
``additionalProperties``, ``properties`` and ``additionalProperties`` exclude each other, root ``metadata`` may
restrict only ``name`` and ``generateName``, and inside ``allOf``/``anyOf``/``oneOf``/``not`` nothing may
declare a type, default, description, nullable or the ``x-kubernetes-*`` extensions.
"""

from __future__ import annotations

import json
from typing import Any

from stalwart.local.apiserver.catalog import Registry, ResourceInfo
from stalwart.local.apiserver.celcheck import compile_error
from stalwart.local.apiserver.schema import Problem
from stalwart.local.apiserver.storage import Storage, now_rfc3339

JSON = dict[str, Any]
CRD_GROUP, CRD_PLURAL = "apiextensions.k8s.io", "customresourcedefinitions"
_JUNCTORS = ("allOf", "anyOf", "oneOf")
_NOT_IN_JUNCTORS = {"type": "must be empty to be structural", "additionalProperties": "must be undefined to be "
                    "structural", "default": "must be undefined to be structural", "title": "must be empty to be "
                    "structural", "description": "must be empty to be structural", "nullable": "must be false to be "
                    "structural", "x-kubernetes-preserve-unknown-fields": "must be false to be structural",
                    "x-kubernetes-embedded-resource": "must be false to be structural",
                    "x-kubernetes-int-or-string": "must be false to be structural", "x-kubernetes-list-map-keys":
                    "must be empty to be structural", "x-kubernetes-list-type": "must be undefined to be structural"}


def is_crd(info: ResourceInfo) -> bool:
    return info.group == CRD_GROUP and info.plural == CRD_PLURAL


# --- checks --------------------------------------------------------------------------------------------------------

def _structural(schema: Any, path: str, level: str) -> list[Problem]:
    """Structural-schema violations of ``schema`` at ``path``; ``level`` is root, item or field."""
    if not isinstance(schema, dict):
        return []
    out: list[Problem] = []
    if schema.get("type") == "array" and "items" not in schema:
        out.append(Problem(f"{path}.items", "FieldValueRequired", "Required value: must be specified"))
    if isinstance(schema.get("items"), dict):
        out += _structural(schema["items"], f"{path}.items", "item")
    for key, sub in (schema.get("properties") or {}).items():
        out += _structural(sub, f"{path}.properties[{key}]", "field")
    extra = schema.get("additionalProperties")
    if extra is not None and "properties" in schema:
        out.append(Problem(f"{path}.additionalProperties", "FieldValueForbidden",
                           "Forbidden: additionalProperties and properties are mutual exclusive"))
    if extra is not None and level == "root":
        out.append(Problem(f"{path}.additionalProperties", "FieldValueForbidden", "Forbidden: must not be used at "
                                                                                  "the root"))
    if isinstance(extra, dict):
        out += _structural(extra, f"{path}.additionalProperties", "field")
    typ = schema.get("type", "")
    if not typ and not schema.get("x-kubernetes-int-or-string") and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        where = {"root": "at the root", "item": "for specified array items", "field": "for specified object fields"}
        out.append(Problem(f"{path}.type", "FieldValueRequired", f"Required value: must not be empty {where[level]}"))
    if level == "root" and typ and typ != "object":
        out.append(Problem(f"{path}.type", "FieldValueInvalid", f'Invalid value: "{typ}": must be object at the root'))
    metadata = (schema.get("properties") or {}).get("metadata")
    if level == "root" and isinstance(metadata, dict):
        rest = {k: v for k, v in metadata.items() if k not in ("type", "properties")}
        if rest or set(metadata.get("properties") or {}) - {"name", "generateName"}:
            out.append(Problem(f"{path}.properties[metadata]", "FieldValueForbidden",
                               "Forbidden: must not specify anything other than name and generateName, but metadata "
                               "is implicitly specified"))
    for junctor in _JUNCTORS:
        for i, sub in enumerate(schema.get(junctor) or []):
            out += _in_junctor(sub, f"{path}.{junctor}[{i}]")
    if isinstance(schema.get("not"), dict):
        out += _in_junctor(schema["not"], f"{path}.not")
    return out


def _in_junctor(schema: Any, path: str) -> list[Problem]:
    if not isinstance(schema, dict):
        return []
    out = [Problem(f"{path}.{key}", "FieldValueForbidden", f"Forbidden: {why}")
           for key, why in _NOT_IN_JUNCTORS.items() if schema.get(key) not in (None, False, "", [], {})]
    if "metadata" in (schema.get("properties") or {}):
        out.append(Problem(f"{path}.properties[metadata]", "FieldValueForbidden",
                           "Forbidden: must not be specified in a nested context"))
    for key, sub in (schema.get("properties") or {}).items():
        out += _in_junctor(sub, f"{path}.properties[{key}]")
    if isinstance(schema.get("items"), dict):
        out += _in_junctor(schema["items"], f"{path}.items")
    for junctor in _JUNCTORS:
        for i, sub in enumerate(schema.get(junctor) or []):
            out += _in_junctor(sub, f"{path}.{junctor}[{i}]")
    return out


def _rule_value(spec: JSON) -> str:
    """A rule as the API server prints it in an Invalid value (the Go value of the ValidationRule)."""
    def opt(v: Any, typ: str) -> str:
        return f"({typ})(nil)" if v is None else json.dumps(v)
    return (f'apiextensions.ValidationRule{{Rule:{json.dumps(spec.get("rule", ""))}, '
            f'Message:{json.dumps(spec.get("message", ""))}, '
            f'MessageExpression:{json.dumps(spec.get("messageExpression", ""))}, '
            f'Reason:{opt(spec.get("reason"), "*apiextensions.FieldValueErrorReason")}, '
            f'FieldPath:{json.dumps(spec.get("fieldPath", ""))}, '
            f'OptionalOldSelf:{opt(spec.get("optionalOldSelf"), "*bool")}}}')


def _rules(schema: Any, path: str, at_root: bool) -> list[Problem]:
    if not isinstance(schema, dict):
        return []
    out = []
    for i, spec in enumerate(schema.get("x-kubernetes-validations") or []):
        error = compile_error(str(spec.get("rule", "")), schema, at_root=at_root)
        if error:
            out.append(Problem(f"{path}.x-kubernetes-validations[{i}].rule", "FieldValueInvalid",
                               f"Invalid value: {_rule_value(spec)}: {error}"))
    for key, sub in (schema.get("properties") or {}).items():
        out += _rules(sub, f"{path}.properties[{key}]", False)
    for key in ("items", "additionalProperties"):
        out += _rules(schema.get(key), f"{path}.{key}", False)
    return out


def problems(crd: JSON) -> list[Problem]:
    """Everything the API server refuses in a CustomResourceDefinition (422 with these field paths)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural = str(spec.get("group") or ""), str(names.get("plural") or "")
    out: list[Problem] = []
    for fld, value in (("spec.group", group), ("spec.names.plural", plural), ("spec.names.kind", names.get("kind"))):
        if not value:
            out.append(Problem(fld, "FieldValueRequired", "Required value"))
    if group and "." not in group:
        out.append(Problem("spec.group", "FieldValueInvalid",
                           f'Invalid value: "{group}": should be a domain with at least one dot'))
    name = crd["metadata"].get("name", "")
    if group and plural and name != f"{plural}.{group}":
        out.append(Problem("metadata.name", "FieldValueInvalid",
                           f'Invalid value: "{name}": must be spec.names.plural+"."+spec.group'))
    versions = spec.get("versions") or []
    if not versions:
        out.append(Problem("spec.versions", "FieldValueInvalid", "Invalid value: null: must have exactly one version "
                                                                 "marked as storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        out.append(Problem("spec.versions", "FieldValueInvalid",
                           f"Invalid value: {json.dumps([v.get('name') for v in versions])}: must have exactly one "
                           "version marked as storage version"))
    for i, version in enumerate(versions):
        root = (version.get("schema") or {}).get("openAPIV3Schema")
        if root is None:
            continue
        path = f"spec.versions[{i}].schema.openAPIV3Schema"
        structural = _structural(root, path, "root")
        out += sorted(structural, key=lambda p: p.render())
        if not structural:  # rules are compiled against a structural schema only
            out += _rules(root, path, True)
    return out


# --- serving -------------------------------------------------------------------------------------------------------

def serve(registry: Registry, crd: JSON) -> None:
    """Serve the resource ``crd`` defines (replacing what it served before) and set its status conditions."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural = spec["group"], names["plural"]
    versions = [v for v in spec.get("versions") or [] if v.get("served", True)]
    registry.remove_group_resource(group, plural)
    for v in sorted(versions, key=lambda v: not v.get("storage", False)):
        subs: dict[str, str] = {}
        if "status" in (v.get("subresources") or {}):
            subs["status"] = names["kind"]
        if "scale" in (v.get("subresources") or {}):
            subs["scale"] = "Scale"
        registry.add(ResourceInfo(
            group=group, version=v["name"], plural=plural, singular=names.get("singular") or plural,
            kind=names["kind"], namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            short_names=list(names.get("shortNames") or []), categories=list(names.get("categories") or []),
            subresources=subs, crd=v))
    old = {c.get("type"): c for c in (crd.get("status") or {}).get("conditions") or []}

    def condition(type_: str, reason: str, message: str) -> JSON:
        since = (old.get(type_) or {}).get("lastTransitionTime")
        return {"type": type_, "status": "True", "reason": reason, "message": message,
                "lastTransitionTime": since or now_rfc3339()}

    crd["status"] = {
        "acceptedNames": names,
        "storedVersions": [v["name"] for v in versions if v.get("storage")],
        "conditions": [condition("NamesAccepted", "NoConflicts", "no conflicts found"),
                       condition("Established", "InitialNamesAccepted", "the initial names have been accepted")],
    }


def unserve(registry: Registry, storage: Storage, crd: JSON) -> None:
    """The CRD ``crd`` is gone: so are its resource, every object of it, and the watches on them."""
    spec = crd.get("spec") or {}
    group, plural = spec.get("group", ""), (spec.get("names") or {}).get("plural", "")
    for key in list(storage.of_resource(group, plural)):
        storage.pop(key)
    storage.end_watches(group, plural)
    registry.remove_group_resource(group, plural)
