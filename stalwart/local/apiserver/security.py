"""The API server's gate: authentication (:mod:`.authentication`), RBAC authorization over the stored RBAC
objects (:mod:`.authorization`), and a record of every authorization decision per user (verb, API group,
resource, subresource, namespace, allowed) that the admin can read at ``/stalwart/access``: tests compare what
a component was actually asked to be allowed with the permissions it declares.

The default RBAC objects of a real cluster are stored at start (:func:`bootstrap_objects`): ``cluster-admin``
for ``system:masters``, discovery and the public info endpoints for everyone authenticated, the health and
version endpoints for anyone, and the self reviews (``kubectl auth can-i``, ``kubectl auth whoami``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from stalwart.local.apiserver.authentication import Authenticator
from stalwart.local.apiserver.authorization import (
    AUTHENTICATED,
    RBAC_GROUP,
    SUPERUSERS,
    UNAUTHENTICATED,
    Attributes,
    UserInfo,
    authorize,
)
from stalwart.local.apiserver.errors import forbidden
from stalwart.local.apiserver.objects import ObjectStore
from stalwart.local.apiserver.requestinfo import RequestInfo
from stalwart.local.apiserver.storage import Event

JSON = dict[str, Any]
_CACHE_LIMIT = 10_000
#: One recorded decision: user, verb, group, resource, subresource, namespace, allowed.
Access = tuple[str, str, str, str, str, str, bool]


def _cluster_role(name: str, rules: list[JSON]) -> JSON:
    return {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "ClusterRole",
            "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}},
            "rules": rules}


def _binding(name: str, role: str, groups: list[str]) -> JSON:
    return {"apiVersion": f"{RBAC_GROUP}/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"},
                         "annotations": {"rbac.authorization.kubernetes.io/autoupdate": "true"}},
            "roleRef": {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": role},
            "subjects": [{"apiGroup": RBAC_GROUP, "kind": "Group", "name": g} for g in groups]}


def bootstrap_objects() -> list[tuple[str, JSON]]:
    """The default ClusterRoles and ClusterRoleBindings of a real cluster that requests rely on."""
    public = ["/healthz", "/livez", "/readyz", "/version", "/version/"]
    return [
        ("clusterroles", _cluster_role("cluster-admin", [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, {"nonResourceURLs": ["*"], "verbs": ["*"]}])),
        ("clusterroles", _cluster_role("system:discovery", [{"nonResourceURLs": [
            "/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*", "/readyz",
            "/version", "/version/"], "verbs": ["get"]}])),
        ("clusterroles", _cluster_role("system:public-info-viewer", [{"nonResourceURLs": public, "verbs": ["get"]}])),
        ("clusterroles", _cluster_role("system:basic-user", [
            {"apiGroups": ["authorization.k8s.io"], "resources": ["selfsubjectaccessreviews",
                                                                  "selfsubjectrulesreviews"], "verbs": ["create"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]}])),
        ("clusterrolebindings", _binding("cluster-admin", "cluster-admin", [SUPERUSERS])),
        ("clusterrolebindings", _binding("system:discovery", "system:discovery", [AUTHENTICATED])),
        ("clusterrolebindings", _binding("system:public-info-viewer", "system:public-info-viewer",
                                         [AUTHENTICATED, UNAUTHENTICATED])),
        ("clusterrolebindings", _binding("system:basic-user", "system:basic-user", [AUTHENTICATED])),
    ]


def attributes(user: UserInfo, info: RequestInfo) -> Attributes:
    if not info.resource_request:
        return Attributes(user, info.verb, resource_request=False, path=info.path)
    return Attributes(user, info.verb, group=info.group, version=info.version, resource=info.resource,
                      subresource=info.subresource, namespace=info.namespace, name=info.authz_name)


class Security:
    """Authenticates, authorizes and records (see the module docstring)."""

    def __init__(self, store: ObjectStore, authenticator: Authenticator) -> None:
        self.store = store
        self.authenticator = authenticator
        self.access: Counter[Access] = Counter()
        self._cache: dict[Attributes, tuple[bool, str]] = {}
        store.listeners.append(self._on_event)
        for plural, obj in bootstrap_objects():
            self.store.create(store.info(RBAC_GROUP, "v1", plural), "", obj)

    def _on_event(self, ev: Event) -> None:
        if ev.group == RBAC_GROUP:
            self._cache.clear()

    def _objects(self, plural: str) -> Iterable[JSON]:
        return self.store.storage.of_resource(RBAC_GROUP, plural).values()

    def decide(self, attrs: Attributes) -> tuple[bool, str]:
        """(allowed, reason), recorded in :attr:`access`."""
        decision = self._cache.get(attrs)
        if decision is None:
            if len(self._cache) > _CACHE_LIMIT:
                self._cache.clear()
            decision = self._cache[attrs] = authorize(self._objects, attrs)
        self.access[(attrs.user.name, attrs.verb, attrs.group, attrs.resource, attrs.subresource, attrs.namespace,
                     decision[0])] += 1
        return decision

    def allowed(self, attrs: Attributes) -> bool:
        return self.decide(attrs)[0]

    def check(self, authorization: str | None, info: RequestInfo) -> UserInfo:
        """The user of a request, or the 401/403 to answer."""
        user = self.authenticator.authenticate(authorization)
        attrs = attributes(user, info)
        if not self.allowed(attrs):
            if not info.resource_request:
                raise forbidden("", "", "", attrs.denial())
            raise forbidden(info.group, info.resource, info.authz_name, attrs.denial())
        return user

    def access_records(self, user: str | None = None) -> list[JSON]:
        return [{"user": u, "verb": v, "group": g, "resource": r, "subresource": s, "namespace": ns,
                 "allowed": ok, "count": n}
                for (u, v, g, r, s, ns, ok), n in sorted(self.access.items(), key=lambda kv: str(kv[0]))
                if user is None or u == user]


def new_security(store: ObjectStore) -> Security:
    """The gate of a fresh API server: a new admin token and signing key, tokens checked against ``store``."""
    def uid_of(plural: str, namespace: str, name: str) -> str | None:
        obj = store.objects.get(("", plural, namespace, name))
        return None if obj is None else str(obj["metadata"].get("uid"))

    return Security(store, Authenticator(uid_of))
