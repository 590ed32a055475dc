"""RBAC authorization as kube-apiserver evaluates it: who asks (:class:`UserInfo`), what for (:class:`Attributes`,
the request attributes of the API server's request-info resolver) and whether the Roles, ClusterRoles and their
bindings allow it. The evaluation is a pure function of the RBAC objects (:func:`authorize`); the members of
``system:masters`` are allowed everything before RBAC is asked, as on a real cluster.

Rules match by verb (``*`` for all), API group, resource (``*``, ``resource/subresource``, ``*/subresource``),
``resourceNames`` (a named request only) and, for requests outside the API, ``nonResourceURLs`` (a trailing
``*`` matches a prefix). A RoleBinding grants its Role or ClusterRole in its own namespace; a ClusterRoleBinding
grants a ClusterRole everywhere. ClusterRoles with an ``aggregationRule`` hold the rules of the ClusterRoles its
selectors match. A ServiceAccount is the user ``system:serviceaccount:<namespace>:<name>`` in the groups
``system:serviceaccounts`` and ``system:serviceaccounts:<namespace>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from stalwart.local.apiserver.selectors import SelectorError, labels_match, selector_from_label_selector_object

JSON = dict[str, Any]
RBAC_GROUP = "rbac.authorization.k8s.io"
SUPERUSERS = "system:masters"
AUTHENTICATED = "system:authenticated"
UNAUTHENTICATED = "system:unauthenticated"


@dataclass(frozen=True)
class UserInfo:
    name: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def as_json(self) -> JSON:
        out: JSON = {"username": self.name, "groups": list(self.groups)}
        if self.uid:
            out["uid"] = self.uid
        if self.extra:
            out["extra"] = {k: list(v) for k, v in self.extra}
        return out


ANONYMOUS = UserInfo("system:anonymous", groups=(UNAUTHENTICATED,))


def service_account_user(namespace: str, name: str, uid: str = "") -> UserInfo:
    return UserInfo(f"system:serviceaccount:{namespace}:{name}", uid,
                    ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED))


@dataclass(frozen=True)
class Attributes:
    """One authorization question. ``resource_request`` False: ``path`` under a non-resource URL."""
    user: UserInfo
    verb: str
    resource_request: bool = True
    group: str = ""
    version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    path: str = ""

    def denial(self) -> str:
        """The reason part of the 403 message (``forbiddenMessage`` of the API server)."""
        if not self.resource_request:
            return f'User "{self.user.name}" cannot {self.verb} path "{self.path}"'
        resource = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        where = f'in the namespace "{self.namespace}"' if self.namespace else "at the cluster scope"
        return (f'User "{self.user.name}" cannot {self.verb} resource "{resource}" in API group "{self.group}" '
                f"{where}")


# --- rules ---------------------------------------------------------------------------------------------------------

def _verb_matches(rule: JSON, verb: str) -> bool:
    verbs = rule.get("verbs") or []
    return "*" in verbs or verb in verbs


def _resource_matches(rule: JSON, resource: str, subresource: str) -> bool:
    combined = f"{resource}/{subresource}" if subresource else resource
    return any(r in ("*", combined) or (subresource and r == f"*/{subresource}") for r in rule.get("resources") or [])


def _url_matches(rule: JSON, path: str) -> bool:
    return any(url in ("*", path) or (url.endswith("*") and path.startswith(url[:-1]))
               for url in rule.get("nonResourceURLs") or [])


def rule_allows(rule: JSON, attrs: Attributes) -> bool:
    """Whether one PolicyRule allows ``attrs``."""
    if not _verb_matches(rule, attrs.verb):
        return False
    if not attrs.resource_request:
        return _url_matches(rule, attrs.path)
    groups = rule.get("apiGroups") or []
    if "*" not in groups and attrs.group not in groups:
        return False
    if not _resource_matches(rule, attrs.resource, attrs.subresource):
        return False
    names = rule.get("resourceNames") or []
    return not names or (bool(attrs.name) and attrs.name in names)


def subject_matches(subject: JSON, user: UserInfo, binding_namespace: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == user.name)
    if kind == "Group":
        return name in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{ns}:{name}"
    return False


# --- the authorizer ------------------------------------------------------------------------------------------------

#: Reads the stored RBAC objects: plural ("roles", "rolebindings", ...) -> every object of it.
RbacObjects = Callable[[str], Iterable[JSON]]


def _cluster_role_rules(objects: RbacObjects, name: str) -> list[JSON]:
    roles = {r["metadata"]["name"]: r for r in objects("clusterroles")}
    role = roles.get(name)
    if role is None:
        return []
    rules = list(role.get("rules") or [])
    for sel in (role.get("aggregationRule") or {}).get("clusterRoleSelectors") or []:
        try:
            reqs = selector_from_label_selector_object(sel)
        except SelectorError:
            continue
        for other in roles.values():
            if other is not role and labels_match(reqs, other["metadata"].get("labels")):
                rules += other.get("rules") or []
    return rules


def _role_rules(objects: RbacObjects, ref: JSON, namespace: str) -> list[JSON]:
    if ref.get("kind") == "ClusterRole":
        return _cluster_role_rules(objects, str(ref.get("name")))
    for role in objects("roles"):
        meta = role["metadata"]
        if meta.get("namespace") == namespace and meta["name"] == ref.get("name"):
            return list(role.get("rules") or [])
    return []


def authorize(objects: RbacObjects, attrs: Attributes) -> tuple[bool, str]:
    """(allowed, reason): the reason names the binding and role that allowed it."""
    if SUPERUSERS in attrs.user.groups:
        return True, f'allowed: "{attrs.user.name}" is in the group "{SUPERUSERS}"'
    for binding in objects("clusterrolebindings"):
        if not any(subject_matches(s, attrs.user, "") for s in binding.get("subjects") or []):
            continue
        ref = binding.get("roleRef") or {}
        if ref.get("kind") != "ClusterRole":
            continue
        if any(rule_allows(r, attrs) for r in _cluster_role_rules(objects, str(ref.get("name")))):
            return True, (f'RBAC: allowed by ClusterRoleBinding "{binding["metadata"]["name"]}" of ClusterRole '
                          f'"{ref.get("name")}" to {attrs.user.name}')
    if attrs.namespace:
        for binding in objects("rolebindings"):
            meta = binding["metadata"]
            if meta.get("namespace") != attrs.namespace:
                continue
            if not any(subject_matches(s, attrs.user, attrs.namespace) for s in binding.get("subjects") or []):
                continue
            ref = binding.get("roleRef") or {}
            if any(rule_allows(r, attrs) for r in _role_rules(objects, ref, attrs.namespace)):
                return True, (f'RBAC: allowed by RoleBinding "{meta["name"]}/{attrs.namespace}" of '
                              f'{ref.get("kind")} "{ref.get("name")}" to {attrs.user.name}')
    return False, ""


def rules_for(objects: RbacObjects, user: UserInfo, namespace: str) -> list[JSON]:
    """Every rule that applies to ``user`` in ``namespace`` (for SelfSubjectRulesReview)."""
    if SUPERUSERS in user.groups:
        return [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}, {"verbs": ["*"], "nonResourceURLs": ["*"]}]
    rules: list[JSON] = []
    for binding in objects("clusterrolebindings"):
        ref = binding.get("roleRef") or {}
        if ref.get("kind") == "ClusterRole" and any(subject_matches(s, user, "") for s in binding.get("subjects")
                                                    or []):
            rules += _cluster_role_rules(objects, str(ref.get("name")))
    for binding in objects("rolebindings"):
        if binding["metadata"].get("namespace") != namespace:
            continue
        if any(subject_matches(s, user, namespace) for s in binding.get("subjects") or []):
            rules += _role_rules(objects, binding.get("roleRef") or {}, namespace)
    return rules
