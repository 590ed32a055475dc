"""OpenAPI documents, as much as clients need.

- ``/openapi/v3`` and ``/openapi/v3/apis/<group>/<version>``: per group-version documents with one schema per
  kind (tagged ``x-kubernetes-group-version-kind``; a CRD's schema is its ``openAPIV3Schema``) and a PATCH
  operation per resource that declares the ``fieldValidation`` parameter, so ``kubectl explain`` works on custom
  resources and kubectl leaves field validation to the server (``fieldValidation=Strict``), as with a real API.
- ``/openapi/v2``: client-go reads this protobuf-encoded and kubectl refuses to apply without it. An empty
  protobuf message is a valid, empty ``openapi_v2.Document``: client-side schema validation then knows no kinds
  and defers to the server, which validates.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from stalwart.local.apiserver.catalog import Registry, ResourceInfo

JSON = dict[str, Any]

_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
_META_SCHEMA: JSON = {
    "type": "object",
    "description": "ObjectMeta is metadata that all persisted resources must have.",
    "properties": {
        "name": {"type": "string", "description": "Name must be unique within a namespace."},
        "namespace": {"type": "string", "description": "Namespace defines the space within which each name "
                                                       "must be unique."},
        "labels": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "Map of string keys and values that can be used to organize objects."},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "Unstructured key value map stored with a resource."},
        "uid": {"type": "string", "description": "UID is the unique in time and space value for this object."},
        "resourceVersion": {"type": "string", "description": "An opaque value that represents the internal "
                                                             "version of this object."},
        "generation": {"type": "integer", "format": "int64", "description": "A sequence number representing "
                                                                            "a specific generation of the "
                                                                            "desired state."},
        "creationTimestamp": {"type": "string", "format": "date-time"},
        "deletionTimestamp": {"type": "string", "format": "date-time"},
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
    },
}


def schema_name(info: ResourceInfo) -> str:
    group = ".".join(reversed(info.group.split("."))) if info.group else "io.k8s.api.core"
    return f"{group}.{info.version}.{info.kind}"


def _kind_schema(info: ResourceInfo) -> JSON:
    gvk = [{"group": info.group, "version": info.version, "kind": info.kind}]
    base: JSON = copy.deepcopy(info.schema) if info.schema else {
        "type": "object", "description": f"{info.kind} ({info.api_version}).",
        "properties": {"spec": {"type": "object"}, "status": {"type": "object"}}}
    props: JSON = base.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string", "description": "APIVersion defines the versioned schema "
                                                                     "of this representation of an object."})
    props.setdefault("kind", {"type": "string", "description": "Kind is a string value representing the REST "
                                                               "resource this object represents."})
    props["metadata"] = {"allOf": [{"$ref": f"#/components/schemas/{_OBJECT_META}"}],
                         "description": "Standard object's metadata."}
    base["x-kubernetes-group-version-kind"] = gvk
    return base


def group_version_document(registry: Registry, group: str, version: str) -> JSON | None:
    infos = registry.resources(group, version)
    if not infos:
        return None
    schemas: JSON = {_OBJECT_META: _META_SCHEMA}
    paths: JSON = {}
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    for info in infos:
        schemas[schema_name(info)] = _kind_schema(info)
        gvk = {"group": info.group, "version": info.version, "kind": info.kind}
        ns = "/namespaces/{namespace}" if info.namespaced else ""
        params = [{"name": n, "in": "query", "schema": {"type": "string"}}
                  for n in ("dryRun", "fieldManager", "fieldValidation", "force")]
        ref = {"$ref": f"#/components/schemas/{schema_name(info)}"}
        ok = {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}}
        paths[f"{prefix}{ns}/{info.plural}/{{name}}"] = {
            "get": {"x-kubernetes-group-version-kind": gvk, "responses": ok},
            "put": {"x-kubernetes-group-version-kind": gvk, "parameters": params, "responses": ok},
            "patch": {"x-kubernetes-group-version-kind": gvk, "parameters": params, "responses": ok},
        }
        paths[f"{prefix}{ns}/{info.plural}"] = {
            "post": {"x-kubernetes-group-version-kind": gvk, "parameters": params, "responses": ok}}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.37.0"}, "paths": paths,
            "components": {"schemas": schemas}}


def document_hash(doc: JSON) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()


def v3_index(registry: Registry) -> JSON:
    paths: JSON = {}
    for group, versions in registry.group_versions():
        for version in versions:
            doc = group_version_document(registry, group, version)
            if doc is None:
                continue
            rel = f"apis/{group}/{version}" if group else f"api/{version}"
            paths[rel] = {"serverRelativeURL": f"/openapi/v3/{rel}?hash={document_hash(doc)}"}
    return {"paths": paths}
