"""The TrainingJob CustomResourceDefinition, generated from the pydantic models.

pydantic writes JSON Schema 2020-12; a CRD needs an OpenAPI v3.0 *structural* schema. :func:`structural`
turns one into the other: ``$ref`` inlined, ``Optional`` unions (``anyOf`` with ``null``) reduced to their
type (the API server drops nulls of non-nullable fields), ``const`` to one-item ``enum``, numeric
``exclusiveMinimum`` to the boolean form, ``additionalProperties: false`` dropped (unknown fields are pruned
or, with kubectl's strict field validation, rejected) and ``additionalProperties: true`` turned into
``x-kubernetes-preserve-unknown-fields``, titles dropped, descriptions joined onto one line. Each model's
cross-field rules (:class:`stalwart.api.base.Rule`) become its ``x-kubernetes-validations``.
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from stalwart.api import naming
from stalwart.api.base import ApiModel
from stalwart.api.trainingjob import (
    CATEGORIES,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    TrainingJob,
)

#: Printer columns. RESTARTS is ``status.totalRestarts``: the recoveries, in-process restarts plus process
#: restarts (the split, and pod replacements, are in ``status.restarts``). STALLED is the ``Stalled`` condition's
#: status, so that ``kubectl get tj`` shows a job that stopped making progress while its phase is Running.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "The job's phase."},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas",
     "description": "Worker pods that are ready."},
    {"name": "World", "type": "integer", "jsonPath": ".status.worldSize",
     "description": "Ranks in the current rendezvous round."},
    {"name": "Round", "type": "integer", "jsonPath": ".status.round",
     "description": "Current rendezvous round."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.totalRestarts",
     "description": ("Recoveries: restarts.inProcess + restarts.processRestarts (pod replacements are "
                     "restarts.podReplacements).")},
    {"name": "Stalled", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Stalled")].status',
     "description": ("True while a rank makes no progress within its soft timeout (the Stalled condition, "
                     "whose message names it).")},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

#: Rules on metadata.name, which a CRD's schema cannot constrain but CEL at the root can (no fieldPath: the
#: schema declares no metadata fields for it to point at).
ROOT_VALIDATIONS: list[dict[str, str]] = [
    {"rule": f"self.metadata.name.size() <= {naming.MAX_JOB_NAME_LENGTH}",
     "message": (f"metadata.name must be at most {naming.MAX_JOB_NAME_LENGTH} characters so that pod names "
                 f"'<name>{naming.WORKER_INFIX}<index>' fit in {naming.MAX_LABEL_LENGTH}"),
},
    {"rule": f"self.metadata.name.matches('{naming.DNS1035_LABEL.pattern}')",
     "message": ("metadata.name must be a DNS-1035 label: lower case letters, digits and '-', starting "
                 "with a letter and ending with a letter or digit")},
]


def _model_classes(root: type[BaseModel]) -> dict[str, type[ApiModel]]:
    """Every ApiModel reachable from ``root``'s fields, by class name (pydantic's ``$defs`` keys)."""
    found: dict[str, type[ApiModel]] = {}
    stack: list[Any] = [root]
    while stack:
        annotation = stack.pop()
        if isinstance(annotation, type) and issubclass(annotation, ApiModel):
            seen = found.get(annotation.__name__)
            if seen is annotation:
                continue
            if seen is not None:
                raise ValueError(f"two API models are named {annotation.__name__}")
            found[annotation.__name__] = annotation
            stack.extend(f.annotation for f in annotation.model_fields.values() if f.annotation is not None)
        else:
            stack.extend(typing.get_args(annotation))
    return found


def _cel_field_path(field: str) -> str:
    # fieldPath cannot index into lists: report such rules on the list itself.
    return "." + field.split("[", 1)[0] if field else ""


def _validations(model: type[ApiModel]) -> list[dict[str, str]]:
    out = []
    for rule in model.__rules__:
        entry = {"rule": rule.cel, "message": rule.message}
        path = _cel_field_path(rule.field)
        if path:
            entry["fieldPath"] = path
        out.append(entry)
    return out


_FIRST_KEYS = ("description", "type", "format", "enum", "default")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    # A stable, readable key order: what the value is first, then its constraints alphabetically.
    first = [k for k in _FIRST_KEYS if k in node]
    return {k: node[k] for k in first + sorted(k for k in node if k not in _FIRST_KEYS)}


def structural(schema: dict[str, Any], models: dict[str, type[ApiModel]] | None = None) -> dict[str, Any]:
    """Turn pydantic's JSON schema (with ``$defs``) into a structural OpenAPI v3.0 schema (see module doc)."""
    defs: dict[str, Any] = schema.get("$defs", {})
    models = models or {}

    def convert(node: Any, depth: int = 0) -> Any:
        if depth > 64:
            raise ValueError("schema nests too deeply (a recursive model?)")
        if isinstance(node, list):
            return [convert(item, depth + 1) for item in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        rules: list[dict[str, str]] = []
        if "$ref" in node:
            name = node.pop("$ref").rsplit("/", 1)[-1]
            target = copy.deepcopy(defs[name])
            if name in models:
                rules = _validations(models[name])
            node = {**target, **node}
        if "allOf" in node and len(node["allOf"]) == 1:
            node = {**node.pop("allOf")[0], **node}
            return convert(node, depth + 1)
        if "anyOf" in node:
            options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
            if len(options) != 1:
                raise ValueError(f"cannot express a union of {len(options)} types in a structural schema")
            node = {**options[0], **node}
            if node.get("default", 0) is None:
                del node["default"]
            return convert(node, depth + 1)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "$defs"):
                continue
            if key == "default" and value is None:
                continue
            if key == "description":
                out[key] = " ".join(str(value).split())
            elif key == "const":
                out["enum"] = [value]
            elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
                out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
                out[key] = True
            elif key == "additionalProperties":
                if value is True:
                    out["x-kubernetes-preserve-unknown-fields"] = True
                elif isinstance(value, dict):
                    out[key] = convert(value, depth + 1)
            elif key in ("properties", "patternProperties"):
                out[key] = {name: convert(sub, depth + 1) for name, sub in value.items()}
            elif key == "items":
                out[key] = convert(value, depth + 1)
            else:
                out[key] = value
        if rules:
            out["x-kubernetes-validations"] = rules + out.get("x-kubernetes-validations", [])
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
        return _ordered(out)

    result = convert({k: v for k, v in schema.items() if k != "$defs"})
    assert isinstance(result, dict)
    return result


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of the TrainingJob CRD."""
    models = _model_classes(TrainingJob)
    raw = TrainingJob.model_json_schema(by_alias=True, mode="validation")
    schema = structural(raw, models)
    root_rules = _validations(TrainingJob)
    props = schema["properties"]
    # The API server owns apiVersion, kind and metadata; a CRD may only describe them.
    props["apiVersion"] = {"type": "string", "description": props["apiVersion"]["description"]}
    props["kind"] = {"type": "string", "description": props["kind"]["description"]}
    props["metadata"] = {"type": "object"}
    schema["required"] = ["spec"]
    schema["x-kubernetes-validations"] = root_rules + ROOT_VALIDATIONS
    return schema


def crd() -> dict[str, Any]:
    """The apiextensions.k8s.io/v1 CustomResourceDefinition of TrainingJob."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "stalwart", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
            }],
        },
    }


def crd_yaml() -> str:
    """:func:`crd` as YAML: what ``stalwart crd`` prints and ``crds/trainingjob.yaml`` holds."""
    return yaml.safe_dump(crd(), sort_keys=False, width=110, allow_unicode=False)


def crd_json() -> str:
    return json.dumps(crd(), indent=2) + "\n"
