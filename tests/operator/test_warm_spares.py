"""A worker pod lost with a warm spare present, on the local cluster with the operator, real agents and real
torch (the example's DDP job): the survivors' processes keep running, the spare's parked processes take the
lost ranks in the new round, the state comes from the surviving peer, and the job ends with the parameters
of a run without faults."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from test_operator_cluster import TRAIN, Jobs, OperatorFactory, job_body, phase_is, wait_for
from torch import nn

from stalwart.examples import train as example
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

STEPS = 400


@pytest.fixture
def jobs(kube_api: Any, k8s_namespace: str) -> Jobs:
    return Jobs(kube_api, k8s_namespace)


def pod_pids(pod: str) -> set[int]:
    """The processes of ``pod`` on this machine (its agent and rank processes), found by their environment."""
    needle = f"STALWART_NODE_ID={pod}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            found.add(int(entry.name))
    return found


def events(cluster: LocalCluster, ns: str, pod: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("logs", pod, "-n", ns, check=False).stdout
    lines = (line for line in out.splitlines() if line.startswith("{"))
    return [json.loads(line) for line in lines]


def fault_free_params(steps: int, world: int, batch_size: int = 32, lr: float = 0.05, seed: int = 0) -> torch.Tensor:
    """The schedule computed in one process: DDP averages the ranks' gradients, i.e. the mean of their losses."""
    model = example.build_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = sum(nn.functional.mse_loss(model(x), y)
                   for x, y in (example.batch(seed, step, r, batch_size) for r in range(world))) / world
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("fault", ["force-delete", "sigkill", "delete"])
def test_worker_lost_with_a_warm_spare_recovers_in_process(fault: str, start_operator: OperatorFactory,
                                                            jobs: Jobs, local_cluster: LocalCluster) -> None:
    name = f"warm-{fault.replace('-', '')}"
    start_operator(jobs.ns)
    jobs.create(job_body(name, replicas=2, spares=1,
                         command=[*TRAIN, "--steps", str(STEPS), "--step-delay", "0.05", "--checkpoint-every", "1000",
                                  "--log-every", "1"],
                         restartPolicy={"inProcess": {"warmSpares": True}}))
    survivor, victim, spare = f"{name}-worker-0", f"{name}-worker-1", f"{name}-spare-0"
    wait_for("a few steps", lambda: (jobs.status(name).get("progress") or {}).get("step", 0) >= 20, timeout=240)
    wait_for("the spare's parked processes", lambda: len(pod_pids(spare)) >= 2, timeout=120)
    before = pod_pids(survivor)
    assert len(before) >= 2  # the agent and its rank

    if fault == "force-delete":
        local_cluster.kubectl("delete", "pod", victim, "-n", jobs.ns, "--grace-period=0", "--force", "--wait=false")
    elif fault == "sigkill":
        for pid in pod_pids(victim):
            os.kill(pid, signal.SIGKILL)
    else:
        local_cluster.kubectl("delete", "pod", victim, "-n", jobs.ns, "--wait=false")

    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    # The survivor's processes are the ones it started with: none was started again.
    survivor_log = events(local_cluster, jobs.ns, survivor)
    assert [e["event"] for e in survivor_log].count("start") == 1, survivor_log[:5]
    # The spare took the lost rank in process, with the state from the survivor, not from a checkpoint.
    spare_log = events(local_cluster, jobs.ns, spare)
    own_rank = next(e["rank"] for e in survivor_log if e["event"] == "start")
    resumed = [e for e in spare_log if e["event"] == "resume"]
    assert resumed and resumed[0]["rank"] == 1 - own_rank, spare_log[:5]
    assert resumed[0]["source"] == own_rank and resumed[0]["step"] > 0, resumed[0]
    done = {e["rank"]: e for e in survivor_log + spare_log if e["event"] == "done"}
    assert sorted(done) == [0, 1] and all(d["step"] == STEPS for d in done.values())
    expected = fault_free_params(STEPS, world=2)
    for d in done.values():
        assert torch.allclose(torch.tensor(d["params"]), expected, rtol=1e-5, atol=1e-6)
    assert st["restarts"]["podReplacements"] == 1, st
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)
