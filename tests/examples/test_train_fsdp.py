"""The sharded example's options: each bad value is refused naming it (its training runs in
tests/operator/test_sharded_pod_loss.py, on the local cluster, and as four plain processes there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.examples.train_fsdp import parse_options


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
