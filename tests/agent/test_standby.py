"""A pod's standby process, the pure decisions: when one is started, what replaces a dead rank, what the pod
reports of a parked process that ended before a round took it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.agent.progress import ProgressBook, parked_failed, record
from stalwart.agent.rank_env import parked_env
from stalwart.agent.settings import PodSettings
from stalwart.agent.standby import parked_failure, read_report, replacement, settled, standby_due
from stalwart.api.exit_codes import ExitCode
from stalwart.api.restart import FailureInfo, RankStatus

ON = {"enabled": True, "warm": True, "member": True, "wrapped": [True], "settled": True, "have": False,
      "given_up": False}


@pytest.mark.parametrize(("change", "due"), [
    ({}, True),
    ({"wrapped": [True, True, True]}, True),
    ({"enabled": False}, False),        # --no-standby, STALWART_STANDBY=false
    ({"warm": False}, False),           # warm spares off for the job
    ({"member": False}, False),         # a spare's parked processes, or a node waiting outside the round
    ({"wrapped": [False]}, False),      # a plain script (or not shown yet): its process cannot wait parked
    ({"wrapped": [True, False]}, False),
    ({"wrapped": []}, False),           # no rank process
    ({"settled": False}, False),        # starting, or recovering: its imports would slow them down
    ({"have": True}, False),            # one is there already
    ({"given_up": True}, False),        # the last one ended on its own: the next would too
])
def test_standby_due(change: dict[str, object], due: bool) -> None:
    assert standby_due(**{**ON, **change}) is due  # type: ignore[arg-type]


def _status(state: str, iteration: int) -> RankStatus:
    return RankStatus(slot=0, pid=10, state=state, iteration=iteration, heartbeat=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("statuses", "stepped", "want"), [
    ([_status("running", 2)], 2, True),
    ([_status("running", 2), _status("running", 2)], 2, True),
    ([_status("running", 3)], 2, False),          # a new iteration (a recovery) has not stepped yet
    ([_status("running", 0)], None, False),       # no step in this round yet
    ([_status("barrier", 2)], 2, False),
    ([_status("running", 2), None], 2, False),    # a rank without a status (a new process)
    ([], 2, False),
])
def test_settled(statuses: list[RankStatus | None], stepped: int | None, want: bool) -> None:
    assert settled(statuses, stepped) is want


@pytest.mark.parametrize(("alive", "in_round", "what"), [
    (True, True, "standby"), (False, True, "spawn"), (True, False, "spawn"), (False, False, "spawn"),
])
def test_replacement(alive: bool, in_round: bool, what: str) -> None:
    assert replacement(standby_alive=alive, in_round=in_round) == what


RAISED = FailureInfo(pod="", reason="the prepare hook raised on a parked process (exit code 100, PREPARE_FAILED)",
                     exception="ValueError", message="bad config", time=5.0)


@pytest.mark.parametrize(("local_rank", "code", "report", "want"), [
    (None, int(ExitCode.PREPARE_FAILED), RAISED, RAISED.model_copy(update={"pod": "p"})),
    (0, int(ExitCode.PREPARE_FAILED), None,
     FailureInfo(pod="p", reason="parked local rank 0 ended before a round took it: exit code 100 (PREPARE_FAILED)",
                 time=9.0)),
    (None, -9, None,
     FailureInfo(pod="p", reason="the standby process ended before a round took it: killed by signal 9", time=9.0)),
    (1, 3, None, FailureInfo(pod="p", reason="parked local rank 1 ended before a round took it: exit code 3",
                             time=9.0)),
])
def test_parked_failure(local_rank: int | None, code: int, report: FailureInfo | None, want: FailureInfo) -> None:
    assert parked_failure(pod="p", local_rank=local_rank, code=code, report=report, now=9.0) == want


def test_read_report(tmp_path: Path) -> None:
    path = tmp_path / "parked-0.json"
    assert read_report(None) is None and read_report(path) is None
    path.write_text("{half")
    assert read_report(path) is None
    path.write_bytes(RAISED.to_json_bytes())
    assert read_report(path) == RAISED


def test_the_progress_record_carries_the_parked_failure_apart_from_the_jobs() -> None:
    book = parked_failed(ProgressBook(node_id="p", incarnation="i"), RAISED)
    rec = record(book, "joining", wall=1.0)
    assert rec.parked_failure == RAISED and rec.last_failure is None


def _settings(nproc: int) -> PodSettings:
    return PodSettings.from_env({"STALWART_JOB": "ns/job", "STALWART_JOB_UID": "u1", "STALWART_NODE_ID": "pod-0",
                                 "STALWART_POD_IP": "127.0.0.1", "STALWART_ETCD_ENDPOINTS": "127.0.0.1:2379",
                                 "STALWART_NPROC_PER_NODE": str(nproc)})


def test_a_parked_environment_names_its_local_rank_and_report_or_neither(tmp_path: Path) -> None:
    env = parked_env(_settings(1), 0, base_env={}, run_dir=tmp_path)
    assert env["LOCAL_RANK"] == "0" and env["STALWART_PARKED"] == "true"
    assert env["STALWART_PARKED_REPORT"] == str(tmp_path / "parked-0.json")
    assert env["STALWART_HANDOVER_FILE"] == str(tmp_path / "handover-0.json")
    # A standby of a pod of several ranks: it does not know which one it will replace (prepare after handover).
    standby = parked_env(_settings(4), None, base_env={}, run_dir=tmp_path)
    assert "LOCAL_RANK" not in standby and standby["LOCAL_WORLD_SIZE"] == "4"
    assert "STALWART_HANDOVER_FILE" not in standby and "STALWART_PARKED_REPORT" not in standby
