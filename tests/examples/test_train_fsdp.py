"""The sharded example's options: each bad value is refused naming it (its training runs in
tests/operator/test_sharded_pod_loss.py, on the local cluster, and as four plain processes there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.examples.train_fsdp import (
    HANG_AT_STEP_ENV,
    HANG_MARKER_ENV,
    HANG_RANK_ENV,
    Hang,
    maybe_hang,
    parse_options,
)


def test_defaults_and_the_checkpoint_directory_per_job() -> None:
    opts = parse_options([], env={"STALWART_JOB_UID": "u-1", "TMPDIR": "/scratch"})
    assert (opts.steps, opts.snapshot_every, opts.checkpoint_every) == (200, 1, 50)
    assert opts.checkpoint_dir == Path("/scratch/stalwart-checkpoints/fsdp-u-1")


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--snapshot-every", "-1"], "--snapshot-every must be >= 0 \\(0: no snapshots\\), got -1"),
    (["--layers", "-1"], "--layers must be a positive integer, got -1"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--step-delay", "-1"], "--step-delay must be >= 0, got -1.0"),
])
def test_bad_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(argv, env={})


@pytest.mark.parametrize(("env", "message"), [
    ({HANG_AT_STEP_ENV: "soon", HANG_MARKER_ENV: "/tmp/m"}, f"{HANG_AT_STEP_ENV} must be an integer, got 'soon'"),
    ({HANG_AT_STEP_ENV: "5", HANG_RANK_ENV: "x", HANG_MARKER_ENV: "/tmp/m"},
     f"{HANG_RANK_ENV} must be an integer, got 'x'"),
    ({HANG_AT_STEP_ENV: "5"}, f"{HANG_MARKER_ENV} must name the file that makes the hang happen once"),
])
def test_a_bad_hang_drill_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options([], env=env)


def test_the_hang_drill_happens_once_per_marker(tmp_path: Path) -> None:
    marker = tmp_path / "hung"
    opts = parse_options([], env={HANG_AT_STEP_ENV: "5", HANG_MARKER_ENV: str(marker)})
    assert opts.hang == Hang(5, 1, marker)
    assert parse_options([], env={}).hang is None
    marker.touch()  # a process before this one hung already: this one goes on
    maybe_hang(opts.hang, rank=1, step=5)
    maybe_hang(opts.hang, rank=0, step=5)  # another rank, another step: never
    maybe_hang(Hang(5, 1, tmp_path / "other"), rank=1, step=4)
    assert not (tmp_path / "other").exists()
