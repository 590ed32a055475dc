"""Integration tests (:data:`MARKERS`) share the machine: at most :func:`slot_count` of them run at once on it,
across every pytest run of this user, not only within one.

One run keeps at most one test per xdist worker going, and its budgets (pytest-timeout's 300 s, the waits inside a
test) are sized for that. Two runs at once on a 2-core machine doubled the processes that compete for the cores:
tests that start a local cluster, agents and rank processes then ran 2 to 5 times slower than alone (their agents
missed heartbeats, which cost further rounds), and some passed their 300 s. Each integration test therefore holds
one of the machine's slots, a file under :func:`slot_dir` locked with ``flock``, from before its setup until after
its teardown; a run alone never waits (it has no more workers than slots), two runs at once share the slots, and a
killed holder frees its slot with its last descriptor. The wait is outside the test's timeout (this hook wraps
pytest-timeout's), and has a deadline of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The environment variable that sets the number of slots (a positive integer).
SLOTS_ENV = "STALWART_TEST_SLOTS"
#: Slots per CPU by default: 6 on 2 cores, one run's worker count there (the Makefile's ``WORKERS``).
SLOTS_PER_CPU = 3
#: The markers of the tests that hold a slot: those that start servers, clusters, agents and rank processes.
MARKERS = ("integration", "e2e", "slow")
#: Seconds a test waits for a slot before it fails (two full runs' integration tests take less).
WAIT_SECONDS = 1800.0
POLL_SECONDS = 0.2


class SlotTimeout(RuntimeError):
    """No slot came free within the wait."""


def slot_count(env: dict[str, str] | None = None, cpus: int | None = None) -> int:
    """The number of integration tests that may run at once on this machine."""
    text = (os.environ if env is None else env).get(SLOTS_ENV)
    if text is None or text == "":
        return SLOTS_PER_CPU * max(1, cpus if cpus is not None else os.cpu_count() or 1)
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise pytest.UsageError(f"{SLOTS_ENV}: expected a positive integer, got {text!r}")
    return count


def slot_dir() -> Path:
    """The directory of this user's slot files (shared by every run on the machine)."""
    return Path(tempfile.gettempdir()) / f"stalwart-test-slots-{os.getuid()}"


@contextlib.contextmanager
def machine_slot(directory: Path, count: int, wait: float = WAIT_SECONDS, poll: float = POLL_SECONDS) -> Iterator[int]:
    """Hold one of ``count`` slots under ``directory`` (its index) for the block; waits up to ``wait`` seconds for
    one to come free, then raises :class:`SlotTimeout`."""
    directory.mkdir(mode=0o700, exist_ok=True)
    deadline = time.monotonic() + wait
    while True:
        for index in range(count):
            fd = os.open(directory / f"slot-{index}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield index
            finally:
                os.close(fd)  # the lock goes with the last descriptor of its open file
            return
        if time.monotonic() >= deadline:
            raise SlotTimeout(f"no slot for an integration test came free within {wait:g}s: all {count} under "
                              f"{directory} are held (another test run on this machine, or set {SLOTS_ENV})")
        time.sleep(poll * (0.5 + random.random()))


COUNT = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # Read once, at the start: a bad count stops the run before any test, naming the variable.
    config.stash[COUNT] = slot_count()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not any(item.get_closest_marker(name) for name in MARKERS):
        return (yield)
    with machine_slot(slot_dir(), item.config.stash[COUNT]):
        return (yield)
