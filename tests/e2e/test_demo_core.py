"""The demo's pure core: the job it applies, reading the ranks' events, measuring recovery (no cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from stalwart.demo import EXAMPLE, DemoOptions, demo_job, finished_by, latest_step, parse_events, recovery_after
from stalwart.examples.train import FAIL_AT_STEP_ENV, FAIL_RANK_ENV


def test_demo_job_adds_training_arguments_and_fault_injection(tmp_path: Path) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    job = demo_job(example, DemoOptions(directory=tmp_path, steps=100, fail_at_step=10, kill_at_step=50,
                                        fail_rank=0))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == example["spec"]["template"]["spec"]["containers"][0]["command"]
    assert container["args"][container["args"].index("--steps") + 1] == "100"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[FAIL_AT_STEP_ENV] == "10" and env[FAIL_RANK_ENV] == "0"
    assert job["spec"]["replicas"] == 2 and job["spec"]["spares"] == 1
    assert job["metadata"]["namespace"] == "default"
    # The example itself is left as it was.
    assert "env" not in example["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"steps": 2}, "steps: expected at least 3"),
    ({"fail_at_step": 200}, "expected 0 < fail_at_step"),
    ({"kill_at_step": 10, "fail_at_step": 20}, "expected 0 < fail_at_step"),
    ({"fail_rank": 2}, "fail_rank: the demo job has ranks 0 and 1"),
    ({"timeout": 0}, "timeout > 0"),
])
def test_demo_options_are_checked(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DemoOptions(directory=tmp_path, **kwargs)


def test_parse_events_keeps_only_timestamped_event_lines() -> None:
    log = "\n".join([
        "2026-01-01 INFO something",
        '{"event": "step", "time": 2.0, "step": 2}',
        '{"event": "step", "time": 1.0, "step": 1}',
        '{"not": "an event"}',
        '{"event": "step"}',
        "{broken",
    ])
    events = parse_events(log, "pod-a")
    assert [e["step"] for e in events] == [1, 2] and all(e["pod"] == "pod-a" for e in events)
    assert latest_step(events) == 2


def ev(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": kind, "time": t, **fields}


def test_recovery_is_from_the_fault_to_the_first_step_after_the_resume() -> None:
    events = [ev("step", 9.0, step=59), ev("fault", 10.0, step=60),
              ev("step", 10.2, step=61),  # a peer finishing the step it was in: not a recovery
              ev("resume", 11.0, step=60, iteration=1), ev("step", 11.5, step=61), ev("step", 12.0, step=62)]
    rec = recovery_after(events, "a rank exception", 10.0)
    assert rec is not None and rec.seconds == 1.5 and rec.resumed_at_step == 61
    assert recovery_after(events[:4], "a rank exception", 10.0) is None  # resumed, but no step yet
    assert recovery_after(events[:3], "a rank exception", 10.0) is None  # not resumed yet


@pytest.mark.parametrize(("at", "expected"), [
    (12.0, None),  # still training when the pod was killed
    (13.0, 120),  # one rank had finished: the kill came too late to interrupt anything
    (14.0, 120),
])
def test_a_kill_after_the_job_finished_is_told_apart_from_a_slow_recovery(at: float, expected: int | None) -> None:
    events = [ev("step", 11.0, step=119), ev("done", 13.0, step=120), ev("done", 13.5, step=120)]
    assert finished_by(events, at) == expected
