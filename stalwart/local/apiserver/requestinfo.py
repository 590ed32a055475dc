"""What a request asks for, read from its method, path and query as kube-apiserver's request-info resolver reads
them: API group, version, namespace, resource, subresource, name and the authorization verb (get, list, watch,
create, update, patch, delete, deletecollection), or a non-resource path with the lower-cased method."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from stalwart.local.apiserver.selectors import SelectorError, parse_field_selector

_NAMESPACE_SUBRESOURCES = ("status", "finalize")
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete", "GET": "get", "HEAD": "get"}


@dataclass(frozen=True)
class RequestInfo:
    path: str
    verb: str
    resource_request: bool = False
    group: str = ""
    version: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""
    #: A request under /api or /apis above the resources (discovery: /api, /apis/<group>, .../<version>).
    discovery: bool = False
    #: The path used the deprecated /watch/ prefix.
    watch_prefix: bool = False
    #: The name authorization sees: the path's, or that of a list or watch by ``metadata.name``.
    authz_name: str = ""


def request_info(method: str, path: str, query: Mapping[str, str]) -> RequestInfo:
    parts = [p for p in path.split("/") if p]
    verb = _VERBS.get(method.upper(), method.lower())
    if not parts or parts[0] not in ("api", "apis"):
        return RequestInfo(path, method.lower() if method.upper() != "HEAD" else "get")
    if parts[0] == "api":
        if len(parts) < 2:
            return RequestInfo(path, method.lower(), discovery=True)
        group, version, rest = "", parts[1], parts[2:]
    else:
        if len(parts) < 3:
            return RequestInfo(path, method.lower(), discovery=True)
        group, version, rest = parts[1], parts[2], parts[3:]
    if not rest:
        return RequestInfo(path, method.lower(), discovery=True)
    watch_prefix = False
    if rest[0] == "watch":
        watch_prefix, rest = True, rest[1:]
    namespace = ""
    if rest and rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
            rest = rest[2:]
    # A path past resource/name/subresource names nothing (resource "" answers 404 once authorized).
    resource = rest[0] if rest and len(rest) <= 3 else ""
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    if watch_prefix and verb == "get":
        verb = "watch"
    authz_name = name
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("true", "1") else "list"
        try:
            fields = parse_field_selector(query.get("fieldSelector"))
        except SelectorError:
            fields = []
        exact = [f.value for f in fields if f.path == ("metadata", "name") and f.equal]
        if len(exact) == 1 and "/" not in exact[0]:
            authz_name = exact[0]
    elif not name and verb == "delete":
        verb = "deletecollection"
    return RequestInfo(path, verb, True, group, version, namespace, resource, subresource, name,
                       watch_prefix=watch_prefix, authz_name=authz_name)
