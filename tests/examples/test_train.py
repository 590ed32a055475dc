"""The example training program, run as real ranks (separate processes, torch gloo on loopback)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from forked_ranks import start_captured

from stalwart.etcd.keys import MANIFEST, JobKeys
from stalwart.examples import train
from stalwart.net import free_port

WAIT = 180  # seconds; generous for a loaded 2-core machine


Result = tuple[int, list[dict[str, Any]], str]


def run_ranks(world: int, args: list[str], extra_env: dict[str, str] | None = None,
              per_rank: Callable[[int], dict[str, str]] | None = None) -> list[Result]:
    """Start ``world`` ranks the way torchrun or the agent would (forked, as the agent's are: tests/forked_ranks.py),
    wait for all; (exit code, events, stderr) each."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra_env or {}),
               **(per_rank(rank) if per_rank else {})}
        procs.append(start_captured([sys.executable, "-m", "stalwart.examples.train", *args], env))
    results = []
    try:
        ended = [proc.communicate(timeout=WAIT) for proc in procs]
    finally:
        for proc in procs:  # those a timeout left running (each timed-out one dumped its stacks first)
            if proc.proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.communicate(timeout=0.1)
    for code, out, err in ended:
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for event in events:
            assert isinstance(event.pop("time"), float)
        results.append((code, events, err))
    return results


def of(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == kind]


@pytest.mark.integration
def test_injected_fault_then_resume_from_checkpoint(tmp_path: Path) -> None:
    args = ["--steps", "40", "--checkpoint-every", "10", "--log-every", "5", "--checkpoint-dir", str(tmp_path)]
    env = {train.FAIL_AT_STEP_ENV: "25", train.FAIL_RANK_ENV: "1"}
    first = run_ranks(2, args, env)
    code, events, err = first[1]
    assert code != 0 and "InjectedFault: injected fault at step 25 on rank 1" in err
    assert of(events, "fault") == [{"event": "fault", "rank": 1, "step": 25, "count": 1}]
    assert first[0][0] != 0, "rank 0 cannot finish without its peer"
    # A fresh start (what a replaced pod does) resumes from the last checkpoint; the fault is not injected again.
    second = run_ranks(2, args, env)
    for code, events, err in second:
        assert code == 0, err
        assert of(events, "start")[0]["step"] == 20
        assert of(events, "fault") == []
        (done,) = of(events, "done")
        assert done["step"] == 40 and done["world_size"] == 2
        losses = [e["loss"] for e in of(events, "step")]
        assert losses[-1] < losses[0], f"the model did not learn: {losses}"
    # The checkpoint holds the final state, written atomically; a fresh model loads it.
    assert train.load_checkpoint(tmp_path, train.build_model(seed=123)) == 40
    assert not list(tmp_path.glob(".*.tmp")), "a temporary checkpoint file was left behind"


def test_sync_from_peers_alone_keeps_the_state(tmp_path: Path) -> None:
    """Single-process group: the state's own step and parameters are kept (the broadcast source is itself)."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = train.build_model(1)
        state = train.TrainState(model, step=7, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        before = [p.clone() for p in state.model.parameters()]
        synced = train.sync_from_peers(state.model, step=state.step)
        assert (synced.source, synced.step, synced.received) == (0, 7, False)
        assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))
    finally:
        torch.distributed.destroy_process_group()


def test_batches_are_a_pure_function_of_step_and_rank() -> None:
    a = train.batch(0, 5, 1, 8)
    b = train.batch(0, 5, 1, 8)
    c = train.batch(0, 5, 0, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--steps", "0"], {}, "--steps must be a positive integer, got 0"),
    (["--epochs", "2", "--steps-per-epoch", "-1"], {}, "--steps-per-epoch must be a positive integer"),
    (["--step-delay", "-1"], {}, "--step-delay must be >= 0"),
    (["--step-delay-until", "0"], {}, "--step-delay-until must be a positive integer, got 0"),
    ([], {train.FAIL_TIMES_ENV: "0"}, f"{train.FAIL_TIMES_ENV} must be a positive integer, got '0'"),
    ([], {train.FAIL_AT_STEP_ENV: "soon"}, f"{train.FAIL_AT_STEP_ENV} must be an integer step, got 'soon'"),
    ([], {train.FAIL_RANK_ENV: "x"}, f"{train.FAIL_RANK_ENV} must be an integer rank"),
])
def test_bad_options_name_the_option(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("-", r"\-").replace("(", r"\(")):
        train.parse_options(argv, env)


def test_the_step_delay_ends_at_the_step_it_is_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests that inject a fault train slowly until then and fast afterwards: steps 1 and 2 of 5 sleep."""
    slept: list[float] = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    monkeypatch.setattr(train, "_state", None)
    opts = train.parse_options(["--steps", "5", "--step-delay", "0.5", "--step-delay-until", "3",
                                "--checkpoint-dir", str(tmp_path)], {})
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        train.train(opts)  # the plain function, without the restart wrapper
    finally:
        torch.distributed.destroy_process_group()
    assert slept == [0.5, 0.5]
    assert train.parse_options(["--step-delay", "0.5"], {}).step_delay_until is None  # by default every step


def test_the_step_delay_until_resume_ends_when_the_process_resumes_a_job_under_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the job's start the steps sleep; called again in the same process (a restart in process, at step 3),
    none does: the recovery is over, the rest need not wait."""
    slept: list[float] = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    monkeypatch.setattr(train, "_state", None)
    monkeypatch.setattr(train, "_resumed_under_way", False)
    opts = train.parse_options(["--steps", "3", "--step-delay", "0.5", "--step-delay-until-resume",
                                "--checkpoint-dir", str(tmp_path)], {})
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        train.train(opts)
        assert slept == [0.5, 0.5, 0.5]
        train.train(dataclasses.replace(opts, steps=6))
    finally:
        torch.distributed.destroy_process_group()
    assert slept == [0.5, 0.5, 0.5] and train._state is not None and train._state.step == 6
    assert not train.parse_options(["--step-delay", "0.5"], {}).step_delay_until_resume  # off by default


def test_fault_injection_count(tmp_path: Path) -> None:
    opts = train.parse_options(["--checkpoint-dir", str(tmp_path)],
                               {train.FAIL_AT_STEP_ENV: "3", train.FAIL_RANK_ENV: "1", train.FAIL_TIMES_ENV: "2"})
    train.maybe_inject_fault(opts, rank=0, step=3)  # another rank
    train.maybe_inject_fault(opts, rank=1, step=2)  # another step
    for _ in range(2):
        with pytest.raises(train.InjectedFault, match="injected fault at step 3 on rank 1"):
            train.maybe_inject_fault(opts, rank=1, step=3)
    train.maybe_inject_fault(opts, rank=1, step=3)  # the count is spent


def test_options_from_arguments_and_environment(tmp_path: Path) -> None:
    opts = train.parse_options(["--epochs", "3", "--steps-per-epoch", "5"],
                               {"BATCH_SIZE": "64", "STALWART_JOB_UID": "u1", "TMPDIR": str(tmp_path),
                                train.FAIL_AT_STEP_ENV: "4"})
    assert opts.steps == 15 and opts.batch_size == 64 and opts.fail_at_step == 4 and opts.fail_rank == 0
    assert opts.checkpoint_dir == tmp_path / "stalwart-checkpoints" / "u1"


@pytest.mark.integration
@pytest.mark.parametrize("momentum", ["0", "0.9"])
def test_in_process_restart_after_an_injected_fault(tmp_path: Path, etcd: Any, store: Any, momentum: str) -> None:
    """Two rank processes run the example under ``@stalwart.restartable`` with a real etcd: rank 1 fails at
    step 25; both re-run the training function in the same processes and finish from the state in memory
    (with momentum, the optimizer's too: they end where a run without faults does)."""
    uid = f"ex-{uuid.uuid4().hex[:12]}"
    keys = JobKeys("examples", uid)
    # The round a sealed rendezvous leaves behind (its manifest's mod_revision is the epoch, the fence).
    epoch = store.put(keys.rendezvous + MANIFEST, b'{"sealed": true}')
    env = {"STALWART_ETCD_ENDPOINTS": etcd.endpoint, "STALWART_JOB": "examples/restart", "STALWART_JOB_UID": uid,
           "STALWART_EPOCH": str(epoch), "STALWART_SLOTS": "2", "STALWART_TARGET_WORLD": "2",
           train.FAIL_AT_STEP_ENV: "25", train.FAIL_RANK_ENV: "1"}
    try:
        results = run_ranks(2, ["--steps", "40", "--momentum", momentum, "--checkpoint-dir", str(tmp_path)], env,
                            per_rank=lambda r: {"STALWART_SLOT": str(r), "STALWART_NODE_ID": f"node-{r}"})
    finally:
        store.delete_prefix(keys.prefix)
    for code, events, err in results:
        assert code == 0, err
        # One process per rank throughout: a second "start" would mean the process was restarted.
        assert len(of(events, "start")) == 1
        resumes = of(events, "resume")
        assert [r["iteration"] for r in resumes] == [0, 1], resumes
        # After the restart the ranks agree on the most advanced state in memory, not on the checkpoint (20).
        assert resumes[1]["step"] == 25
        assert of(events, "done")[0]["step"] == 40
    assert of(results[1][1], "fault") == [{"event": "fault", "rank": 1, "step": 25, "count": 1}]
    clean = run_ranks(2, ["--steps", "40", "--momentum", momentum, "--checkpoint-dir", str(tmp_path / "clean")])
    assert _digests(results) == _digests(clean)


def _final_loss(hidden: int, lr: float, steps: int = 25) -> float:
    model = train.build_model(0, hidden)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        x, y = train.batch(0, step, 0, 32)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    return float(loss.detach())


def test_the_default_learning_rate_keeps_a_wide_model_finite() -> None:
    # About 1 M parameters (21 per hidden unit): the benchmark's smallest size.
    hidden = 47_618
    opts = train.parse_options(["--hidden", str(hidden)], env={})
    assert opts.lr == pytest.approx(train.BASE_LR * train.HIDDEN / hidden)
    assert train.parse_options([], env={}).lr == train.BASE_LR  # the default width trains as it always did
    assert train.parse_options(["--hidden", str(hidden), "--lr", "0.01"], env={}).lr == 0.01
    assert not torch.isfinite(torch.tensor(_final_loss(hidden, train.BASE_LR)))  # the fixed rate diverged
    first = _final_loss(hidden, opts.lr, steps=1)
    last = _final_loss(hidden, opts.lr)
    assert torch.isfinite(torch.tensor(last)) and last < first


def test_a_learning_rate_that_is_not_positive_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match=r"--lr must be > 0, got 0\.0"):
        train.parse_options(["--lr", "0"], env={})


def test_the_done_line_lists_small_models_and_digests_every_model(monkeypatch: pytest.MonkeyPatch) -> None:
    small = train.build_model(0, 4)
    out = train.final_parameters(small)
    flat = torch.cat([p.detach().flatten() for p in small.parameters()])
    assert out["params"] == flat.tolist()
    assert out["params_sha256"] == hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    # One parameter changed by one ulp changes the digest.
    with torch.no_grad():
        next(small.parameters()).view(-1)[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
    assert train.final_parameters(small)["params_sha256"] != out["params_sha256"]
    # Past the limit, the digest only (a 100 M-parameter list would be gigabytes of JSON).
    monkeypatch.setattr(train, "PARAMS_IN_DONE", flat.numel() - 1)
    assert set(train.final_parameters(small)) == {"params_sha256"}


def test_a_momentum_outside_zero_to_one_is_refused_naming_the_option() -> None:
    for bad in ("1", "-0.1"):
        with pytest.raises(ValueError, match=re.escape(f"--momentum must be in [0, 1), got {float(bad)}")):
            train.parse_options(["--momentum", bad], env={})
    assert train.parse_options(["--momentum", "0.9"], env={}).momentum == 0.9


def test_the_checkpoint_keeps_the_momentum(tmp_path: Path) -> None:
    opts = train.parse_options(["--momentum", "0.9", "--checkpoint-dir", str(tmp_path)], env={})
    model = train.build_model(0)
    opt = train.make_optimizer(model, opts)
    for step in range(3):
        x, y = train.batch(0, step, 0, 8)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    train.save_checkpoint(tmp_path, model, 3, opt)
    fresh = train.build_model(1)
    fresh_opt = train.make_optimizer(fresh, opts)
    assert train.load_checkpoint(tmp_path, fresh, fresh_opt) == 3
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], fresh_opt.state[q]["momentum_buffer"])


def _digests(results: list[Result]) -> set[str]:
    for code, _, err in results:
        assert code == 0, err
    return {of(events, "done")[0]["params_sha256"] for _, events, _ in results}


@pytest.mark.integration
def test_with_momentum_a_resume_from_the_checkpoint_ends_where_a_run_without_faults_does(tmp_path: Path) -> None:
    args = ["--steps", "40", "--checkpoint-every", "10", "--momentum", "0.9"]
    (clean,) = _digests(run_ranks(2, [*args, "--checkpoint-dir", str(tmp_path / "clean")]))
    faulty = [*args, "--checkpoint-dir", str(tmp_path / "faulty")]
    env = {train.FAIL_AT_STEP_ENV: "25", train.FAIL_RANK_ENV: "1"}
    assert run_ranks(2, faulty, env)[1][0] != 0
    resumed = run_ranks(2, faulty, env)
    assert [of(events, "start")[0]["step"] for _, events, _ in resumed] == [20, 20]
    # Without the momentum in the checkpoint, steps 20 to 40 would start from zero momentum and end elsewhere.
    assert _digests(resumed) == {clean}
