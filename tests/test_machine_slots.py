"""The machine's slots for integration tests (tests/machine_slots.py): held across processes, waited for with a
deadline, freed by a holder's death, and counted as the environment says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from machine_slots import SLOTS_ENV, SlotTimeout, machine_slot, slot_count

# A second process that holds one slot of one until its standard input closes (or it is killed).
HOLDER = """
import sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from machine_slots import machine_slot
with machine_slot(Path({directory!r}), 1):
    print("held", flush=True)
    sys.stdin.read()
"""


def holder(directory: Path) -> subprocess.Popen[str]:
    code = HOLDER.format(tests=str(Path(__file__).parent), directory=str(directory))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_slot_another_process_holds_is_waited_for_until_its_deadline_then_taken_once_freed(tmp_path: Path) -> None:
    proc = holder(tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(SlotTimeout, match=r"within 0.5s: all 1 under .* are held"), \
                machine_slot(tmp_path, 1, wait=0.5, poll=0.05):
            pass
        assert time.monotonic() - started >= 0.5
        with machine_slot(tmp_path, 2, wait=0.5, poll=0.05) as index:  # a second slot is free
            assert index == 1
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    with machine_slot(tmp_path, 1, wait=5, poll=0.05) as index:
        assert index == 0


def test_a_killed_holder_frees_its_slot(tmp_path: Path) -> None:
    proc = holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    with machine_slot(tmp_path, 1, wait=5, poll=0.05) as index:
        assert index == 0


def test_slots_in_one_process_are_distinct_and_released_on_leaving(tmp_path: Path) -> None:
    with machine_slot(tmp_path, 2, wait=1) as first, machine_slot(tmp_path, 2, wait=1) as second:
        assert (first, second) == (0, 1)
        with pytest.raises(SlotTimeout), machine_slot(tmp_path, 2, wait=0.2, poll=0.05):
            pass
    with machine_slot(tmp_path, 2, wait=1) as again:
        assert again == 0


@pytest.mark.parametrize(("env", "cpus", "expected"), [
    ({}, 2, 6),
    ({SLOTS_ENV: ""}, 16, 48),
    ({SLOTS_ENV: "4"}, 2, 4),
], ids=["default-2-cpus", "empty-16-cpus", "set"])
def test_the_slot_count(env: dict[str, str], cpus: int, expected: int) -> None:
    assert slot_count(env, cpus) == expected


@pytest.mark.parametrize("text", ["0", "-1", "six"])
def test_a_bad_slot_count_names_the_variable(text: str) -> None:
    with pytest.raises(pytest.UsageError, match=rf"{SLOTS_ENV}: expected a positive integer, got '{text}'"):
        slot_count({SLOTS_ENV: text}, 2)


def test_a_run_with_a_bad_slot_count_stops_before_any_test_naming_the_variable(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one() -> None:\n    pass\n")
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                                          "pytest_plugins = ['machine_slots']\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env={**os.environ, SLOTS_ENV: "six"}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert f"{SLOTS_ENV}: expected a positive integer, got 'six'" in done.stderr
    assert "test_one" not in done.stdout
