"""Peer snapshots of sharded state (stalwart/restart/snapshots.py, snapshot_plan.py).

The placement and the restore plan as tables; then four real torch processes on gloo, two "pods" of two ranks,
training a small MLP sharded with FSDP2 (``fully_shard``) and Adam, with a snapshot after every step. In one
run of those processes, each scenario against a fault-free run of the same script: pod 1's ranks lose their
whole state (as the spares that take their places hold none) while pod 0's ranks are a step ahead; the same,
with the newest snapshot torn (its copies had not landed on the buddies); a snapshot whose layout differs from
the model (every rank refuses, naming the tensor, and nothing is restored); both a rank and its buddy lost (no
snapshot: the checkpoint's turn, with the reason); a memory limit below a rank's snapshots; snapshots turned off
by the job; every rank on one pod (no buddy possible)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from typing import Any

import mp_ranks
import pytest

from stalwart.net import free_port
from stalwart.restart.snapshot_plan import (
    Holding,
    Move,
    NoSnapshot,
    RestorePlan,
    buddies,
    decode_holdings,
    encode_holding,
    plan_restore,
)


@pytest.mark.parametrize(("pods", "expected"), [
    (["a", "a", "b", "b"], [2, 3, 0, 1]),              # two pods of two: each rank's twin on the other pod
    (["a", "b"], [1, 0]),
    (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),
    (["a", "a", "a", "a", "b", "b"], [4, 5, 4, 5, 0, 1]),  # uneven pods: the ranks of a big pod spread
    (["a", "b", "a", "b"], [1, 0, 3, 2]),              # a pod's ranks need not be contiguous
])
def test_buddies(pods: list[str], expected: list[int]) -> None:
    got = buddies(pods)
    assert got == expected
    assert all(pods[b] != pods[r] for r, b in enumerate(got)), "a buddy on its own pod"


def test_buddies_need_two_pods() -> None:
    with pytest.raises(ValueError, match=r"need ranks on at least two pods.*all 2 rank.s. are on pod 'a'"):
        buddies(["a", "a"])


def own(shard: int, *steps: int) -> tuple[int, tuple[int, ...]]:
    return (shard, tuple(steps))


@pytest.mark.parametrize(("holdings", "expected"), [
    # Pod 1 (ranks 2, 3) lost; its spares hold nothing. Pod 0 holds its own shards and its wards' at 4 and 5.
    ([Holding(own(0, 4, 5), (own(2, 4, 5),)), Holding(own(1, 4, 5), (own(3, 4, 5),)), Holding(), Holding()],
     RestorePlan(5, (Move(0, 0, 0, True), Move(1, 1, 1, True), Move(0, 2, 2, False), Move(1, 3, 3, False)))),
    # The newest copy of shard 3 never landed on its buddy: the step before it, every shard rolled back to it.
    ([Holding(own(0, 4, 5), (own(2, 4, 5),)), Holding(own(1, 4, 5), (own(3, 4),)), Holding(), Holding()],
     RestorePlan(4, (Move(0, 0, 0, True), Move(1, 1, 1, True), Move(0, 2, 2, False), Move(1, 3, 3, False)))),
    # A survivor whose rank changed: its own shard goes to the rank that has it now, before a ward's copy.
    ([Holding(own(1, 5), (own(3, 5),)), Holding(None, (own(0, 5),)), Holding(own(2, 5)), Holding(own(3, 5))],
     RestorePlan(5, (Move(1, 0, 0, False), Move(0, 1, 1, True), Move(2, 2, 2, True), Move(3, 3, 3, True)))),
    # Rank 1's process took what a hung one wrote out, and the others have not restored since: one timeline.
    ([Holding(own(0, 4, 5), (own(1, 4, 5),), 2, 3), Holding(own(1, 4, 5), (own(0, 4, 5),), 2, 3)],
     RestorePlan(5, (Move(0, 0, 0, True), Move(1, 1, 1, True)))),
    # Rank 2's copies are of generation 2: the others restored without it since, and went on to step 5 again.
    # Its step 5 is of a timeline that no longer is: shard 2 comes from its buddy's copy of the new one.
    ([Holding(own(0, 4, 5), (own(2, 4, 5),), 3, 3), Holding(own(1, 4, 5), (own(0, 4, 5),), 3, 3),
      Holding(own(2, 4, 5), (own(1, 4, 5),), 3, 2)],
     RestorePlan(5, (Move(0, 0, 0, True), Move(1, 1, 1, True), Move(0, 2, 2, False)))),
])
def test_plan_restore(holdings: list[Holding], expected: RestorePlan) -> None:
    assert plan_restore(holdings) == expected


@pytest.mark.parametrize(("holdings", "reason"), [
    ([Holding(), Holding()], "shard 0 has no copy on any rank"),
    # The world shrank from 4 to 2 ranks: the copies are shards of another sharding.
    ([Holding(own(0, 5), (own(2, 5),), 4), Holding(own(1, 5), (own(3, 5),), 4)],
     "sharded over 4 ranks, and this iteration has 2: another sharding"),
    ([Holding(own(0, 5)), Holding(None, (own(0, 5),))], "shard 1 has no copy on any rank: its rank and its buddy"),
    ([Holding(own(0, 5), (own(1, 4),)), Holding()], "no snapshot step has a copy of every shard"),
    # The only copies of shard 1 are of an older timeline (a process that missed a restore since).
    ([Holding(own(0, 5), world=2, generation=4), Holding(own(1, 5), (own(0, 5),), 2, 3)],
     "shard 1 has no copy of the current timeline: rank(s) 1 hold copies from before a restore they missed"),
])
def test_no_snapshot(holdings: list[Holding], reason: str) -> None:
    got = plan_restore(holdings)
    assert isinstance(got, NoSnapshot) and reason in got.reason


@pytest.mark.parametrize("holding", [
    Holding(), Holding(own(3, 1, 2), world=4), Holding(None, (own(1, 7), own(2, 6, 7)), 8),
    Holding(own(0), (own(5),), 6), Holding(own(1, 3), world=2, generation=7),
])
def test_a_holding_survives_its_encoding_padded(holding: Holding) -> None:
    assert decode_holdings([[*encode_holding(holding), 0, 0, 0]]) == [holding]


def test_a_truncated_holding_is_refused() -> None:
    with pytest.raises(ValueError, match="ends early or is malformed"):
        decode_holdings([encode_holding(Holding(own(1, 4, 5), world=2))[:5]])


def test_every_must_be_a_positive_number_of_steps() -> None:
    from torch import nn

    from stalwart.restart.snapshots import PeerSnapshots

    with pytest.raises(ValueError, match="every: expected a whole number of steps >= 1, got 0"):
        PeerSnapshots(nn.Linear(2, 2), every=0)


# --- four real processes ---------------------------------------------------------------------------------------

WORLD, STEPS, LOSE_AT = 4, 10, 5


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def _rank(rank: int, port: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from stalwart.restart import snapshots as snap
    from stalwart.restart.errors import NonRetryable
    from stalwart.restart.peers import StateMismatch
    from stalwart.restart.sockets import SocketSnapshot, shutdown_sockets_since

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    pod = f"pod-{rank // 2}"

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
        h = hashlib.sha256()
        for _, t in snap._state(model, opt):
            h.update(t.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    def lose_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        """What a spare that takes this rank's place holds: other weights, no optimizer state, no snapshot."""
        with torch.no_grad():
            for p in model.parameters():
                snap._local(p).normal_()
        opt.state.clear()
        snap.forget()

    def abandon_a_copy(snaps: snap.PeerSnapshots, sockets_before: SocketSnapshot) -> None:
        """Pod 1 stops (its node froze, then went) while pod 0's next copies are on their way to it: each rank
        of pod 0 shuts its snapshot connections down, as its monitor does when it interrupts the iteration.
        gloo leaves a send cut off mid-transfer this way pending until the group's timeout (300 s)."""
        pids = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))
        copy = torch.zeros(1 << 22)  # 16 MB: more than the sockets' buffers take in
        if rank >= 2:
            dist.irecv(copy, snaps.buddy, group=snaps._group, tag=7)
            os.kill(os.getpid(), signal.SIGSTOP)
            shutdown_sockets_since(sockets_before)
            return
        buddy = int(pids[snaps.buddy].item())
        deadline = time.monotonic() + 60
        while _process_state(buddy) != "T":
            assert time.monotonic() < deadline, f"rank {snaps.buddy} did not stop"
            time.sleep(0.01)
        snap.HELD.sending.append(dist.isend(copy, snaps.buddy, group=snaps._group, tag=7))
        snap.HELD.group = snaps._group
        time.sleep(0.5)  # the copy fills the connection's buffers
        assert shutdown_sockets_since(sockets_before) > 0
        os.kill(buddy, signal.SIGCONT)

    result: dict[str, Any] = {"rank": rank}
    # Fault-free, with snapshots taken (they do not change the training).
    model, opt = build()
    snaps = snap.PeerSnapshots(model, opt, pod=pod)
    result["first_restore"] = snaps.restore()
    for step in range(STEPS):
        train(model, opt, step)
        snaps.commit(step)
    snaps.close()
    result["clean"] = digest(model, opt)
    result["held_bytes"] = snaps.held_bytes()

    for scenario in ("lose-pod", "torn", "abandoned"):
        snap.forget()
        model, opt = build()
        sockets_before = SocketSnapshot()
        snaps = snap.PeerSnapshots(model, opt, pod=pod)
        for step in range(LOSE_AT + 1):
            train(model, opt, step)
            snaps.commit(step)
        train(model, opt, LOSE_AT + 1)  # the step in flight when pod 1 is lost: pod 0 is ahead of every snapshot
        snaps._land()
        if scenario == "torn" and rank < 2:
            # The newest copies of pod 1's shards had not landed on their buddies here.
            for copies in snap.HELD.wards.values():
                copies.pop(LOSE_AT, None)
        if scenario == "abandoned":
            abandon_a_copy(snaps, sockets_before)
        if rank >= 2:
            lose_state(model, opt)
        if scenario == "abandoned":
            dist.destroy_process_group(snaps._group)  # as the wrapper's abort destroys every group
        else:
            snaps.close()
        snaps = snap.PeerSnapshots(model, opt, pod=pod)  # the next iteration
        began = time.monotonic()
        start = snaps.restore()
        # Bounded by SETTLE_SECONDS (2 s), not by the snapshot group's 300 s timeout, the bound it had before.
        result[f"{scenario}_restore_seconds"] = time.monotonic() - began
        assert start is not None
        result[f"{scenario}_start"] = start
        for step in range(start + 1, STEPS):
            train(model, opt, step)
            snaps.commit(step)
        snaps.close()
        result[scenario] = digest(model, opt)

    # A snapshot whose layout is not the model's: refused on every rank before anything is restored.
    snap.forget()
    model, opt = build()
    snaps = snap.PeerSnapshots(model, opt, pod=pod)
    for step in range(3):
        train(model, opt, step)
        snaps.commit(step)
    snaps._land()
    if rank == 0:
        for copies in snap.HELD.wards.values():
            for c in copies.values():
                bad = c.layout[1]
                c.layout[1] = snap.TensorSpec(bad.name, (bad.shape[0] + 1, *bad.shape[1:]), bad.dtype)
    if rank >= 2:
        lose_state(model, opt)
    before = digest(model, opt) if rank < 2 else None
    try:
        snaps.restore()
        result["mismatch"] = None
    except StateMismatch as e:
        result["mismatch"] = str(e)
        result["mismatch_unchanged"] = before is None or digest(model, opt) == before
    snaps.close()

    # Rank and buddy both lost: no snapshot covers every shard; the reason says so and nothing is restored.
    snaps = snap.PeerSnapshots(model, opt, pod=pod)
    if rank < 2:
        snap.HELD.wards.clear()
    else:
        snap.forget()
    result["both_lost"] = snaps.restore()
    result["both_lost_reason"] = snaps.fallback_reason
    snaps.close()

    # A memory limit below what one rank's snapshots need: every rank fails at its first snapshot, naming it.
    snap.forget()
    model, opt = build()
    snaps = snap.PeerSnapshots(model, opt, pod=pod, memory_limit=1000)
    train(model, opt, 0)
    try:
        snaps.commit(1)
        result["limit"] = None
    except NonRetryable as e:
        result["limit"] = str(e)
    snaps.close()

    # The job turned snapshots off (restartPolicy.inProcess.peerSnapshots.enabled: false).
    snap.forget()
    os.environ["STALWART_SNAPSHOTS"] = "false"
    snaps = snap.PeerSnapshots(model, opt, pod=pod)
    snaps.commit(1)
    result["off"] = [snaps.restore(), snaps.fallback_reason, snaps.held_bytes()]
    snaps.close()
    del os.environ["STALWART_SNAPSHOTS"]

    try:
        snap.PeerSnapshots(model, opt, pod="one-pod")
        result["one_pod"] = None
    except ValueError as e:
        result["one_pod"] = str(e)
    out.put(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, Any]]:
    ctx = mp_ranks.context()
    out = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    try:
        for _ in procs:
            rec = json.loads(out.get(timeout=240))
            results[rec["rank"]] = rec
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert [p.exitcode for p in procs] == [0] * WORLD
    return results


@pytest.mark.integration
def test_a_lost_pods_shards_come_back_from_their_buddies_bit_for_bit(runs: dict[int, dict[str, Any]]) -> None:
    for rank, r in runs.items():
        assert r["first_restore"] is None  # nothing held yet: the job's first iteration
        # Pod 0 was a step ahead: rolled back to the newest snapshot, with the others, and went on from there.
        assert r["lose-pod_start"] == LOSE_AT, r
        assert r["lose-pod"] == r["clean"], f"rank {rank}: the recovered run differs from the fault-free one"
        assert r["held_bytes"] > 0


@pytest.mark.integration
def test_a_copy_that_never_landed_does_not_hold_the_restore(runs: dict[int, dict[str, Any]]) -> None:
    """Pod 0's last copies to pod 1 were still on their way when the iteration ended, and their group went with
    it: the next restore gives them up (they did not land) and restores the snapshot before them."""
    for rank, r in runs.items():
        assert r["abandoned_start"] == LOSE_AT, r
        assert r["abandoned"] == r["clean"], f"rank {rank}: the recovered run differs from the fault-free one"
        assert r["abandoned_restore_seconds"] < 60, f"rank {rank} waited on a copy that could never land: {r}"


@pytest.mark.integration
def test_a_torn_snapshot_is_passed_over_for_the_one_before(runs: dict[int, dict[str, Any]]) -> None:
    for rank, r in runs.items():
        assert r["torn_start"] == LOSE_AT - 1, r
        assert r["torn"] == r["clean"], f"rank {rank}: the recovered run differs from the fault-free one"


@pytest.mark.integration
def test_a_snapshot_unlike_the_model_is_refused_on_every_rank_naming_the_tensor(
        runs: dict[int, dict[str, Any]]) -> None:
    assert "model.0.bias" in runs[2]["mismatch"] and "shape" in runs[2]["mismatch"], runs[2]
    for rank, r in runs.items():
        assert r["mismatch"] is not None, f"rank {rank} went on"
        assert r["mismatch_unchanged"], f"rank {rank} restored part of a refused snapshot"


@pytest.mark.integration
def test_rank_and_buddy_both_lost_leaves_it_to_the_checkpoint_with_the_reason(
        runs: dict[int, dict[str, Any]]) -> None:
    for r in runs.values():
        assert r["both_lost"] is None
        assert "shard 2 has no copy on any rank: its rank and its buddy were both lost" in r["both_lost_reason"]


@pytest.mark.integration
def test_snapshots_with_every_rank_on_one_pod_are_refused(runs: dict[int, dict[str, Any]]) -> None:
    for r in runs.values():
        assert r["one_pod"] is not None and "PeerSnapshots: peer snapshots need ranks on at least two pods" \
            in r["one_pod"]


@pytest.mark.integration
def test_a_memory_limit_below_a_ranks_snapshots_fails_every_rank_at_the_first_naming_it(
        runs: dict[int, dict[str, Any]]) -> None:
    for r in runs.values():
        assert r["limit"] is not None and "above the memory_limit argument (1,000 bytes)" in r["limit"], r["limit"]


@pytest.mark.integration
def test_snapshots_turned_off_by_the_job_take_nothing_and_leave_it_to_the_checkpoint(
        runs: dict[int, dict[str, Any]]) -> None:
    for r in runs.values():
        restored, reason, held = r["off"]
        assert restored is None and held == 0
        assert "peerSnapshots.enabled: false" in reason
