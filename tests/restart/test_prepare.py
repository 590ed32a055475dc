"""The decorator's ``prepare`` hook against a real etcd with real torch ranks (bench/restart_ddp.py
``--prepare``): a warm spare runs it while it waits parked, before any round took it, and never again (not at
its promotion, not at an in-process restart after it), in both script styles; one that raises on a parked
spare ends that process ``PREPARE_FAILED`` with the exception in its log and in its report for the agent while
the running ranks finish; one that raises on a running rank fails it as an exception raised before its first
iteration does; one that never returns ends its parked process ``PREPARE_FAILED`` at ``prepare_timeout``, its
stacks in its log and the deadline in its report; a parked process without LOCAL_RANK (a pod's standby of
several local ranks) runs it after its handover, once."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from forked_ranks import spawn_rank
from restart_helpers import SCRIPT, expected_checksum, new_job, rank_env, read_status, run_ranks, start_rank, wait_until

from stalwart.agent.handover import handover_env, write_handover
from stalwart.agent.processes import RankProcess
from stalwart.api.exit_codes import ExitCode
from stalwart.api.handover import HANDOVER_FILE_ENV, PARKED_ENV, Handover
from stalwart.api.restart import FailureInfo
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

STEPS = 60


def _prepared(work: Path) -> list[dict[str, Any]]:
    path = work / "prepare.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _command(work: Path, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, "--mode", "wrapped", "--steps", str(STEPS), "--step-sleep", "0.1",
            "--barrier-timeout", "15", "--out", str(work / "out.jsonl"), "--marker-dir", str(work), *extra]


def _parked_env(etcd: EtcdServer, env: dict[str, str], work: Path) -> dict[str, str]:
    """A warm spare's environment before a round takes it: no epoch, no slot, no status file yet."""
    parked = {k: v for k, v in env.items()
              if not k.startswith("STALWART_") or k in ("STALWART_ETCD_ENDPOINTS", "STALWART_JOB", "STALWART_JOB_UID")}
    parked.update({PARKED_ENV: "true", HANDOVER_FILE_ENV: str(work / "handover-spare.json"),
                   "STALWART_NODE_ID": "node-spare"})
    return parked


def _start_workers(etcd: EtcdServer, keys: JobKeys, epoch: int, work: Path, cmd: list[str], *,
                   procs: dict[str, RankProcess]) -> None:
    for slot in (0, 1):
        env = rank_env(etcd, keys, epoch, slot=slot, slots=2, target=2, work=work)
        env[HANDOVER_FILE_ENV] = str(work / f"handover-{slot}.json")
        env["STALWART_NODE_ID"] = f"node-{slot}"
        procs[f"slot{slot}"] = spawn_rank(cmd, env)


def _end(procs: dict[str, RankProcess]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


@pytest.mark.parametrize("style", ["wrapper-builds-the-group", "torchrun-style"])
def test_the_spare_prepares_while_parked_and_never_again(etcd: EtcdServer, tmp_path: Path, style: str) -> None:
    store = Store([etcd.endpoint])
    keys, epoch1 = new_job(store)
    # A fault in the new round, on the promoted spare (rank 1), makes an in-process restart after the promotion.
    cmd = _command(tmp_path, "--prepare", "count", "--fault", "exception", "--fault-rank", "1", "--fault-step",
                   "40", *(["--self-init", "bare"] if style == "torchrun-style" else []))
    procs: dict[str, RankProcess] = {}
    try:
        _start_workers(etcd, keys, epoch1, tmp_path, cmd, procs=procs)
        spare_env = _parked_env(etcd, rank_env(etcd, keys, epoch1, slot=1, slots=2, target=2, work=tmp_path),
                                tmp_path)
        procs["spare"] = spawn_rank(cmd, spare_env)
        spare = procs["spare"].pid
        wait_until("the parked spare's prepare and a few steps of round 1", lambda: any(
            r["pid"] == spare for r in _prepared(tmp_path))
            and (st := read_status(tmp_path / "status-0.json")) is not None and (st.step or 0) >= 5)
        lost = procs.pop("slot1")
        lost.kill()
        assert lost.wait(timeout=30) == -signal.SIGKILL
        promoted = time.time()
        assert read_status(tmp_path / "status-spare.json") is None  # nothing of a round reached the spare yet
        epoch2 = store.put(keys.rendezvous + "manifest", b"{}")
        for slot, path, status, node in ((0, "handover-0.json", "status-0.json", "node-0"),
                                         (1, "handover-spare.json", "status-spare.json", "node-spare")):
            env = rank_env(etcd, keys, epoch2, slot=slot, slots=2, target=2, work=tmp_path)
            env.update({"STALWART_STATUS_FILE": str(tmp_path / status), "STALWART_NODE_ID": node})
            write_handover(tmp_path / path, Handover(epoch=epoch2, round=2, env=handover_env(env)))
        assert procs["slot0"].wait(timeout=180) == 0
        assert procs["spare"].wait(timeout=60) == 0
    finally:
        _end(procs)
        store.close()

    calls = _prepared(tmp_path)
    # Once per process: the two workers before their first session, the spare while parked; not after.
    assert sorted(r["pid"] for r in calls) == sorted([procs["slot0"].pid, lost.pid, spare]), calls
    [by_spare] = [r for r in calls if r["pid"] == spare]
    assert by_spare["parked"] and by_spare["time"] < promoted, by_spare
    # Its status carries the hook's run among the marks of its recovery (the phases' "prepare").
    marks = (read_status(tmp_path / "status-spare.json") or pytest.fail("no status of the spare")).recovery
    assert marks is not None and marks.prepare_parked and marks.prepare_end is not None, marks
    assert marks.prepare_end < promoted < marks.sealed and marks.epoch == epoch2, marks
    assert not any(r["parked"] for r in calls if r["pid"] != spare)
    finals = {r["rank"]: r for r in (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
              if not r.get("leak")}
    assert finals[0]["pid"] == procs["slot0"].pid and finals[1]["pid"] == spare, finals
    # The function saw the hook's result, in the process that made it, after an in-process restart too.
    assert finals[1]["prepared"] == by_spare and finals[1]["restarts"] >= 1, finals[1]
    assert finals[0]["prepared"]["pid"] == procs["slot0"].pid
    assert (tmp_path / "fault-0").exists()
    expected = expected_checksum(steps=STEPS)
    assert all(r["step"] == STEPS and abs(r["checksum"] - expected) < 1e-4 for r in finals.values()), finals


def test_a_prepare_that_raises_ends_the_parked_spare_not_the_job(etcd: EtcdServer, tmp_path: Path) -> None:
    store = Store([etcd.endpoint])
    keys, epoch = new_job(store)
    store.close()
    procs: dict[str, RankProcess] = {}
    try:
        _start_workers(etcd, keys, epoch, tmp_path, _command(tmp_path, "--prepare", "count"), procs=procs)
        spare_env = _parked_env(etcd, rank_env(etcd, keys, epoch, slot=1, slots=2, target=2, work=tmp_path),
                                tmp_path)
        spare_env["STALWART_PARKED_REPORT"] = str(tmp_path / "parked-report.json")
        spare, pipe = start_rank(_command(tmp_path, "--prepare", "raise"), spare_env)
        procs["spare"] = spare
        with open(pipe, encoding="utf-8", errors="replace") as stream:
            err = stream.read()  # to its end: the process's exit
        assert spare.wait(timeout=60) == ExitCode.PREPARE_FAILED, err
        # The running ranks (60 steps of 0.1 s) were still running when the spare's process ended.
        alive = [procs["slot0"].poll(), procs["slot1"].poll()]
        assert procs["slot0"].wait(timeout=180) == 0
        assert procs["slot1"].wait(timeout=60) == 0
    finally:
        _end(procs)

    assert "ValueError: the model's configuration is invalid (injected in prepare)" in err, err
    assert f"exiting {int(ExitCode.PREPARE_FAILED)} (PREPARE_FAILED)" in err, err
    # What its agent reports for the pod: the exception, apart from any failure of the job.
    report = FailureInfo.from_json_bytes((tmp_path / "parked-report.json").read_bytes())
    assert (report.pod, report.exception, report.message) == (
        "node-spare", "ValueError", "the model's configuration is invalid (injected in prepare)")
    assert "raised on a parked process" in report.reason and "PREPARE_FAILED" in report.reason
    # They finished as a run without the spare does: no fault, no restart, a fault-free run's parameters.
    assert alive == [None, None]
    finals = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["rank"] for r in finals) == [0, 1] and {r["restarts"] for r in finals} == {0}, finals
    expected = expected_checksum(steps=STEPS)
    assert all(abs(r["checksum"] - expected) < 1e-4 for r in finals), finals


def test_a_prepare_that_raises_on_a_running_rank_fails_it_as_the_script_would(etcd: EtcdServer,
                                                                              tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, "--prepare", "raise", "--steps", "5", slots=1)
    assert run.codes == [ExitCode.FAILED], run.stderr
    assert "ValueError: the model's configuration is invalid (injected in prepare)" in run.stderr[0]
    assert "Traceback" in run.stderr[0] and run.results == []


def test_a_prepare_that_never_returns_ends_the_parked_process_at_its_deadline(etcd: EtcdServer,
                                                                              tmp_path: Path) -> None:
    store = Store([etcd.endpoint])
    keys, epoch = new_job(store)
    store.close()
    env = _parked_env(etcd, rank_env(etcd, keys, epoch, slot=1, slots=2, target=2, work=tmp_path), tmp_path)
    env["STALWART_PARKED_REPORT"] = str(tmp_path / "parked-report.json")
    parked, pipe = start_rank(_command(tmp_path, "--prepare", "hang", "--prepare-timeout", "2"), env)
    try:
        with open(pipe, encoding="utf-8", errors="replace") as stream:
            err = stream.read()  # to its end: the process's exit
        assert parked.wait(timeout=60) == ExitCode.PREPARE_FAILED, err
    finally:
        _end({"parked": parked})
    assert "the prepare hook did not return within 2 s" in err, err
    assert "in prepare" in err, err  # the main thread's stack: where the hook was blocked
    report = FailureInfo.from_json_bytes((tmp_path / "parked-report.json").read_bytes())
    assert report.reason == "the prepare hook did not return within 2 s on a parked process (exit code 100, " \
                            "PREPARE_FAILED)" and report.exception is None and report.pod == "node-spare"


def test_a_standby_without_a_local_rank_prepares_after_its_handover(etcd: EtcdServer, tmp_path: Path) -> None:
    # A pod's standby when the pod runs several local ranks: parked without LOCAL_RANK (it does not know which
    # rank it will replace), it runs the hook once its handover names one, then takes that rank's place.
    store = Store([etcd.endpoint])
    keys, epoch = new_job(store)
    store.close()
    cmd = _command(tmp_path, "--prepare", "count")
    procs: dict[str, RankProcess] = {}
    try:
        env0 = rank_env(etcd, keys, epoch, slot=0, slots=2, target=2, work=tmp_path)
        env0.update({HANDOVER_FILE_ENV: str(tmp_path / "handover-0.json"), "STALWART_NODE_ID": "node-0"})
        procs["slot0"] = spawn_rank(cmd, env0)
        parked = _parked_env(etcd, rank_env(etcd, keys, epoch, slot=1, slots=2, target=2, work=tmp_path), tmp_path)
        parked.pop("LOCAL_RANK")
        procs["standby"] = spawn_rank(cmd, parked)
        env1 = rank_env(etcd, keys, epoch, slot=1, slots=2, target=2, work=tmp_path)
        env1["STALWART_NODE_ID"] = "node-spare"
        handed = time.time()
        write_handover(tmp_path / "handover-spare.json", Handover(epoch=epoch, round=1, env=handover_env(env1)))
        assert procs["slot0"].wait(timeout=180) == 0
        assert procs["standby"].wait(timeout=60) == 0
    finally:
        _end(procs)
    standby = procs["standby"].pid
    [record] = [r for r in _prepared(tmp_path) if r["pid"] == standby]
    assert not record["parked"] and record["time"] >= handed, record
    finals = {r["rank"]: r for r in (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())}
    assert finals[1]["pid"] == standby and finals[1]["prepared"] == record, finals
    expected = expected_checksum(steps=STEPS)
    assert all(r["step"] == STEPS and abs(r["checksum"] - expected) < 1e-4 for r in finals.values()), finals
