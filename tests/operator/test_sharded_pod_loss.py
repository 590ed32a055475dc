"""A sharded job loses a pod and recovers from peer snapshots, on the local cluster with the operator, real
agents and real torch: FSDP2 over gloo (stalwart/examples/train_fsdp.py), 2 workers of 2 ranks and a spare,
no warm-spare setting (on by default for a job with spares). A worker pod is force-deleted mid-run; the
survivor's processes continue in process, the spare's parked processes take the lost ranks, their shards come
from their buddies' memory (not from the checkpoint, which is never written in this run), and the job ends
with the parameters of a fault-free run of the same script, bit for bit. Also when the survivor rank that holds
the only copy of a lost shard is stuck where no interrupt frees it: its successor takes what it wrote out."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_operator_cluster import Jobs, OperatorFactory, job_body, phase_is, wait_for
from test_warm_spares import events, pod_pids, story, wait_for_steps

from stalwart.examples.train_fsdp import HANG_AT_STEP_ENV, HANG_MARKER_ENV, HANG_RANK_ENV
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

# Enough steps after the fault (at step 20 or a little later) for the recovery to happen mid-run and for every
# rank to train on at full world for long after it; the reference run trains as many.
STEPS = 150
SCRIPT = ["python", "-m", "stalwart.examples.train_fsdp", "--steps", str(STEPS), "--log-every", "1",
          "--checkpoint-every", "100000"]


@pytest.fixture
def jobs(kube_api: Any, k8s_namespace: str) -> Jobs:
    return Jobs(kube_api, k8s_namespace)


def fault_free_digest(tmp: Path) -> str:
    """The same script as four plain processes on this machine, two "pods" (GROUP_RANK) of two, no faults."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(4):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GROUP_RANK": str(rank // 2), "OMP_NUM_THREADS": "1"}
        env.pop("STALWART_JOB", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "stalwart.examples.train_fsdp", "--steps", str(STEPS), "--log-every", "1000",
             "--checkpoint-every", "100000", "--checkpoint-dir", str(tmp / "reference")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    digests = {json.loads(line)["params_sha256"] for out in outs for line in out.splitlines()
               if line.startswith('{"event": "done"')}
    assert len(digests) == 1, digests
    return digests.pop()


@pytest.fixture(scope="module")
def expected(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of the fault-free run, for every test of the module (one worker runs them all)."""
    return fault_free_digest(tmp_path_factory.mktemp("reference"))


@pytest.mark.timeout(900)  # a reference run of four processes, then a job of six rank processes, on two cores
def test_a_sharded_job_recovers_a_lost_pod_from_peer_snapshots_bit_for_bit(
        start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster, expected: str) -> None:
    name = "sharded"
    start_operator(jobs.ns)
    jobs.create(job_body(name, replicas=2, spares=1, nprocPerNode=2,
                         command=[*SCRIPT, "--step-delay", "0.05"]))
    survivor, victim, spare = f"{name}-worker-0", f"{name}-worker-1", f"{name}-spare-0"
    # The spare parks its two rank processes once the workers' ranks showed the restart wrapper.
    wait_for("the spare's parked processes", lambda: len(pod_pids(jobs.ns, spare)) >= 3, timeout=240)
    at = wait_for_steps(local_cluster, jobs.ns, survivor, 20)
    # The status says how far the snapshots are: the newest step every rank's copy has landed for.
    snap = wait_for("status.peerSnapshot", lambda: (s := jobs.status(name).get("peerSnapshot") or {}).get(
        "step", 0) >= 10 and s, timeout=120)
    assert snap["time"] and not snap.get("fallback"), snap
    assert at < STEPS - 60, f"the job reached step {at} of {STEPS} before the fault: too late to inject it"
    local_cluster.kubectl("delete", "pod", victim, "-n", jobs.ns, "--grace-period=0", "--force", "--wait=false")

    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=600)
    assert st["phase"] == "Succeeded", (st, story(local_cluster, jobs.ns, survivor, spare))
    survivor_log, spare_log = events(local_cluster, jobs.ns, survivor), events(local_cluster, jobs.ns, spare)
    # The survivor's two processes are the ones it started with.
    assert [e["event"] for e in survivor_log].count("start") == 2, story(local_cluster, jobs.ns, survivor)
    # Every rank of the new round took its shard from the snapshots: the spare's from their buddies.
    resumed = [e for e in survivor_log + spare_log if e["event"] == "resume" and e["source"] == "peers"]
    assert {e["rank"] for e in resumed} == {0, 1, 2, 3}, story(local_cluster, jobs.ns, survivor, spare)
    steps = {e["step"] for e in resumed}
    assert len(steps) == 1 and min(steps) > 0, resumed
    resumed_at = min(steps)
    assert not any(e["event"] == "resume" and e["source"] == "checkpoint" for e in survivor_log + spare_log)
    done = [e for e in survivor_log + spare_log if e["event"] == "done"]
    assert {e["rank"] for e in done} == {0, 1, 2, 3}, done
    assert {e["params_sha256"] for e in done} == {expected}, "the recovered run differs from the fault-free one"
    assert st["peerSnapshot"]["step"] >= resumed_at, st["peerSnapshot"]  # the new round's ranks report theirs too
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


@pytest.mark.timeout(900)
def test_a_survivor_stuck_where_no_interrupt_frees_it_hands_its_snapshots_to_its_successor(
        start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster, tmp_path: Path,
        expected: str) -> None:
    # Rank 1 holds the only copy of a shard of the other worker (its ward), and hangs in native code at step 25
    # (the example's drill: as a gloo transfer cut off in flight holds a rank); the other worker is lost while
    # it hangs. Its monitor writes what it holds out and ends the process, long before its hard timeout; its
    # agent starts a new process in its slot, which takes the copies: every shard comes back from the
    # snapshots.
    name = "sharded-stuck"
    start_operator(jobs.ns)
    body = job_body(name, replicas=2, spares=1, nprocPerNode=2, command=[*SCRIPT, "--step-delay", "0.05"],
                    restartPolicy={"inProcess": {"softTimeoutSeconds": 10, "hardTimeoutSeconds": 120}})
    body["spec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": HANG_AT_STEP_ENV, "value": "25"}, {"name": HANG_RANK_ENV, "value": "1"},
        {"name": HANG_MARKER_ENV, "value": str(tmp_path / "hung")}]
    jobs.create(body)
    workers, spare = [f"{name}-worker-{i}" for i in (0, 1)], f"{name}-spare-0"
    wait_for("the spare's parked processes", lambda: len(pod_pids(jobs.ns, spare)) >= 3, timeout=240)
    hung = wait_for("rank 1 to hang", lambda: next((w for w in workers if any(
        e["event"] == "hang" for e in events(local_cluster, jobs.ns, w))), None), timeout=240, interval=0.2)
    survivor, victim = hung, next(w for w in workers if w != hung)
    local_cluster.kubectl("delete", "pod", victim, "-n", jobs.ns, "--grace-period=0", "--force", "--wait=false")

    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=600)
    assert st["phase"] == "Succeeded", (st, story(local_cluster, jobs.ns, survivor, spare))
    survivor_log, spare_log = events(local_cluster, jobs.ns, survivor), events(local_cluster, jobs.ns, spare)
    # The stuck rank's process was replaced (a third start on the survivor), the other kept its own.
    assert [e["event"] for e in survivor_log].count("start") == 3, story(local_cluster, jobs.ns, survivor)
    hang = next(e for e in survivor_log if e["event"] == "hang")
    after = sorted((e for e in survivor_log + spare_log if e["event"] == "resume" and e["time"] > hang["time"]),
                   key=lambda e: e["time"])
    assert after and {e["source"] for e in after} == {"peers"}, after  # never the checkpoint, never from scratch
    final = after[-4:]
    assert {e["rank"] for e in final} == {0, 1, 2, 3}, after
    assert len({e["step"] for e in final}) == 1 and final[0]["step"] > 0, final
    done = [e for e in survivor_log + spare_log if e["event"] == "done"]
    assert {e["rank"] for e in done} == {0, 1, 2, 3}, done
    assert {e["params_sha256"] for e in done} == {expected}, "the recovered run differs from the fault-free one"
    text = local_cluster.kubectl("logs", survivor, "-n", jobs.ns).stdout
    assert "bytes of snapshots it holds to" in text, story(local_cluster, jobs.ns, survivor)  # written out
    assert "snapshot copies the process before this one spilled" in text, story(local_cluster, jobs.ns, survivor)
    assert "ended itself (exit code 98): its main thread stayed blocked after its interrupt" in text, text[-3000:]
    assert "within its hard timeout" not in text, text[-3000:]  # not the agent's kill: the process's own end
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)
