"""A pod's standby process end to end: real etcd, two agents (pods) of one rank each, real torch ranks
(bench/restart_ddp.py, whose ``prepare`` hook records each call). A SIGKILLed rank process is replaced by its
pod's standby (its PID is the standby's, which prepared while parked), the job ends with a fault-free run's
parameters, a new standby stands behind it, and every process ends with the agents. A spare whose parked
process's ``prepare`` raises is reported in its pod's progress record (the exception and the pod), while the
job finishes untouched."""

from __future__ import annotations

import json
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_agent import agents_end, ended_ok, progress, results, start_agent  # puts tests/restart on the path

from restart_helpers import expected_checksum, wait_until  # isort: skip

from stalwart.api.rendezvous import Manifest
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.procfs import process_state

pytestmark = pytest.mark.integration

STEPS = 80
STARTED = re.compile(r"started a standby process \(pid (\d+)")
TOOK = re.compile(r"local rank 0 \(.*\): the standby process \(pid (\d+)\) takes its place")


def prepared(tmp: Path) -> list[dict[str, Any]]:
    path = tmp / "prepare.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def running_pid(etcd: EtcdServer, keys: JobKeys, pod: str) -> int | None:
    """The pid of the pod's rank process once it has completed a few steps (from its agent's report)."""
    rec = progress(etcd, keys, pod)
    if rec is None:
        return None
    return next((r.pid for r in rec.ranks if r.state == "running" and (r.step or 0) >= 3), None)


def test_a_killed_rank_is_replaced_by_its_pods_standby(etcd: EtcdServer, tmp_path: Path) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    agents = [start_agent(etcd, tmp_path, "--steps", str(STEPS), "--step-sleep", "0.15", "--prepare", "count",
                          keys=keys, pod=f"job-worker-{i}", nproc=1, nodes=2, agent_args=("--warm-spares",))[0]
              for i in range(2)]
    with agents_end(agents):
        # Both pods' standbys prepared while parked, and the ranks train.
        wait_until("two parked standbys and steps on worker-1", lambda: sum(
            r["parked"] for r in prepared(tmp_path)) >= 2 and running_pid(etcd, keys, "job-worker-1") is not None)
        victim = running_pid(etcd, keys, "job-worker-1")
        assert victim is not None
        parked_before = {r["pid"] for r in prepared(tmp_path) if r["parked"]}
        os.kill(victim, signal.SIGKILL)
        errs = [err for _, err in ended_ok(agents)]

    err = errs[1]
    (took,) = [int(pid) for pid in TOOK.findall(err)]
    assert "respawning local rank" not in err, err[-3000:]
    # It was parked (and prepared) before the kill; one more was started behind it.
    assert took in parked_before, (took, parked_before)
    at = err.index(TOOK.search(err)[0])  # type: ignore[index]
    before = [int(p) for p in STARTED.findall(err[:at])]
    after = [int(p) for p in STARTED.findall(err[at:])]
    assert took in before and len(after) == 1 and after[0] != took, err[-4000:]
    # The rank's place is the standby's process to the end, with the parameters of a fault-free run (which rank
    # it holds then is the rendezvous' choice: a later round under load may number the pods the other way).
    res = {r["rank"]: r for r in results(tmp_path)}
    assert sorted(res) == [0, 1] and took in {r["pid"] for r in res.values()}, res
    reference = expected_checksum(steps=STEPS)
    assert all(r["step"] == STEPS and r["restarts"] >= 1 and r["checksum"] == pytest.approx(reference, abs=1e-6)
               for r in res.values()), res
    # Its prepare ran once, while parked: never again after it took the place.
    assert [r["parked"] for r in prepared(tmp_path) if r["pid"] == took] == [True]
    rec = progress(etcd, keys, "job-worker-1")
    assert rec is not None and rec.process_restarts == 1 and rec.parked_failure is None
    # Every process the agents started ended with them: the ranks, the replaced one, every standby.
    started = {victim, took, *after, *(int(p) for e in errs for p in STARTED.findall(e)),
                *(r["pid"] for r in prepared(tmp_path))}
    assert {pid: process_state(pid) for pid in started if process_state(pid) not in ("", "Z")} == {}


def workers_sealed(etcd: EtcdServer, keys: JobKeys) -> bool:
    """Whether the job's round manifest names both workers as members."""
    with Store([etcd.endpoint]) as store:
        kv = store.get(keys.rendezvous + "manifest")
    if kv is None:
        return False
    manifest = Manifest.from_json_bytes(kv.value)
    return all(manifest.member(f"job-worker-{i}") is not None for i in range(2))


#: Long enough (0.1 s a step) for the spare, started once the workers hold the round, to park and run its hook.
SPARE_STEPS = 100


def test_a_spare_whose_prepare_raises_is_reported_and_the_job_runs_on(etcd: EtcdServer, tmp_path: Path) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    workers = [start_agent(etcd, tmp_path, "--steps", str(SPARE_STEPS), "--step-sleep", "0.1", "--prepare", "count",
                           keys=keys, pod=f"job-worker-{i}", nproc=1, nodes=2,
                           agent_args=("--warm-spares", "--no-standby"))[0]
               for i in range(2)]
    agents = list(workers)
    with agents_end(agents):
        # The spare comes once the workers hold the round (its manifest names both): started beside them, a loaded
        # machine may let it register first and take a worker's place as a member, where its hook fails a rank,
        # not a parked process. The workers' ranks are still starting then, so the spare parks while they train.
        wait_until("a round of both workers", lambda: workers_sealed(etcd, keys), timeout=240)
        spare, _ = start_agent(etcd, tmp_path, "--steps", str(SPARE_STEPS), "--prepare", "raise", keys=keys,
                               pod="job-spare-0", nproc=1, nodes=2, agent_args=("--warm-spares",),
                               extra_env={"STALWART_SPARE": "true"})
        agents.append(spare)
        errs = [err for _, err in ended_ok(agents)]
    rec = progress(etcd, keys, "job-spare-0")
    assert rec is not None and rec.parked_failure is not None, errs[2][-3000:]
    failure = rec.parked_failure
    assert (failure.pod, failure.exception, failure.message) == (
        "job-spare-0", "ValueError", "the model's configuration is invalid (injected in prepare)")
    assert "PREPARE_FAILED" in failure.reason and rec.last_failure is None
    assert "parked local rank 0 (pid" in errs[2] and "ValueError: the model's configuration is invalid" in errs[2]
    # The job: both ranks to the end, no restart, a fault-free run's parameters.
    res = results(tmp_path)
    reference = expected_checksum(steps=SPARE_STEPS)
    assert sorted(r["rank"] for r in res) == [0, 1], res
    assert all(r["restarts"] == 0 and r["checksum"] == pytest.approx(reference, abs=1e-6) for r in res), res
