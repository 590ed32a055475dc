"""Launch the DDP test script (bench/restart_ddp.py) as rank processes with the environment an agent gives,
against a real etcd, and read back what each rank wrote. The processes are forked, as an agent's are, from the
test process's fork server (tests/forked_ranks.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forked_ranks import spawn_rank

from stalwart.agent.processes import RankProcess
from stalwart.api.restart import RankStatus
from stalwart.etcd.keys import JobKeys
from stalwart.etcd.store import Store, StoreError
from stalwart.local.etcd import EtcdServer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "restart_ddp.py")
TIMEOUT = 240


def read_status(path: Path) -> RankStatus | None:
    """A rank's status file, or None while it has none (or a half-written one)."""
    try:
        return RankStatus.from_json_bytes(path.read_bytes())
    except (OSError, ValueError):
        return None


def wait_until(what: str, check: Callable[[], object], timeout: float = 120.0) -> None:
    """Poll ``check`` every 0.1 s until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def start_rank(cmd: list[str], env: dict[str, str]) -> tuple[RankProcess, int]:
    """A rank process forked as an agent's are (:func:`forked_ranks.spawn_rank`), and the read end of a pipe its
    standard error goes to."""
    read, write = os.pipe()
    try:
        return spawn_rank(cmd, env, stderr=write), read
    finally:
        os.close(write)


@dataclass
class Run:
    codes: list[int]
    results: list[dict[str, Any]]
    leaks: list[dict[str, Any]]
    work: Path
    keys: JobKeys
    stderr: list[str]

    def by_rank(self) -> dict[int, dict[str, Any]]:
        return {r["rank"]: r for r in self.results}


def new_job(store: Store) -> tuple[JobKeys, int]:
    """A fresh job prefix with a sealed-looking manifest key; its mod_revision is the epoch."""
    keys = JobKeys("test", uuid.uuid4().hex[:12])
    epoch = store.put(keys.rendezvous + "manifest", b"{}")
    return keys, epoch


def rank_env(etcd: EtcdServer, keys: JobKeys, epoch: int, *, slot: int, slots: int, target: int,
             work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "STALWART_ETCD_ENDPOINTS": etcd.endpoint, "STALWART_JOB": f"{keys.namespace}/job",
        "STALWART_JOB_UID": keys.uid, "STALWART_NODE_ID": "node-0", "STALWART_EPOCH": str(epoch),
        "STALWART_SLOT": str(slot), "STALWART_SLOTS": str(slots), "STALWART_TARGET_WORLD": str(target),
        "STALWART_SPARE": "true" if slot >= target else "false",
        "STALWART_STATUS_FILE": str(work / f"status-{slot}.json"), "LOCAL_RANK": str(slot),
        "RANK": str(slot), "WORLD_SIZE": str(target), "OMP_NUM_THREADS": "1",
    })
    return env


def run_ranks(etcd: EtcdServer, tmp: Path, *args: str, slots: int = 2, target: int | None = None,
              job: tuple[JobKeys, int] | None = None, until: list[int] | None = None,
              extra_env: dict[str, str] | None = None) -> Run:
    """Run ``slots`` rank processes of the script (``target`` of them active at first) to the end, in
    ``job`` (keys and epoch, see :func:`new_job`) or a new one. With ``until``, wait for those slots only and
    then kill the others (left hung by the test); their code is then -9. ``extra_env``: more variables for
    every process (as its agent would set them)."""
    target = slots if target is None else target
    if job is None:
        with Store([etcd.endpoint]) as store:
            job = new_job(store)
    keys, epoch = job
    out = tmp / "out.jsonl"
    procs, pipes = [], []
    for slot in range(slots):
        cmd = [sys.executable, SCRIPT, "--mode", "wrapped", "--marker-dir", str(tmp), "--out", str(out), *args]
        env = rank_env(etcd, keys, epoch, slot=slot, slots=slots, target=target, work=tmp)
        env.update(extra_env or {})
        proc, pipe = start_rank(cmd, env)
        procs.append(proc)
        pipes.append(pipe)
    errs = [""] * slots

    def read(slot: int) -> None:
        with open(pipes[slot], encoding="utf-8", errors="replace") as stream:
            errs[slot] = stream.read()

    readers = [threading.Thread(target=read, args=(slot,), daemon=True) for slot in range(slots)]
    for t in readers:
        t.start()
    for slot in until if until is not None else range(slots):
        try:
            procs[slot].wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
    codes = [p.wait(timeout=TIMEOUT) for p in procs]
    for t in readers:
        t.join(timeout=10)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    results = [r for r in lines if not r.get("leak")]
    leaks = [r for r in lines if r.get("leak")]
    return Run(codes, results, leaks, tmp, keys, errs)


def expected_checksum(*, steps: int, hidden: int = 32, ranks: int = 2) -> float:
    """The checksum a fault-free run of the script reaches, computed here in one process: DDP averages the
    ranks' gradients, which is the gradient of the ranks' mean loss."""
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from restart_ddp import batch, checksum
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for rank in range(ranks):
            x, y = batch(step, rank, hidden)
            losses.append(nn.functional.mse_loss(model(x), y))
        (sum(losses) / ranks).backward()  # type: ignore[operator]
        opt.step()
    return checksum(model)


def restart_records(etcd: EtcdServer, keys: JobKeys, kind: str) -> dict[str, dict[str, Any]]:
    """The job's restart records of one kind (``fault``, ``seal``...), by key relative to the epoch's prefix
    (``"0/1"``: iteration 0, slot 1 for a fault; ``"1"`` for a seal): every one ever written, read from etcd's
    history (the sealer deletes the keys of old iterations, and under load a run may take more restarts than
    the test injected), the last value of each key."""
    return {key: value for key, (_, value) in restart_history(etcd, keys, kind).items()}


def restart_history(etcd: EtcdServer, keys: JobKeys, kind: str) -> dict[str, tuple[int, dict[str, Any]]]:
    """As :func:`restart_records`, with the revision of each key's last write."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}

    def keep(key: str, value: bytes, revision: int) -> None:
        rel = key[len(keys.restart):].split("/", 1)[1]  # drop the epoch
        if rel.startswith(kind + "/"):
            out[rel[len(kind) + 1:]] = revision, json.loads(value)

    with Store([etcd.endpoint]) as s:
        kvs, revision = s.get_prefix(keys.restart)
        try:
            with s.watch(keys.restart, prefix=True, start_revision=max(1, revision - 90_000)) as w:
                while (ev := w.next(timeout=0.5)) is not None and ev.kv.mod_revision <= revision:
                    if ev.type == "put":
                        keep(ev.kv.key, ev.kv.value, ev.kv.mod_revision)
                    if ev.kv.mod_revision == revision:
                        break
        except StoreError:  # compacted: what is still there
            for kv in kvs:
                keep(kv.key, kv.value, kv.mod_revision)
    return out
