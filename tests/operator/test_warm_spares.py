"""A worker pod lost with a warm spare present, on the local cluster with the operator, real agents and real
torch (the example's DDP job): the survivors' processes keep running, the spare's parked processes take the
lost ranks in the new round, the state comes from the surviving peer, and the job ends with the parameters
of a run without faults."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_operator_cluster import TRAIN, Jobs, OperatorFactory, job_body, phase_is, wait_for
from torch import nn

from stalwart.api.recovery import PHASES, from_records
from stalwart.api.rendezvous import Manifest
from stalwart.api.restart import ProgressRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.examples import train as example
from stalwart.local.cluster import LocalCluster

pytestmark = pytest.mark.integration

STEPS = 600
#: The tests whose fault comes at step 20 or soon after train slowly (0.05 s a step) until the fault's recovery
#: (``--step-delay-until-resume``: 30 s and more for the fault to land, however loaded the machine) or until this
#: step, then at full speed: every step after the recovery is still compared with the run without faults; only
#: the waiting for the remaining steps goes.
SLOW_UNTIL = 150
UNTIL_RECOVERED = ["--step-delay", "0.05", "--step-delay-until-resume"]


@pytest.fixture
def jobs(kube_api: Any, k8s_namespace: str) -> Jobs:
    return Jobs(kube_api, k8s_namespace)


def pod_pids(ns: str, pod: str) -> set[int]:
    """The processes of pod ``pod`` in namespace ``ns`` on this machine (its agent and rank processes, its
    earlier incarnations' too), found by their environment. The namespace matters: another test suite on this
    machine runs pods of the same names, in its own namespaces, and its processes are not this test's to kill."""
    node, job = f"STALWART_NODE_ID={pod}".encode(), f"STALWART_JOB={ns}/".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if node in env and any(var.startswith(job) for var in env):
            found.add(int(entry.name))
    return found


def rank_pids(ns: str, pod: str) -> set[int]:
    """The rank processes of ``pod``: its processes running the example whose parent is one of the pod's too (the
    agent, whose own command line names the example after ``--``, is the pod's first process)."""
    pids = pod_pids(ns, pod)
    found = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"stalwart.examples.train" in cmdline and parent in pids:
            found.add(pid)
    return found


def slotted_rank_pid(store: Store, keys: JobKeys, pod: str) -> int:
    """The pid of ``pod``'s one rank process with a slot, as its agent reports it (its progress record): with
    warm spares the pod also runs a parked standby process, which looks the same from outside."""
    def found() -> list[int] | None:
        kv = store.get(keys.progress_of(pod))
        pids = [] if kv is None else [r.pid for r in ProgressRecord.from_json_bytes(kv.value).ranks if r.slot >= 0]
        return pids or None
    pids = wait_for(f"{pod}'s progress record naming its rank", found, timeout=60)
    assert len(pids) == 1, f"{pod}: ranks with a slot {pids}, expected one"
    return pids[0]


def manifest(store: Store, keys: JobKeys) -> Manifest | None:
    kv = store.get(keys.rendezvous + "manifest")
    return None if kv is None else Manifest.from_json_bytes(kv.value)


def wait_for_steps(cluster: LocalCluster, ns: str, pod: str, step: int) -> int:
    """Wait until the rank of ``pod`` logged ``step`` (its log: the job's status lags behind under load, and a
    fault meant for a training job must not come after it ended); returns the last step logged."""
    last = [0]

    def reached() -> bool:
        res = cluster.kubectl("logs", pod, "-n", ns, check=False)
        if res.returncode != 0:  # its container has not started yet
            return False
        steps = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"event": "step"')]
        last[0] = max((e["step"] for e in steps), default=0)
        return last[0] >= step

    wait_for(f"step {step} in the log of {pod}", reached, timeout=240)
    return last[0]


def events(cluster: LocalCluster, ns: str, pod: str) -> list[dict[str, Any]]:
    res = cluster.kubectl("logs", pod, "-n", ns, check=False)
    assert res.returncode == 0, f"kubectl logs {pod}: {res.stderr}"
    out = res.stdout
    lines = (line for line in out.splitlines() if line.startswith("{"))
    return [json.loads(line) for line in lines]


def story(cluster: LocalCluster, ns: str, *pods: str, tail: int = 80) -> str:
    """What the agents and ranks of ``pods`` said, step events left out: the message of a failed check, so
    that a failure on a loaded machine explains itself."""
    parts = []
    for pod in pods:
        res = cluster.kubectl("logs", pod, "-n", ns, check=False)
        lines = [line for line in res.stdout.splitlines() if '"event": "step"' not in line]
        parts.append(f"--- {pod} ({len(lines)} lines, the last {tail}):\n" + "\n".join(lines[-tail:]))
    return "\n".join(parts)


def fault_free_params(steps: int, world: int) -> torch.Tensor:
    return schedule_params(steps, [(0, world)])


def assert_fault_free(logs: list[list[dict[str, Any]]], steps: int, world: int) -> None:
    """Every rank of ``world`` finished ``steps`` steps with the parameters of a run without faults."""
    done = {e["rank"]: e for log_ in logs for e in log_ if e["event"] == "done"}
    assert sorted(done) == list(range(world)) and all(d["step"] == steps for d in done.values()), done.keys()
    expected = fault_free_params(steps, world=world)
    for d in done.values():
        assert torch.allclose(torch.tensor(d["params"]), expected, rtol=1e-5, atol=1e-6)
    # The replicas are the same to the bit, the spare's copy from its peer included.
    assert len({d["params_sha256"] for d in done.values()}) == 1, done


@pytest.mark.parametrize(("fault", "in_process"), [
    ("force-delete", {"warmSpares": True}),
    ("sigkill", {"warmSpares": True}),
    ("delete", {}),  # nothing said of warm spares: on by default for a job with spares and a wrapped script
])
def test_worker_lost_with_a_warm_spare_recovers_in_process(fault: str, in_process: dict[str, bool], *,
                                                            start_operator: OperatorFactory, jobs: Jobs,
                                                            local_cluster: LocalCluster, etcd_store: Store) -> None:
    name = f"warm-{fault.replace('-', '')}"
    start_operator(jobs.ns)
    created = jobs.create(job_body(name, replicas=2, spares=1,
                         command=[*TRAIN, "--steps", str(STEPS), *UNTIL_RECOVERED, "--checkpoint-every", "1000",
                                  "--log-every", "1"],
                         restartPolicy={"inProcess": in_process}))
    survivor, victim, spare = f"{name}-worker-0", f"{name}-worker-1", f"{name}-spare-0"
    try:
        # Its parked rank processes, not just two processes of the pod: its agent and the agent's fork server are
        # two before any parked process exists (a spare that parks only once a member's report shows the wrapper,
        # as with warm spares left to their default, may park after the fault under load, and then start a
        # fresh process for the lost ranks).
        wait_for("the spare's parked processes", lambda: rank_pids(jobs.ns, spare), timeout=240)
    except AssertionError as e:
        tail = local_cluster.kubectl("logs", spare, "-n", jobs.ns, check=False).stdout[-3000:]
        res = local_cluster.kubectl("get", "pods", "-n", jobs.ns, "-o", "wide", check=False)
        got = res.stdout + res.stderr
        raise AssertionError(f"{e}; pods:\n{got}\nthe spare's log ends: {tail}") from None
    at = wait_for_steps(local_cluster, jobs.ns, survivor, 20)
    before = pod_pids(jobs.ns, survivor)
    assert len(before) >= 2  # the agent and its rank

    # The fault must land while the job trains slowly: until its recovery, at 0.05 s a step.
    assert at < STEPS // 2, f"the job reached step {at} before the fault: too late to inject it"
    t_fault = time.time()
    if fault == "force-delete":
        local_cluster.kubectl("delete", "pod", victim, "-n", jobs.ns, "--grace-period=0", "--force", "--wait=false")
    elif fault == "sigkill":
        for pid in pod_pids(jobs.ns, victim):
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
    assert resumed and resumed[0]["rank"] == 1 - own_rank, story(local_cluster, jobs.ns, survivor, spare)
    assert resumed[0]["source"] == own_rank and resumed[0]["step"] > 0, story(local_cluster, jobs.ns, survivor,
                                                                              spare)
    assert_fault_free([survivor_log, spare_log], STEPS, world=2)
    assert st["restarts"] == {"inProcess": 1, "processRestarts": 0, "podReplacements": 1}, (
        st["restarts"], story(local_cluster, jobs.ns, survivor, spare))
    assert st["lastFailure"]["pod"] == victim, st["lastFailure"]  # the lost pod, not the survivor
    assert took_over(jobs, name) == [spare]
    # The ranks' and agents' marks give every phase of the recovery, in order, each >= 0, adding up to the
    # time from the fault to the first step at full world size (the spare's model was built while it waited).
    kvs, _ = etcd_store.get_prefix(JobKeys(jobs.ns, created["metadata"]["uid"]).progress)
    phases = from_records([ProgressRecord.from_json_bytes(kv.value) for kv in kvs], t_fault)
    assert phases is not None, story(local_cluster, jobs.ns, survivor, spare)
    assert [name for name, _ in phases.seconds] == list(PHASES)
    assert all(s is not None and s >= 0 for _, s in phases.seconds), phases
    assert sum(s or 0.0 for _, s in phases.seconds) == pytest.approx(phases.raw)
    assert phases.copy_bytes > 0 and phases.copy_sources == 1 and phases.first_knower, phases
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


def took_over(jobs: Jobs, name: str) -> list[str]:
    """The spares the job's ``SpareTookOver`` Events name, in the order of the Events."""
    items = [e for e in jobs.core.list_namespaced_event(jobs.ns).items if e.involved_object.kind == "TrainingJob"
             and e.involved_object.name == name and e.reason == "SpareTookOver"]
    items.sort(key=lambda e: e.metadata.creation_timestamp)
    return [e.message.split()[2] for e in items]


def schedule_params(steps: int, worlds: list[tuple[int, int]], batch_size: int = 32, lr: float = 0.05,
                    seed: int = 0) -> torch.Tensor:
    """The parameters after ``steps`` steps where the world size changes as ``worlds`` says: (first step,
    world size) pairs, computed in one process (the mean of the ranks' losses, as DDP averages gradients)."""
    model = example.build_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        world = [w for first, w in worlds if first <= step][-1]
        opt.zero_grad(set_to_none=True)
        loss = sum(nn.functional.mse_loss(model(x), y)
                   for x, y in (example.batch(seed, step, r, batch_size) for r in range(world))) / world
        loss.backward()  # type: ignore[union-attr]
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_without_a_spare_the_world_shrinks_and_grows_back_in_process(
        start_operator: OperatorFactory, jobs: Jobs, local_cluster: LocalCluster) -> None:
    name = "warm-shrink"
    start_operator(jobs.ns)
    jobs.create(job_body(name, replicas=2, minReplicas=1, spares=0,
                         command=[*TRAIN, "--steps", str(STEPS), "--step-delay", "0.05", "--checkpoint-every", "1000",
                                  "--log-every", "1"],
                         restartPolicy={"inProcess": {"warmSpares": True}}))
    survivor, victim = f"{name}-worker-0", f"{name}-worker-1"
    wait_for_steps(local_cluster, jobs.ns, f"{name}-worker-0", 20)
    nodes = [n["metadata"]["name"] for n in json.loads(local_cluster.kubectl("get", "nodes", "-o", "json").stdout)[
        "items"]]
    # No room for the replacement until the world has shrunk: the shrink is certain, not a race.
    for node in nodes:
        local_cluster.kubectl("cordon", node)
    try:
        # The pod's processes killed outright: the shrink starts at once (a force delete waits for the kubelet,
        # which a loaded machine once kept busy for 300 steps, leaving the growth too few steps to land in).
        for pid in pod_pids(jobs.ns, victim):
            os.kill(pid, signal.SIGKILL)
        wait_for("the world shrunk to 1", lambda: jobs.status(name).get("worldSize") == 1
                 and (jobs.status(name).get("progress") or {}).get("step", 0) >= 60, timeout=240)
    finally:
        for node in nodes:
            local_cluster.kubectl("uncordon", node)
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    survivor_log = events(local_cluster, jobs.ns, survivor)
    assert [e["event"] for e in survivor_log].count("start") == 1, survivor_log[:5]
    resumes = sorted((e["time"], e["step"], e["world_size"]) for e in survivor_log if e["event"] == "resume")
    worlds = [(step, world) for _, step, world in resumes]
    sizes = [w for _, w in worlds]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, worlds  # shrank to minReplicas, grew back
    done = [e for e in survivor_log if e["event"] == "done"]
    assert done and done[0]["step"] == STEPS and done[0]["world_size"] == 2
    expected = schedule_params(STEPS, worlds)
    assert torch.allclose(torch.tensor(done[0]["params"]), expected, rtol=1e-5, atol=1e-6)
    assert st["restarts"]["podReplacements"] == 1, st
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


def test_losing_the_spare_itself_leaves_training_alone(start_operator: OperatorFactory, jobs: Jobs,
                                                       local_cluster: LocalCluster) -> None:
    name = "warm-spareloss"
    start_operator(jobs.ns)
    jobs.create(job_body(name, replicas=2, spares=1,
                         command=[*TRAIN, "--steps", str(STEPS), "--step-delay", "0.05", "--step-delay-until",
                                  str(SLOW_UNTIL), "--checkpoint-every", "1000", "--log-every", "1"],
                         restartPolicy={"inProcess": {"warmSpares": True}}))
    spare = f"{name}-spare-0"
    wait_for("the spare's parked processes", lambda: rank_pids(jobs.ns, spare), timeout=240)
    at = wait_for_steps(local_cluster, jobs.ns, f"{name}-worker-0", 20)
    assert at < SLOW_UNTIL - 50, f"the job reached step {at} before the spare's loss: too late to inject it"
    local_cluster.kubectl("delete", "pod", spare, "-n", jobs.ns, "--grace-period=0", "--force", "--wait=false")
    wait_for("a new spare", lambda: any(p.metadata.name.startswith(f"{name}-spare-") and p.metadata.name != spare
                                        for p in jobs.live_pods(name)), timeout=120)
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    logs = [events(local_cluster, jobs.ns, f"{name}-worker-{i}") for i in (0, 1)]
    for log_ in logs:  # neither worker restarted anything, nor resumed more than once
        assert [e["event"] for e in log_].count("start") == 1
        assert [e["event"] for e in log_].count("resume") == 1
    done = [e for log_ in logs for e in log_ if e["event"] == "done"]
    expected = fault_free_params(STEPS, world=2)
    assert len(done) == 2 and all(torch.allclose(torch.tensor(d["params"]), expected, rtol=1e-5, atol=1e-6)
                                  for d in done)
    assert st["restarts"]["podReplacements"] == 1, st
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


def test_a_second_worker_lost_while_the_job_recovers_from_the_first(
        start_operator: OperatorFactory, jobs: Jobs, etcd_store: Store, local_cluster: LocalCluster) -> None:
    name = "warm-double"
    start_operator(jobs.ns)
    created = jobs.create(job_body(name, replicas=3, spares=2, command=[
        *TRAIN, "--steps", str(STEPS), *UNTIL_RECOVERED, "--checkpoint-every", "1000", "--log-every", "1"],
        restartPolicy={"inProcess": {"warmSpares": True}}))
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    workers = [f"{name}-worker-{i}" for i in range(3)]
    spares = [f"{name}-spare-{i}" for i in range(2)]
    for spare in spares:
        wait_for(f"the parked processes of {spare}", lambda spare=spare: rank_pids(jobs.ns, spare), timeout=240)
    at = wait_for_steps(local_cluster, jobs.ns, f"{name}-worker-0", 20)
    assert at < STEPS // 2, f"the job reached step {at} before the fault: too late to inject it"
    first = manifest(etcd_store, keys)
    assert first is not None and sorted(m.node_id for m in first.members) == workers
    # The spares' parked ranks are paused, so the new round cannot take a step before the second loss: the
    # second loss lands in the recovery from the first, for certain (the spares' agents still act).
    paused = {pid for spare in spares for pid in rank_pids(jobs.ns, spare)}
    for pid in paused:
        os.kill(pid, signal.SIGSTOP)
    try:
        local_cluster.kubectl("delete", "pod", workers[2], "-n", jobs.ns, "--grace-period=0", "--force",
                              "--wait=false")
        second = wait_for("a round without the lost worker", lambda: (m := manifest(etcd_store, keys)) is not None
                          and m.round > first.round and m, timeout=120, interval=0.05)
        assert workers[2] not in {m.node_id for m in second.members} and workers[1] in {
            m.node_id for m in second.members}, second
        for pid in pod_pids(jobs.ns, workers[1]):  # the whole pod, while the new round waits for its first step
            os.kill(pid, signal.SIGKILL)
    finally:
        for pid in paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    survivor_log = events(local_cluster, jobs.ns, workers[0])
    assert [e["event"] for e in survivor_log].count("start") == 1, survivor_log[:5]
    spare_logs = [events(local_cluster, jobs.ns, spare) for spare in spares]
    for log_ in spare_logs:  # each spare's parked process took ranks in process: started once, never again
        assert [e["event"] for e in log_].count("start") == 1, log_[:5]
        resumed = [e for e in log_ if e["event"] == "resume"]
        assert resumed and resumed[0]["step"] > 0 and resumed[0]["source"] is not None, story(
            local_cluster, jobs.ns, *workers, *spares)
    assert_fault_free([survivor_log, *spare_logs], STEPS, world=3)
    # In process, no rank process started again. The new round is one restart; the second loss adds one where
    # the ranks ran into it in the round it hit (a fault record of that round) before the next round was
    # sealed, else the next round recovers from both: which comes first is the ranks' race, not the status'.
    restarts = st["restarts"]
    assert restarts["processRestarts"] == 0 and restarts["podReplacements"] == 2, st
    assert restarts["inProcess"] in (1, 2), st
    assert st["lastFailure"]["pod"] in workers[1:], st["lastFailure"]  # a lost pod, not the survivor
    # Each spare is announced once, also one whose first round was superseded before its agent wrote a record
    # of it (the second loss may seal the next round within a fraction of a second).
    assert sorted(took_over(jobs, name)) == spares
    assert st["promotedSpares"] == spares, st
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


def test_a_partitioned_node_with_warm_spares_recovers_in_process_and_its_zombie_writes_nothing(
        start_operator: OperatorFactory, jobs: Jobs, etcd_store: Store, local_cluster: LocalCluster) -> None:
    name, steps = "warm-part", 600
    start_operator(jobs.ns)
    body = job_body(name, replicas=2, spares=1, command=[
        *TRAIN, "--steps", str(steps), "--step-delay", "0.05", "--checkpoint-every", "1000", "--log-every", "1"],
        restartPolicy={"inProcess": {"warmSpares": True}})
    # 3 CPUs a pod on nodes of 8: the scheduler spreads the three pods, one per node.
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "3"}}
    created = jobs.create(body)
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    survivor, victim, spare = f"{name}-worker-0", f"{name}-worker-1", f"{name}-spare-0"
    wait_for("the spare's parked processes", lambda: rank_pids(jobs.ns, spare), timeout=240)
    wait_for_steps(local_cluster, jobs.ns, f"{name}-worker-0", 20)
    node = next(p.spec.node_name for p in jobs.pods(name) if p.metadata.name == victim)
    assert [p.metadata.name for p in jobs.pods(name) if p.spec.node_name == node] == [victim]
    zombie = pod_pids(jobs.ns, victim)
    assert len(zombie) >= 2  # its agent and its rank

    local_cluster.lose_node(node, partition=True)
    try:
        new = wait_for("a round without the partitioned pod", lambda: (m := manifest(etcd_store, keys)) is not None
                       and m.round > 1 and (jobs.status(name).get("progress") or {}).get("step", 0) > 0 and m,
                       timeout=180)
        assert sorted(m.node_id for m in new.members) == sorted([survivor, spare]), new
        epoch = etcd_store.get(keys.rendezvous + "manifest").mod_revision  # type: ignore[union-attr]
        # The partition heals towards etcd first: the zombie runs again, its round long fenced out.
        _, since = etcd_store.get_prefix(keys.prefix, keys_only=True)
        for pid in zombie:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        written: list[str] = []
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            current = manifest(etcd_store, keys)
            assert current is not None and current.member(victim) is None
            kvs, _ = etcd_store.get_prefix(keys.restart)
            written += [kv.key for kv in kvs if kv.mod_revision > since and victim.encode() in kv.value]
            time.sleep(0.1)
        # Nothing of the zombie's in the current round: no fault, no barrier arrival, no new round.
        assert written == [], written
        assert etcd_store.get(keys.rendezvous + "manifest").mod_revision == epoch  # type: ignore[union-attr]
    finally:
        local_cluster.restore_node(node)
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=300)
    assert st["phase"] == "Succeeded", st
    survivor_log = events(local_cluster, jobs.ns, survivor)
    assert [e["event"] for e in survivor_log].count("start") == 1, survivor_log[:5]
    spare_log = events(local_cluster, jobs.ns, spare)
    resumed = [e for e in spare_log if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] > 0 and resumed[0]["source"] is not None, story(
        local_cluster, jobs.ns, survivor, spare)
    assert_fault_free([survivor_log, spare_log], steps, world=2)
    assert st["restarts"] == {"inProcess": 1, "processRestarts": 0, "podReplacements": 1}, st
    assert st["lastFailure"]["pod"] == victim and st["lastFailure"]["reason"] == "NodeLost", st["lastFailure"]
    assert took_over(jobs, name) == [spare]
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)
