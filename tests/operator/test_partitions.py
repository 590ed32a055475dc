"""Live zombies: a worker's node cut off from the network while its agent and rank run on, on the local cluster with
a network namespace per node, the operator, real agents and real torch (the example's DDP job, 2 workers and a warm
spare). The cut is held past the agents' lease TTL, then healed. Whatever the zombie does while cut off and once the
link is back, the job ends Succeeded with the parameters of a fault-free run, bit for bit; nothing it wrote after its
round was superseded names it in etcd's history of the job (every key's create and mod revisions, every value
naming a node: the restart records, progress records and rendezvous keys carry the writer's node id); its ranks
never joined the new round's group; the status names the partitioned pod; and its agent said it was fenced.
A cut from one peer only (the other worker's node) makes no zombie: both leases live and neither end is more
cut than the other, so the job waits the cut out (the collective waits, or its ranks are interrupted after
the soft timeout, once the link is back), fences and replaces no one, and ends with the same parameters.

The lease TTL is 4 s (the default is 10 s) and the node-monitor grace period 3 s (the session cluster's): what the
tests prove does not depend on them, only how long they wait."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_operator_cluster import TRAIN, Jobs, OperatorFactory, job_body, phase_is, wait_for
from test_operator_node_loss import nodes_free_of_other_pods
from test_warm_spares import events, manifest, pod_pids, rank_pids, story, took_over, wait_for_steps

from stalwart.api.rendezvous import Manifest
from stalwart.etcd.keys import FENCED, JobKeys
from stalwart.etcd.records import WatchEvent
from stalwart.etcd.store import Store
from stalwart.local.cluster import LocalCluster
from stalwart.local.processes import ended

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from test_train import run_ranks  # isort: skip

pytestmark = pytest.mark.integration

STEPS = 600
LEASE_TTL = 4
#: What each kind of cut takes the node off from (None: everything).
CUTS: dict[str, list[str] | None] = {"full": None, "etcd": ["etcd"], "api": ["api"]}
COMMAND = [*TRAIN, "--steps", str(STEPS), "--checkpoint-every", "1000", "--log-every", "1"]
#: The fault-free run's parameters digest, computed once per session (the first test that needs it runs it).
_BASELINE: dict[str, str] = {}


def needs_namespaces(cluster: LocalCluster) -> None:
    if cluster.network.get("mode") != "netns":
        pytest.skip("a network cut needs a network namespace per node (root and `ip netns`); this cluster runs "
                    f"in {cluster.network.get('mode')} mode")


def fault_free_digest(tmp_path: Path) -> str:
    """The ``params_sha256`` of the same training without a fault (two ranks, forked as an agent forks them, no
    cluster: the digest does not depend on how the ranks were started, as tests/agent/test_agent_copy_fault.py
    shows against an agent-run job): the digest every partitioned run must end with."""
    if "sha" not in _BASELINE:
        args = COMMAND[COMMAND.index("stalwart.examples.train") + 1:]  # the job's arguments, without the command
        results = run_ranks(2, [*args, "--checkpoint-dir", str(tmp_path / "fault-free")])
        assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
        done = [e for _, evs, _ in results for e in evs if e["event"] == "done"]
        assert len(done) == 2 and len({d["params_sha256"] for d in done}) == 1, done
        _BASELINE["sha"] = done[0]["params_sha256"]
    return _BASELINE["sha"]


def history(store: Store, prefix: str, since: int) -> list[WatchEvent]:
    """Every change under ``prefix`` after revision ``since`` up to now, from etcd's own history."""
    until = store.revision()
    found: list[WatchEvent] = []
    with store.watch(prefix, prefix=True, start_revision=since + 1) as watch:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            event = watch.next(timeout=2.0)
            if event is None:
                if not found or found[-1].kv.mod_revision >= until:
                    break
                continue
            found.append(event)
            if event.kv.mod_revision >= until:
                break
    return found


def zombie_writes(changes: list[WatchEvent], keys: JobKeys, victim: str) -> list[str]:
    """The puts among ``changes`` whose key or value names ``victim``: what its agent or ranks wrote (each writer
    names itself: node keys, progress records, restart records carry the node id), the operator's own records
    (the job's, the expected nodes, the fence records) left out."""
    operators = (keys.job, keys.expected, keys.prefix + FENCED)
    return [f"{e.kv.key[len(keys.prefix):]}@{e.kv.mod_revision}" for e in changes if e.type == "put"
            and not e.kv.key.startswith(operators) and (victim in e.kv.key or victim.encode() in e.kv.value)
            and not (e.kv.key == keys.manifest and not by_or_with(e.kv.value, victim))]


def by_or_with(manifest: bytes, node: str) -> bool:
    """Whether a manifest was sealed by ``node`` or takes it in (another sealer's may name it as lost)."""
    m = Manifest.from_json_bytes(manifest)
    return m.sealed_by == node or m.member(node) is not None or node in m.spares


def pod_log(cluster: LocalCluster, ns: str, pod: str) -> str:
    """The whole log of ``pod`` (agent and ranks), from its directory: the zombie's pod is gone from the API."""
    dirs = sorted((cluster.dir / "pods").glob(f"{ns}_{pod}_*"))
    return "".join(Path(d, "trainer.log").read_text(errors="replace") for d in dirs if Path(d, "trainer.log").exists())


def start_spread_job(jobs: Jobs, local_cluster: LocalCluster, name: str,
                     in_process: dict[str, Any]) -> tuple[JobKeys, str, str, str]:
    """Start job ``name`` (2 workers and a spare, the test's lease TTL, ``in_process`` as its
    restartPolicy.inProcess), one pod a node, and wait until the spare is parked and worker-0 trains; its keys and
    its survivor's, victim's and spare's pod names."""
    body = job_body(name, replicas=2, spares=1, command=[*COMMAND, "--step-delay", "0.05"],
                    restartPolicy={"inProcess": in_process})
    body["spec"]["rendezvous"]["leaseTTLSeconds"] = LEASE_TTL
    # 3 CPUs a pod on nodes of 8: the scheduler spreads the three pods, one per node.
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "3"}}
    wait_for("the nodes free of other tests' pods", lambda: nodes_free_of_other_pods(jobs), timeout=120)
    created = jobs.create(body)
    keys = JobKeys(jobs.ns, created["metadata"]["uid"])
    survivor, victim, spare = f"{name}-worker-0", f"{name}-worker-1", f"{name}-spare-0"
    wait_for("the spare's parked processes", lambda: rank_pids(jobs.ns, spare), timeout=240)
    wait_for_steps(local_cluster, jobs.ns, survivor, 20)
    return keys, survivor, victim, spare


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_live_zombie_is_fenced_and_the_job_ends_with_fault_free_parameters(
        cut: str, *, start_operator: OperatorFactory, jobs: Jobs, etcd_store: Store,
        local_cluster: LocalCluster, tmp_path: Path) -> None:
    needs_namespaces(local_cluster)
    start_operator(jobs.ns)
    expected = fault_free_digest(tmp_path)
    name = f"part-{cut}"
    keys, survivor, victim, spare = start_spread_job(jobs, local_cluster, name, {"warmSpares": True})
    node = next(p.spec.node_name for p in jobs.pods(name) if p.metadata.name == victim)
    assert [p.metadata.name for p in jobs.pods(name) if p.spec.node_name == node] == [victim]
    first = manifest(etcd_store, keys)
    assert first is not None and victim in {m.node_id for m in first.members}
    uid = next(p.metadata.uid for p in jobs.pods(name) if p.metadata.name == victim)
    zombie = pod_pids(jobs.ns, victim)
    assert len(zombie) >= 2  # its agent and its rank

    local_cluster.partition(node, CUTS[cut])
    healed = False
    try:
        new = wait_for("a round without the partitioned pod", lambda: (m := manifest(etcd_store, keys)) is not None
                       and m.round > first.round and m, timeout=180)
        assert sorted(m.node_id for m in new.members) == sorted([survivor, spare]), new
        wait_for("training in the new round", lambda: (jobs.status(name).get("progress") or {}).get(
            "step", 0) > 0 and jobs.status(name).get("round", 0) > first.round, timeout=180)
        # The operator counted the pod lost (its node unreachable, or its lease gone and its agent silent) and
        # fenced it for good: its fence record names its uid.
        fence = wait_for("the pod's fence record", lambda: etcd_store.get(keys.fenced(uid)), timeout=180)
        time.sleep(LEASE_TTL)  # held well past the TTL: the zombie's lease is long gone
        alive_in_cut = [pid for pid in zombie if not ended(pid)]
        local_cluster.heal(node)
        healed = True
        # One lease TTL and more after the heal: whatever the zombie had pending has landed or been refused.
        time.sleep(3 * LEASE_TTL)
    finally:
        if not healed:
            with contextlib.suppress(Exception):
                local_cluster.heal(node)

    wait_for("the zombie's processes to end", lambda: all(ended(pid) for pid in zombie), timeout=120)
    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=400)
    assert st["phase"] == "Succeeded", st
    zlog = pod_log(local_cluster, jobs.ns, victim)
    told = "\n".join(line for line in zlog.splitlines() if '"event": "step"' not in line)[-6000:]
    changes = history(etcd_store, keys.prefix, fence.mod_revision)
    assert zombie_writes(changes, keys, victim) == [], (zombie_writes(changes, keys, victim), told)

    survivor_log = events(local_cluster, jobs.ns, survivor)
    spare_log = events(local_cluster, jobs.ns, spare)
    done = [e for e in survivor_log + spare_log if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1] and all(e["world_size"] == 2 for e in done), done
    assert {e["params_sha256"] for e in done} == {expected}, story(local_cluster, jobs.ns, survivor, spare)
    # In process: one start. (Where a survivor's main thread stays blocked after its interrupt, its stacks, dumped
    # before it ends itself, are in its log: the message shows them.)
    assert [e["event"] for e in survivor_log].count("start") == 1, story(local_cluster, jobs.ns, survivor, tail=200)
    # The zombie's ranks never joined another group: the one time they resumed was the job's start (step 0),
    # and they never finished.
    zevents = [json.loads(line) for line in zlog.splitlines() if line.startswith('{"event"')]
    joined = [(e["event"], e.get("step")) for e in zevents if e["event"] in ("resume", "done")]
    assert joined == [("resume", 0)], joined
    assert st["lastFailure"]["pod"] == victim, st["lastFailure"]
    assert took_over(jobs, name) == [spare]
    # It knew: from its own keep-alives, unanswered past the TTL while cut off, or from etcd once healed.
    assert "fenced" in zlog, (alive_in_cut, told)
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)


#: How long a one-peer cut is held: past the lease TTL but short of the soft timeout (the default 60 s: the
#: collective waits, nothing has to recover), and past a soft timeout of 4 s (the stalled collective is a hang,
#: recovered from once the link is back).
PEER_HOLDS = {"short": (3 * LEASE_TTL, None), "long": (20, 4.0)}


@pytest.mark.parametrize("hold", sorted(PEER_HOLDS))
def test_a_cut_from_one_peer_fences_no_one_and_the_job_ends_with_fault_free_parameters(
        hold: str, *, start_operator: OperatorFactory, jobs: Jobs, etcd_store: Store,
        local_cluster: LocalCluster, tmp_path: Path) -> None:
    """A worker's node cut from the other worker's node only: both still reach etcd and the API server, so both
    leases live, neither is a zombie, and no round can leave either out (either end is as cut as the other;
    the spare reaches both). The job waits the cut out: the collective waits (short), or its ranks stall past
    the soft timeout and the job recovers once the link is back (long). It ends Succeeded with the fault-free
    parameters bit for bit; nothing was fenced or replaced, the spare never took over; where a hang was
    detected, ``lastFailure`` names the cut link by both ends, else it names nothing."""
    needs_namespaces(local_cluster)
    start_operator(jobs.ns)
    expected = fault_free_digest(tmp_path)
    seconds, soft = PEER_HOLDS[hold]
    name = f"part-peer-{hold}"
    in_process: dict[str, object] = {"warmSpares": True}
    if soft is not None:
        in_process |= {"softTimeoutSeconds": soft, "hardTimeoutSeconds": 120}
    keys, survivor, victim, _spare = start_spread_job(jobs, local_cluster, name, in_process)
    where = {p.metadata.name: p.spec.node_name for p in jobs.pods(name)}
    assert len(set(where.values())) == 3, where
    first = manifest(etcd_store, keys)
    assert first is not None and {m.node_id for m in first.members} == {survivor, victim}
    start = etcd_store.revision()

    local_cluster.partition(where[victim], [where[survivor]])
    try:
        time.sleep(seconds)
        during = manifest(etcd_store, keys)
    finally:
        local_cluster.heal(where[victim])

    st = wait_for("Succeeded", phase_is(jobs, name, "Succeeded", "Failed"), timeout=400)
    assert st["phase"] == "Succeeded", (st, story(local_cluster, jobs.ns, survivor, victim))
    # Both leases lived through the cut: no round left either out, and nothing was fenced or replaced.
    assert during is not None and during.round == first.round, during
    fences = [e.kv.key for e in history(etcd_store, keys.prefix + FENCED, start) if e.type == "put"]
    assert fences == [], fences
    assert took_over(jobs, name) == []
    assert (st.get("restarts") or {}).get("podReplacements", 0) == 0, st["restarts"]
    done = [e for pod in (survivor, victim) for e in events(local_cluster, jobs.ns, pod) if e["event"] == "done"]
    assert sorted(e["rank"] for e in done) == [0, 1] and all(e["world_size"] == 2 for e in done), done
    assert {e["params_sha256"] for e in done} == {expected}, story(local_cluster, jobs.ns, survivor, victim)
    # The two workers ended holding both ranks of the world of 2, so the spare held none (its pod may be gone by
    # now: cleanPodPolicy deletes a finished job's running pods, and a parked spare can be one).
    lf = st.get("lastFailure")
    if soft is None:
        assert lf is None and st.get("totalRestarts", 0) == 0, st
    else:
        # The link by both ends (``pod`` and ``peer``): whichever end had bytes in flight said so, the reporter in
        # its soft-timeout record or the end that report interrupted in its link_down record, addressed to the
        # other end's pod IP or, for a connection the other end made, its node's address.
        assert lf is not None and {lf["pod"], lf.get("peer")} == {survivor, victim}, lf
        assert "carries nothing" in lf["message"], lf
        assert st.get("totalRestarts", 0) >= 1, st
    jobs.delete(name)
    wait_for("the job to go", lambda: jobs.gone(name), timeout=90)
