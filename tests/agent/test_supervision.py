"""The agent's decisions about its rank processes (pure) and its settings from the pod environment."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.agent.processes import RankProcesses
from stalwart.agent.settings import PodSettings
from stalwart.agent.supervision import ProcView, fault_for, supervise
from stalwart.api.exit_codes import ExitCode
from stalwart.api.pod_env import PodEnvError
from stalwart.api.restart import RankStatus


def kinds(actions: list) -> list[str]:
    return [a.kind for a in actions]


def test_all_returned_finishes_ok() -> None:
    [a] = supervise([ProcView(0, 0), ProcView(1, 0)], restarts_used=0, max_restarts=3)
    assert (a.kind, a.exit_code) == ("finish", 0)


def test_running_ranks_are_left_alone_and_a_finished_one_waits_for_the_rest() -> None:
    assert kinds(supervise([ProcView(0, None), ProcView(1, 0)], restarts_used=0, max_restarts=3)) == ["wait"]


def test_dead_wrapped_rank_is_respawned_alone() -> None:
    [a] = supervise([ProcView(0, None, wrapped=True), ProcView(1, -9, wrapped=True)], restarts_used=0,
                    max_restarts=3)
    assert (a.kind, a.local_ranks) == ("respawn", (1,))


def test_a_rank_that_ended_itself_stuck_is_respawned_and_said_so() -> None:
    [a] = supervise([ProcView(0, None, wrapped=True), ProcView(1, int(ExitCode.ABANDONED), wrapped=True)],
                    restarts_used=0, max_restarts=3)
    assert (a.kind, a.local_ranks) == ("respawn", (1,))
    assert a.reason == ("local rank 1 ended itself (exit code 98): its main thread stayed blocked after its "
                        "interrupt")


def test_dead_plain_rank_restarts_everything_like_torchrun() -> None:
    [a] = supervise([ProcView(0, None), ProcView(1, 1)], restarts_used=0, max_restarts=3)
    assert a.kind == "restart_all"


def test_budget_exhausted_finishes_with_the_rank_code() -> None:
    [a] = supervise([ProcView(0, None), ProcView(1, 3)], restarts_used=3, max_restarts=3)
    assert (a.kind, a.exit_code) == ("finish", 3)
    [a] = supervise([ProcView(0, None), ProcView(1, -9)], restarts_used=3, max_restarts=3)
    assert (a.kind, a.exit_code) == ("finish", int(ExitCode.FAILED))


@pytest.mark.parametrize("code", [ExitCode.RESTARTS_EXHAUSTED, ExitCode.NON_RETRYABLE, ExitCode.UNHEALTHY,
                                  ExitCode.WORLD_TOO_SMALL])
def test_wrapper_give_up_codes_end_the_pod_with_that_code(code: ExitCode) -> None:
    [a] = supervise([ProcView(0, None, wrapped=True), ProcView(1, int(code), wrapped=True)], restarts_used=0,
                    max_restarts=3)
    assert (a.kind, a.exit_code) == ("finish", int(code))


def test_hung_rank_is_killed_after_its_hard_timeout() -> None:
    procs = [ProcView(0, None, wrapped=True, heartbeat_age=5.0, hard_timeout=10.0),
             ProcView(1, None, wrapped=True, heartbeat_age=11.0, hard_timeout=10.0)]
    [a] = supervise(procs, restarts_used=0, max_restarts=3)
    assert (a.kind, a.local_ranks, a.exit_code, a.fault) == ("kill", (1,), int(ExitCode.HARD_TIMEOUT), "hard_timeout")


def test_stopped_rank_is_killed_past_its_soft_timeout_and_a_running_or_traced_one_is_not() -> None:
    procs = [ProcView(0, None, wrapped=True, heartbeat_age=5.0, soft_timeout=4.0, hard_timeout=8.0, stopped=True),
             ProcView(1, None, wrapped=True, heartbeat_age=5.0, soft_timeout=4.0, hard_timeout=8.0),
             ProcView(2, None, wrapped=True, heartbeat_age=3.0, soft_timeout=4.0, hard_timeout=8.0, stopped=True)]
    [a] = supervise(procs, restarts_used=0, max_restarts=3)
    assert (a.kind, a.local_ranks, a.fault) == ("kill", (0,), "stopped")


def test_a_rank_past_its_hard_timeout_is_killed_as_hung_even_when_stopped() -> None:
    procs = [ProcView(0, None, wrapped=True, heartbeat_age=9.0, soft_timeout=4.0, hard_timeout=8.0, stopped=True)]
    [a] = supervise(procs, restarts_used=0, max_restarts=3)
    assert (a.kind, a.local_ranks, a.fault) == ("kill", (0,), "hard_timeout")


def test_stale_epoch_rejoins() -> None:
    [a] = supervise([ProcView(0, int(ExitCode.STALE_EPOCH), wrapped=True)], restarts_used=0, max_restarts=3)
    assert a.kind == "restart_all"


POD_ENV = {
    "STALWART_JOB": "team/train", "STALWART_JOB_UID": "uid-1", "STALWART_NODE_ID": "train-worker-0",
    "STALWART_POD_IP": "10.0.0.5", "STALWART_SPARE": "false", "STALWART_NPROC_PER_NODE": "4",
    "STALWART_MIN_NODES": "2", "STALWART_MAX_NODES": "3", "STALWART_ETCD_ENDPOINTS": "etcd-0:2379,etcd-1:2379",
    "STALWART_RPC_TOKEN": "s3cret",
}


def test_settings_from_the_pod_environment() -> None:
    s = PodSettings.from_env(POD_ENV)
    assert s.nproc_per_node == 4 and s.etcd_endpoints == ["etcd-0:2379", "etcd-1:2379"]
    assert s.keys.prefix == "/stalwart/v1/team/uid-1/"
    assert s.rpc_token is not None and "s3cret" not in repr(s)


@pytest.mark.parametrize(("change", "message"), [
    ({"STALWART_POD_IP": None}, "STALWART_POD_IP: is required"),
    ({"STALWART_NPROC_PER_NODE": "0"}, "STALWART_NPROC_PER_NODE"),
    ({"STALWART_MAX_NODES": "1"}, "STALWART_MAX_NODES \\(1\\) must be >= STALWART_MIN_NODES"),
    ({"STALWART_ETCD_ENDPOINTS": "etcd-0"}, "STALWART_ETCD_ENDPOINTS"),
    ({"STALWART_JOB": "train"}, "STALWART_JOB"),
    ({"STALWART_SPARE": "maybe"}, "STALWART_SPARE"),
])
def test_settings_errors_name_the_variable(change: dict, message: str) -> None:
    env = {k: v for k, v in {**POD_ENV, **change}.items() if v is not None}
    with pytest.raises(PodEnvError, match=message):
        PodSettings.from_env(env)


def _status(state: str, epoch: int | None, iteration: int = 3, rank: int | None = 1) -> RankStatus:
    return RankStatus.model_validate({"slot": 4, "pid": 321, "state": state, "epoch": epoch, "iteration": iteration,
                                      "rank": rank, "heartbeat": 1.0})


@pytest.mark.parametrize(("status", "recorded"), [
    (None, None),                                        # no status: not a wrapped process's
    (_status("running", 7), (3, 1)),                     # running in this round: that iteration, that rank
    (_status("barrier", 7), (3, None)),                  # at a barrier: no rank yet
    (_status("running", 6), None),                       # still in the ended round: its iteration is not ours
    (_status("barrier", 6), None),
    (_status("running", None), None),                    # parked: no round at all
    (_status("inactive", 7, rank=None), None),           # a spare waiting: no iteration of its to fault
    (_status("restarting", 7), None),                    # between iterations: the next barrier notices
    (_status("done", 7), None),
])
def test_the_agent_records_a_fault_only_in_the_iteration_of_its_own_round(
        status: RankStatus | None, recorded: tuple[int, int | None] | None) -> None:
    rec = fault_for(status, epoch=7, slot=4, node_id="pod-a", kind="hard_timeout", reason="x" * 5000, time=9.0)
    if recorded is None:
        assert rec is None
        return
    assert rec is not None and (rec.iteration, rec.rank) == recorded
    # It names the dead process, so that the one respawned in the slot takes it as a peer's fault.
    assert (rec.slot, rec.pid, rec.node_id, rec.kind, len(rec.reason)) == (4, 321, "pod-a", "hard_timeout", 2048)


def test_a_process_that_dies_before_its_status_was_read_is_judged_by_its_last_word(tmp_path: Path) -> None:
    # A forked rank runs the script milliseconds after its start and can die before the agent's first read of
    # its status file (at most every status_interval). Its death must still be read as a wrapped process's (a
    # respawn into the next iteration), not as a plain script's (a new round for the whole job).
    status = tmp_path / "rank-0.json"
    ranks = RankProcesses(status_interval=3600.0, finish_grace=60.0)
    proc = ranks.start([sys.executable, "-c", "import time; time.sleep(60)"], {}, 0, slot=0, status_file=status,
                       fresh=True)
    try:
        assert ranks.views()[0].wrapped is False  # read now: nothing there yet, and not again for an hour
        status.write_bytes(RankStatus(slot=0, pid=proc.popen.pid, state="running", epoch=1,
                                      heartbeat=time.monotonic()).to_json_bytes())
        assert ranks.views()[0].wrapped is False  # the interval holds while it runs
        proc.popen.kill()
        proc.popen.wait(10)
        ranks.poll()
        (view,) = ranks.views()
        assert view.exit_code == -9 and view.wrapped is True
    finally:
        proc.popen.kill()
        assert isinstance(proc.popen, subprocess.Popen) and proc.popen.wait(10) == -9
