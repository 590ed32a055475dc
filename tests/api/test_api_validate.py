"""``stalwart validate``: one line per problem naming the field, line and column for malformed YAML."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_manifests import BAD, GOOD, MALFORMED

from stalwart.api.validation import Problem, document_problems, format_path, text_problems
from stalwart.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_catalogue_is_large_and_distinct() -> None:
    assert len(BAD) >= 30
    assert len({c.id for c in BAD}) == len(BAD)
    assert len({yaml.safe_dump(c.manifest()) for c in BAD}) == len(BAD)


def test_the_good_manifest_is_valid() -> None:
    assert document_problems(copy.deepcopy(GOOD)) == []


@pytest.mark.parametrize("case", BAD, ids=[c.id for c in BAD])
def test_each_bad_manifest_gets_one_problem_on_its_field(case: Any) -> None:
    problems = document_problems(case.manifest())
    assert len(problems) == 1, problems
    ((path, message),) = problems
    assert path == case.path
    assert case.message in message, message


@pytest.mark.parametrize(("case_id", "text", "line", "column", "message"), MALFORMED,
                         ids=[m[0] for m in MALFORMED])
def test_malformed_yaml_gets_line_and_column(case_id: str, text: str, line: int, column: int,
                                             message: str) -> None:
    count, problems = text_problems("job.yaml", text)
    assert count == 0
    assert [str(p) for p in problems][-1].startswith(f"job.yaml: line {line}, column {column}: malformed YAML")
    assert message in problems[-1].message


def test_several_problems_in_one_document_are_all_reported() -> None:
    document = copy.deepcopy(GOOD)
    document["spec"]["replicas"] = 0
    document["spec"]["spares"] = -1
    document["spec"]["rendezvous"]["endpoints"] = ["ok:1", "bad", "http://x:2"]
    problems = document_problems(document)
    assert problems == [
        ("spec.replicas", "must be greater than or equal to 1, got 0"),
        ("spec.spares", "must be greater than or equal to 0, got -1"),
        ("spec.rendezvous.endpoints[1]",
         "expected host:port (e.g. etcd.example.svc:2379 or [fd00::1]:2379), got 'bad'"),
        ("spec.rendezvous.endpoints[2]",
         "expected host:port (e.g. etcd.example.svc:2379 or [fd00::1]:2379) without a scheme, got 'http://x:2'"),
    ]


def test_cross_field_rules_of_one_object_are_all_reported() -> None:
    document = copy.deepcopy(GOOD)
    document["spec"]["rendezvous"].update(tls=True, lastCallSeconds=700)
    assert document_problems(document) == [
        ("spec.rendezvous.secretRef", "required when tls is true (the Secret holds ca.crt)"),
        ("spec.rendezvous.lastCallSeconds", "must be less than joinTimeoutSeconds (600), got 700"),
    ]


def test_rules_of_an_object_with_an_invalid_field_inside_are_still_reported() -> None:
    document = copy.deepcopy(GOOD)
    document["spec"]["minReplicas"] = 3
    document["spec"]["rendezvous"].update(tls=True, endpoints=["etcd"])
    document["spec"]["restartPolicy"]["rules"].append({"action": "Retry"})
    assert document_problems(document) == [
        ("spec.rendezvous.endpoints[0]",
         "expected host:port (e.g. etcd.example.svc:2379 or [fd00::1]:2379), got 'etcd'"),
        ("spec.restartPolicy.rules[1].action",
         "expected 'RestartInProcess', 'ReplacePod' or 'FailJob', got \"Retry\""),
        ("spec.minReplicas", "must be less than or equal to replicas (2), got 3"),
        ("spec.rendezvous.secretRef", "required when tls is true (the Secret holds ca.crt)"),
        ("spec.restartPolicy.rules[1].onExitCodes", "a rule needs onExitCodes or onReasons (or both)"),
    ]


def test_a_rule_reading_an_invalid_field_does_not_echo_its_problem() -> None:
    document = copy.deepcopy(GOOD)
    document["spec"].update(replicas="3", minReplicas=4, spares=-1)
    assert document_problems(document) == [
        ("spec.replicas", "expected an integer, got a string \"3\""),
        ("spec.spares", "must be greater than or equal to 0, got -1"),
    ]


def test_nulls_are_dropped_like_the_api_server_does() -> None:
    document = copy.deepcopy(GOOD)
    document["spec"]["nprocPerNode"] = None
    document["spec"]["runPolicy"] = None
    assert document_problems(document) == []


def test_objects_as_the_api_server_returns_them_are_valid() -> None:
    text = (REPO / "examples" / "minimal.yaml").read_text().replace(
        "  name: minimal\n",
        "  name: minimal\n  namespace: default\n  uid: 0b6f7bde-4c3b-4a8e-9a8e-1c1d0d3c3c3c\n"
        "  resourceVersion: \"812\"\n  generation: 3\n  creationTimestamp: 2026-01-02T03:04:05Z\n"
        "  finalizers: [stalwart.dev/etcd-cleanup]\n"
        "  managedFields: [{manager: kubectl, operation: Update}]\n")
    text += ("status:\n  phase: Running\n  replicas: 2\n  readyReplicas: 2\n  worldSize: 2\n  round: 4\n"
             "  restarts: {inProcess: 3, podReplacements: 1}\n  totalRestarts: 4\n"
             "  conditions:\n  - {type: Running, status: \"True\", lastTransitionTime: 2026-01-02T03:05:00Z}\n"
             "  selector: stalwart.dev/job-name=minimal\n")
    assert text_problems("live.yaml", text) == (1, [])


def test_documents_are_numbered_only_in_multi_document_files() -> None:
    good = yaml.safe_dump(GOOD)
    bad = yaml.safe_dump({**GOOD, "kind": "Job"})
    assert [str(p) for p in text_problems("one.yaml", bad)[1]] == [
        "one.yaml: kind: expected 'TrainingJob', got \"Job\""]
    count, problems = text_problems("many.yaml", f"---\n{good}---\n{bad}---\n")
    assert count == 2
    assert [str(p) for p in problems] == ["many.yaml#2: kind: expected 'TrainingJob', got \"Job\""]


def test_documents_before_a_syntax_error_are_still_checked() -> None:
    bad = yaml.safe_dump({**GOOD, "kind": "Job"})
    count, problems = text_problems("f.yaml", f"{bad}---\nkind: [\n")
    assert count == 1
    assert str(problems[0]) == "f.yaml#1: kind: expected 'TrainingJob', got \"Job\""
    line = bad.count("\n") + 3  # the end of the stream, after "---" and "kind: ["
    assert str(problems[1]).startswith(f"f.yaml: line {line}, column 1: malformed YAML")


def test_a_document_that_is_not_a_mapping() -> None:
    assert [str(p) for p in text_problems("l.yaml", "- a\n- b\n")[1]] == [
        "l.yaml: expected a Kubernetes object (a mapping), got a list"]


def test_an_empty_file_is_a_problem() -> None:
    assert [str(p) for p in text_problems("e.yaml", "# nothing\n")[1]] == [
        "e.yaml: no documents: expected a TrainingJob manifest"]


def test_format_path() -> None:
    assert format_path(("spec", "rules", 0, "action")) == "spec.rules[0].action"
    assert format_path(("metadata", "labels", "app.kubernetes.io/name")) == \
        'metadata.labels["app.kubernetes.io/name"]'
    assert format_path(()) == ""
    assert str(Problem("f", 2, "spec", "m")) == "f#2: spec: m"


# ---- the command line -------------------------------------------------------------------------------------


def test_cli_accepts_the_examples(capsys: pytest.CaptureFixture[str]) -> None:
    args = [arg for path in EXAMPLES for arg in ("-f", str(path))]
    assert main(["validate", *args]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{len(EXAMPLES)} TrainingJobs valid" in captured.err


def test_cli_prints_one_line_per_problem_and_exits_1(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cases = [c for c in BAD if c.caught_by == "cel"][:3]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump_all([c.manifest() for c in cases]))
    good = REPO / "examples" / "minimal.yaml"
    assert main(["validate", "-f", str(good), "-f", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(cases)
    for number, (line, case) in enumerate(zip(lines, cases, strict=True), start=1):
        assert line.startswith(f"{path}#{number}: {case.path}: ")
        assert case.message in line


def test_cli_reads_standard_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("apiVersion: stalwart.dev/v1alpha1\nkind: TrainingJob\n"))
    assert main(["validate", "-f", "-"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "-: metadata: required field is missing", "-: spec: required field is missing"]


def test_cli_reports_an_unreadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    assert main(["validate", "-f", str(missing), "-f", str(REPO / "examples" / "rules.yaml")]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{missing}: cannot read: ")


def test_cli_needs_a_file() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["validate"])
    assert exc.value.code == 2


def test_the_installed_command_end_to_end(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: stalwart.dev/v1alpha1\nkind: TrainingJob\nmetadata: {name: x}\n"
                    "spec:\n  replicas: 2\n  maxReplicas: 1\n  template: {spec: {containers: [{name: t, image: i, "
                    "command: [python]}]}}\n")
    result = subprocess.run([sys.executable, "-m", "stalwart", "validate", "-f", str(path)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1, result.stderr
    assert result.stdout == f"{path}: spec.maxReplicas: must be greater than or equal to replicas (2), got 1\n"
    result = subprocess.run([sys.executable, "-m", "stalwart", "validate", "-f", "-"],
                            input=(REPO / "examples" / "elastic.yaml").read_text(), capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("size", "problem"), [
    ("1Gi", None),
    ("64Mi", None),
    ("8G", None),
    ("1.5Gi", None),
    ("32Mi", "must be at least 64Mi (a container runtime's default), got '32Mi'"),
    ("0", "must be at least 64Mi (a container runtime's default), got '0'"),
    ("2gb", "expected a quantity of bytes such as 1Gi, 512Mi or 2G, got '2gb'"),
    ("-1Gi", "expected a quantity of bytes such as 1Gi, 512Mi or 2G, got '-1Gi'"),
])
def test_shm_size_is_a_quantity_of_at_least_64mi(size: str, problem: str | None) -> None:
    doc = copy.deepcopy(GOOD)
    doc["spec"]["shmSize"] = size
    assert document_problems(doc) == ([] if problem is None else [("spec.shmSize", problem)])
