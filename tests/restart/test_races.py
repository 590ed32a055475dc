"""Races of the restart loop, each forced to happen on real rank processes and a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from restart_helpers import SCRIPT, TIMEOUT, new_job, rank_env

from stalwart.api.restart import ArrivalRecord, FaultRecord
from stalwart.etcd.store import Store
from stalwart.local.etcd import EtcdServer

pytestmark = pytest.mark.integration


def test_an_interrupt_that_arrives_as_the_iteration_begins_restarts_it(etcd: EtcdServer, tmp_path: Path) -> None:
    # A peer reported a fault in iteration 0 before this process began running it (its monitor has seen the
    # fault: the slow rank assignment leaves it the time). Beginning the iteration delivers the interrupt at
    # once; it must restart the iteration, not escape the wrapper (which would end the process with exit 1).
    # The peer is played by the test through etcd: it arrives, reports its fault and is never seen again.
    with Store([etcd.endpoint]) as store:
        keys, epoch = new_job(store)
        base = f"{keys.restart}{epoch}/"
        store.put(base + "arrive/0/1", ArrivalRecord(slot=1, node_id="node-1").to_json_bytes())
        store.put(base + "fault/0/1", FaultRecord(slot=1, rank=1, node_id="node-1", iteration=0, kind="exception",
                                                  reason="RuntimeError('boom')", time=time.time()).to_json_bytes())
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, SCRIPT, "--mode", "wrapped", "--marker-dir", str(tmp_path), "--out", str(out),
           "--steps", "8", "--barrier-timeout", "3", "--slow-assignment", "2"]
    done = subprocess.run(cmd, env=rank_env(etcd, keys, epoch, slot=0, slots=2, target=2, work=tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (result["rank"], result["world"], result["step"], result["restarts"]) == (0, 1, 8, 1)
