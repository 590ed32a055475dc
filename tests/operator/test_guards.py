"""What holds a job back before any pod is made: credentials its etcd refuses or its Secret lacks, and objects of
the names it needs that are not the job's. Pure: table rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opbuild import JOB, job, observe, of, pod, status

from stalwart.api.status import ConditionStatus, Phase
from stalwart.etcd.client import CredentialsError
from stalwart.etcd.store import StorePermissionDenied, StoreSecurityError, StoreUnavailable
from stalwart.operator import provenance
from stalwart.operator.guards import conflict_of, etcd_problem
from stalwart.operator.kube import KubeError
from stalwart.operator.model import (
    Conflict,
    CreatePod,
    EmitEvent,
    EnsureOwnedObjects,
    EtcdProblem,
    EtcdView,
    Observation,
    PatchStatus,
)
from stalwart.operator.reconcile import condition, reconcile

UID = "uid-1"
MINE = {"apiVersion": "stalwart.dev/v1alpha1", "kind": "TrainingJob", "name": JOB, "uid": UID, "controller": True}


@pytest.mark.parametrize(("refs", "owner"), [
    (None, None),  # it does not exist: nothing to conflict with
    ([MINE], None),  # the job's own
    ([], "no controller"),
    ([{**MINE, "controller": False}], "the job is an owner but not its controller"),
    ([{**MINE, "uid": "uid-2", "name": "other"}], "controlled by TrainingJob other"),
    ([{"kind": "ReplicaSet", "name": "web-1", "uid": "x", "controller": True}], "controlled by ReplicaSet web-1"),
])
def test_an_existing_object_is_the_jobs_only_with_its_uid_as_controller(refs: list[dict[str, Any]] | None,
                                                                        owner: str | None) -> None:
    conflict = conflict_of("Secret", JOB, UID, refs)
    assert (conflict.owner if conflict is not None else None) == owner


@pytest.mark.parametrize(("refs", "made_here", "owner"), [
    ([MINE], True, None),  # the job's, made by this operator: adopted
    ([MINE], False, "controlled by the job but not made by this operator: no valid stalwart.dev/made-by mark"),
    ([MINE], None, None),  # a kind adopted by its owner reference alone
    ([], False, "no controller"),  # not the job's at all: said so, whatever the mark
    (None, False, None),  # it does not exist
])
def test_a_secret_is_the_jobs_only_with_the_operators_mark_too(refs: list[dict[str, Any]] | None,
                                                                 made_here: bool | None, owner: str | None) -> None:
    conflict = conflict_of("Secret", JOB, UID, refs, made_here)
    assert (conflict.owner if conflict is not None else None) == owner


def test_the_mark_binds_key_kind_namespace_name_and_uid(tmp_path: Path) -> None:
    key = provenance.new_key()
    good = provenance.mark(key, "Secret", "ns", "job-secret", UID)
    assert provenance.verifies(key, "Secret", "ns", "job-secret", UID, shown=good)
    for other in (provenance.mark(provenance.new_key(), "Secret", "ns", "job-secret", UID),  # another key
                  provenance.mark(key, "Secret", "ns", "job-secret", "uid-2"),  # another job's
                  provenance.mark(key, "Secret", "other-ns", "job-secret", UID),
                  provenance.mark(key, "Service", "ns", "job-secret", UID), "v1:" + "0" * 64, "", None):
        assert not provenance.verifies(key, "Secret", "ns", "job-secret", UID, shown=other)
    (tmp_path / "key").write_bytes(b"k" * 40 + b"\n")
    assert provenance.load_key(str(tmp_path / "key")) == b"k" * 40
    (tmp_path / "short").write_bytes(b"k" * 31)
    with pytest.raises(ValueError, match=r"--adoption-key-file: .*short holds 31 bytes; expected at least 32"):
        provenance.load_key(str(tmp_path / "short"))
    with pytest.raises(ValueError, match=r"--adoption-key-file: cannot read .*missing"):
        provenance.load_key(str(tmp_path / "missing"))


@pytest.mark.parametrize(("error", "reason", "names"), [
    (CredentialsError("Secret creds (spec.rendezvous.secretRef): tls is true but the Secret has no ca.crt"),
     "EtcdCredentialsInvalid", "ca.crt"),
    (KubeError("get", "secrets", "creds", 404, "Not Found"), "EtcdCredentialsInvalid",
     "Secret creds (spec.rendezvous.secretRef) does not exist"),
    (KubeError("get", "secrets", "creds", 403, "Forbidden"), "EtcdCredentialsInvalid", "cannot be read"),
    (StoreSecurityError("authentication failed: invalid user ID or password"), "EtcdAuthFailed", "invalid user ID"),
    (StorePermissionDenied("permission denied"), "EtcdPermissionDenied", "permission denied"),
    (StoreUnavailable("connection refused"), None, None),  # passing: CoordinationDegraded covers it
    (KubeError("get", "secrets", "creds", None, "timed out"), None, None),
])
def test_which_errors_are_credentials_problems(error: Exception, reason: str | None, names: str | None) -> None:
    jobv = job(rendezvous={"secretRef": {"name": "creds"}, "tls": True})
    problem = etcd_problem(error, jobv)
    assert (problem.reason if problem else None) == reason
    if names is not None:
        assert problem is not None and names in problem.message


def _observe(problem: EtcdProblem | None = None, conflicts: tuple[Conflict, ...] = (), **kw: Any) -> Observation:
    base = observe(kw.pop("jobv", job(status(Phase.PENDING))), kw.pop("pods", []),
                   EtcdView(reachable=problem is None), ready=False)
    return Observation(**{**{k: getattr(base, k) for k in base.__slots__}, "etcd_problem": problem,
                          "conflicts": conflicts})


PROBLEM = EtcdProblem("EtcdCredentialsInvalid", "Secret creds (spec.rendezvous.secretRef): no ca.crt")


def test_bad_credentials_hold_the_job_with_a_condition_and_one_event_until_they_work() -> None:
    d = reconcile(_observe(PROBLEM))
    access = condition(d.status, "EtcdAccess")
    assert access is not None and access.status == ConditionStatus.FALSE
    assert (access.reason, access.message) == (PROBLEM.reason, PROBLEM.message)
    assert [e.reason for e in of(d, EmitEvent)] == ["EtcdCredentialsInvalid"]
    assert not of(d, CreatePod) and not of(d, EnsureOwnedObjects) and of(d, PatchStatus)
    assert d.status.phase == Phase.PENDING
    # Still bad: nothing new is said.
    again = reconcile(_observe(PROBLEM, jobv=job(d.status)))
    assert not of(again, EmitEvent) and not of(again, CreatePod)
    # Fixed: the condition turns True, once, and the pods are made.
    fixed = reconcile(_observe(None, jobv=job(d.status)))
    access = condition(fixed.status, "EtcdAccess")
    assert access is not None and access.status == ConditionStatus.TRUE
    assert "EtcdAccessRestored" in [e.reason for e in of(fixed, EmitEvent)] and len(of(fixed, CreatePod)) == 2


def test_a_job_whose_etcd_never_failed_has_no_etcd_access_condition() -> None:
    assert condition(reconcile(_observe(None)).status, "EtcdAccess") is None


def test_a_foreign_secret_holds_the_job_and_is_named() -> None:
    foreign = Conflict("Secret", JOB, "no controller")
    d = reconcile(_observe(conflicts=(foreign,)))
    cond = condition(d.status, "OwnershipConflict")
    assert cond is not None and cond.status == ConditionStatus.TRUE and cond.reason == "NotOwned"
    assert cond.message is not None and cond.message.startswith(f"Secret {JOB} (no controller): exists and is not")
    assert [e.reason for e in of(d, EmitEvent)] == ["NotOwned"]
    assert not of(d, CreatePod) and not of(d, EnsureOwnedObjects)
    gone = reconcile(_observe(jobv=job(d.status)))
    cond = condition(gone.status, "OwnershipConflict")
    assert cond is not None and cond.status == ConditionStatus.FALSE
    assert of(gone, EnsureOwnedObjects) and len(of(gone, CreatePod)) == 2


def test_a_foreign_pod_takes_only_its_name_out_of_use() -> None:
    foreign = Conflict("Pod", f"{JOB}-worker-1", "controlled by ReplicaSet web-1")
    d = reconcile(_observe(conflicts=(foreign,), pods=[pod("worker-0")]))
    cond = condition(d.status, "OwnershipConflict")
    assert cond is not None and cond.status == ConditionStatus.TRUE and f"Pod {JOB}-worker-1" in cond.message
    assert [c.name for c in of(d, CreatePod)] == [f"{JOB}-spare-0"]
