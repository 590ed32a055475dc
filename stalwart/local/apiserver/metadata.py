"""The object metadata rules every kind shares, worded as kube-apiserver words them: names (RFC 1123 subdomains
and labels, RFC 1035 labels for Services, path segments for RBAC objects), label keys and values, annotation
keys and their total size (256 KiB), finalizer names and owner references."""

from __future__ import annotations

import re
from typing import Any

from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.schema import Problem

JSON = dict[str, Any]
ANNOTATIONS_LIMIT = 256 * 1024

_LABEL_RE = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN_RE = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS1035_RE = "[a-z]([-a-z0-9]*[a-z0-9])?"
_NAME_PART_RE = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_VALUE_RE = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"

SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                 "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                 f"is '{_SUBDOMAIN_RE}')")
LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
             f"and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
             f"'{_LABEL_RE}')")
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
               f"validation is '{_DNS1035_RE}')")
NAME_PART_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                 "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                 f"'{_NAME_PART_RE}')")
VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
             "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
             f"for validation is '{_VALUE_RE}')")
_STANDARD_FINALIZERS = {"kubernetes", "orphan", "foregroundDeletion"}
#: Kinds whose names are RFC 1123 labels, RFC 1035 labels, or path segments rather than subdomains.
_LABEL_NAMED = {("", "namespaces")}
_DNS1035_NAMED = {("", "services")}
_PATH_SEGMENT_GROUPS = {"rbac.authorization.k8s.io", "authorization.k8s.io", "authentication.k8s.io"}


def _q(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check(value: str, limit: int, regex: str, message: str) -> list[str]:
    out = [f"must be no more than {limit} characters"] if len(value) > limit else []
    return out + ([message] if not re.fullmatch(regex, value) else [])


def is_subdomain(value: str) -> list[str]:
    return _check(value, 253, _SUBDOMAIN_RE, SUBDOMAIN_MSG)


def is_dns_label(value: str) -> list[str]:
    return _check(value, 63, _LABEL_RE, LABEL_MSG)


def is_qualified_name(value: str) -> list[str]:
    """A label or annotation key: ``[prefix/]name``."""
    prefix, slash, name = value.rpartition("/")
    out = []
    if slash and not prefix:
        out.append("prefix part must be non-empty")
    elif slash:
        out += [f"prefix part {m}" for m in is_subdomain(prefix)]
    if not name:
        out.append("name part must be non-empty")
    elif len(name) > 63:
        out.append("name part must be no more than 63 characters")
    if name and not re.fullmatch(_NAME_PART_RE, name):
        out.append(NAME_PART_MSG)
    return out


def is_label_value(value: str) -> list[str]:
    return _check(value, 63, _VALUE_RE, VALUE_MSG)


def name_problems(info: ResourceInfo, name: str, field: str = "metadata.name") -> list[Problem]:
    kind = (info.group, info.plural)
    if info.group in _PATH_SEGMENT_GROUPS:
        why = [f"may not contain '{c}'" for c in "/%" if c in name]
        why += [f"may not be '{name}'"] if name in (".", "..") else []
    elif kind in _DNS1035_NAMED:
        why = _check(name, 63, _DNS1035_RE, DNS1035_MSG)
    elif kind in _LABEL_NAMED:
        why = is_dns_label(name)
    else:
        why = is_subdomain(name)
    return [Problem(field, "FieldValueInvalid", f"Invalid value: {_q(name)}: {w}") for w in why]


def labels_problems(labels: Any, field: str = "metadata.labels") -> list[Problem]:
    out = []
    for key, value in (labels or {}).items():
        out += [Problem(field, "FieldValueInvalid", f"Invalid value: {_q(key)}: {m}") for m in is_qualified_name(key)]
        out += [Problem(field, "FieldValueInvalid", f"Invalid value: {_q(str(value))}: {m}")
                for m in is_label_value(str(value))]
    return out


def annotations_problems(annotations: Any, field: str = "metadata.annotations") -> list[Problem]:
    out = []
    total = 0
    for key, value in (annotations or {}).items():
        out += [Problem(field, "FieldValueInvalid", f"Invalid value: {_q(key)}: {m}")
                for m in is_qualified_name(key.lower())]
        total += len(key) + len(str(value))
    if total > ANNOTATIONS_LIMIT:
        out.append(Problem(field, "FieldValueTooLong", f"Too long: may not be more than {ANNOTATIONS_LIMIT} bytes"))
    return out


def finalizer_problems(finalizers: Any) -> list[Problem]:
    out = []
    for i, name in enumerate(finalizers or []):
        field = f"metadata.finalizers[{i}]"
        why = is_qualified_name(str(name))
        if not why and "/" not in str(name) and name not in _STANDARD_FINALIZERS:
            why = ["name is neither a standard finalizer name nor is it fully qualified"]
        out += [Problem(field, "FieldValueInvalid", f"Invalid value: {_q(str(name))}: {m}") for m in why]
    return out


def owner_problems(refs: Any) -> list[Problem]:
    out = []
    for ref in refs or []:
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                out.append(Problem(f"metadata.ownerReferences.{key}", "FieldValueInvalid",
                                   f'Invalid value: "": {key} must not be empty'))
    if sum(1 for r in refs or [] if r.get("controller")) > 1:
        out.append(Problem("metadata.ownerReferences", "FieldValueInvalid",
                           "Invalid value: only one reference can have Controller set to true"))
    return out


def metadata_problems(info: ResourceInfo, obj: JSON) -> list[Problem]:
    """Every metadata rule ``obj`` breaks."""
    meta = obj.get("metadata") or {}
    out = name_problems(info, str(meta.get("name", "")))
    out += labels_problems(meta.get("labels"))
    out += annotations_problems(meta.get("annotations"))
    out += finalizer_problems(meta.get("finalizers"))
    out += owner_problems(meta.get("ownerReferences"))
    return out
