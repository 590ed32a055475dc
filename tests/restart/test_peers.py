"""sync_from_peers: the plan and the layout check as tables; the transfer between real torch processes over
gloo (the source's state arrives at a rank that had none; a rank already at the newest step gets nothing; a
mismatched model fails every rank before anything is copied)."""

from __future__ import annotations

import json
import os
from typing import Any

import mp_ranks
import pytest

from stalwart.net import free_port
from stalwart.restart.peers import SyncPlan, TensorSpec, first_difference, plan_sync


@pytest.mark.parametrize(("steps", "max_sources", "plan"), [
    ([5, 5, None], None, SyncPlan(0, 5, (2,), (0, 1))),
    ([5, 5, None], 1, SyncPlan(0, 5, (2,), (0,))),
    ([3, 7, 7], None, SyncPlan(1, 7, (0,), (1, 2))),
    ([4, 4], None, SyncPlan(0, 4, (), (0, 1))),
    ([None, None], None, SyncPlan(0, None, (), ())),
    ([None, 0], 2, SyncPlan(1, 0, (0,), (1,))),
    ([2, 9, 9, 9, None], 2, SyncPlan(1, 9, (0, 4), (1, 2))),
])
def test_plan_sync(steps: list[int | None], max_sources: int | None, plan: SyncPlan) -> None:
    assert plan_sync(steps, max_sources) == plan


@pytest.mark.parametrize(("steps", "max_sources", "message"), [
    ([], None, "one entry per rank"), ([1, -3], None, "step of rank 1"), ([1], 0, "max_sources: expected >= 1"),
])
def test_plan_sync_bad_input(steps: list[int | None], max_sources: int | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_sync(steps, max_sources)


W = TensorSpec("model.0.weight", (4, 2), "float32")
B = TensorSpec("model.0.bias", (4,), "float32")
M = TensorSpec("optimizer.0.momentum_buffer", (4, 2), "float32")


@pytest.mark.parametrize(("mine", "theirs", "expected"), [
    ([W, B], [W, B], None),
    ([W, B], [W, B, M], ("optimizer.0.momentum_buffer", "missing on this rank")),
    ([TensorSpec("model.0.weight", (3, 2), "float32"), B], [W, B],
     ("model.0.weight", "shape [3, 2] here, [4, 2] on the sending rank")),
    ([W, TensorSpec("model.0.bias", (4,), "float64")], [W, B],
     ("model.0.bias", "dtype float64 here, float32 on the sending rank")),
    ([W, B, TensorSpec("model.1.weight", (1,), "float32")], [W, B],
     ("model.1.weight", "present here, missing on the sending rank")),
])
def test_first_difference(mine: list[TensorSpec], theirs: list[TensorSpec],
                          expected: tuple[str, str] | None) -> None:
    assert first_difference(mine, theirs) == expected


def _rank(rank: int, world: int, port: int, case: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from stalwart.restart import StateMismatch, sync_from_peers

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hidden = 3 if case == "mismatch" and rank == 2 else 8
    torch.manual_seed(100 + rank)  # every rank starts different
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8 if hidden == 8 else 3, 2)) \
        if hidden == 8 else nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step: int | None = None
    if rank < 2:  # ranks 0 and 1 trained together: same weights, same momentum
        torch.manual_seed(7)
        for p in model.parameters():
            p.data.normal_()
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
        step = 3
    before = [p.detach().clone() for p in model.parameters()]
    try:
        res = sync_from_peers(model, opt, step=step)
    except StateMismatch as e:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        out.put(json.dumps({"rank": rank, "error": str(e), "name": e.name, "unchanged": unchanged}))
        dist.destroy_process_group()
        return
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].flatten().tolist() for p in model.parameters()]
    out.put(json.dumps({"rank": rank, "step": res.step, "source": res.source, "received": res.received,
                        "bytes": res.bytes, "params": params, "momentum": momentum}))
    dist.destroy_process_group()


def _run(case: str) -> dict[int, dict[str, Any]]:
    ctx = mp_ranks.context()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 3, port, case, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rec = json.loads(out.get(timeout=120))
        results[rec["rank"]] = rec
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_state_reaches_the_rank_without_it() -> None:
    r = _run("ok")
    assert all("error" not in r[i] for i in range(3)), r
    assert [r[i]["step"] for i in range(3)] == [3, 3, 3]
    assert {r[i]["source"] for i in range(3)} == {0}
    # The newcomer got the model and the momentum; the up-to-date peer moved nothing.
    assert r[2]["params"] == r[0]["params"] and r[2]["momentum"] == r[0]["momentum"]
    assert r[2]["received"] and r[2]["bytes"] > 0
    assert not r[1]["received"] and r[1]["bytes"] == 0
    assert not r[0]["received"]


def test_mismatched_model_fails_every_rank_before_copying() -> None:
    r = _run("mismatch")
    # Rank 2's last layer is Linear(8, 3), the source's Linear(8, 2): the first differing tensor is named.
    assert r[2]["name"] == "model.2.weight" and "shape [3, 8] here, [2, 8]" in r[2]["error"]
    assert r[0]["name"] == "model.2.weight"  # the source names it too
    assert r[2]["unchanged"], "a rank kept a half-copied state"
    assert "error" not in r[1] or r[1]["name"] == "model.2.weight"
