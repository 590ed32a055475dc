"""The errors the API answers with, as ``Status`` objects shaped like kube-apiserver's.

Field order and omissions follow the Go encoding of ``metav1.Status`` (``kind, apiVersion, metadata, status,
message, reason, details, code``; empty ``details`` members left out), because clients compare these bodies as
text (the kubernetes client's ``FailToCreateError`` does).
"""

from __future__ import annotations

from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.schema import Problem

JSON = dict[str, Any]


class ApiError(Exception):
    """An error the API answers with a ``Status`` object. ``continue_token`` is the ``metadata.continue`` of a
    410 on a paged list that may go on inconsistently."""

    def __init__(self, code: int, reason: str, message: str, details: JSON | None = None,
                 continue_token: str = "") -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}
        self.continue_token = continue_token

    def status(self) -> JSON:
        meta: JSON = {"continue": self.continue_token} if self.continue_token else {}
        out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": meta, "status": "Failure",
                     "message": self.message, "reason": self.reason}
        details = {k: self.details[k] for k in ("name", "group", "kind", "uid", "causes", "retryAfterSeconds")
                   if self.details.get(k)}
        if details:
            out["details"] = details
        out["code"] = self.code
        return out


def qualified(info: ResourceInfo) -> str:
    """``plural.group`` (``plural`` for the core group), as the API names a resource in messages."""
    return f"{info.plural}.{info.group}" if info.group else info.plural


def not_found(info: ResourceInfo, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(info)} "{name}" not found',
                    {"name": name, "group": info.group, "kind": info.plural})


def already_exists(info: ResourceInfo, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{qualified(info)} "{name}" already exists',
                    {"name": name, "group": info.group, "kind": info.plural})


def conflict(info: ResourceInfo, name: str, why: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified(info)} "{name}": {why}',
                    {"name": name, "group": info.group, "kind": info.plural})


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(info: ResourceInfo, name: str, problems: list[Problem]) -> ApiError:
    """422 Invalid: ``<Kind>[.group] "<name>" is invalid: <field>: <message>`` (a bracketed list for several)."""
    kind_group = f"{info.kind}.{info.group}" if info.group else info.kind
    rendered = [p.render() for p in problems]
    text = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    return ApiError(422, "Invalid", f'{kind_group} "{name}" is invalid: {text}',
                    {"name": name, "group": info.group, "kind": info.kind,
                     "causes": [{"reason": p.reason, "message": p.message, "field": p.field} for p in problems]})


def forbidden(group: str, resource: str, name: str, why: str) -> ApiError:
    """403 Forbidden as ``NewForbidden`` builds it: ``<resource>[.group] ["<name>"] is forbidden: <why>``."""
    qualified_resource = f"{resource}.{group}" if group else resource
    if not resource:
        message = f"forbidden: {why}"
    elif name:
        message = f'{qualified_resource} "{name}" is forbidden: {why}'
    else:
        message = f"{qualified_resource} is forbidden: {why}"
    return ApiError(403, "Forbidden", message, {"name": name, "group": group, "kind": resource})


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def expired(message: str, continue_token: str = "") -> ApiError:
    return ApiError(410, "Expired", message, continue_token=continue_token)
