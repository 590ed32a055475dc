"""A rank process across rendezvous rounds, against a real etcd with real torch ranks (bench/restart_ddp.py):

* the survivor of a lost peer is handed to the new round and finishes there in the same process, with a
  parked spare (started before the round, waiting for its assignment) taking the lost rank, and the
  parameters of a run without faults;
* the lost peer's process, paused through the change of round and resumed after it (a zombie), can write
  nothing into etcd (its writes are fenced by the old epoch) and takes no part in the new round's group.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from forked_ranks import spawn_rank
from restart_helpers import SCRIPT, expected_checksum, new_job, rank_env, read_status, wait_until

from stalwart.agent.handover import handover_env, write_handover
from stalwart.agent.processes import RankProcess
from stalwart.agent.supervision import fault_for
from stalwart.api.exit_codes import ExitCode
from stalwart.api.handover import HANDOVER_FILE_ENV, PARKED_ENV, Handover
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

STEPS = 60


def _command(work: Path, *, barrier_timeout: float) -> tuple[Path, list[str]]:
    out = work / "out.jsonl"
    return out, [sys.executable, SCRIPT, "--mode", "wrapped", "--steps", str(STEPS), "--step-sleep", "0.1",
                 "--barrier-timeout", str(barrier_timeout), "--out", str(out), "--marker-dir", str(work)]


def _start_round_one(etcd: EtcdServer, keys: JobKeys, epoch: int, work: Path, cmd: list[str], *,
                     procs: dict[str, RankProcess]) -> None:
    """Slots 0 and 1 running in the round of ``epoch``, and a spare started before its round, parked (no epoch,
    no slot yet); returns once slot 0 took a few steps."""
    for slot in (0, 1):
        env = rank_env(etcd, keys, epoch, slot=slot, slots=2, target=2, work=work)
        env[HANDOVER_FILE_ENV] = str(work / f"handover-{slot}.json")
        env["STALWART_NODE_ID"] = f"node-{slot}"
        procs[f"slot{slot}"] = spawn_rank(cmd, env)
    parked = {k: v for k, v in rank_env(etcd, keys, epoch, slot=1, slots=2, target=2, work=work).items()
              if not k.startswith("STALWART_") or k in ("STALWART_ETCD_ENDPOINTS", "STALWART_JOB", "STALWART_JOB_UID")}
    parked.update({PARKED_ENV: "true", HANDOVER_FILE_ENV: str(work / "handover-spare.json"),
                   "STALWART_NODE_ID": "node-spare"})
    procs["spare"] = spawn_rank(cmd, parked)
    wait_until("a few steps", lambda: (st := read_status(work / "status-0.json")) is not None and (st.step or 0) >= 5)


def test_survivor_continues_in_the_new_round_and_the_zombie_is_fenced(etcd: EtcdServer, tmp_path: Path) -> None:
    store = Store([etcd.endpoint])
    keys, epoch1 = new_job(store)
    out, cmd = _command(tmp_path, barrier_timeout=15)
    procs: dict[str, RankProcess] = {}
    try:
        _start_round_one(etcd, keys, epoch1, tmp_path, cmd, procs=procs)

        zombie = procs["slot1"]
        os.kill(zombie.pid, signal.SIGSTOP)
        # The new round: the manifest is written again (its mod_revision is the new epoch).
        epoch2 = store.put(keys.rendezvous + "manifest", b"{}")
        for slot, path, status in ((0, "handover-0.json", "status-0.json"),
                                   (1, "handover-spare.json", "status-spare.json")):
            env = rank_env(etcd, keys, epoch2, slot=slot, slots=2, target=2, work=tmp_path)
            env["STALWART_STATUS_FILE"] = str(tmp_path / status)
            env["STALWART_NODE_ID"] = "node-0" if slot == 0 else "node-spare"
            write_handover(tmp_path / path, Handover(epoch=epoch2, round=2, env=handover_env(env)))
        # The zombie's peer socket stays open while it is stopped; the survivor is freed by the handover.
        wait_until("the new round's first step", lambda: (st := read_status(tmp_path / "status-spare.json")) is not None
              and st.state == "running" and (st.step or 0) >= 1)
        os.kill(zombie.pid, signal.SIGCONT)

        assert procs["slot0"].wait(timeout=180) == 0
        assert procs["spare"].wait(timeout=60) == 0
        # The zombie's first write after it resumed is refused: it ends with STALE_EPOCH, having joined nothing.
        assert zombie.wait(timeout=120) == ExitCode.STALE_EPOCH
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)

    results = [json.loads(line) for line in out.read_text().splitlines()]
    finals = {r["rank"]: r for r in results if not r.get("leak")}
    assert sorted(finals) == [0, 1]
    # The survivor is the process that started in round 1; the lost rank ran in the spare's process.
    assert finals[0]["pid"] == procs["slot0"].pid and finals[1]["pid"] == procs["spare"].pid
    assert all(r["step"] == STEPS for r in finals.values())
    expected = expected_checksum(steps=STEPS)
    assert all(abs(r["checksum"] - expected) < 1e-4 for r in finals.values())
    # Nothing of the zombie's in the new epoch: every record there names the survivor or the spare.
    kvs, _ = store.get_prefix(f"{keys.restart}{epoch2}/")
    writers = {json.loads(kv.value).get("nodeId") for kv in kvs} - {None}
    assert writers <= {"node-0", "node-spare"}, writers
    alive = [json.loads(kv.value) for kv in kvs if "/alive/" in kv.key]
    assert zombie.pid not in {a.get("pid") for a in alive}
    store.close()


def test_a_survivor_stuck_in_the_old_round_is_replaced_without_faulting_the_new_one(
        etcd: EtcdServer, tmp_path: Path) -> None:
    """The survivor cannot leave the ended round (stopped here; blocked in a collective the handover's abort did
    not free, in a real failure), so its agent kills it at its hard timeout. Its status names an iteration of the
    ended round: recorded in the new round, that fault would interrupt the new round's iteration of the same
    number and leave the spare to train alone. The agent records nothing; the process respawned in the
    survivor's slot and the promoted spare run the new round together."""
    store = Store([etcd.endpoint])
    keys, epoch1 = new_job(store)
    out, cmd = _command(tmp_path, barrier_timeout=60)
    procs: dict[str, RankProcess] = {}
    try:
        _start_round_one(etcd, keys, epoch1, tmp_path, cmd, procs=procs)
        for name in ("slot1", "slot0"):  # the lost peer, and the survivor that will not leave its round
            os.kill(procs[name].pid, signal.SIGSTOP)
        epoch2 = store.put(keys.rendezvous + "manifest", b"{}")
        envs = {}
        for slot, path, status in ((0, "handover-0.json", "status-0.json"),
                                   (1, "handover-spare.json", "status-spare.json")):
            envs[slot] = rank_env(etcd, keys, epoch2, slot=slot, slots=2, target=2, work=tmp_path)
            envs[slot]["STALWART_STATUS_FILE"] = str(tmp_path / status)
            envs[slot]["STALWART_NODE_ID"] = "node-0" if slot == 0 else "node-spare"
            write_handover(tmp_path / path, Handover(epoch=epoch2, round=2, env=handover_env(envs[slot])))
        wait_until("the spare at the new round's first barrier", lambda: (
            st := read_status(tmp_path / "status-spare.json")) is not None and st.epoch == epoch2
              and st.state == "barrier")

        # The agent's part at the hard timeout: the survivor's last status is of the ended round.
        last = read_status(tmp_path / "status-0.json")
        assert last is not None and last.epoch == epoch1 and last.state == "running", last
        assert fault_for(last, epoch=epoch2, slot=0, node_id="node-0", kind="hard_timeout", reason="hard timeout",
                         time=time.time()) is None
        survivor = procs.pop("slot0")
        survivor.kill()
        survivor.wait(timeout=30)
        envs[0][HANDOVER_FILE_ENV] = str(tmp_path / "handover-0.json")
        procs["respawned"] = spawn_rank(cmd, envs[0])

        assert procs["respawned"].wait(timeout=180) == 0
        assert procs["spare"].wait(timeout=60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=30)

    finals = {r["rank"]: r for r in (json.loads(line) for line in out.read_text().splitlines()) if not r.get("leak")}
    assert finals[0]["pid"] == procs["respawned"].pid and finals[1]["pid"] == procs["spare"].pid, finals
    # One iteration of the new round, at full size, and no fault recorded in it.
    assert all((r["world"], r["step"], r["restarts"]) == (2, STEPS, 0) for r in finals.values()), finals
    kvs, _ = store.get_prefix(f"{keys.restart}{epoch2}/fault/")
    assert kvs == [], [kv.key for kv in kvs]
    store.close()
