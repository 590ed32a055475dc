"""The TrainingJob models, pod naming and the JobRecord the agents read."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from api_manifests import GOOD
from pydantic import ValidationError

from stalwart.api import (
    MAX_JOB_NAME_LENGTH,
    MAX_RECORD_BYTES,
    CleanPodPolicy,
    FailureAction,
    JobRecord,
    Phase,
    RestartCounts,
    SuccessPolicy,
    TrainingJob,
    TrainingJobStatus,
    check_job_name,
    pod_labels,
    secret_name,
    selector,
    service_name,
    spare_pod_name,
    worker_pod_name,
)
from stalwart.api.naming import DNS1123_LABEL, MAX_LABEL_LENGTH, MAX_POD_INDEX
from stalwart.api.restart import MAX_SEAL_SLOTS, SealRecord, rank_runs
from stalwart.api.spec import MANAGED_BY_STALWART, MAX_REPLICAS, endpoint_problem, managed_here

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def job(**spec: object) -> TrainingJob:
    document = copy.deepcopy(GOOD)
    document["spec"].update(spec)
    return TrainingJob.model_validate(document)


def test_defaults_are_filled_in() -> None:
    document = copy.deepcopy(GOOD)
    del document["spec"]["restartPolicy"], document["spec"]["rendezvous"], document["spec"]["spares"]
    spec = TrainingJob.model_validate(document).spec
    assert (spec.min_replicas, spec.max_replicas, spec.min_nodes, spec.max_nodes) == (2, 2, 2, 2)
    assert spec.spares == 0 and spec.nproc_per_node == 1
    assert spec.rendezvous.endpoints is None  # the operator's default etcd
    assert (spec.rendezvous.join_timeout_seconds, spec.rendezvous.last_call_seconds,
            spec.rendezvous.lease_ttl_seconds) == (600.0, 10.0, 10)
    in_process = spec.restart_policy.in_process
    assert (in_process.max_restarts, in_process.soft_timeout_seconds, in_process.hard_timeout_seconds,
            in_process.barrier_timeout_seconds) == (10, 60.0, 90.0, 120.0)
    assert spec.restart_policy.backoff_limit == 6 and spec.restart_policy.rules == []
    assert spec.run_policy.clean_pod_policy is CleanPodPolicy.RUNNING and spec.run_policy.suspend is False
    assert spec.success_policy is SuccessPolicy.ALL_WORKERS


def test_elastic_bounds_are_kept() -> None:
    spec = job(replicas=4, minReplicas=2, maxReplicas=6).spec
    assert (spec.min_nodes, spec.replicas, spec.max_nodes) == (2, 4, 6)


def test_wire_form_is_camel_case_and_round_trips() -> None:
    parsed = job(nprocPerNode=4)
    wire = parsed.to_wire()
    assert wire["spec"]["nprocPerNode"] == 4
    assert wire["spec"]["rendezvous"]["leaseTTLSeconds"] == 10
    assert wire["spec"]["restartPolicy"]["rules"][0] == {
        "action": "FailJob", "onExitCodes": {"operator": "In", "values": [3]}}
    assert TrainingJob.model_validate(wire) == parsed
    assert parsed.spec.restart_policy.rules[0].action is FailureAction.FAIL_JOB


def test_unknown_container_fields_pass_through_unchanged() -> None:
    document = copy.deepcopy(GOOD)
    container = document["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"limits": {"nvidia.com/gpu": 8}}
    document["spec"]["template"]["spec"]["volumes"] = [{"name": "data", "emptyDir": {}}]
    wire = TrainingJob.model_validate(document).to_wire()
    assert wire["spec"]["template"]["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert wire["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_pod_templates_are_valid_kubernetes_pod_templates(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        parsed = TrainingJob.model_validate(document)
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": parsed.metadata.name},
                    "template": parsed.spec.template.to_wire()}
        kubernetes_validate.validate(template, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(("endpoint", "ok"), [
    ("etcd:2379", True), ("10.0.0.1:2379", True), ("[fd00::1]:2379", True), ("a.b-c.svc:1", True),
    ("etcd", False), ("etcd:", False), (":2379", False), ("etcd:0", False), ("etcd:65536", False),
    ("etcd:http", False), ("https://etcd:2379", False), ("fd00::1:2379", False), ("[zz::1]:2379", False),
    ("[fd00::1:2379", False), ("-etcd:2379", False), ("etcd_1:2379", False),
])
def test_endpoint_forms(endpoint: str, ok: bool) -> None:
    assert (endpoint_problem(endpoint) is None) is ok


def test_pod_names_fit_in_a_label_for_the_longest_name_and_index() -> None:
    name = "a" * MAX_JOB_NAME_LENGTH
    longest = worker_pod_name(name, MAX_POD_INDEX)
    assert len(longest) == MAX_LABEL_LENGTH and DNS1123_LABEL.fullmatch(longest)
    assert len(spare_pod_name(name, MAX_POD_INDEX)) <= MAX_LABEL_LENGTH
    assert len(secret_name(name)) <= MAX_LABEL_LENGTH


def test_pod_indices_cover_every_worker_and_spare_with_room_for_replacements() -> None:
    assert MAX_REPLICAS * 2 <= MAX_POD_INDEX + 1


def test_derived_names_and_labels() -> None:
    assert worker_pod_name("mnist", 0) == "mnist-worker-0"
    assert spare_pod_name("mnist", 12) == "mnist-spare-12"
    assert service_name("mnist") == "mnist"
    assert secret_name("mnist") == "mnist-stalwart"
    assert selector("mnist") == "stalwart.dev/job-name=mnist"
    assert pod_labels("mnist", "spare", 1) == {
        "stalwart.dev/job-name": "mnist", "stalwart.dev/role": "spare", "stalwart.dev/index": "1"}


@pytest.mark.parametrize("bad", ["", "A", "1a", "a-", "a_b", "a" * (MAX_JOB_NAME_LENGTH + 1)])
def test_bad_job_names_are_refused_by_every_derivation(bad: str) -> None:
    for derive in (check_job_name, service_name, secret_name, selector):
        with pytest.raises(ValueError, match="TrainingJob name"):
            derive(bad)
    with pytest.raises(ValueError, match="TrainingJob name"):
        worker_pod_name(bad, 0)


@pytest.mark.parametrize("index", [-1, MAX_POD_INDEX + 1, True, 1.0])
def test_bad_pod_indices_are_refused(index: object) -> None:
    with pytest.raises(ValueError, match="pod index"):
        worker_pod_name("mnist", index)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role"):
        pod_labels("mnist", "chief", 0)


def test_status_total_restarts_is_derived_from_restarts() -> None:
    status = TrainingJobStatus(phase=Phase.RESTARTING, restarts=RestartCounts(in_process=3, process_restarts=1,
                                                                              pod_replacements=2),
                               start_time=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    wire = status.to_wire()
    # RESTARTS counts recoveries (in process or with new processes); pod replacements are counted apart.
    assert wire == {"phase": "Restarting", "restarts": {"inProcess": 3, "processRestarts": 1, "podReplacements": 2},
                    "totalRestarts": 4, "startTime": "2026-01-02T03:04:05Z"}
    assert TrainingJobStatus.model_validate({"totalRestarts": 99}).total_restarts is None
    assert Phase.FAILED.finished and not Phase.RUNNING.finished


# ---- JobRecord --------------------------------------------------------------------------------------------


def record(**changes: object) -> JobRecord:
    parsed = job(replicas=2, minReplicas=1, maxReplicas=3, nprocPerNode=4)
    base = JobRecord.from_job(parsed, ["mnist-worker-0", "mnist-worker-1"], ["mnist-spare-0"], uid="u-1")
    return JobRecord.model_validate({**base.to_wire(), **changes})


def test_job_record_from_a_job() -> None:
    parsed = job(replicas=2, minReplicas=1, maxReplicas=3, nprocPerNode=4)
    parsed.metadata.uid = "u-1"
    parsed.metadata.generation = 7
    built = JobRecord.from_job(parsed, ["mnist-worker-0", "mnist-worker-1"], ["mnist-spare-0"])
    assert (built.job_name, built.namespace, built.uid, built.generation) == ("mnist", "ml", "u-1", 7)
    assert (built.min_nodes, built.max_nodes, built.nproc_per_node, built.world_size_max) == (1, 3, 4, 12)
    assert (built.join_timeout_seconds, built.last_call_seconds, built.lease_ttl_seconds) == (600, 10, 10)
    assert (built.max_restarts, built.soft_timeout_seconds, built.hard_timeout_seconds,
            built.barrier_timeout_seconds, built.backoff_limit) == (10, 60, 90, 120, 6)
    assert built.rules[0].on_exit_codes is not None and built.rules[0].on_exit_codes.values == [3]
    assert JobRecord.from_json_bytes(built.to_json_bytes()) == built


def test_job_record_json_is_camel_case() -> None:
    data = json.loads(record().to_json_bytes())
    assert {"jobName", "minNodes", "maxNodes", "nprocPerNode", "leaseTTLSeconds", "softTimeoutSeconds",
            "members", "spares"} <= set(data)


def test_job_record_needs_a_uid() -> None:
    with pytest.raises(ValueError, match="uid"):
        JobRecord.from_job(job(), ["mnist-worker-0"])


@pytest.mark.parametrize(("changes", "message"), [
    ({"minNodes": 4}, "minNodes: must be less than or equal to maxNodes (3), got 4"),
    ({"softTimeoutSeconds": 95}, "softTimeoutSeconds: must be less than hardTimeoutSeconds (90), got 95"),
    ({"spares": ["mnist-worker-1"]}, "'mnist-worker-1' is also in members"),
    ({"members": ["a", "b", "a"]}, "'a' is listed twice in members"),
    ({"members": ["a", ""]}, "must not be empty"),
    ({"surprise": 1}, "Extra inputs are not permitted"),
    ({"nprocPerNode": 0}, "greater than or equal to 1"),
])
def test_job_record_rules(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        record(**changes)


def test_records_are_size_capped_both_ways() -> None:
    huge = record(members=[f"node-{i:06d}-{'x' * 40}" for i in range(6000)])
    with pytest.raises(ValueError, match="the limit is"):
        huge.to_json_bytes()
    with pytest.raises(ValueError, match="the limit is"):
        JobRecord.from_json_bytes(b" " * (MAX_RECORD_BYTES + 1))
    with pytest.raises(ValidationError):
        JobRecord.from_json_bytes(b"not json")


@pytest.mark.parametrize(("ranks", "runs"), [
    ({str(s): s for s in range(20_000)}, [[0, 20_000, 0]]),  # an unchanged world: one run at any size
    ({"0": 0, "1": 1, "3": 2, "4": 3, "9": 4}, [[0, 2, 0], [3, 2, 2], [9, 1, 4]]),  # a spare in a lost slot's place
    ({"2": 1, "1": 0, "0": 2}, [[0, 1, 2], [1, 2, 0]]),
    ({}, []),
])
def test_a_seal_is_written_as_runs_and_read_back_whole(ranks: dict[str, int], runs: list[list[int]]) -> None:
    seal = SealRecord(iteration=3, world_size=len(ranks), ranks=ranks, inactive=[7], sealed_by=1)
    data = seal.to_json_bytes()
    assert rank_runs(ranks) == runs and json.loads(data)["rankRuns"] == runs and "ranks" not in json.loads(data)
    assert SealRecord.from_json_bytes(data) == seal
    assert SealRecord.model_validate(seal.model_dump()) == seal
    assert len(data) < 200 + 30 * len(runs)


def test_a_seal_in_the_map_form_is_read_too() -> None:
    seal = SealRecord.from_json_bytes(b'{"iteration":1,"worldSize":1,"ranks":{"3":0},"sealedBy":3}')
    assert seal.ranks == {"3": 0}


@pytest.mark.parametrize(("runs", "message"), [
    ([[0, 0, 0]], "counts >= 1"),
    ([[-1, 2, 0]], "slots and ranks >= 0"),
    ([[0, 2, 0], [1, 1, 5]], "a slot is given twice"),
    ([[0, 2]], "integer triples"),
    ([[0, True, 0]], "integer triples"),
    ("0-3", "integer triples"),
    ([[0, MAX_SEAL_SLOTS + 1, 0]], f"more than {MAX_SEAL_SLOTS} slots"),
])
def test_bad_rank_runs_are_refused_by_name(runs: object, message: str) -> None:
    doc = {"iteration": 1, "worldSize": 1, "rankRuns": runs, "sealedBy": 0}
    with pytest.raises(ValidationError, match=f"rankRuns: .*{message}"):
        SealRecord.from_json_bytes(json.dumps(doc))
    with pytest.raises(ValidationError, match="either ranks or rankRuns"):
        SealRecord.from_json_bytes(json.dumps({**doc, "rankRuns": [[0, 1, 0]], "ranks": {"0": 0}}))


@pytest.mark.parametrize(("managed_by", "here"), [
    (None, True),
    (MANAGED_BY_STALWART, True),
    ("kueue.x-k8s.io/multikueue", False),
    ("example.com/other-controller", False),
])
def test_managed_by_names_the_controller_that_reconciles_the_job(managed_by: str | None, here: bool) -> None:
    spec = job() if managed_by is None else job(managedBy=managed_by)
    assert spec.spec.managed_by == managed_by
    assert managed_here(spec.spec.managed_by) is here


@pytest.mark.parametrize("bad", ["multikueue", "/path-only", "Example.com/x", "a.b/" + "x" * 64])
def test_managed_by_must_be_a_domain_prefixed_path(bad: str) -> None:
    with pytest.raises(ValidationError) as raised:
        job(managedBy=bad)
    [error] = raised.value.errors()
    assert error["loc"][-1] == "managedBy", error
