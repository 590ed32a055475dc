"""A prepare hook that raises in parked processes, on the local cluster with the operator and real agents: the
example's job (2 workers + 1 warm spare) whose ``prepare`` raises wherever a process waits parked (the spare's,
and each worker pod's standby). The job's status names each such pod and the exception (the PrepareFailed
condition and a Warning Event), and the job itself trains to the end untouched: no fault, no restart, a run
without faults' parameters."""

from __future__ import annotations

from typing import Any

import pytest
from test_operator_cluster import TRAIN, Jobs, OperatorFactory, job_body, phase_is, wait_for
from test_warm_spares import assert_fault_free, events

from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

STEPS = 120
RAISED = "ValueError: the model cannot be built here (injected: STALWART_EXAMPLE_FAIL_PREPARE=parked)"


def prepare_failed(jobs: Jobs, name: str) -> dict[str, Any] | None:
    return next((c for c in jobs.status(name).get("conditions") or [] if c["type"] == "PrepareFailed"), None)


def test_a_parked_process_whose_prepare_raises_is_named_in_the_status(start_operator: OperatorFactory, jobs: Jobs,
                                                                     local_cluster: LocalCluster) -> None:
    start_operator(jobs.ns)
    name = "prepfail"
    body = job_body(name, replicas=2, spares=1,
                    command=[*TRAIN, "--steps", str(STEPS), "--step-delay", "0.1", "--log-every", "1",
                             "--checkpoint-every", "1000"],
                    restartPolicy={"inProcess": {"warmSpares": True}})
    body["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "STALWART_EXAMPLE_FAIL_PREPARE", "value": "parked"}]
    jobs.create(body)
    spare = f"{name}-spare-0"
    cond = wait_for("the PrepareFailed condition naming the spare", lambda: (
        c := prepare_failed(jobs, name)) is not None and f"pod {spare}: " in (c.get("message") or "") and c,
        timeout=240)
    assert cond["status"] == "True" and cond["reason"] == "PrepareHookRaised", cond
    assert f"pod {spare}: {RAISED}" in cond["message"], cond
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    assert st.get("lastFailure") is None and st["restarts"] == {"inProcess": 0, "processRestarts": 0,
                                                                "podReplacements": 0}, st
    warnings = [e for e in jobs.core.list_namespaced_event(jobs.ns).items
                if e.involved_object.name == name and e.reason == "PrepareFailed"]
    assert warnings and all(e.type == "Warning" for e in warnings), warnings
    assert any(f"pod {spare}: {RAISED}" in e.message for e in warnings), [e.message for e in warnings]
    # The workers trained as a job without a spare does, to a fault-free run's parameters.
    logs = [events(local_cluster, jobs.ns, f"{name}-worker-{i}") for i in range(2)]
    assert_fault_free(logs, STEPS, world=2)
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)
