"""Decoding of the Kubernetes protobuf request bodies that typed Go clients send, for the kinds they write here.

Helm's release storage writes Secrets (or ConfigMaps) through client-go's typed client, which encodes request
bodies as ``application/vnd.kubernetes.protobuf`` whatever the server answers in; so the emulator reads the
``k8s\\0`` envelope (``runtime.Unknown``) and the messages of Secret, ConfigMap, ObjectMeta,
OwnerReference, DeleteOptions, the metadata of Namespace and ServiceAccount (``kubectl create
namespace``), TokenRequest (``kubectl create token``) and the self reviews (``kubectl auth whoami`` and
``can-i``) into JSON. Other kinds are answered with 415 Unsupported Media Type. Responses are
always JSON, which these clients accept.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

JSON = dict[str, Any]
MAGIC = b"k8s\x00"
CONTENT_TYPE = "application/vnd.kubernetes.protobuf"


class ProtobufError(ValueError):
    """A body that is not a protobuf message of a kind decoded here."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ProtobufError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtobufError("varint too long")


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message: ints for varint/fixed fields, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield num, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > len(buf):
                raise ProtobufError("truncated length-delimited field")
            yield num, buf[pos:pos + length]
            pos += length
        elif wire == 1:
            yield num, int.from_bytes(buf[pos:pos + 8], "little")
            pos += 8
        elif wire == 5:
            yield num, int.from_bytes(buf[pos:pos + 4], "little")
            pos += 4
        else:
            raise ProtobufError(f"unsupported wire type {wire}")


def _s(v: int | bytes) -> str:
    if not isinstance(v, bytes):
        raise ProtobufError("expected a string field")
    return v.decode("utf-8")


def _b(v: int | bytes) -> bytes:
    if not isinstance(v, bytes):
        raise ProtobufError("expected a bytes field")
    return v


def _map_entry(v: int | bytes) -> tuple[str, bytes]:
    key, value = "", b""
    for n, x in fields(_b(v)):
        if n == 1:
            key = _s(x)
        elif n == 2:
            value = _b(x)
    return key, value


def _owner_ref(buf: bytes) -> JSON:
    out: JSON = {}
    names = {1: "kind", 3: "name", 4: "uid", 5: "apiVersion"}
    for n, v in fields(buf):
        if n in names:
            out[names[n]] = _s(v)
        elif n == 6:
            out["controller"] = bool(v)
        elif n == 7:
            out["blockOwnerDeletion"] = bool(v)
    return out


def object_meta(buf: bytes) -> JSON:
    out: JSON = {}
    strings = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    for n, v in fields(buf):
        if n in strings and _s(v):
            out[strings[n]] = _s(v)
        elif n == 7:
            out["generation"] = v
        elif n in (11, 12):
            k, val = _map_entry(v)
            out.setdefault("labels" if n == 11 else "annotations", {})[k] = val.decode("utf-8")
        elif n == 13:
            out.setdefault("ownerReferences", []).append(_owner_ref(_b(v)))
        elif n == 14:
            out.setdefault("finalizers", []).append(_s(v))
    return out


def _secret(buf: bytes) -> JSON:
    out: JSON = {"apiVersion": "v1", "kind": "Secret"}
    for n, v in fields(buf):
        if n == 1:
            out["metadata"] = object_meta(_b(v))
        elif n == 2:
            k, val = _map_entry(v)
            out.setdefault("data", {})[k] = base64.b64encode(val).decode()
        elif n == 3:
            out["type"] = _s(v)
        elif n == 4:
            k, val = _map_entry(v)
            out.setdefault("stringData", {})[k] = val.decode("utf-8")
        elif n == 5:
            out["immutable"] = bool(v)
    return out


def _configmap(buf: bytes) -> JSON:
    out: JSON = {"apiVersion": "v1", "kind": "ConfigMap"}
    for n, v in fields(buf):
        if n == 1:
            out["metadata"] = object_meta(_b(v))
        elif n == 2:
            k, val = _map_entry(v)
            out.setdefault("data", {})[k] = val.decode("utf-8")
        elif n == 3:
            out["immutable"] = bool(v)
        elif n == 4:
            k, val = _map_entry(v)
            out.setdefault("binaryData", {})[k] = base64.b64encode(val).decode()
    return out


def _delete_options(buf: bytes) -> JSON:
    out: JSON = {"kind": "DeleteOptions", "apiVersion": "v1"}
    for n, v in fields(buf):
        if n == 1:
            if isinstance(v, int):  # int64 as a varint: two's complement
                out["gracePeriodSeconds"] = v if v < 2 ** 63 else v - 2 ** 64
        elif n == 2:
            pre: JSON = {}
            for m, x in fields(_b(v)):
                pre["uid" if m == 1 else "resourceVersion"] = _s(x)
            out["preconditions"] = pre
        elif n == 3:
            out["orphanDependents"] = bool(v)
        elif n == 4:
            out["propagationPolicy"] = _s(v)
        elif n == 5:
            out.setdefault("dryRun", []).append(_s(v))
    return out


def _meta_only(kind: str) -> Callable[[bytes], JSON]:
    """Kinds whose other fields are defaulted by the server when created imperatively (Namespace,
    ServiceAccount): metadata is what ``kubectl create`` sets."""

    def decode(buf: bytes) -> JSON:
        out: JSON = {"apiVersion": "v1", "kind": kind}
        for n, v in fields(buf):
            if n == 1:
                out["metadata"] = object_meta(_b(v))
        return out

    return decode


def _strings(buf: bytes, names: dict[int, str]) -> JSON:
    """The string fields ``names`` of a message; empty ones are left out, as JSON omits them."""
    return {names[n]: _s(v) for n, v in fields(buf) if n in names and _s(v)}


def _spec_fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """The fields of a message's ``spec`` (field 2, after ``metadata``)."""
    for n, v in fields(buf):
        if n == 2:
            yield from fields(_b(v))


def _token_request(buf: bytes) -> JSON:
    spec: JSON = {}
    for m, x in _spec_fields(buf):
        if m == 1:
            spec.setdefault("audiences", []).append(_s(x))
        elif m == 3:
            spec["boundObjectRef"] = _strings(_b(x), {1: "kind", 2: "apiVersion", 3: "name", 4: "uid"})
        elif m == 4 and isinstance(x, int):
            spec["expirationSeconds"] = x
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}


def _access_review(buf: bytes) -> JSON:
    spec: JSON = {}
    for m, x in _spec_fields(buf):
        if m == 1:
            spec["resourceAttributes"] = _strings(_b(x), {1: "namespace", 2: "verb", 3: "group", 4: "version",
                                                          5: "resource", 6: "subresource", 7: "name"})
        elif m == 2:
            spec["nonResourceAttributes"] = _strings(_b(x), {1: "path", 2: "verb"})
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": spec}


def _rules_review(buf: bytes) -> JSON:
    spec: JSON = {}
    for m, x in _spec_fields(buf):
        if m == 1 and _s(x):
            spec["namespace"] = _s(x)
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview", "spec": spec}


def _policy_rule(buf: bytes) -> JSON:
    names = {1: "verbs", 2: "apiGroups", 3: "resources", 4: "resourceNames", 5: "nonResourceURLs"}
    out: JSON = {}
    for n, v in fields(buf):
        if n in names:
            out.setdefault(names[n], []).append(_s(v))
    return out


def _rbac(kind: str) -> Callable[[bytes], JSON]:
    """Role and ClusterRole (rules), RoleBinding and ClusterRoleBinding (subjects, roleRef):
    ``kubectl create role|clusterrole|rolebinding|clusterrolebinding``."""
    binding = kind.endswith("Binding")

    def decode(buf: bytes) -> JSON:
        out: JSON = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind}
        for n, v in fields(buf):
            if n == 1:
                out["metadata"] = object_meta(_b(v))
            elif n == 2 and binding:
                out.setdefault("subjects", []).append(
                    _strings(_b(v), {1: "kind", 2: "apiGroup", 3: "name", 4: "namespace"}))
            elif n == 2:
                out.setdefault("rules", []).append(_policy_rule(_b(v)))
            elif n == 3 and binding:
                out["roleRef"] = _strings(_b(v), {1: "apiGroup", 2: "kind", 3: "name"})
            elif n == 3:
                out["aggregationRule"] = {"clusterRoleSelectors": [
                    {"matchLabels": dict((k, val.decode()) for m, x in fields(_b(sel)) if m == 1
                                         for k, val in [_map_entry(x)])}
                    for m0, sel in fields(_b(v)) if m0 == 1]}
        return out

    return decode


_KINDS: dict[str, Callable[[bytes], JSON]] = {
    "Role": _rbac("Role"), "ClusterRole": _rbac("ClusterRole"), "RoleBinding": _rbac("RoleBinding"),
    "ClusterRoleBinding": _rbac("ClusterRoleBinding"),
    "Secret": _secret, "ConfigMap": _configmap, "DeleteOptions": _delete_options,
    "Namespace": _meta_only("Namespace"), "ServiceAccount": _meta_only("ServiceAccount"),
    # kubectl create token, kubectl auth whoami / can-i
    "TokenRequest": _token_request, "SelfSubjectAccessReview": _access_review,
    "SelfSubjectRulesReview": _rules_review,
    "SelfSubjectReview": lambda buf: {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
}


def decode(body: bytes) -> JSON:
    """The JSON form of a protobuf-encoded Kubernetes object; :class:`ProtobufError` if it is not one of the
    kinds decoded here."""
    if not body.startswith(MAGIC):
        raise ProtobufError("missing the k8s protobuf envelope")
    kind, raw = "", b""
    for n, v in fields(body[len(MAGIC):]):
        if n == 1:
            for m, x in fields(_b(v)):
                if m == 2:
                    kind = _s(x)
        elif n == 2:
            raw = _b(v)
    decoder = _KINDS.get(kind)
    if decoder is None:
        raise ProtobufError(f"protobuf bodies of kind {kind or '<none>'!r} are not supported here; send JSON")
    return decoder(raw)
