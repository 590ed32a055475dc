"""Snapshots spilled by a rank about to be lost to a hang, and taken by the process that replaces it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.restart import snapshot_spill
from stalwart.restart.peers import TensorSpec
from stalwart.restart.snapshot_spill import SpilledCopy


def copy(kind: str, shard: int, step: int) -> SpilledCopy:
    layout = [TensorSpec("model.w", (2, 3), "float32"), TensorSpec("model.h", (4,), "bfloat16"),
              TensorSpec("optimizer.0.step", (), "float32"), TensorSpec("model.empty", (0,), "int64")]
    flats = {"float32": torch.arange(7, dtype=torch.float32) + step, "bfloat16": torch.tensor([1.5, -2, 3, 4],
                                                                                               dtype=torch.bfloat16),
             "int64": torch.empty(0, dtype=torch.int64)}
    return SpilledCopy(kind, shard, step, 4, 3, layout, flats)  # type: ignore[arg-type]


def same(a: SpilledCopy, b: SpilledCopy) -> bool:
    return (a.kind, a.shard, a.step, a.world, a.generation, a.layout) == \
        (b.kind, b.shard, b.step, b.world, b.generation, b.layout) and \
        sorted(a.flats) == sorted(b.flats) and all(torch.equal(a.flats[d], b.flats[d]) for d in a.flats)


def test_the_status_files_neighbour_is_the_directory() -> None:
    assert snapshot_spill.directory_for("/run/agent/rank-3.json") == Path("/run/agent/rank-3.snapshots")


def test_copies_come_back_as_written_and_each_is_written_once(tmp_path: Path) -> None:
    written = [copy("own", 2, 7), copy("ward", 3, 7), copy("ward", 3, 6)]
    assert snapshot_spill.write(tmp_path, written) == 3 * (7 * 4 + 4 * 2)
    assert snapshot_spill.write(tmp_path, written[:1]) == 0  # already there: a copy never changes once held
    got = snapshot_spill.read(tmp_path)
    assert len(got) == 3 and all(any(same(g, w) for w in written) for g in got)


def test_nothing_held_writes_nothing_and_a_missing_directory_reads_as_none(tmp_path: Path) -> None:
    assert snapshot_spill.write(tmp_path / "d", []) == 0 and not (tmp_path / "d").exists()
    assert snapshot_spill.read(tmp_path / "d") == []


def test_a_part_written_or_inconsistent_copy_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    snapshot_spill.write(tmp_path, [copy("own", 0, 1), copy("ward", 1, 1), copy("ward", 2, 1)])
    (tmp_path / "own-0-1").rename(tmp_path / ".partial-own-0-1-123")  # the writer died before the rename
    with open(tmp_path / "ward-1-1" / "float32.bin", "ab") as f:
        f.write(b"\0")  # one byte more than its layout says
    (tmp_path / "ward-2-1" / "layout.json").write_text('{"kind": "ward", "shard": -1}')
    got = snapshot_spill.read(tmp_path)
    assert got == []
    assert "float32.bin has 29 bytes, its layout says 28" in caplog.text
    assert "ward-2-1" in caplog.text and "shard" in caplog.text


# Two ranks on two pods, each the other's buddy: an Adam-trained layer snapshotted every step.
PHASE_ONE = """
import json, os, sys
import torch, torch.distributed as dist
from stalwart.restart import snapshot_spill, snapshots
rank, store_path, status, out, spill = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
os.environ["STALWART_STATUS_FILE"] = status
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
torch.manual_seed(rank)
model = torch.nn.Linear(3, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.1)
snaps = snapshots.PeerSnapshots(model, opt, pod=f"pod-{rank}")
for step in range(3):
    model(torch.ones(1, 3) * (rank + 1)).sum().backward()
    opt.step()
    opt.zero_grad()
    snaps.commit(step)
snaps.close()  # the copies of step 2 have landed
state = [t.tolist() for _, t in snapshots._state(model, opt)]
open(out, "w").write(json.dumps(state))
if spill:
    snapshots.spill(snapshot_spill.directory_for(status))
dist.destroy_process_group()
"""

# Fresh processes: a spare for pod 0's rank, and the process that takes the slot of pod 1's rank. Each restores
# twice: first with the spill moved aside (as if nothing had been written), then, holding nothing again, with it.
PHASE_TWO = """
import json, os, sys
import torch, torch.distributed as dist
from stalwart.restart import snapshot_held, snapshot_spill, snapshots
rank, store_path, status, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ["STALWART_STATUS_FILE"] = status
spilled = snapshot_spill.directory_for(status)
aside = spilled.with_name("aside")
dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
results = []
for with_spill in (False, True):
    if spilled.exists() and not with_spill:
        spilled.rename(aside)
    if aside.exists() and with_spill:
        aside.rename(spilled)
    torch.manual_seed(100 + rank)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    snaps = snapshots.PeerSnapshots(model, opt, pod=f"new-pod-{rank}")
    step = snaps.restore()
    state = [t.tolist() for _, t in snapshots._state(model, opt)]
    results.append({"step": step, "state": state, "spilled_left": spilled.exists()})
    snaps.close()
    snapshot_held.forget()  # a new process holds nothing
open(out, "w").write(json.dumps(results))
dist.destroy_process_group()
"""


def run_pair(script: str, tmp_path: Path, phase: str, statuses: list[Path], extra: list[str]) -> list[Any]:
    store = tmp_path / f"store-{phase}"
    outs = [tmp_path / f"{phase}-{rank}.json" for rank in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(store), str(statuses[rank]),
                               str(outs[rank]), *extra], env={**os.environ, "OMP_NUM_THREADS": "1"})
             for rank in (0, 1)]
    try:
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.integration
def test_the_process_that_takes_a_stuck_ranks_slot_restores_from_its_spill_bit_for_bit(tmp_path: Path) -> None:
    # Pod 0 is lost; pod 1's rank, which holds the only copy of pod 0's shard, is stuck in a transfer gloo does
    # not fail, spills, and is killed by its agent. A spare takes rank 0 and a new process rank 1's slot (the
    # same status file): both come back to step 2, the state each had there.
    statuses = [tmp_path / "a" / "rank-0.json", tmp_path / "b" / "rank-0.json"]
    for s in statuses:
        s.parent.mkdir()
    before = run_pair(PHASE_ONE, tmp_path, "one", statuses, ["1"])
    spilled = snapshot_spill.directory_for(statuses[1])
    assert sorted(p.name for p in spilled.iterdir()) == ["own-1-1", "own-1-2", "ward-0-1", "ward-0-2"]
    spare_status = tmp_path / "spare" / "rank-0.json"
    spare_status.parent.mkdir()
    without, after = zip(*run_pair(PHASE_TWO, tmp_path, "two", [spare_status, statuses[1]], []), strict=True)
    # Without the spill nothing holds either shard: the job would go back to its checkpoint.
    assert [w["step"] for w in without] == [None, None]
    assert [a["step"] for a in after] == [2, 2]
    assert [a["state"] for a in after] == before
    assert not any(a["spilled_left"] for a in after)  # taken, then removed: a later spill starts clean
