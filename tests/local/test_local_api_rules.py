"""Table tests of the API emulator's pure rules, each checked against what kube-apiserver does: request
attributes, RBAC rule matching and evaluation, the 403 wording, quantities, metadata rules, field ownership and
apply conflicts, CRD structural-schema and CEL compile checks, continue tokens."""

from __future__ import annotations

from typing import Any

import pytest

from stalwart.local.apiserver import crds, fieldmanager, metadata
from stalwart.local.apiserver import podspec as pod_rules
from stalwart.local.apiserver.authentication import Authenticator
from stalwart.local.apiserver.authorization import (
    ANONYMOUS,
    Attributes,
    UserInfo,
    authorize,
    rule_allows,
    service_account_user,
)
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.errors import ApiError, forbidden
from stalwart.local.apiserver.requestinfo import request_info
from stalwart.local.apiserver.storage import decode_continue, encode_continue

JSON = dict[str, Any]
BOB = service_account_user("team", "bob", "uid-bob")


# --- request attributes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "query", "expected"), [
    ("GET", "/api/v1/namespaces/ns/pods", {}, ("list", "", "ns", "pods", "", "")),
    ("GET", "/api/v1/namespaces/ns/pods", {"watch": "true"}, ("watch", "", "ns", "pods", "", "")),
    ("GET", "/api/v1/watch/namespaces/ns/pods", {}, ("watch", "", "ns", "pods", "", "")),
    ("GET", "/api/v1/namespaces/ns/pods/p", {}, ("get", "", "ns", "pods", "", "p")),
    ("GET", "/api/v1/namespaces/ns/pods/p/log", {}, ("get", "", "ns", "pods", "log", "p")),
    ("POST", "/api/v1/namespaces/ns/pods", {}, ("create", "", "ns", "pods", "", "")),
    ("DELETE", "/api/v1/namespaces/ns/pods", {}, ("deletecollection", "", "ns", "pods", "", "")),
    ("PATCH", "/apis/stalwart.dev/v1alpha1/namespaces/ns/trainingjobs/j/status", {},
     ("patch", "stalwart.dev", "ns", "trainingjobs", "status", "j")),
    ("PUT", "/apis/stalwart.dev/v1alpha1/namespaces/ns/trainingjobs/j/finalizers", {},
     ("update", "stalwart.dev", "ns", "trainingjobs", "finalizers", "j")),
    # A namespace's own namespace is itself; its status and finalize are subresources.
    ("GET", "/api/v1/namespaces/ns", {}, ("get", "", "ns", "namespaces", "", "ns")),
    ("PUT", "/api/v1/namespaces/ns/finalize", {}, ("update", "", "ns", "namespaces", "finalize", "ns")),
    ("GET", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", {},
     ("list", "apiextensions.k8s.io", "", "customresourcedefinitions", "", "")),
])
def test_request_attributes(method: str, path: str, query: dict[str, str], expected: tuple[str, ...]) -> None:
    info = request_info(method, path, query)
    assert info.resource_request
    assert (info.verb, info.group, info.namespace, info.resource, info.subresource, info.name) == expected


def test_a_list_by_name_is_authorized_for_that_name_and_other_paths_are_not_resources() -> None:
    info = request_info("GET", "/api/v1/namespaces/ns/secrets", {"fieldSelector": "metadata.name=creds"})
    assert (info.verb, info.name, info.authz_name) == ("list", "", "creds")
    for path in ("/healthz", "/version", "/stalwart/access"):
        assert not request_info("GET", path, {}).resource_request
    assert request_info("GET", "/apis", {}).discovery and request_info("GET", "/api/v1", {}).discovery
    assert request_info("GET", "/api/v1/namespaces/ns/pods/p/log/extra", {}).resource == ""


# --- RBAC ------------------------------------------------------------------------------------------------------

def pods(verb: str, **kw: Any) -> Attributes:
    return Attributes(BOB, verb, resource="pods", namespace="team", **kw)


@pytest.mark.parametrize(("rule", "attrs", "allowed"), [
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}, pods("list"), True),
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}, pods("delete"), False),
    ({"apiGroups": ["apps"], "resources": ["pods"], "verbs": ["*"]}, pods("get"), False),
    ({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, pods("delete"), True),
    # a subresource is its own resource: pods does not grant pods/log, */log does
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}, pods("get", subresource="log"), False),
    ({"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}, pods("get", subresource="log"), True),
    ({"apiGroups": [""], "resources": ["*/log"], "verbs": ["get"]}, pods("get", subresource="log"), True),
    # resourceNames restrict to named requests
    ({"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["get"]},
     pods("get", name="a"), True),
    ({"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["get"]},
     pods("get", name="b"), False),
    ({"apiGroups": [""], "resources": ["pods"], "resourceNames": ["a"], "verbs": ["list"]}, pods("list"), False),
    # non-resource URLs: exact or a prefix ending in *
    ({"nonResourceURLs": ["/healthz"], "verbs": ["get"]},
     Attributes(BOB, "get", resource_request=False, path="/healthz"), True),
    ({"nonResourceURLs": ["/apis/*"], "verbs": ["get"]},
     Attributes(BOB, "get", resource_request=False, path="/apis/apps/v1"), True),
    ({"nonResourceURLs": ["/apis/*"], "verbs": ["get"]},
     Attributes(BOB, "get", resource_request=False, path="/api"), False),
    ({"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
     Attributes(BOB, "get", resource_request=False, path="/healthz"), False),
])
def test_policy_rules(rule: JSON, attrs: Attributes, allowed: bool) -> None:
    assert rule_allows(rule, attrs) is allowed


def rbac(**objects: list[JSON]) -> Any:
    return lambda plural: objects.get(plural, [])


def role(name: str, rules: list[JSON], namespace: str = "team", labels: dict[str, str] | None = None) -> JSON:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "rules": rules}


def binding(name: str, kind: str, role_name: str, subjects: list[JSON], namespace: str = "team") -> JSON:
    return {"metadata": {"name": name, "namespace": namespace}, "roleRef": {"kind": kind, "name": role_name},
            "subjects": subjects}


READ_PODS = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]
SA_BOB = {"kind": "ServiceAccount", "name": "bob", "namespace": "team"}


def test_role_bindings_grant_only_in_their_namespace() -> None:
    objects = rbac(roles=[role("reader", READ_PODS)],
                   rolebindings=[binding("bob-reads", "Role", "reader", [SA_BOB])])
    allowed, reason = authorize(objects, pods("list"))
    assert allowed and reason == ('RBAC: allowed by RoleBinding "bob-reads/team" of Role "reader" to '
                                  "system:serviceaccount:team:bob")
    assert not authorize(objects, Attributes(BOB, "list", resource="pods", namespace="other"))[0]
    assert not authorize(objects, Attributes(BOB, "list", resource="pods"))[0]  # nor cluster-wide


def test_a_role_binding_may_name_a_cluster_role_and_groups_match() -> None:
    objects = rbac(clusterroles=[role("reader", READ_PODS, namespace="")],
                   rolebindings=[binding("all-sas", "ClusterRole", "reader",
                                         [{"kind": "Group", "name": "system:serviceaccounts:team"}])])
    assert authorize(objects, pods("get", name="x"))[0]
    assert not authorize(objects, Attributes(BOB, "get", resource="pods", namespace="other"))[0]
    someone = UserInfo("alice", groups=("system:authenticated",))
    assert not authorize(objects, Attributes(someone, "get", resource="pods", namespace="team"))[0]


def test_cluster_role_bindings_and_aggregation() -> None:
    objects = rbac(clusterroles=[
        role("aggregate", [], namespace="") | {"aggregationRule": {"clusterRoleSelectors": [
            {"matchLabels": {"rbac.example.dev/aggregate": "true"}}]}},
        role("part", READ_PODS, namespace="", labels={"rbac.example.dev/aggregate": "true"})],
        clusterrolebindings=[binding("bob", "ClusterRole", "aggregate", [SA_BOB], namespace="")])
    assert authorize(objects, Attributes(BOB, "list", resource="pods"))[0]  # every namespace
    assert not authorize(objects, Attributes(BOB, "delete", resource="pods", namespace="team"))[0]


def test_masters_need_no_rbac_and_nobody_else_gets_anything_by_default() -> None:
    admin = UserInfo("kubernetes-admin", groups=("system:masters",))
    assert authorize(rbac(), Attributes(admin, "delete", resource="nodes"))[0]
    assert not authorize(rbac(), Attributes(ANONYMOUS, "get", resource="pods", namespace="default"))[0]


@pytest.mark.parametrize(("attrs", "message"), [
    (pods("list"), 'pods is forbidden: User "system:serviceaccount:team:bob" cannot list resource "pods" in API '
                   'group "" in the namespace "team"'),
    (pods("create", subresource="eviction", name="p"),
     'pods "p" is forbidden: User "system:serviceaccount:team:bob" cannot create resource "pods/eviction" in API '
     'group "" in the namespace "team"'),
    (Attributes(BOB, "list", group="apiextensions.k8s.io", resource="customresourcedefinitions"),
     'customresourcedefinitions.apiextensions.k8s.io is forbidden: User "system:serviceaccount:team:bob" cannot '
     'list resource "customresourcedefinitions" in API group "apiextensions.k8s.io" at the cluster scope'),
    (Attributes(ANONYMOUS, "get", resource_request=False, path="/apis"),
     'forbidden: User "system:anonymous" cannot get path "/apis"'),
])
def test_forbidden_messages_are_worded_as_the_api_servers(attrs: Attributes, message: str) -> None:
    err = forbidden(attrs.group, attrs.resource, attrs.name, attrs.denial())
    assert err.message == message
    body = err.status()
    assert (body["code"], body["reason"], body["status"]) == (403, "Forbidden", "Failure")
    assert list(body) == ["kind", "apiVersion", "metadata", "status", "message", "reason", "details", "code"] or (
        not attrs.resource_request and "details" not in body)


# --- tokens ----------------------------------------------------------------------------------------------------

def test_service_account_tokens_expire_and_die_with_their_account() -> None:
    accounts = {("serviceaccounts", "team", "bob"): "uid-bob"}
    now = [1_000_000.0]
    auth = Authenticator(lambda plural, ns, name: accounts.get((plural, ns, name)), clock=lambda: now[0])
    issued = auth.issue("team", "bob", "uid-bob", expiration_seconds=600)
    user = auth.verify(issued.token)
    assert user is not None and user.name == "system:serviceaccount:team:bob" and user.uid == "uid-bob"
    assert "system:serviceaccounts:team" in user.groups
    assert auth.verify(issued.token[:-2] + "xx") is None  # a forged signature
    assert auth.verify(issued.token, audiences=["https://elsewhere"]) is None
    now[0] += 601
    assert auth.verify(issued.token) is None  # expired
    now[0] -= 601
    accounts[("serviceaccounts", "team", "bob")] = "uid-of-a-new-bob"
    assert auth.verify(issued.token) is None  # the account it was issued for is gone
    with pytest.raises(ApiError) as err:
        auth.authenticate("Bearer not-a-token")
    assert err.value.code == 401 and err.value.status()["message"] == "Unauthorized"
    assert auth.authenticate(None) == ANONYMOUS


# --- quantities and metadata -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "refused"), [
    ("500m", False), ("1Gi", False), ("1e3", False), (2, False), ("1x", True), ("1Gii", True), ("one", True)])
def test_quantities_that_do_not_parse_are_decoding_errors(value: Any, refused: bool) -> None:
    spec = {"containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": value}}}]}
    assert pod_rules.decode_problems(spec) == ([pod_rules.QUANTITY_DECODE_ERROR] if refused else [])


CMS = ResourceInfo("", "v1", "configmaps", "configmap", "ConfigMap", True)
SVCS = ResourceInfo("", "v1", "services", "service", "Service", True)


@pytest.mark.parametrize(("info", "name", "ok"), [
    (CMS, "a.b-c", True), (CMS, "Upper", False), (CMS, "-lead", False), (CMS, "x" * 254, False),
    (SVCS, "a.b", False), (SVCS, "1abc", False), (SVCS, "abc-1", True),
    (ResourceInfo("rbac.authorization.k8s.io", "v1", "roles", "role", "Role", True), "system:Odd_Name", True),
    (ResourceInfo("rbac.authorization.k8s.io", "v1", "roles", "role", "Role", True), "a/b", False),
])
def test_names(info: ResourceInfo, name: str, ok: bool) -> None:
    assert (metadata.name_problems(info, name) == []) is ok


def test_labels_annotations_and_finalizers() -> None:
    assert metadata.labels_problems({"app.kubernetes.io/name": "x", "a": ""}) == []
    bad_key, bad_value = metadata.labels_problems({"bad key": "ok", "ok": "bad value!"})
    assert bad_key.field == "metadata.labels" and bad_key.message.startswith('Invalid value: "bad key": name part')
    assert bad_value.message.startswith('Invalid value: "bad value!": a valid label must be an empty string')
    (too_long,) = metadata.annotations_problems({"a": "x" * (256 * 1024)})
    assert (too_long.reason, too_long.message) == ("FieldValueTooLong", "Too long: may not be more than 262144 bytes")
    assert metadata.annotations_problems({"a": "x" * (256 * 1024 - 1)}) == []
    assert [p.field for p in metadata.finalizer_problems(["kubernetes", "example.dev/x", "plain"])] == [
        "metadata.finalizers[2]"]


# --- field ownership -------------------------------------------------------------------------------------------

DEPLOY = ResourceInfo("apps", "v1", "deployments", "deployment", "Deployment", True, subresources={"status": "x"})


def deployment(replicas: int, image: str = "app:1") -> JSON:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "app", "image": image}]}}}}


def test_updates_take_ownership_and_applies_conflict_with_other_owners() -> None:
    live = deployment(1)
    fieldmanager.record_update(None, live, "kubectl-create", "", "2030-01-01T00:00:00Z")
    # the same values: shared ownership, no conflict
    shared = fieldmanager.apply(DEPLOY, live, deployment(1), "ci", False, "", "t")
    owners = {e["manager"]: e["operation"] for e in shared["metadata"]["managedFields"]}
    assert owners == {"kubectl-create": "Update", "ci": "Apply"}
    with pytest.raises(ApiError) as err:
        fieldmanager.apply(DEPLOY, live, deployment(3), "ci", False, "", "t")
    body = err.value.status()
    assert body["code"] == 409 and body["reason"] == "Conflict"
    assert body["message"] == ('Apply failed with 1 conflict: conflict with "kubectl-create" using apps/v1 at '
                               "2030-01-01T00:00:00Z: .spec.replicas")
    assert body["details"]["causes"] == [{"reason": "FieldManagerConflict", "field": ".spec.replicas",
                                          "message": 'conflict with "kubectl-create" using apps/v1 at '
                                                     "2030-01-01T00:00:00Z"}]
    forced = fieldmanager.apply(DEPLOY, live, deployment(3), "ci", True, "", "t")
    assert forced["spec"]["replicas"] == 3
    creator = next(e for e in forced["metadata"]["managedFields"] if e["manager"] == "kubectl-create")
    assert "f:replicas" not in creator["fieldsV1"]["f:spec"]  # taken over


def test_several_conflicts_are_listed_per_manager() -> None:
    live = fieldmanager.apply(DEPLOY, {}, deployment(1), "alice", False, "", "t")
    with pytest.raises(ApiError) as err:
        fieldmanager.apply(DEPLOY, live, deployment(2, "app:2"), "bob", False, "", "t")
    assert err.value.message == ('Apply failed with 2 conflicts: conflicts with "alice":\n- .spec.replicas\n'
                                 '- .spec.template.spec.containers[name="app"].image')


def test_an_update_moves_the_fields_it_changes_to_its_manager() -> None:
    old = fieldmanager.apply(DEPLOY, {"apiVersion": "apps/v1", "kind": "Deployment"}, deployment(1), "alice", False,
                             "", "t")
    new = {**old, "spec": {**old["spec"], "replicas": 5}}
    fieldmanager.record_update(old, new, "kubectl-scale", "", "t")
    by = {e["manager"]: fieldmanager.fieldsv1_to_paths(e["fieldsV1"]) for e in new["metadata"]["managedFields"]}
    assert by["kubectl-scale"] == {("f:spec", "f:replicas")}
    assert ("f:spec", "f:replicas") not in by["alice"]
    # so alice's next apply of another value conflicts with the scaler
    with pytest.raises(ApiError) as err:
        fieldmanager.apply(DEPLOY, new, deployment(2), "alice", False, "", "t")
    assert err.value.message.endswith('conflict with "kubectl-scale" using apps/v1 at t: .spec.replicas')


# --- CRDs ------------------------------------------------------------------------------------------------------

def crd(schema: JSON) -> JSON:
    return {"metadata": {"name": "widgets.example.dev"},
            "spec": {"group": "example.dev", "scope": "Namespaced",
                     "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": schema}}]}}


ROOT = "spec.versions[0].schema.openAPIV3Schema"


@pytest.mark.parametrize(("schema", "expected"), [
    ({"type": "object", "properties": {"spec": {"properties": {"a": {"type": "string"}}}}},
     f"{ROOT}.properties[spec].type: Required value: must not be empty for specified object fields"),
    ({"type": "string"}, f'{ROOT}.type: Invalid value: "string": must be object at the root'),
    ({"type": "object", "properties": {"spec": {"type": "object", "properties": {"a": {"type": "string"}},
                                                "additionalProperties": {"type": "string"}}}},
     f"{ROOT}.properties[spec].additionalProperties: Forbidden: additionalProperties and properties are mutual "
     "exclusive"),
    ({"type": "object", "properties": {"spec": {"type": "array"}}},
     f"{ROOT}.properties[spec].items: Required value: must be specified"),
    ({"type": "object", "properties": {"spec": {"type": "object", "anyOf": [{"type": "object"}]}}},
     f"{ROOT}.properties[spec].anyOf[0].type: Forbidden: must be empty to be structural"),
    ({"type": "object", "properties": {"metadata": {"type": "object", "properties": {
        "labels": {"type": "object"}}}}},
     f"{ROOT}.properties[metadata]: Forbidden: must not specify anything other than name and generateName, but "
     "metadata is implicitly specified"),
])
def test_structural_schema_violations(schema: JSON, expected: str) -> None:
    assert [p.render() for p in crds.problems(crd(schema))] == [expected]


def rule_problems(rule: str) -> list[str]:
    schema = {"type": "object", "properties": {"spec": {
        "type": "object", "x-kubernetes-validations": [{"rule": rule}],
        "properties": {"replicas": {"type": "integer"}, "items": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}}}}
    return [p.render() for p in crds.problems(crd(schema))]


@pytest.mark.parametrize("rule", [
    "self.replicas >= 0", "self.items.all(i, i.name != '')", "has(self.labels) && self.labels.team == 'x'",
    "self.replicas <= oldSelf.replicas", "self.replicas > 0 ? true : false",
    # valid CEL this cluster does not evaluate: stored, reported as not enforced
    "self.items.map(i, i.name).size() >= 0 && timestamp('2030-01-01T00:00:00Z') > timestamp('2020-01-01T00:00:00Z')",
])
def test_rules_that_compile_are_accepted(rule: str) -> None:
    assert rule_problems(rule) == []


@pytest.mark.parametrize(("rule", "error"), [
    ("self.replicas >>= 1", "compilation failed: ERROR: <input>:1:"),
    ("self.replicas > (1", "Syntax error"),
    ("replicas > 1", "undeclared reference to 'replicas' (in container '')"),
    ("self.replica > 1", "ERROR: <input>:1:6: undefined field 'replica'\n | self.replica > 1\n | .....^"),
    ("self.items.all(i, i.nmae != '')", "undefined field 'nmae'"),
])
def test_rules_that_do_not_compile_are_refused(rule: str, error: str) -> None:
    (problem,) = rule_problems(rule)
    assert problem.startswith(f"{ROOT}.properties[spec].x-kubernetes-validations[0].rule: Invalid value: "
                              f'apiextensions.ValidationRule{{Rule:"{rule}"'.replace("'", "'"))
    assert error in problem


def test_continue_tokens_round_trip_and_garbage_is_a_bad_request() -> None:
    assert decode_continue(encode_continue(42, "ns/name\x00")) == (42, "ns/name\x00")
    with pytest.raises(ApiError) as err:
        decode_continue("not a token")
    assert err.value.code == 400


def test_an_apply_that_drops_a_keyed_element_removes_it_whole() -> None:
    def ports(*numbers: int) -> JSON:
        body = deployment(1)
        body["spec"]["template"]["spec"]["containers"][0]["ports"] = [
            {"name": f"p{n}", "containerPort": n, "protocol": "TCP"} for n in numbers]
        return body

    live = fieldmanager.apply(DEPLOY, {}, ports(8080, 9090), "helm", False, "", "t")
    out = fieldmanager.apply(DEPLOY, live, ports(8080), "helm", False, "", "t")
    assert out["spec"]["template"]["spec"]["containers"][0]["ports"] == [
        {"name": "p8080", "containerPort": 8080, "protocol": "TCP"}]
