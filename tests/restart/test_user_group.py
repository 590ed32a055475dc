"""A training function that calls ``init_process_group`` itself (a script written for torchrun): what each call
means (pure), and real ranks of each style through a fault."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
from restart_helpers import expected_checksum, run_ranks

from stalwart.api.exit_codes import ExitCode
from stalwart.local.etcd import EtcdServer
from stalwart.restart.errors import ProcessGroupConflict
from stalwart.restart.policies import GroupArgs
from stalwart.restart.user_group import InitCall, decide

GLOO = GroupArgs("gloo", 1800.0)


def call(**arguments: object) -> InitCall:
    return InitCall.of(arguments)


@pytest.mark.parametrize(("the_call", "action", "args", "unused"), [
    (call(), "reuse", GLOO, ()),
    (call(backend="gloo"), "reuse", GLOO, ()),
    (call(backend="GLOO", init_method="env://"), "reuse", GLOO, ("init_method",)),
    (call(backend="gloo", store=object(), rank=1, world_size=2), "reuse", GLOO, ("store",)),
    (call(timeout=datetime.timedelta(seconds=1800)), "reuse", GLOO, ()),
    (call(timeout=datetime.timedelta(seconds=20)), "rebuild", GroupArgs("gloo", 20.0), ()),
    (call(backend="nccl"), "rebuild", GroupArgs("nccl", 1800.0), ()),
    (call(backend="cpu:gloo,cuda:nccl", init_method="tcp://10.0.0.1:23456"), "rebuild",
     GroupArgs("cpu:gloo,cuda:nccl", 1800.0), ("init_method",)),
])
def test_a_call_in_an_iteration_whose_group_exists(the_call: InitCall, action: str, args: GroupArgs,
                                                   unused: tuple[str, ...]) -> None:
    plan = decide(the_call, exists=True, built=GLOO, fallback=GroupArgs("nccl", 600.0), rank=1, world_size=2)
    assert (plan.action, plan.args, plan.unused) == (action, args, unused)


def test_once_learned_the_call_is_a_reuse() -> None:
    learned = GroupArgs("gloo", 20.0)
    plan = decide(call(backend="gloo", timeout=datetime.timedelta(seconds=20)), exists=True, built=learned,
                  fallback=GLOO, rank=0, world_size=2)
    assert plan.action == "reuse"


def test_without_a_group_the_call_builds_one_from_the_fallback_and_its_arguments() -> None:
    plan = decide(call(timeout=datetime.timedelta(seconds=5)), exists=False, built=None, fallback=GLOO, rank=0,
                  world_size=1)
    assert (plan.action, plan.args) == ("build", GroupArgs("gloo", 5.0))


def test_a_group_the_wrapper_did_not_build_is_used_as_it_is() -> None:
    plan = decide(call(backend="nccl"), exists=True, built=None, fallback=GLOO, rank=0, world_size=1)
    assert (plan.action, plan.args) == ("reuse", None)


@pytest.mark.parametrize(("the_call", "says"), [
    (call(rank=0), "init_process_group(rank=0): this iteration runs rank 1 of world size 2"),
    (call(world_size=4, rank=1), "init_process_group(world_size=4, rank=1): this iteration's world size is 2"),
])
def test_a_rank_or_world_size_that_contradicts_the_iteration_is_a_conflict(the_call: InitCall, says: str) -> None:
    with pytest.raises(ProcessGroupConflict) as e:
        decide(the_call, exists=True, built=GLOO, fallback=GLOO, rank=1, world_size=2)
    assert str(e.value).startswith(says)
    assert "dist.get_rank()" in str(e.value)


@pytest.mark.integration
@pytest.mark.parametrize("style", ["bare", "env", "timeout", "destroy"])
def test_a_function_that_builds_its_own_group_restarts_in_process(etcd: EtcdServer, tmp_path: Path,
                                                                 style: str) -> None:
    # bare: init_process_group("gloo"); env: init_method="env://"; timeout: another timeout than the
    # wrapper's (the group is rebuilt once, then reused); destroy: init_process_group() with no arguments and
    # destroy_process_group() at the end. A raise in rank 1 restarts both in process, to the exact result.
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--fault", "exception", "--fault-step", "4",
                    "--self-init", style)
    assert run.codes == [0, 0], run.stderr
    reference = expected_checksum(steps=8)
    assert sorted(r["rank"] for r in run.results) == [0, 1]
    for r in run.results:
        assert (r["world"], r["step"], r["restarts"]) == (2, 8, 1)
        assert r["checksum"] == pytest.approx(reference, abs=1e-6)


@pytest.mark.integration
def test_a_call_for_another_world_fails_the_job_with_the_conflict(etcd: EtcdServer, tmp_path: Path) -> None:
    run = run_ranks(etcd, tmp_path, "--steps", "8", "--self-init", "bad-world")
    assert run.codes == [int(ExitCode.NON_RETRYABLE)] * 2
    for err in run.stderr:
        assert "ProcessGroupConflict: init_process_group(backend='gloo', world_size=3" in err
        assert "this iteration's world size is 2" in err
