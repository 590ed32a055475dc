"""sync_from_peers' bucketed copy between real torch processes over gloo: two sources give the same bytes as
one (every transport, buckets small enough to cut tensors, odd tails, mixed dtypes, empty tensors, Adam
slots the receiver lacks); a source killed between buckets leaves each receiver its old state or none, never
a mix, with SyncInterrupted saying which, and the survivors then copy from the remaining replica."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import time
from datetime import timedelta
from typing import Any

import mp_ranks

from stalwart.net import free_port


def _run(target: Any, world: int, *args: Any) -> tuple[dict[int, dict[str, Any]], list[int | None]]:
    """Start ``world`` ranks of ``target``; their records (one each) and their exit codes, every one ended."""
    ctx = mp_ranks.context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 240
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rec = json.loads(out.get(timeout=1))
            except queue.Empty:
                if all(p.exitcode is not None for p in procs):
                    break  # every rank ended: no record is coming
                continue
            results[rec["rank"]] = rec
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert len(results) == world, (results, [p.exitcode for p in procs])
    return results, [p.exitcode for p in procs]


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 3)
            self.b = nn.Linear(3, 7).double()
            self.register_buffer("count", torch.arange(5) * seed)
            self.register_buffer("mask", torch.tensor([True, seed % 2 == 0, True]))
            self.register_buffer("empty", torch.empty(0, 4))
            self.register_buffer("halves", torch.full((3,), float(seed)).half())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)).double())

    torch.manual_seed(seed)
    return Mixed()


def _train(model: Any, opt: Any, steps: int) -> None:
    import torch

    torch.manual_seed(11)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()


def _digest(model: Any, opt: Any) -> str:
    import torch

    h = hashlib.sha256()
    for k, t in model.state_dict().items():
        h.update(k.encode() + t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for i, p in enumerate(model.parameters()):
        for key, v in sorted(opt.state.get(p, {}).items()):
            h.update(f"{i}.{key}".encode() + v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _init(rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _sources_rank(rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.restart import sync_from_peers

    _init(rank, 3, port)
    model = _model(1 if rank < 2 else 5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank < 2:
        _train(model, opt, 3)
    digests = {}
    for transport in ("group", "streams"):
        for sources in (1, 2):
            if rank == 2:  # a fresh spare each time: other values, no optimizer state
                fresh = _model(5)
                model.load_state_dict(fresh.state_dict())
                opt.state.clear()
            # 40-byte buckets: tensors cut across buckets, tails packed with the next tensors.
            res = sync_from_peers(model, opt, step=3 if rank < 2 else None, transport=transport,
                                  bucket_bytes=40, max_sources=sources, streams=3)
            digests[f"{transport}/{sources}"] = _digest(model, opt)
            if rank == 2:
                assert res.received and res.sources == tuple(range(sources)) and res.bytes > 0, res
    out.put(json.dumps({"rank": rank, "digests": digests}))
    dist.destroy_process_group()


def test_two_sources_give_the_same_state_as_one() -> None:
    records, codes = _run(_sources_rank, 3, free_port())
    assert codes == [0, 0, 0]
    results = {r: rec["digests"] for r, rec in records.items()}
    source = results[0]["group/1"]
    assert set(results[0].values()) == {source} and set(results[1].values()) == {source}
    # The spare's state, bit for bit the source's, from one source and from two, over both transports.
    assert results[2] == {"group/1": source, "group/2": source, "streams/1": source, "streams/2": source}


KILLED_AFTER_BUCKET = 3


def _fault_rank(rank: int, ports: tuple[int, int], out: Any) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.restart import SyncInterrupted, copy_wire, sync_from_peers

    _init(rank, 4, ports[0])
    # Ranks 0 and 3 hold the newest state (step 3); rank 1 an older one of its own (step 2); rank 2 none.
    model = _model(1 if rank in (0, 3) else 7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = {0: 3, 1: 2, 2: None, 3: 3}[rank]
    if step is not None:
        _train(model, opt, step)
    before = _digest(model, opt)

    if rank == 0:
        def die(index: int) -> None:
            if index == KILLED_AFTER_BUCKET:
                out.put(json.dumps({"rank": 0, "before": before}))
                out.close()
                out.join_thread()  # the record is in the pipe before the process dies
                os.kill(os.getpid(), signal.SIGKILL)

        copy_wire.after_bucket = die
    record: dict[str, Any] = {"rank": rank, "before": before}
    try:
        res = sync_from_peers(model, opt, step=step, bucket_bytes=32, max_sources=1, timeout_s=60.0)
        record["first"] = {"received": res.received}
    except SyncInterrupted as e:
        record["first"] = {"error": str(e), "kept_state": e.kept_state, "bucket": e.bucket, "peer": e.peer,
                           "digest": _digest(model, opt)}
    # The next iteration: the survivors in a group of their own (ranks 1, 2, 3 as 0, 1, 2). Rank 2 says it is at
    # step 3, as a script counting its own steps might: the interrupted copy's mark overrides it.
    with contextlib.suppress(RuntimeError):
        dist.destroy_process_group()
    _init(rank - 1, 3, ports[1])
    res = sync_from_peers(model, opt, step=3 if rank in (2, 3) else step, bucket_bytes=32, timeout_s=60.0)
    record["second"] = {"received": res.received, "step": res.step, "source": res.source,
                        "digest": _digest(model, opt)}
    out.put(json.dumps(record))
    dist.destroy_process_group()


def test_a_source_killed_mid_copy_leaves_old_state_or_none_then_recovers() -> None:
    results, codes = _run(_fault_rank, 4, (free_port(), free_port()))
    assert codes == [-signal.SIGKILL, 0, 0, 0]
    newest = results[0]["before"]
    assert results[3]["before"] == newest
    # Rank 1 had a state: it keeps it, bit for bit, and says so.
    first = results[1]["first"]
    assert first["kept_state"] is True and first["digest"] == results[1]["before"], first
    assert first["peer"] == 0 and "this rank keeps the state it had" in first["error"]
    # Rank 2 had none: it still has none (not presented as a state, whatever step it is given next).
    first = results[2]["first"]
    assert first["kept_state"] is False and first["peer"] == 0 and "holds no state" in first["error"], first
    assert first["digest"] != newest
    assert results[3]["first"] == {"received": False}
    # The next iteration: rank 3 (now rank 2) is the only source at step 3; both receivers take its state.
    for r in (1, 2, 3):
        second = results[r]["second"]
        assert second["step"] == 3 and second["source"] == 2 and second["digest"] == newest, (r, second)
        assert second["received"] is (r != 3)


def test_a_receiver_without_the_senders_optimizer_is_named() -> None:
    results, codes = _run(_no_optimizer_rank, 2, free_port())
    assert codes == [0, 0]
    assert results[1]["name"] == "optimizer.0.exp_avg" and "given no optimizer" in results[1]["error"]
    assert results[0]["name"] == "optimizer.0.exp_avg"
    assert results[1]["unchanged"]


def _no_optimizer_rank(rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.restart import StateMismatch, sync_from_peers

    _init(rank, 2, port)
    model = _model(1 if rank == 0 else 5)
    opt = torch.optim.Adam(model.parameters()) if rank == 0 else None
    if opt is not None:
        _train(model, opt, 1)
    before = model.state_dict()["a.weight"].clone()
    try:
        sync_from_peers(model, opt, step=1 if rank == 0 else None)
        out.put(json.dumps({"rank": rank, "error": None}))
    except StateMismatch as e:
        out.put(json.dumps({"rank": rank, "error": str(e), "name": e.name,
                            "unchanged": bool(torch.equal(before, model.state_dict()["a.weight"]))}))
    dist.destroy_process_group()


def _slots_made_ahead_rank(rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from stalwart.restart import materialize_optimizer_state, sync_from_peers
    from stalwart.restart.optimizer_slots import placeholders

    _init(rank, 2, port)
    record: dict[str, Any] = {"rank": rank}
    # First: no rank holds state (a job's start, a spare among the first ranks): nothing is copied, and the
    # slots the spare made while parked are dropped, so that it trains as the fresh optimizers beside it.
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == 1:
        record["made"] = materialize_optimizer_state(opt)
    res = sync_from_peers(model, opt, step=None)
    record["nothing_held"] = {"step": res.step, "received": res.received, "slots": len(opt.state)}
    # Then: rank 0 holds the newest state, rank 1 is a promoted spare that made its slots while parked.
    model = _model(1 if rank == 0 else 5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if rank == 0:
        _train(model, opt, 3)
    else:
        materialize_optimizer_state(opt)
    where = {(i, k): v.data_ptr() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}
    res = sync_from_peers(model, opt, step=3 if rank == 0 else None, bucket_bytes=40)
    record["copied"] = {"received": res.received, "digest": _digest(model, opt), "left": len(placeholders(opt)),
                        "in_place": all(opt.state[p][k].data_ptr() == at for (i, k), at in where.items()
                                        for p in [list(model.parameters())[i]])}
    out.put(json.dumps(record))
    dist.destroy_process_group()


def test_slots_made_while_parked_take_the_copy_in_place_and_go_when_nothing_is_copied() -> None:
    results, codes = _run(_slots_made_ahead_rank, 2, free_port())
    assert codes == [0, 0]
    assert results[1]["made"] is True
    assert results[1]["nothing_held"] == {"step": None, "received": False, "slots": 0}
    assert results[0]["nothing_held"] == {"step": None, "received": False, "slots": 0}
    spare, source = results[1]["copied"], results[0]["copied"]
    assert spare["received"] is True and spare["digest"] == source["digest"]
    assert spare["in_place"] is True and spare["left"] == 0
