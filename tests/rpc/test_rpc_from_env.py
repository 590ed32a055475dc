"""``init_rpc()`` with no arguments inside real rank processes of ``stalwart agent``, and its environment errors.

Run as a script, this file is the training command: it calls ``init_rpc()`` with no arguments, calls the other
rank by name and by rank, fetches a value through an RRef, shuts down and writes what it saw to
``<out>/rank-<RANK>.json``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from rpc_helpers import sealed, wait_for

from stalwart.api.pod_env import PodEnvError
from stalwart.api.rpc import RpcWorkerRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.local.exitcheck import WatchedProcess
from stalwart.rpc import (
    EtcdMembership,
    MembershipView,
    RpcAgent,
    RpcShutdown,
    StaticMembership,
    Worker,
    current_agent,
    get_worker_info,
    init_rpc,
    rpc_function,
    rpc_sync,
    shutdown,
)
from stalwart.rpc.environment import DEFAULT_HOST, RpcEnvironment
from stalwart.rref import remote

TOKEN = "from-env-token-0123456789abcdef"
TIMEOUT = 180


@rpc_function("from_env.whoami")
def whoami() -> dict[str, Any]:
    agent = current_agent()
    return {"name": agent.name, "rank": agent.rank, "address": agent.address, "pid": os.getpid(),
            "epoch": int(os.environ["STALWART_EPOCH"])}


@rpc_function("from_env.add")
def add(a: int, b: int) -> int:
    return a + b


ENTERED = threading.Event()


@rpc_function("from_env.entered")
def entered() -> None:
    ENTERED.set()


@rpc_function("from_env.name")
def served_by() -> str:
    return current_agent().name


@rpc_function("from_env.make")
def make(caller: str) -> dict[str, Any]:
    return {"made_by": current_agent().name, "for": caller}


def rank_main(out: Path) -> int:
    """The training script: everything about the job comes from the environment the agent gave."""
    init_rpc(timeout=120)
    me = get_worker_info()
    peer = 1 - me.rank
    by_name = rpc_sync(f"worker{peer}", whoami, timeout=60)
    by_rank = rpc_sync(peer, add, (me.rank, 10), timeout=60)
    rref = remote(peer, make, (me.name,), timeout=60)
    value = rref.to_here(60)
    owner = rref.owner()
    address = current_agent().address
    del rref
    gc.collect()
    report = shutdown(graceful=True, timeout=60)
    result = {"name": me.name, "rank": me.rank, "address": address, "by_name": by_name, "by_rank": by_rank,
              "rref": value, "owner": [owner.name, owner.rank], "clean": report.clean, "report": str(report),
              "epoch": int(os.environ["STALWART_EPOCH"])}
    (out / f"rank-{me.rank}.json").write_text(json.dumps(result))
    return 0


def restart_main(out: Path) -> int:
    """The training script with in-process restarts: RPC is initialised once, before the restartable
    function; rank 1 fails the first iteration; the second runs on the same agents and RRefs."""
    import stalwart
    from stalwart.restart.policies import Abort, Initialize, IterationContext

    class Nothing(Initialize, Abort):  # no process group: the iterations talk over RPC only
        def __call__(self, ctx: IterationContext) -> None:
            return None

    init_rpc(timeout=120)
    me = get_worker_info()
    peer = 1 - me.rank
    before = rpc_sync(peer, whoami, timeout=60)
    held = [remote(f"worker{peer}", make, (me.name,), timeout=60)]
    held[0].to_here(60)

    @stalwart.restartable(max_restarts=3, initialize=Nothing(), abort=Nothing(), health_check=None,
                          soft_timeout=60, hard_timeout=120, barrier_timeout=60, start_timeout=120)
    def train(call_wrapper: stalwart.CallWrapper) -> dict[str, Any]:
        if call_wrapper.iteration == 0:
            # the fault comes once rank 0 runs the iteration too (a fault already reported when a rank
            # begins an iteration is a different path, not this test's subject)
            if me.rank == 0:
                rpc_sync(1, entered, timeout=60)
            else:
                ENTERED.wait(60)
                raise RuntimeError("injected fault in the first iteration")
        return {"iteration": call_wrapper.iteration, "me": get_worker_info().name,
                "peer": rpc_sync(f"worker{peer}", whoami, timeout=60), "kept": held[0].to_here(60)}

    result = train()
    result.update({"rank": me.rank, "pid": os.getpid(), "before": before})
    held.clear()
    gc.collect()
    report = shutdown(graceful=True, timeout=60)
    result.update({"clean": report.clean, "report": str(report)})
    (out / f"rank-{me.rank}.json").write_text(json.dumps(result))
    return 0


# -- the environment (no servers) ---------------------------------------------------------------------------

def _env(**changes: str | None) -> dict[str, str]:
    env = {
        "STALWART_ETCD_ENDPOINTS": "127.0.0.1:2379", "STALWART_JOB": "ns/job", "STALWART_JOB_UID": "uid-1",
        "STALWART_NODE_ID": "job-worker-0", "STALWART_EPOCH": "7", "STALWART_SLOT": "1", "STALWART_SLOTS": "2",
        "STALWART_TARGET_WORLD": "2", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2",
        "STALWART_POD_IP": "10.1.2.3", "STALWART_RPC_TOKEN": TOKEN,
    }
    for var, value in changes.items():
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def test_the_environment_gives_rank_world_round_address_and_token() -> None:
    env = RpcEnvironment.from_env(_env())
    assert (env.rank, env.world_size, env.epoch, env.host, env.token) == (1, 2, 7, "10.1.2.3", TOKEN)
    assert env.keys == JobKeys("ns", "uid-1") and env.rank_env.node_id == "job-worker-0"
    assert TOKEN not in repr(env)
    assert RpcEnvironment.from_env(_env(STALWART_POD_IP=None)).host == DEFAULT_HOST
    assert RpcEnvironment.from_env(_env(STALWART_POD_IP="fd00::1")).host == "fd00::1"
    given = RpcEnvironment.from_env(_env(RANK=None, WORLD_SIZE=None, STALWART_RPC_TOKEN=None), need_rank=False,
                                    need_world_size=False, need_token=False)
    assert (given.rank, given.world_size, given.token) == (None, None, None)


@pytest.mark.parametrize(("var", "value", "says"), [
    ("RANK", None, "RANK: is required"),
    ("RANK", "one", "RANK: expected an integer >= 0, got 'one'"),
    ("RANK", "-1", "RANK: expected an integer >= 0"),
    ("WORLD_SIZE", None, "WORLD_SIZE: is required"),
    ("WORLD_SIZE", "0", "WORLD_SIZE: expected an integer >= 1, got '0'"),
    ("STALWART_RPC_TOKEN", None, "STALWART_RPC_TOKEN: is required"),
    ("STALWART_POD_IP", "pod-a.local", "STALWART_POD_IP: expected the pod's IP address"),
    ("STALWART_EPOCH", None, "STALWART_EPOCH: is required"),
    ("STALWART_EPOCH", "x", "STALWART_EPOCH: "),
    ("STALWART_ETCD_ENDPOINTS", "etcd", "STALWART_ETCD_ENDPOINTS: "),
    ("STALWART_JOB_UID", None, "STALWART_JOB_UID: is required"),
])
def test_a_missing_or_malformed_variable_is_named(var: str, value: str | None, says: str) -> None:
    with pytest.raises(PodEnvError, match="^(.*; )?" + says.replace("(", r"\(").replace(")", r"\)")):
        RpcEnvironment.from_env(_env(**{var: value}))


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(PodEnvError) as e:
        RpcEnvironment.from_env(_env(STALWART_EPOCH=None, RANK="x", STALWART_RPC_TOKEN=None))
    for var in ("STALWART_EPOCH", "RANK", "STALWART_RPC_TOKEN"):
        assert f"{var}: " in str(e.value)


def test_init_rpc_without_arguments_outside_an_agent_names_the_variables_and_starts_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _env():
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(PodEnvError) as e:
        init_rpc()
    for var in ("STALWART_ETCD_ENDPOINTS", "STALWART_EPOCH", "RANK", "WORLD_SIZE", "STALWART_RPC_TOKEN"):
        assert f"{var}: " in str(e.value)
    with pytest.raises(RpcShutdown):
        current_agent()
    # what is passed is not asked of the environment
    with pytest.raises(PodEnvError) as e:
        init_rpc("w", 0, world_size=1, token=TOKEN)
    assert "RANK" not in str(e.value) and "WORLD_SIZE" not in str(e.value) and "TOKEN" not in str(e.value)


def test_functions_served_during_a_graceful_shutdown_still_see_the_agent() -> None:
    # The module-level agent waits in its shutdown barrier for its peer; the peer's calls meanwhile run
    # functions that use current_agent().
    membership = StaticMembership(MembershipView(1))
    a = init_rpc("a", 0, membership=membership, token=TOKEN)
    b = RpcAgent("b", 1, token=TOKEN)
    b.start()
    b.join(membership)
    membership.set_view(MembershipView.of(1, [a.member, b.member]))
    wait_for(lambda: b.rpc_sync("a", served_by, timeout=30) == "a", what="b reaching a")
    reports: list[Any] = []
    stopping = threading.Thread(target=lambda: reports.append(shutdown(graceful=True, timeout=60)))
    stopping.start()
    try:

        def refused() -> bool:
            try:
                rpc_sync("b", served_by, timeout=30)
            except RpcShutdown:
                return True
            return False

        wait_for(refused, what="a's shutdown under way")
        assert current_agent() is a and stopping.is_alive()
        assert b.rpc_sync("a", served_by, timeout=30) == "a"
    finally:
        b.shutdown(graceful=True, timeout=30)
        stopping.join(90)
    assert reports and reports[0].clean, reports
    with pytest.raises(RpcShutdown):
        current_agent()


def test_init_rpc_from_the_environment_registers_in_the_round_and_shutdown_removes_it(
        etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as store:
        epoch = sealed(store, keys)  # workers register only in the round the manifest names
    env = _env(STALWART_ETCD_ENDPOINTS=etcd.endpoint, STALWART_JOB_UID=keys.uid, STALWART_JOB="test/job",
               STALWART_POD_IP=None, RANK="0", WORLD_SIZE="1", STALWART_SLOT="0", LOCAL_RANK="0",
               STALWART_EPOCH=str(epoch))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("STALWART_POD_IP", raising=False)
    with Store([etcd.endpoint]) as store:
        for name, expected in ((None, "worker0"), ("trainer", "trainer")):
            agent = init_rpc() if name is None else init_rpc(name=name)
            try:
                assert (agent.name, agent.rank) == (expected, 0)
                assert agent.address.startswith(f"{DEFAULT_HOST}:")  # no pod IP given
                kv = store.get(keys.rpc + "workers/" + expected)
                assert kv is not None
                record = RpcWorkerRecord.from_json_bytes(kv.value)
                assert (record.epoch, record.node, record.address) == (epoch, "job-worker-0", agent.address)
                assert rpc_sync(expected, served_by, timeout=30) == expected
                with pytest.raises(RuntimeError, match="already running"):
                    init_rpc()
            finally:
                assert shutdown(graceful=True, timeout=30).clean
            assert store.get(keys.rpc + "workers/" + expected) is None  # the lease went with it


# -- membership of one round, in a real etcd ----------------------------------------------------------------

def test_an_older_rounds_records_do_not_complete_the_world(etcd: EtcdServer) -> None:
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    with Store([etcd.endpoint]) as s_old, Store([etcd.endpoint]) as s_new:
        first = s_old.put(keys.manifest, b"{}")
        old = EtcdMembership(s_old, keys, epoch=first, lease_ttl=5)
        old.register(Worker("worker1", 1, "127.0.0.1:1001", "old"), node="n1")
        epoch = s_new.put(keys.manifest, b"{}")
        new = EtcdMembership(s_new, keys, epoch=epoch, lease_ttl=5, older_rounds=False)
        keeps_old = EtcdMembership(s_new, keys, epoch=epoch, lease_ttl=5)
        late = EtcdMembership(s_new, keys, epoch=epoch, lease_ttl=5)
        try:
            new.register(Worker("worker0", 0, "127.0.0.1:1000", "a"), node="n0")
            with pytest.raises(TimeoutError, match=rf"rank\(s\) \[1\] did not register in the round of epoch {epoch}"):
                new.wait_for_ranks(2, timeout=1.0)  # worker1's record is the old round's
            assert set(new.view().members) == {"worker0"}  # and it is no peer
            wait_for(lambda: set(keeps_old.view().members) == {"worker0", "worker1"}, what="keeps_old's view")
            late.register(Worker("worker1", 1, "127.0.0.1:1002", "b"), node="n1")
            view = new.wait_for_ranks(2, timeout=30)
            assert view.epoch == epoch and view.members["worker1"] == Worker("worker1", 1, "127.0.0.1:1002", "b")
        finally:
            for m in (old, new, keeps_old, late):
                m.close()


# -- real agents, real rank processes ---------------------------------------------------------------------

def _agent_env(etcd: EtcdServer, keys: JobKeys, pod: str, pod_ip: str, *, nproc: int, nodes: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_") and k not in ("RANK", "WORLD_SIZE")}
    env.update({
        "STALWART_ETCD_ENDPOINTS": etcd.endpoint, "STALWART_JOB": f"{keys.namespace}/job",
        "STALWART_JOB_UID": keys.uid, "STALWART_NODE_ID": pod, "STALWART_POD_IP": pod_ip,
        "STALWART_SPARE": "false", "STALWART_NPROC_PER_NODE": str(nproc), "STALWART_MIN_NODES": str(nodes),
        "STALWART_MAX_NODES": str(nodes), "STALWART_RPC_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
    })
    return env


def _kill_session(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run_agents(etcd: EtcdServer, out: Path, pods: dict[str, str], *script_args: str,
                nproc: int) -> dict[int, dict[str, Any]]:
    """Run ``stalwart agent -- python <this file> OUT ...`` as each pod (name -> pod IP) to the end; returns
    what ranks 0 and 1 wrote."""
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    # Watched: each agent must end within the exit bound of deciding to (stalwart.local.pytest_plugin).
    agents = [WatchedProcess([sys.executable, "-m", "stalwart", "agent", "--last-call", "0.1", "--",
                              sys.executable, __file__, str(out), *script_args],
                             env=_agent_env(etcd, keys, pod, ip, nproc=nproc, nodes=len(pods)),
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
              for pod, ip in pods.items()]  # a session each: a stuck test ends the agent and its ranks together
    errs: list[str] = []
    timed_out = False
    try:
        for agent in agents:
            try:
                _, err = agent.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                timed_out = True
                for a in agents:
                    _kill_session(a)
                _, err = agent.communicate()
            errs.append(err)
    finally:
        for agent in agents:
            _kill_session(agent)
            agent.wait()
    assert not timed_out, "\n----\n".join(e[-12000:] for e in errs)
    for agent, err in zip(agents, errs, strict=True):
        assert agent.returncode == 0, err[-12000:]
    files = {r: out / f"rank-{r}.json" for r in (0, 1)}
    assert all(f.exists() for f in files.values()), "\n----\n".join(e[-12000:] for e in errs)
    return {r: json.loads(f.read_text()) for r, f in files.items()}


def test_ranks_of_stalwart_agent_call_each_other_after_init_rpc_without_arguments(etcd: EtcdServer,
                                                                                   tmp_path: Path) -> None:
    # Two pods of one rank each, on their own pod IPs: each rank's RPC server listens on its pod's IP and
    # the other rank reaches it there, by name and by rank.
    pods = {"job-worker-0": "127.0.0.2", "job-worker-1": "127.0.0.3"}
    results = _run_agents(etcd, tmp_path, pods, nproc=1)
    ips = {r["address"].rpartition(":")[0] for r in results.values()}
    assert ips == set(pods.values())  # bound to the pod IP, not 0.0.0.0 nor loopback's 127.0.0.1
    epochs = {r["epoch"] for r in results.values()}
    assert len(epochs) == 1
    for rank, r in results.items():
        peer = results[1 - rank]
        assert r["name"] == f"worker{rank}" and r["rank"] == rank
        assert r["by_name"]["name"] == peer["name"] and r["by_name"]["rank"] == 1 - rank
        assert r["by_name"]["address"] == peer["address"] and r["by_name"]["epoch"] == r["epoch"]
        assert r["by_rank"] == rank + 10
        assert r["rref"] == {"made_by": peer["name"], "for": r["name"]}
        assert r["owner"] == [peer["name"], 1 - rank]
        assert r["clean"], [results[0]["report"], results[1]["report"]]


def test_rpc_outlives_in_process_restarts_of_its_round(etcd: EtcdServer, tmp_path: Path) -> None:
    # One pod, two ranks: rank 1 fails the first iteration of the restartable function; both ranks re-run it
    # in the same processes, where the agents, their names and an RRef made before the fault still serve.
    results = _run_agents(etcd, tmp_path, {"job-worker-0": "127.0.0.4"}, "--restart", nproc=2)
    for rank, r in results.items():
        peer = results[1 - rank]
        assert r["iteration"] >= 1 and r["me"] == f"worker{rank}"
        assert r["peer"]["pid"] == r["before"]["pid"] == peer["pid"]  # the peer's process, not a respawn
        assert r["peer"]["name"] == f"worker{1 - rank}" and r["peer"]["address"].startswith("127.0.0.4:")
        assert r["kept"] == {"made_by": f"worker{1 - rank}", "for": f"worker{rank}"}
        assert r["clean"], r["report"]


if __name__ == "__main__":
    main = restart_main if sys.argv[2:] == ["--restart"] else rank_main
    sys.exit(main(Path(sys.argv[1])))
