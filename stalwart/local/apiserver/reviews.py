"""The API's create-only review resources and the TokenRequest subresource, answered from the authenticator and
the authorizer: ``serviceaccounts/<name>/token`` (``kubectl create token``), TokenReview and SelfSubjectReview
(``kubectl auth whoami``), SubjectAccessReview, LocalSubjectAccessReview, SelfSubjectAccessReview
(``kubectl auth can-i``) and SelfSubjectRulesReview (``kubectl auth can-i --list``)."""

from __future__ import annotations

import datetime
from typing import Any

from stalwart.local.apiserver.authentication import (
    ISSUER,
    MAX_EXPIRATION,
    MIN_EXPIRATION,
    Authenticator,
)
from stalwart.local.apiserver.authorization import Attributes, UserInfo, rules_for
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError, bad_request, invalid
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.apiserver.schema import Problem
from stalwart.local.apiserver.security import Security

JSON = dict[str, Any]
REVIEWS = {("authentication.k8s.io", "tokenreviews"), ("authentication.k8s.io", "selfsubjectreviews"),
           ("authorization.k8s.io", "subjectaccessreviews"), ("authorization.k8s.io", "localsubjectaccessreviews"),
           ("authorization.k8s.io", "selfsubjectaccessreviews"), ("authorization.k8s.io", "selfsubjectrulesreviews")}

_TOKEN_REQUEST = ResourceInfo("authentication.k8s.io", "v1", "tokenrequests", "tokenrequest", "TokenRequest", True)


def _answer(info: ResourceInfo, body: JSON, status: JSON) -> JSON:
    return {"kind": info.kind, "apiVersion": info.api_version, "metadata": body.get("metadata") or {},
            "spec": body.get("spec") or {}, "status": status}


def token_request(store: ObjectStore, authenticator: Authenticator, namespace: str, name: str, body: JSON) -> JSON:
    """POST serviceaccounts/<name>/token: a TokenRequest with ``status.token`` and its expiry."""
    sa = store.get(store.info("", "v1", "serviceaccounts"), namespace, name)
    spec = dict(body.get("spec") or {})
    seconds = int(spec.get("expirationSeconds") or 3600)
    if seconds < MIN_EXPIRATION or seconds > MAX_EXPIRATION:
        why = "less than 10 minutes" if seconds < MIN_EXPIRATION else "larger than 2^32 seconds"
        raise invalid(_TOKEN_REQUEST, name, [Problem("spec.expirationSeconds", "FieldValueInvalid",
                                                     f"Invalid value: {seconds}: may not specify a duration {why}")])
    pod = None
    ref = spec.get("boundObjectRef") or {}
    if ref:
        if ref.get("kind") != "Pod":
            raise bad_request(f"cannot bind token to object of kind {ref.get('kind')!r}: only Pod is supported here")
        bound = store.get(store.info("", "v1", "pods"), namespace, str(ref.get("name")))
        if ref.get("uid") and ref["uid"] != bound["metadata"]["uid"]:
            raise ApiError(409, "Conflict", f"the UID in the bound object reference ({ref['uid']}) does not match "
                                            f"the UID in record. The object might have been deleted and then "
                                            f"recreated")
        pod = (bound["metadata"]["name"], bound["metadata"]["uid"])
        spec["boundObjectRef"] = {**ref, "uid": bound["metadata"]["uid"]}
    audiences = list(spec.get("audiences") or [ISSUER])
    issued = authenticator.issue(namespace, name, sa["metadata"]["uid"], audiences=audiences,
                                 expiration_seconds=seconds, pod=pod)
    spec.update({"audiences": audiences, "expirationSeconds": seconds})
    expires = datetime.datetime.fromtimestamp(issued.expires, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec,
            "status": {"token": issued.token, "expirationTimestamp": expires}}


def _attributes(user: UserInfo, spec: JSON, namespace: str | None = None) -> Attributes:
    res, non = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
    if res:
        return Attributes(user, str(res.get("verb", "")), group=str(res.get("group", "")),
                          version=str(res.get("version", "")), resource=str(res.get("resource", "")),
                          subresource=str(res.get("subresource", "")),
                          namespace=namespace if namespace is not None else str(res.get("namespace", "")),
                          name=str(res.get("name", "")))
    if non:
        return Attributes(user, str(non.get("verb", "")), resource_request=False, path=str(non.get("path", "")))
    raise bad_request("spec: exactly one of nonResourceAttributes or resourceAttributes must be specified")


def review(info: ResourceInfo, security: Security, user: UserInfo, namespace: str, body: JSON) -> JSON:
    """Answer a POST of one of the :data:`REVIEWS` by ``user``."""
    spec = body.get("spec") or {}
    plural = info.plural
    if plural == "tokenreviews":
        found = security.authenticator.verify(str(spec.get("token", "")), spec.get("audiences"))
        status: JSON = {"authenticated": True, "user": found.as_json(),
                        "audiences": spec.get("audiences") or [ISSUER]} if found else {"authenticated": False}
        return _answer(info, body, status)
    if plural == "selfsubjectreviews":
        return _answer(info, body, {"userInfo": user.as_json()})
    if plural == "selfsubjectrulesreviews":
        ns = str(spec.get("namespace") or "")
        rules = rules_for(lambda p: security.store.storage.of_resource("rbac.authorization.k8s.io", p).values(),
                          user, ns)
        return _answer(info, body, {
            "resourceRules": [{k: r[k] for k in ("verbs", "apiGroups", "resources", "resourceNames") if k in r}
                              for r in rules if "nonResourceURLs" not in r],
            "nonResourceRules": [{k: r[k] for k in ("verbs", "nonResourceURLs")} for r in rules
                                 if "nonResourceURLs" in r],
            "incomplete": False})
    if plural == "selfsubjectaccessreviews":
        subject = user
    else:
        subject = UserInfo(str(spec.get("user", "")), str(spec.get("uid", "")), tuple(spec.get("groups") or ()))
    attrs = _attributes(subject, spec, namespace if plural == "localsubjectaccessreviews" else None)
    allowed, reason = security.decide(attrs)
    status = {"allowed": allowed}
    if reason:
        status["reason"] = reason
    return _answer(info, body, status)
