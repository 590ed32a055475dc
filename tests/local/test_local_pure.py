"""Pure parts of the API emulator: patches, selectors, schemas, the CEL subset, tables, protobuf bodies."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from stalwart.local.apiserver import fieldmanager, protobuf, tables
from stalwart.local.apiserver.catalog import ResourceInfo
from stalwart.local.apiserver.cel import CelError, CelEvalError, compile_rule
from stalwart.local.apiserver.patches import PatchError, json_patch, merge_patch, strategic_merge
from stalwart.local.apiserver.schema import apply_defaults, prune, unsupported_rules, validate
from stalwart.local.apiserver.selectors import SelectorError, parse_field_selector, parse_label_selector

# --- patches ---------------------------------------------------------------------------------------------------

def test_merge_patch_rfc7386() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    assert merge_patch(target, {"a": "z", "c": {"f": None}, "l": [3]}) == {"a": "z", "c": {"d": "e"}, "l": [3]}
    assert target["c"] == {"d": "e", "f": "g"}  # inputs are not modified


def test_json_patch_rfc6902() -> None:
    assert json_patch({"a": [1]}, [{"op": "add", "path": "/a/-", "value": 2}]) == {"a": [1, 2]}
    with pytest.raises(PatchError):
        json_patch({"a": 1}, [{"op": "remove", "path": "/missing"}])
    with pytest.raises(PatchError):
        json_patch({"a": 1}, {"op": "add"})


def pod(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"containers": list(containers)}}


def test_strategic_merge_merges_containers_by_name_and_env_by_name() -> None:
    live = pod({"name": "a", "image": "1", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
               {"name": "b", "image": "1"})
    out = strategic_merge(live, pod({"name": "a", "env": [{"name": "X", "value": "9"}]}))
    assert out["spec"]["containers"][0] == {"name": "a", "image": "1", "env": [{"name": "X", "value": "9"},
                                                                               {"name": "Y", "value": "2"}]}
    assert out["spec"]["containers"][1] == {"name": "b", "image": "1"}


def test_strategic_merge_directives() -> None:
    live = pod({"name": "a", "image": "1"}, {"name": "b", "image": "1"})
    out = strategic_merge(live, pod({"name": "b", "$patch": "delete"}))
    assert [c["name"] for c in out["spec"]["containers"]] == ["a"]
    out = strategic_merge(live, {"spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
                                          "containers": [{"name": "a", "image": "2"}]}})
    assert [(c["name"], c["image"]) for c in out["spec"]["containers"]] == [("b", "1"), ("a", "2")]
    out = strategic_merge({"spec": {"x": {"a": 1, "b": 2}}}, {"spec": {"x": {"$patch": "replace", "c": 3}}})
    assert out == {"spec": {"x": {"c": 3}}}
    out = strategic_merge({"metadata": {"finalizers": ["a", "b"]}},
                          {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}})
    assert out == {"metadata": {"finalizers": ["b"]}}
    out = strategic_merge({"metadata": {"finalizers": ["a"]}}, {"metadata": {"finalizers": ["b"]}})
    assert out == {"metadata": {"finalizers": ["a", "b"]}}
    out = strategic_merge({"spec": {"a": 1, "b": 2}}, {"spec": {"$retainKeys": ["b"], "b": 3}})
    assert out == {"spec": {"b": 3}}


def test_strategic_merge_ports_by_port_or_container_port() -> None:
    svc = {"spec": {"ports": [{"port": 80, "name": "http"}, {"port": 443}]}}
    out = strategic_merge(svc, {"spec": {"ports": [{"port": 80, "name": "web"}]}})
    assert out["spec"]["ports"] == [{"port": 80, "name": "web"}, {"port": 443}]


THINGS = ResourceInfo("example.dev", "v1", "things", "thing", "Thing", True)


def ssa(live: dict[str, Any], applied: dict[str, Any], manager: str, force: bool = False) -> dict[str, Any]:
    return fieldmanager.apply(THINGS, live, applied, manager, force, "", "t")


def test_server_side_apply_removes_fields_a_manager_gives_up() -> None:
    live = ssa({}, {"apiVersion": "v1", "spec": {"a": 1, "x": {"y": 1}}}, "m")
    live = ssa(live, {"apiVersion": "v1", "spec": {"b": 2}}, "other")
    out = ssa(live, {"apiVersion": "v1", "spec": {"a": 2}}, "m")
    assert out["spec"] == {"a": 2, "b": 2}  # x.y and the emptied x went; other's b stays
    fields = {m["manager"]: m["fieldsV1"] for m in out["metadata"]["managedFields"]}
    assert fields["m"]["f:spec"] == {"f:a": {}}


# --- selectors -------------------------------------------------------------------------------------------------

def test_selector_parse_errors_name_the_term() -> None:
    with pytest.raises(SelectorError, match="labelSelector"):
        parse_label_selector("a in b")
    with pytest.raises(SelectorError, match="fieldSelector"):
        parse_field_selector("metadata.name")


# --- schema ----------------------------------------------------------------------------------------------------

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 5, "default": 1},
            "s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4},
            "l": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "m": {"type": "object", "additionalProperties": {"type": "integer"}},
            "io": {"x-kubernetes-int-or-string": True},
            "opt": {"type": "string", "nullable": True},
        }},
    },
}


def fields_of(obj: dict[str, Any]) -> dict[str, str]:
    return {p.field: p.reason for p in validate(SCHEMA, obj)}


def test_schema_validation_messages_and_types() -> None:
    assert fields_of({"spec": {"n": 3, "s": "ab", "l": ["x"], "m": {"a": 1}, "io": "50%", "opt": None}}) == {}
    assert fields_of({"spec": {"n": 9, "s": "AB", "l": ["a", "b", "c"], "m": {"a": "x"}, "io": 1.5}}) == {
        "spec.n": "FieldValueInvalid", "spec.s": "FieldValueInvalid", "spec.l": "FieldValueTooMany",
        "spec.m.a": "FieldValueTypeInvalid", "spec.io": "FieldValueTypeInvalid"}
    (problem,) = validate(SCHEMA, {"spec": {"n": 0}})
    assert problem.render() == "spec.n: Invalid value: 0: spec.n in body should be greater than or equal to 1"
    (problem,) = validate(SCHEMA, {"spec": {"s": "abcdef"}})
    assert problem.render() == "spec.s: Too long: may not be more than 4 bytes"


def test_schema_defaults_and_pruning() -> None:
    assert apply_defaults(SCHEMA, {"spec": {}}) == {"spec": {"n": 1}}
    pruned, dropped = prune(SCHEMA, {"apiVersion": "v", "kind": "K", "metadata": {}, "spec": {"x": 1, "n": 2},
                                     "other": True})
    assert pruned == {"apiVersion": "v", "kind": "K", "metadata": {}, "spec": {"n": 2}}
    assert dropped == ["spec.x", "other"]
    # metadata is never pruned, even when the schema declares it as a bare object
    with_meta = {**SCHEMA, "properties": {**SCHEMA["properties"], "metadata": {"type": "object"}}}
    pruned, dropped = prune(with_meta, {"metadata": {"name": "n", "labels": {"a": "b"}}})
    assert pruned == {"metadata": {"name": "n", "labels": {"a": "b"}}} and dropped == []


def test_unsupported_rules_are_reported() -> None:
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": "self.x == 1"},
                                                             {"rule": "duration(self.d) > duration('1s')"}]}
    (only,) = unsupported_rules(schema)
    assert only.startswith("<root>: duration(self.d)")


# --- CEL subset ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("rule", "expected"), [
    ("self.a + 1 == 3", True),
    ("7 / 2 == 3 && -7 / 2 == -3 && 7 % 3 == 1", True),
    ("has(self.b) || !has(self.zz)", True),
    ("self.l.all(x, x > 0) && self.l.exists(x, x == 2) && self.l.exists_one(x, x == 3)", True),
    ("self.l.map(x, x * 2) == [2, 4, 6] && self.l.filter(x, x > 1) == [2, 3]", True),
    ("size(self.s) == 5 && self.s.size() == 5 && self.s.startsWith('he') && self.s.matches('^h.*o$')", True),
    ("'b' in self.m && !('z' in self.m) && 2 in self.l", True),
    ("self.a > 5 ? 'big' : 'small'", "small"),
    ("string(self.a) + 'x'", "2x"),
    ("self.m.b.c", 1),
])
def test_cel_subset(rule: str, expected: Any) -> None:
    env = {"self": {"a": 2, "b": 1, "l": [1, 2, 3], "s": "hello", "m": {"b": {"c": 1}}}}
    assert compile_rule(rule).evaluate(env) == expected


def test_cel_errors() -> None:
    with pytest.raises(CelError):
        compile_rule("self.x.quantity()")
    with pytest.raises(CelError):
        compile_rule("self.a ==")
    with pytest.raises(CelEvalError, match="no such key"):
        compile_rule("self.missing == 1").evaluate({"self": {}})
    assert compile_rule("self == oldSelf").uses_old_self


# --- tables ----------------------------------------------------------------------------------------------------

def test_table_uses_printer_columns() -> None:
    version = {"additionalPrinterColumns": [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.conditions[0].count"},
        {"name": "Label", "type": "string", "jsonPath": ".metadata.labels['a.b/c']"}]}
    obj = {"metadata": {"name": "x", "labels": {"a.b/c": "v"}},
           "status": {"phase": "Running", "conditions": [{"count": 2}]}}
    t = tables.table([obj], "g", "things", version, "7", include_object="None")
    assert [c["name"] for c in t["columnDefinitions"]] == ["Name", "Phase", "Ready", "Label"]
    assert t["rows"] == [{"cells": ["x", "Running", 2, "v"]}]
    assert t["metadata"]["resourceVersion"] == "7"


def test_json_path_filters() -> None:
    obj = {"status": {"conditions": [{"type": "A", "status": "x"}, {"type": "Ready", "status": "True"}]}}
    assert tables.json_path(obj, '.status.conditions[?(@.type=="Ready")].status') == "True"
    assert tables.json_path(obj, ".status.conditions[?(@.type=='Gone')].status") is None


def test_age_formatting() -> None:
    import datetime

    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    assert tables.age("2026-01-02T03:04:00Z", now) == "5s"
    assert tables.age("2026-01-02T02:59:05Z", now) == "5m"
    assert tables.age("2026-01-01T03:04:05Z", now) == "24h"
    assert tables.age("2025-12-20T03:04:05Z", now) == "13d"


# --- protobuf request bodies -----------------------------------------------------------------------------------

def _field(num: int, payload: bytes) -> bytes:
    return bytes([num << 3 | 2, len(payload)]) + payload


def _entry(key: str, value: bytes) -> bytes:
    return _field(1, key.encode()) + _field(2, value)


def test_protobuf_secret_body_decodes() -> None:
    meta = _field(1, b"rel.v1") + _field(3, b"ns") + _field(11, _entry("owner", b"helm"))
    secret = _field(1, meta) + _field(2, _entry("release", b"\x00\xff")) + _field(3, b"helm.sh/release.v1")
    type_meta = _field(1, b"v1") + _field(2, b"Secret")
    body = protobuf.MAGIC + _field(1, type_meta) + _field(2, secret)
    assert protobuf.decode(body) == {
        "apiVersion": "v1", "kind": "Secret", "type": "helm.sh/release.v1",
        "metadata": {"name": "rel.v1", "namespace": "ns", "labels": {"owner": "helm"}},
        "data": {"release": base64.b64encode(b"\x00\xff").decode()}}
    with pytest.raises(protobuf.ProtobufError, match="Pod"):
        protobuf.decode(protobuf.MAGIC + _field(1, _field(2, b"Pod")))
