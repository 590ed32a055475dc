"""Back-off and log lines during an outage (the pure core of :mod:`stalwart.etcd.outage`)."""

from __future__ import annotations

import logging

import pytest

from stalwart.etcd.outage import Backoff, Outage, OutageState, attempt_due, on_failure, on_success


@pytest.mark.parametrize(("failures", "u", "expected"), [
    (1, 0.5, 0.2), (2, 0.5, 0.4), (3, 0.5, 0.8), (7, 0.5, 10.0), (50, 0.5, 10.0),  # doubling, capped
    (1, 0.0, 0.1), (1, 0.999999, 0.3),  # +-50% jitter
    (10, 0.999999, 10.0),  # jitter never goes past the cap
])
def test_backoff_delay(failures: int, u: float, expected: float) -> None:
    assert Backoff(initial=0.2, cap=10.0).delay(failures, u) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"initial": 0}, "initial"), ({"cap": 0.1, "initial": 1}, "cap"), ({"factor": 0.5}, "factor"),
    ({"jitter": 1.0}, "jitter"), ({"initial": float("nan")}, "initial"),
])
def test_backoff_is_validated(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(**kwargs)


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends() -> None:
    b = Backoff(initial=1.0, cap=4.0, jitter=0.0)
    s = OutageState()
    assert attempt_due(s, 0.0)
    s, starts = on_failure(s, 0.0, b, 0.5)
    assert starts and s.since == 0.0 and s.retry_at == 1.0
    assert not attempt_due(s, 0.5) and attempt_due(s, 1.0)
    s, starts = on_failure(s, 1.0, b, 0.5)
    assert not starts and s.retry_at == 3.0 and s.failures == 2
    s, lasted, failures = on_success(s, 3.5)
    assert (lasted, failures) == (3.5, 2) and s == OutageState()
    assert on_success(s, 4.0) == (s, None, 0)


def test_the_shell_logs_two_lines_for_one_outage(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    outage = Outage("etcd", logger=logging.getLogger("t.outage"), context="job=a/b",
                    backoff=Backoff(initial=1.0, cap=2.0, jitter=0.0), clock=lambda: now[0], rng=lambda: 0.5)
    caplog.set_level(logging.DEBUG, logger="t.outage")
    attempts = 0
    for tick in range(100):  # 10 s of a loop that would retry every 0.1 s
        now[0] = tick / 10
        if outage.due():
            attempts += 1
            outage.failed("connection refused")
    assert attempts == 6  # at 0, 1, 3, 5, 7, 9 s
    now[0] = 10.0
    outage.ok()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(lines) == 2
    assert lines[0].startswith("job=a/b: etcd unreachable: connection refused")
    assert lines[1] == "job=a/b: etcd reachable again after 10.0s (6 failed attempts)"
