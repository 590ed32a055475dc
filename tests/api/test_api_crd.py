"""The generated CRD: committed as generated, a valid structural apiextensions.k8s.io/v1 CRD, and its schema
and CEL rules reject the bad manifests a CRD can express while accepting the examples."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from api_manifests import BAD, GOOD
from crd_harness import apply_defaults, cel_failures, cel_rules, schema_errors, to_cel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stalwart.api import TrainingJob
from stalwart.api.crd import _model_classes, crd, crd_yaml, openapi_schema
from stalwart.api.status import TrainingJobStatus
from stalwart.api.validation import document_problems
from stalwart.cli import main
from stalwart.local.apiserver.tables import json_path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_committed_crd_is_exactly_the_generated_one(capsys: pytest.CaptureFixture[str]) -> None:
    committed = (REPO / "crds" / "trainingjob.yaml").read_text()
    assert committed == crd_yaml(), "crds/trainingjob.yaml is stale: run `stalwart crd > crds/trainingjob.yaml`"
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == committed


def test_crd_json_output_is_the_same_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd", "-o", "json"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == crd()


def test_crd_is_a_valid_apiextensions_v1_object() -> None:
    # kubernetes-validate checks against Kubernetes' own OpenAPI schema of CustomResourceDefinition.
    kubernetes_validate.validate(crd(), kubernetes_validate.latest_version(), strict=True)


def _nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, sub in node.get("properties", {}).items():
        out += _nodes(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _nodes(node[key], f"{path}[{key}]")
    return out


def test_schema_is_structural() -> None:
    nodes = _nodes(openapi_schema())
    assert len(nodes) > 80
    for path, node in nodes:
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "not", "nullable", "title", "const"):
            assert banned not in node, f"{path or '<root>'} has {banned}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert node.get("additionalProperties") is not False, path
        assert not ("properties" in node and "additionalProperties" in node), path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, True), bool), f"{path}: {key} must be the OpenAPI 3.0 boolean"
        if node.get("type") == "object" and path.startswith(".spec.template"):
            continue
        if "default" in node and node.get("type") == "object":
            assert node["default"] == {}, path


def test_every_spec_and_status_field_is_described() -> None:
    schema = openapi_schema()
    for top in ("spec", "status"):
        for path, node in _nodes(schema["properties"][top], top):
            if path.endswith("[items]") or path.endswith("[additionalProperties]"):
                continue
            assert node.get("description"), f"{path} has no description (kubectl explain would show nothing)"


def test_pod_template_is_loose_but_requires_named_containers() -> None:
    template = openapi_schema()["properties"]["spec"]["properties"]["template"]
    pod = template["properties"]["spec"]
    assert pod["x-kubernetes-preserve-unknown-fields"] is True
    assert pod["required"] == ["containers"]
    containers = pod["properties"]["containers"]
    assert containers["minItems"] == 1
    assert containers["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert containers["items"]["required"] == ["name", "image"]


def test_every_cross_field_rule_is_a_cel_rule_that_compiles() -> None:
    schema = openapi_schema()
    in_crd = {rule["rule"] for _, rule in cel_rules(schema)}
    declared = [rule for model in _model_classes(TrainingJob).values() for rule in model.__rules__]
    assert len(declared) >= 7
    for rule in declared:
        assert rule.cel in in_crd, f"rule on {rule.field} missing from the CRD"
    assert any("metadata.name.size()" in rule for rule in in_crd)
    assert any("metadata.name.matches(" in rule for rule in in_crd)
    for _, rule in cel_rules(schema):
        assert rule["message"]
        # Every rule evaluates to a boolean on the defaulted good manifest (compiles, fields exist).
    assert cel_failures(GOOD) == []


def test_names_subresources_and_printer_columns() -> None:
    spec = crd()["spec"]
    assert crd()["metadata"]["name"] == "trainingjobs.stalwart.dev"
    assert spec["names"]["shortNames"] == ["tj"]
    assert spec["names"]["categories"] == ["all"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = {c["name"].upper(): c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["PHASE", "READY", "WORLD", "ROUND", "RESTARTS", "STALLED", "AGE"]
    assert columns["PHASE"]["jsonPath"] == ".status.phase"
    assert columns["WORLD"]["jsonPath"] == ".status.worldSize"
    assert columns["ROUND"]["jsonPath"] == ".status.round"
    assert columns["RESTARTS"]["jsonPath"] == ".status.totalRestarts"
    assert columns["AGE"] == {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    # The RESTARTS column says what the model sums into totalRestarts, no more (issue 35).
    counted = TrainingJobStatus.model_validate({"restarts": {"inProcess": 2, "processRestarts": 3,
                                                             "podReplacements": 5}}).total_restarts
    assert counted == 2 + 3
    assert columns["RESTARTS"]["description"].startswith("Recoveries: restarts.inProcess + restarts.processRestarts ")
    # A stalled job shows in `kubectl get tj`: the Stalled condition's status (as the API server's JSONPath has it).
    stalled = {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Stalled", "status": "True"}]}}
    assert json_path(stalled, columns["STALLED"]["jsonPath"]) == "True"
    assert json_path({"status": {"conditions": []}}, columns["STALLED"]["jsonPath"]) is None
    status = openapi_schema()["properties"]["status"]["properties"]
    for column in columns.values():
        field = column["jsonPath"].split(".")
        if field[1] == "status" and "[" not in field[2]:
            assert field[2] in status, column


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_schema_and_the_cel_rules(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        assert schema_errors(document) == []
        assert cel_failures(document) == []


def test_the_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {"minimal.yaml", "elastic.yaml", "rules.yaml", "etcd-tls.yaml"}


def _under(found: str, expected: str) -> bool:
    return expected == found or expected.startswith(found + ".") or expected.startswith(found + "[") or not found


SCHEMA_CASES = [c for c in BAD if c.caught_by == "schema"]
CEL_CASES = [c for c in BAD if c.caught_by == "cel"]


@pytest.mark.parametrize("case", SCHEMA_CASES, ids=[c.id for c in SCHEMA_CASES])
def test_the_schema_rejects_what_a_schema_can_express(case: Any) -> None:
    errors = schema_errors(case.manifest())
    assert errors, f"the CRD schema accepts {case.id}"
    assert all(_under(path, case.path) for path, _ in errors), errors


@pytest.mark.parametrize("case", CEL_CASES, ids=[c.id for c in CEL_CASES])
def test_the_cel_rules_reject_the_cross_field_cases(case: Any) -> None:
    document = case.manifest()
    assert schema_errors(document) == [], "a CEL case must be schema-valid, else the rule is not what catches it"
    failures = cel_failures(document)
    assert failures, f"no CEL rule rejects {case.id}"
    assert all(_under(path, case.path) for path, _ in failures), failures


def test_defaults_in_the_crd_are_the_models_defaults() -> None:
    schema = openapi_schema()
    minimal = copy.deepcopy(GOOD)
    del minimal["spec"]["restartPolicy"]
    by_server = apply_defaults(schema, minimal)
    by_model = TrainingJob.model_validate(minimal).to_wire()
    # minReplicas/maxReplicas default to replicas: the model fills them in, a static CRD default cannot.
    assert by_model["spec"].pop("minReplicas") == by_model["spec"].pop("maxReplicas") == 2
    assert yaml.safe_dump(by_server, sort_keys=True) == yaml.safe_dump(by_model, sort_keys=True)


def test_cel_sees_numbers_as_doubles_like_the_api_server() -> None:
    node = openapi_schema()["properties"]["spec"]["properties"]["restartPolicy"]["properties"]["inProcess"]
    value = to_cel(node, {"softTimeoutSeconds": 30, "hardTimeoutSeconds": 60.5, "maxRestarts": 3})
    assert type(value["softTimeoutSeconds"]).__name__ == "DoubleType"
    assert type(value["maxRestarts"]).__name__ == "IntType"


def _spec_document(numbers: dict[str, Any]) -> dict[str, Any]:
    document = copy.deepcopy(GOOD)
    spec = document["spec"]
    spec.update(replicas=numbers["replicas"], spares=numbers["spares"])
    for field in ("minReplicas", "maxReplicas"):
        if numbers[field] is not None:
            spec[field] = numbers[field]
    spec["restartPolicy"]["inProcess"] = {"softTimeoutSeconds": numbers["soft"], "hardTimeoutSeconds": numbers["hard"]}
    spec["rendezvous"].update(lastCallSeconds=numbers["lastCall"], joinTimeoutSeconds=numbers["join"])
    return document


counts = st.integers(min_value=1, max_value=10_000)
seconds = st.sampled_from([0.5, 1, 2, 10, 30, 59.5, 60, 90, 600])
spec_numbers = st.fixed_dictionaries({
    "replicas": counts, "minReplicas": st.none() | counts, "maxReplicas": st.none() | counts,
    "spares": st.integers(min_value=0, max_value=10_000), "soft": seconds, "hard": seconds,
    "lastCall": seconds, "join": seconds})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numbers=spec_numbers)
def test_python_rules_and_crd_rules_agree(numbers: dict[str, Any]) -> None:
    document = _spec_document(numbers)
    by_validate = document_problems(document) == []
    by_crd = schema_errors(document) == [] and cel_failures(document) == []
    assert by_validate == by_crd, (document_problems(document), schema_errors(document), cel_failures(document))
