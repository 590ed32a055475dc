"""Validation on construction (policies, the wrapper's config, the rank environment) and the exit codes."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import pytest

from stalwart.api.exit_codes import Disposition, ExitCode, disposition
from stalwart.api.pod_env import PodEnvError
from stalwart.restart import (
    Abort,
    AbortProcessGroup,
    CallWrapper,
    Compose,
    CudaHealthCheck,
    FaultCounter,
    FinalizeCallback,
    HealthCheck,
    InitProcessGroup,
    IterationContext,
    RestartConfig,
    Unhealthy,
    restartable,
)
from stalwart.restart.decorator import _injection
from stalwart.restart.environment import RankEnvironment


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_restarts": -1}, "max_restarts"),
    ({"soft_timeout": 0}, "soft_timeout"),
    ({"soft_timeout": float("nan")}, "soft_timeout"),
    ({"soft_timeout": 10, "hard_timeout": 5}, "hard_timeout: must exceed soft_timeout"),
    ({"barrier_timeout": -1}, "barrier_timeout"),
    ({"heartbeat_ttl": 1}, "heartbeat_ttl"),
    ({"prepare_timeout": 0}, "prepare_timeout"),
    ({"initialize": lambda ctx: None}, "initialize: expected a Initialize policy"),
    ({"health_check": AbortProcessGroup()}, "health_check: expected a HealthCheck policy"),
])
def test_restart_config_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        RestartConfig(**kwargs)


def test_decorator_validates_at_decoration_time() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        restartable(max_restarts=-5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        restartable(no_such_option=1)


async def _async_build() -> None:
    return None


def _build(options: int) -> int:
    return options


class _Builder:
    def __call__(self, options: int) -> int:
        return options


@pytest.mark.parametrize(("prepare", "message"), [
    (42, r"prepare: expected a callable taking no arguments, got 42"),
    ("build_model", r"prepare: expected a callable taking no arguments, got 'build_model'"),
    (_build, r"prepare: expected a callable taking no arguments, got <function _build .*with parameters \(options"),
    (lambda x: x, r"prepare: expected a callable taking no arguments, .*\(x\)"),
    (lambda *, size: size, r"prepare: .*\(\*, size\)"),
    (_Builder(), r"prepare: expected a callable taking no arguments, .*_Builder object"),
    (_async_build, r"prepare: expected a plain callable, got the async"),
], ids=["int", "str", "function-with-a-parameter", "lambda-with-a-parameter", "keyword-only", "callable-object",
        "async"])
def test_bad_prepare_hooks_are_refused_at_decoration_time(prepare: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        restartable(prepare=prepare)
    with pytest.raises(TypeError, match=message):
        RestartConfig(prepare=prepare)  # type: ignore[arg-type]


@pytest.mark.parametrize("prepare", [
    lambda: 1, lambda x=1: x, lambda *args: args, functools.partial(_build, 3), dict, None,
])
def test_good_prepare_hooks_are_kept(prepare: Callable[[], object] | None) -> None:
    assert RestartConfig(prepare=prepare).prepare is prepare
    # The job's settings leave it as the decorator gave it.
    assert RestartConfig(prepare=prepare).for_job({"max_restarts": 3}, frozenset()).prepare is prepare


def test_importing_stalwart_does_not_import_torch() -> None:
    import subprocess

    code = "import stalwart, sys; stalwart.restartable; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(("policy", "message"), [
    (lambda: InitProcessGroup("mpi"), "InitProcessGroup.backend"),  # type: ignore[arg-type]
    (lambda: InitProcessGroup(timeout=0), "InitProcessGroup.timeout"),
    (lambda: CudaHealthCheck(timeout=-1), "CudaHealthCheck.timeout"),
    (lambda: FaultCounter(-1), "FaultCounter.max_faults"),
    (Compose, "Compose: give at least one policy"),
    (lambda: Compose(AbortProcessGroup(), 3), "policy #1"),  # type: ignore[arg-type]
    (lambda: Compose(AbortProcessGroup(), lambda ctx: None), r"policy #1 \(<function .*\) is not a policy"),
    (lambda: Compose(AbortProcessGroup(), FaultCounter(1)), "expected policies of one kind, got Abort, HealthCheck"),
])
def test_policies_are_validated(policy: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        policy()  # type: ignore[operator]


@pytest.mark.parametrize(("option", "chain", "message"), [
    ("health_check", lambda: Compose(AbortProcessGroup()), "health_check: expected a HealthCheck policy"),
    ("abort", lambda: Compose(FaultCounter(1), CudaHealthCheck()), "abort: expected a Abort policy"),
    ("initialize", lambda: Compose(FinalizeCallback(print)), "initialize: expected a Initialize policy"),
])
def test_a_chain_is_a_policy_of_its_members_kind_only(option: str, chain: Callable[[], object],
                                                      message: str) -> None:
    with pytest.raises(TypeError, match=message):
        RestartConfig(**{option: chain()})  # type: ignore[arg-type]


def test_chains_of_each_kind_are_accepted_where_that_kind_is_expected() -> None:
    config = RestartConfig(initialize=Compose(InitProcessGroup("gloo")), abort=Compose(AbortProcessGroup()),
                           finalize=Compose(FinalizeCallback(print)),
                           health_check=Compose(CudaHealthCheck(), FaultCounter(2)))
    assert isinstance(config.health_check, HealthCheck) and not isinstance(config.health_check, Abort)
    assert "FaultCounter" in repr(config.health_check)


def test_a_policy_kind_is_abstract() -> None:
    class NoCall(Abort):
        pass

    with pytest.raises(TypeError, match="abstract"):
        NoCall()  # type: ignore[abstract]


def test_the_iteration_context_is_frozen() -> None:
    ctx = _ctx()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 3  # type: ignore[misc]
    after = dataclasses.replace(ctx, own_faults=2)
    assert after.group is ctx.group and after.own_faults == 2 and ctx.own_faults == 0


def _ctx(**kw: object) -> IterationContext:
    return IterationContext(iteration=0, slot=0, rank=0, world_size=1, store=None, **kw)  # type: ignore[arg-type]


def test_fault_counter_and_compose() -> None:
    FaultCounter(1)(_ctx(own_faults=1))
    with pytest.raises(Unhealthy, match="2 faults"):
        Compose(CudaHealthCheck(), FaultCounter(1))(_ctx(own_faults=2))


def test_abort_chain_runs_every_member_then_raises_the_first_error() -> None:
    ran: list[str] = []

    class Failing(AbortProcessGroup):
        def __call__(self, ctx: IterationContext) -> None:
            ran.append("failing")
            raise RuntimeError("first")

    class Recording(AbortProcessGroup):
        def __call__(self, ctx: IterationContext) -> None:
            ran.append("recording")

    with pytest.raises(RuntimeError, match="first"):
        Compose(Failing(), Recording())(_ctx())
    assert ran == ["failing", "recording"]


def test_call_wrapper_is_injected_by_name_or_annotation() -> None:
    def by_name(call_wrapper):  # type: ignore[no-untyped-def]
        return call_wrapper

    def by_annotation(cw: CallWrapper) -> None:
        return None

    def neither(x: int) -> None:
        return None

    assert _injection(by_name) == "call_wrapper"
    assert _injection(by_annotation) == "cw"
    assert _injection(neither) is None


def test_exit_code_dispositions() -> None:
    assert disposition(ExitCode.OK) is Disposition.SUCCEEDED
    assert disposition(ExitCode.RESTARTS_EXHAUSTED) is Disposition.JOB_FAILURE
    assert disposition(ExitCode.NON_RETRYABLE) is Disposition.JOB_FAILURE
    assert disposition(ExitCode.UNHEALTHY) is Disposition.POD_REPLACEMENT
    assert disposition(ExitCode.WORLD_TOO_SMALL) is Disposition.POD_REPLACEMENT
    assert disposition(ExitCode.HARD_TIMEOUT) is Disposition.LOCAL_RESPAWN
    assert disposition(ExitCode.ABANDONED) is Disposition.LOCAL_RESPAWN
    assert disposition(ExitCode.PREPARE_FAILED) is Disposition.JOB_FAILURE
    assert disposition(-9) is Disposition.LOCAL_RESPAWN
    assert disposition(137) is Disposition.LOCAL_RESPAWN
    assert disposition(1) is Disposition.JOB_FAILURE
    codes = [int(c) for c in ExitCode]
    assert len(codes) == len(set(codes))
    assert all(c in {0, 1} or 79 <= c <= 125 for c in codes)


GOOD_ENV = {
    "STALWART_ETCD_ENDPOINTS": "127.0.0.1:2379, 127.0.0.1:2380", "STALWART_JOB": "ns/job",
    "STALWART_JOB_UID": "abc-123", "STALWART_NODE_ID": "pod-0", "STALWART_EPOCH": "7", "STALWART_SLOT": "1",
    "STALWART_SLOTS": "3", "STALWART_TARGET_WORLD": "2", "STALWART_SPARE": "false",
}


def test_rank_environment_round_trips() -> None:
    env = RankEnvironment.from_env(GOOD_ENV)
    assert env.etcd_endpoints == ["127.0.0.1:2379", "127.0.0.1:2380"]
    assert env.keys.prefix == "/stalwart/v1/ns/abc-123/"
    assert RankEnvironment.from_env(env.to_env()) == env


@pytest.mark.parametrize(("change", "message"), [
    ({"STALWART_EPOCH": None}, "STALWART_EPOCH: is required"),
    ({"STALWART_EPOCH": "zero"}, "STALWART_EPOCH"),
    ({"STALWART_JOB": "nojob"}, "STALWART_JOB"),
    ({"STALWART_SLOT": "5"}, "must be below STALWART_SLOTS"),
    ({"STALWART_SOFT_TIMEOUT": "-1"}, "STALWART_SOFT_TIMEOUT"),
    ({"STALWART_SOFT_TIMEOUT": "nan"}, "STALWART_SOFT_TIMEOUT"),
    ({"STALWART_SOFT_TIMEOUT": "30", "STALWART_HARD_TIMEOUT": "30"},
     r"STALWART_HARD_TIMEOUT: must exceed STALWART_SOFT_TIMEOUT \(30\), got 30"),
    ({"STALWART_MAX_RESTARTS": "many"}, "STALWART_MAX_RESTARTS"),
    ({"STALWART_ETCD_ENDPOINTS": None, "STALWART_SLOT": "x"}, "STALWART_ETCD_ENDPOINTS: is required"),
])
def test_rank_environment_errors_name_the_variable(change: dict, message: str) -> None:
    env = {k: v for k, v in {**GOOD_ENV, **change}.items() if v is not None}
    with pytest.raises(PodEnvError, match=message):
        RankEnvironment.from_env(env)


def test_the_jobs_settings_reach_the_rank_and_fill_in_what_the_decorator_leaves_out() -> None:
    env = RankEnvironment.from_env({**GOOD_ENV, "STALWART_MAX_RESTARTS": "2", "STALWART_SOFT_TIMEOUT": "30",
                                    "STALWART_HARD_TIMEOUT": "45", "STALWART_BARRIER_TIMEOUT": "90"})
    assert RankEnvironment.from_env(env.to_env()) == env
    job = env.job_settings()
    assert job == {"max_restarts": 2, "soft_timeout": 30.0, "hard_timeout": 45.0, "barrier_timeout": 90.0}
    decorated = RestartConfig(soft_timeout=10.0, hard_timeout=40.0)
    config = decorated.for_job(job, frozenset({"soft_timeout", "hard_timeout"}))
    assert (config.max_restarts, config.soft_timeout, config.hard_timeout, config.barrier_timeout) == (2, 10, 40, 90)
    unchanged = RestartConfig()
    assert unchanged.for_job({}, frozenset()) is unchanged


def test_a_mix_of_decorator_and_job_settings_that_does_not_hold_names_both() -> None:
    with pytest.raises(ValueError) as e:
        RestartConfig(soft_timeout=60.0, hard_timeout=120.0).for_job({"hard_timeout": 45.0},
                                                                     frozenset({"soft_timeout"}))
    assert "hard_timeout: must exceed soft_timeout" in str(e.value)
    assert "@restartable(soft_timeout=60.0)" in str(e.value) and "hardTimeoutSeconds=45.0" in str(e.value)
