"""The per-pod agent end to end: real etcd, real rendezvous, real rank processes (torch CPU, gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "restart"))
from restart_helpers import SCRIPT, expected_checksum, restart_history, restart_records

from stalwart.api.exit_codes import ExitCode
from stalwart.api.job_record import JobRecord
from stalwart.api.restart import ProgressRecord, SealRecord
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer
from stalwart.local.exitcheck import WatchedProcess
from stalwart.procfs import process_state

pytestmark = pytest.mark.integration
TIMEOUT = 240


def agent_env(etcd: EtcdServer, keys: JobKeys, *, pod: str, nproc: int, nodes: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "STALWART_ETCD_ENDPOINTS": etcd.endpoint, "STALWART_JOB": f"{keys.namespace}/job",
        "STALWART_JOB_UID": keys.uid, "STALWART_NODE_ID": pod, "STALWART_POD_IP": "127.0.0.1",
        "STALWART_SPARE": "false", "STALWART_NPROC_PER_NODE": str(nproc), "STALWART_MIN_NODES": str(nodes),
        "STALWART_MAX_NODES": str(nodes),
    })
    return env


def start_agent(etcd: EtcdServer, tmp: Path, *script_args: str, mode: str = "wrapped",
                agent_args: tuple[str, ...] = (), keys: JobKeys | None = None, pod: str = "job-worker-0",
                nproc: int = 2, nodes: int = 1, quit_ignored: bool = False,
                extra_env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], JobKeys]:
    """Start ``stalwart agent`` as pod ``pod`` of job ``keys`` (a new job unless given); with ``quit_ignored``
    as a shell's background job starts it, with SIGQUIT ignored. Watched: after the test, the agent must have
    ended within the exit bound of its ``leaving with exit code`` line (stalwart.local.pytest_plugin)."""
    keys = keys or JobKeys("test", uuid.uuid4().hex[:12])
    cmd = [sys.executable, "-m", "stalwart", "agent", "--last-call", "0.1", *agent_args, "--", sys.executable,
           SCRIPT, "--mode", mode, "--marker-dir", str(tmp), "--out", str(tmp / "out.jsonl"), *script_args]
    if quit_ignored:
        cmd = ["sh", "-c", 'trap "" QUIT; exec "$@"', "sh", *cmd]
    env = {**agent_env(etcd, keys, pod=pod, nproc=nproc, nodes=nodes), **(extra_env or {})}
    return WatchedProcess(cmd, env=env, stderr=subprocess.PIPE, text=True), keys


@contextlib.contextmanager
def agents_end(agents: list[subprocess.Popen[str]]) -> Iterator[None]:
    """Kill (and reap) every agent of ``agents`` still running when the block is left, whatever ended it."""
    try:
        yield
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)


def ended_ok(agents: list[subprocess.Popen[str]]) -> list[tuple[str, str]]:
    """Each agent's standard output and error once it ended, in order; each must end with 0 within TIMEOUT."""
    ended = []
    for agent in agents:
        out, err = agent.communicate(timeout=TIMEOUT)
        assert agent.returncode == 0, err[-3000:]
        ended.append((out, err))
    return ended


def results(tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "out.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def progress(etcd: EtcdServer, keys: JobKeys, pod: str = "job-worker-0") -> ProgressRecord | None:
    with Store([etcd.endpoint]) as s:
        kv = s.get(keys.progress + pod)
    return None if kv is None else ProgressRecord.from_json_bytes(kv.value)


def test_killed_rank_is_respawned_and_rejoins_in_process(etcd: EtcdServer, tmp_path: Path) -> None:
    # Two pods of one rank each: the rendezvous forms the round, rank 1's process is SIGKILLed, its agent
    # respawns it and it rejoins the next in-process iteration; rank 0 keeps its process.
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    agents = [start_agent(etcd, tmp_path, "--steps", "8", "--fault", "sigkill", "--fault-step", "4",
                          keys=keys, pod=f"job-worker-{i}", nproc=1, nodes=2)[0] for i in range(2)]
    errs = []
    for agent in agents:
        _, err = agent.communicate(timeout=TIMEOUT)
        errs.append(err)
        assert agent.returncode == 0, err[-3000:]
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    reference = expected_checksum(steps=8)
    for r in res:
        assert r["step"] == 8 and r["restarts"] >= 1
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)
    assert sum("respawning local rank 0" in e for e in errs) == 1
    # Both first processes and the respawn came from the pods' fork servers (torch imported once per pod).
    assert sum(len(re.findall(r"started local rank 0 \(pid \d+, forked from the fork server\)", e)) for e in errs) == 3
    records = [progress(etcd, keys, f"job-worker-{i}") for i in range(2)]
    assert all(rec is not None and rec.state == "succeeded" and rec.step == 8 for rec in records)
    assert sorted(rec.process_restarts for rec in records if rec) == [0, 1]
    assert all(rec and rec.restarts_in_process >= 1 and rec.last_failure for rec in records)


def test_the_ranks_of_a_pod_arrive_at_the_restart_barrier_through_its_agent(etcd: EtcdServer,
                                                                           tmp_path: Path) -> None:
    # One pod of three ranks; rank 2 raises at step 3. The three hand their arrival at the next barrier to
    # the agent's relay, which writes them in one transaction: their keys carry one revision. Without the
    # relay each rank writes its own.
    # A linger of a second: on a loaded machine the ranks' aborts may end more than the default's 20 ms apart.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "6", "--fault", "exception", "--fault-rank", "2",
                              "--fault-step", "3", nproc=3, agent_args=("--relay-linger", "1"))
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1, 2]
    reference = expected_checksum(steps=6, ranks=3)
    assert all(r["step"] == 6 and r["restarts"] == 1 and r["checksum"] == pytest.approx(reference, abs=1e-6)
               for r in res), (res, restart_records(etcd, keys, "fault"), err[-4000:])
    arrivals = restart_history(etcd, keys, "arrive")
    assert set(arrivals) >= {"1/0", "1/1", "1/2"}, sorted(arrivals)
    assert arrivals["1/0"][0] == arrivals["1/1"][0] == arrivals["1/2"][0], arrivals
    used = re.search(r"barrier relay: (\d+) requests from the ranks in (\d+) etcd transactions", err)
    assert used is not None, err[-3000:]
    # One request per rank and barrier (iterations 0 and 1): the arrival after the fault reads the cause in the
    # same request; and each rank's one request for the pod's lease, at its start (no etcd transaction).
    assert int(used[1]) == 3 + 2 * 3 and int(used[1]) - 3 > int(used[2]) >= 1, used[0]
    # The pod's one lease, its node's: lent, never granted for the ranks.
    assert err.count("the ranks' liveness is on the pod's rendezvous lease") == 1, err[-3000:]
    assert "the ranks' liveness is on lease" not in err, err[-3000:]


def test_a_killed_sealer_is_respawned_and_seals_the_next_barrier(etcd: EtcdServer, tmp_path: Path) -> None:
    # Slot 0 is the one process that follows the arrivals at the next barrier (the lowest slot that took part);
    # the other waits for the seal's key only. Slot 0's process is SIGKILLed mid-iteration: its respawn joins
    # the next barrier as its sealer and seals it with the whole world, long before the barrier timeout
    # would have let slot 1 seal alone.
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    agents = [start_agent(etcd, tmp_path, "--steps", "8", "--fault", "sigkill", "--fault-step", "4",
                          "--fault-rank", "0", "--barrier-timeout", "120", keys=keys, pod=f"job-worker-{i}",
                          nproc=1, nodes=2)[0] for i in range(2)]
    errs = []
    for agent in agents:
        _, err = agent.communicate(timeout=TIMEOUT)
        errs.append(err)
        assert agent.returncode == 0, err[-3000:]
    assert sum("respawning local rank 0" in e for e in errs) == 1  # the pod of rank 0 (slot 0), once
    reference = expected_checksum(steps=8)
    res = results(tmp_path)
    assert sorted((r["rank"], r["world"]) for r in res) == [(0, 2), (1, 2)]
    assert all(r["step"] == 8 and r["checksum"] == pytest.approx(reference, abs=1e-6) for r in res)
    seal = SealRecord.model_validate(restart_records(etcd, keys, "seal")["1"])
    assert (seal.sealed_by, seal.timed_out, seal.ranks) == (0, False, {"0": 0, "1": 1})


def test_plain_script_gets_pod_local_restarts_like_torchrun(etcd: EtcdServer, tmp_path: Path) -> None:
    agent, keys = start_agent(etcd, tmp_path, "--steps", "6", "--fault", "exception", "--fault-step", "3",
                              mode="plain", agent_args=("--max-restarts", "2"),
                              extra_env={"STALWART_FORK_SERVER": "false"})
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    # With the fork server off (the container's opt-out), every process (the respawns too) starts fresh, as
    # under torchrun.
    assert len(re.findall(r"started local rank \d \(pid \d+\)", err)) == 4 and "fork server" not in err
    res = results(tmp_path)
    # Every rank ran again from the start in new processes (TORCHELASTIC_RESTART_COUNT=1), to the right end.
    assert sorted(r["rank"] for r in res) == [0, 1]
    reference = expected_checksum(steps=6)
    for r in res:
        assert r["restarts"] == 1 and r["step"] == 6
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)
    rec = progress(etcd, keys)
    assert rec is not None and rec.state == "succeeded" and rec.process_restarts == 1


def test_hang_beyond_the_soft_timeout_ends_with_the_hard_timeout_kill(etcd: EtcdServer, tmp_path: Path) -> None:
    # The hung rank blocks in C with the wakeup signal masked: the soft timeout restarts the others, and
    # only the agent's hard timeout (2 x soft here) can end the hung process; its respawn rejoins.
    # The agent is started as a shell starts a background job, with SIGQUIT ignored: its ranks must not
    # inherit that, or no stack dump could be asked of them.
    agent, _ = start_agent(etcd, tmp_path, "--steps", "8", "--fault", "hang-hard", "--fault-step", "3",
                           "--soft-timeout", "4", quit_ignored=True)
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    assert "made no progress within its hard timeout" in err
    # Before the kill, the hung process wrote where it was: its main thread in the script's pause(). The
    # kernel hands the signal to any thread that does not block it, so the main thread may be listed as the
    # current thread or as another one.
    found = re.search(r"^(Current thread|Thread) 0x", err, re.MULTILINE)
    assert found is not None, err[-3000:]
    dump = err[found.start():]
    assert re.search(r'File ".*restart_ddp\.py", line \d+ in inject', dump), err[-3000:]
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    reference = expected_checksum(steps=8)
    assert all(r["step"] == 8 and r["checksum"] == pytest.approx(reference, abs=1e-6) for r in res)


def test_a_rank_that_blocks_in_the_final_teardown_is_ended_as_an_exit_and_the_job_succeeds(etcd: EtcdServer,
                                                                                            tmp_path: Path) -> None:
    # Every rank returned; rank 1's process then blocks for good in the collection that ends the job (a
    # destructor that never returns). The outcome is decided: the agent ends that process after its finish grace
    # and keeps its work, instead of taking it for a training hang (hard timeout) and restarting the slot.
    # The grace is 8 s: rank 0's own teardown (writing its line, then exiting) must fit in it, and with two test
    # suites at once on two cores, 3 s once did not.
    agent, _ = start_agent(etcd, tmp_path, "--steps", "6", "--teardown-hang", "1", "--soft-timeout", "4",
                           agent_args=("--finish-grace", "8"))
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    assert re.search(r"local rank 1 returned from the training function but its process has not exited in 8s: "
                     r"killing it", err), err[-3000:]
    assert "respawning" not in err and "hard timeout" not in err
    assert [r["rank"] for r in results(tmp_path)] == [0]  # rank 1 never got past its teardown to write its line
    assert results(tmp_path)[0]["step"] == 6


def test_a_stopped_rank_is_killed_at_its_soft_timeout_and_the_job_recovers_in_process(etcd: EtcdServer,
                                                                                      tmp_path: Path) -> None:
    # Rank 1 stops itself (SIGSTOP) at step 3. It can neither progress nor obey an interrupt, so its agent
    # kills it once it has shown no progress for the soft timeout (not the hard one) and records the fault,
    # naming it, in its iteration: the peer is interrupted at once and keeps its process; the respawned
    # rank rejoins at the next iteration.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "8", "--fault", "sigstop", "--fault-step", "3",
                              "--soft-timeout", "4")
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    assert "local rank 1 (pid" in err and "is stopped and made no progress within its soft timeout" in err
    # The peer's stack, dumped by its agent before a hard-timeout kill, says where it was held.
    hung = max(err.find("made no progress within its hard timeout"), 0)
    assert "respawning local rank 0" not in err, err[max(hung - 1500, 0):hung + 6000]
    stopped = float((tmp_path / "fault-0").read_text())
    fault = restart_records(etcd, keys, "fault")["0/1"]
    assert (fault["kind"], fault["rank"]) == ("stopped", 1)
    assert fault["time"] - stopped <= 4 + 1  # within the soft timeout + 1 s of the stop
    reference = expected_checksum(steps=8)
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert all(r["step"] == 8 and r["restarts"] == 1 and r["checksum"] == pytest.approx(reference, abs=1e-6)
               for r in res)


def test_a_rank_waiting_in_its_first_collective_for_a_late_peer_is_not_killed(etcd: EtcdServer,
                                                                             tmp_path: Path) -> None:
    # Rank 1 reaches the iteration's first collective 14 s after rank 0 (busy in Python, as a respawned rank
    # building its model is), and rank 0 waits there in C, without progress, for longer than its hard timeout
    # (8 s). Before an iteration's first ping a rank's own monitor allows the barrier timeout (60 s), and its
    # agent as much more: rank 0 is neither interrupted nor killed (before, its agent killed it at 8 s and
    # respawned it), and the job ends without a fault.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "4", "--late-rank", "1", "--late-seconds", "14",
                              "--soft-timeout", "4")
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    assert "within its hard timeout" not in err and "respawning" not in err, err[-3000:]
    assert restart_records(etcd, keys, "fault") == {}
    res = results(tmp_path)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert all(r["step"] == 4 and r["restarts"] == 0 for r in res)
    assert (tmp_path / "late").exists()  # the delay was injected


def test_a_rank_hung_in_the_wrappers_own_step_is_killed_at_its_hard_timeout(etcd: EtcdServer,
                                                                          tmp_path: Path) -> None:
    # Rank 1 raises, then blocks in its Finalize policy (outside the training function, where no soft timeout
    # applies). Its heartbeat is its main thread's progress there too, so the agent kills it at the hard
    # timeout (2 x soft) and the respawned process joins the next barrier in time: the world stays whole. The
    # barrier waits for it up to 120 s: a respawn imports torch again, which on a loaded 2-core machine took
    # more than the 34 s a 40 s barrier left it (the world then shrank to rank 0); the barrier opens as soon as
    # the respawn joins, so the long bound costs nothing when all goes well.
    agent, _ = start_agent(etcd, tmp_path, "--steps", "8", "--fault", "exception", "--fault-step", "3",
                           "--finalize-hang", "--soft-timeout", "3", "--barrier-timeout", "120")
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == 0, err[-3000:]
    assert "local rank 1 (pid" in err and "made no progress within its hard timeout" in err
    res = results(tmp_path)
    assert sorted((r["rank"], r["world"]) for r in res) == [(0, 2), (1, 2)]
    assert all(r["step"] == 8 for r in res)


def test_a_stopped_rank_is_killed_at_once_when_the_agent_stops(etcd: EtcdServer, tmp_path: Path) -> None:
    # A stopped process cannot act on SIGTERM: the agent kills it at once instead of waiting out the grace.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "100000", "--step-sleep", "0.05",
                              agent_args=("--term-grace", "30"))
    deadline = time.monotonic() + TIMEOUT
    while (rec := progress(etcd, keys)) is None or rec.step is None or rec.step < 2:
        assert time.monotonic() < deadline, "training never reported progress"
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        time.sleep(0.2)
    pids, _ = _ranks(agent.pid)
    ranks = sorted(pids)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGSTOP)
    # The stop takes effect when the rank is next scheduled: on a loaded machine a SIGTERM sent before that is
    # dequeued first (the lower signal number) and the rank ends as a running process would, so the agent
    # must be told to stop only once the rank is stopped.
    until = time.monotonic() + 30
    while process_state(ranks[1]) not in ("T", "t"):
        assert time.monotonic() < until, f"rank {ranks[1]} did not stop: state {process_state(ranks[1])!r}"
        time.sleep(0.01)
    start = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=TIMEOUT)
    took = time.monotonic() - start
    assert agent.returncode == int(ExitCode.TERMINATED), err[-3000:]
    assert "is stopped: killing it" in err
    assert took < 15, f"the agent took {took:.1f}s to stop (its term grace is 30 s)"
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.add(int(entry))
            except OSError:
                continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _ranks(agent: int) -> tuple[set[int], int]:
    """The agent's rank processes and its fork server: the ranks are the server's children, and each shows the
    training command in ps."""
    (server,) = [pid for pid in _children(agent) if b"stalwart.forkserver" in _cmdline(pid)]
    ranks = _children(server)
    assert all(_cmdline(pid).startswith(f"{sys.executable}\0{SCRIPT}\0".encode()) for pid in ranks)
    return ranks, server


def test_sigterm_is_forwarded_and_the_ranks_are_gone(etcd: EtcdServer, tmp_path: Path) -> None:
    agent, keys = start_agent(etcd, tmp_path, "--steps", "100000", "--step-sleep", "0.05",
                              agent_args=("--term-grace", "20"))
    deadline = time.monotonic() + TIMEOUT
    while True:
        rec = progress(etcd, keys)
        if rec is not None and rec.step is not None and rec.step >= 2:
            break
        assert time.monotonic() < deadline, "training never reported progress"
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        time.sleep(0.2)
    ranks, server = _ranks(agent.pid)
    assert len(ranks) == 2
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=TIMEOUT)
    assert agent.returncode == int(ExitCode.TERMINATED), err[-3000:]
    for pid in (*ranks, server):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_stops_an_agent_waiting_in_the_rendezvous(etcd: EtcdServer, tmp_path: Path) -> None:
    # One pod of a job of two: its agent waits in the rendezvous's join for a peer that never comes. SIGTERM
    # (a pod deleted before its gang formed) must end it at once, not after the pod's termination grace
    # (SIGKILL at 30 s) nor the join timeout.
    agent, keys = start_agent(etcd, tmp_path, "--steps", "5", nodes=2)
    deadline = time.monotonic() + TIMEOUT
    while True:
        with Store([etcd.endpoint]) as s:
            if s.get_prefix(keys.rendezvous, keys_only=True)[0]:
                break  # registered: its node key is there
        assert time.monotonic() < deadline, "the agent never joined"
        assert agent.poll() is None, agent.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # well inside join()
    agent.send_signal(signal.SIGTERM)
    try:
        _, err = agent.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        agent.kill()
        pytest.fail("the agent ignored SIGTERM while joining: " + agent.communicate()[1][-3000:])
    assert agent.returncode == int(ExitCode.TERMINATED), err[-3000:]
    with Store([etcd.endpoint]) as s:  # it left: its node key went with it
        assert not [kv for kv in s.get_prefix(keys.rendezvous, keys_only=True)[0] if "/nodes/" in kv.key]


def test_bad_pod_environment_is_reported_by_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALWART_")}
    env["STALWART_NPROC_PER_NODE"] = "zero"
    env["STALWART_FORK_SERVER"] = "maybe"
    out = subprocess.run([sys.executable, "-m", "stalwart", "agent", "--", "true"], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2
    assert "STALWART_JOB: is required" in out.stderr
    assert "STALWART_NPROC_PER_NODE" in out.stderr
    assert "STALWART_FORK_SERVER" in out.stderr


@pytest.mark.parametrize(("agent_args", "ttl"), [((), 3), (("--node-ttl", "7"), 7)], ids=["the-jobs", "the-flag"])
def test_the_agents_lease_has_the_jobs_ttl_unless_its_flag_says_otherwise(agent_args: tuple[str, ...], ttl: int,
                                                                        etcd: EtcdServer, tmp_path: Path) -> None:
    # The operator's record carries rendezvous.leaseTTLSeconds: how soon the operator and the peers count this
    # node lost, and how soon, cut off, it knows itself fenced. One pod of a job of two waits in the join.
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    record = JobRecord(job_name="job", namespace="test", uid=keys.uid, members=["job-worker-0", "job-worker-1"],
                       min_nodes=2, max_nodes=2, nproc_per_node=1, join_timeout_seconds=90, last_call_seconds=1,
                       lease_ttl_seconds=3, max_restarts=3, soft_timeout_seconds=10, hard_timeout_seconds=20,
                       barrier_timeout_seconds=30, backoff_limit=2)
    with Store([etcd.endpoint]) as s:
        s.put(keys.job, record.to_json_bytes())
        agent, _ = start_agent(etcd, tmp_path, "--steps", "5", keys=keys, nodes=2, agent_args=agent_args)
        deadline = time.monotonic() + TIMEOUT
        while (kv := s.get(keys.node("job-worker-0"))) is None:
            assert time.monotonic() < deadline, "the agent never joined"
            assert agent.poll() is None, agent.communicate()[1][-3000:]
            time.sleep(0.2)
        granted = s.lease_ttl(kv.lease)
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=60)
    assert 0 < granted <= ttl and (ttl == 3) is (granted <= 3), (granted, err[-2000:])
