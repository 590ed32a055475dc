"""The pod-log window a soak shows beside a fault it judged wrong (bench/log_window.py)."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.log_window import lines_between, pod_logs_between


def _t(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


A = ["2026-12-06 23:45:20,000 INFO a: before the window",
     "2026-12-06 23:45:22,448 WARNING a: the fault",
     "Traceback (most recent call last):",
     "  RuntimeError: connection closed",
     "2026-12-06 23:45:30,000 INFO a: after the window"]
B = ["2026-12-06 23:45:21,500 INFO b: first inside",
     "  a continued line, without a stamp",
     "2026-12-06 23:45:23,000 INFO b: the survivor"]


def test_the_window_keeps_stamped_lines_and_their_tracebacks_in_time_order() -> None:
    got = lines_between([("a", A), ("b", B)], _t("2026-12-06 23:45:21,000"), _t("2026-12-06 23:45:25,000"))
    assert got == ["b: 2026-12-06 23:45:21,500 INFO b: first inside",
                   "b:   a continued line, without a stamp",
                   "a: 2026-12-06 23:45:22,448 WARNING a: the fault",
                   "a: Traceback (most recent call last):",
                   "a:   RuntimeError: connection closed",
                   "b: 2026-12-06 23:45:23,000 INFO b: the survivor"]


def test_the_earliest_lines_are_kept_and_a_bad_limit_is_refused() -> None:
    got = lines_between([("a", A), ("b", B)], _t("2026-12-06 23:45:21,000"), _t("2026-12-06 23:45:25,000"), limit=2)
    assert got == ["b: 2026-12-06 23:45:21,500 INFO b: first inside", "b:   a continued line, without a stamp"]
    with pytest.raises(ValueError, match="limit: expected >= 1, got 0"):
        lines_between([("a", A)], 0.0, 1.0, limit=0)


def test_a_clusters_pod_logs_are_named_by_pod_and_container(tmp_path: Path) -> None:
    pod = tmp_path / "default_minimal-worker-0_56bc31ec"
    pod.mkdir()
    (pod / "trainer.log").write_text("\n".join(A) + "\n")
    got = pod_logs_between(tmp_path, _t("2026-12-06 23:45:22,000"), _t("2026-12-06 23:45:23,000"))
    assert got[0] == "default_minimal-worker-0/trainer: 2026-12-06 23:45:22,448 WARNING a: the fault" and len(got) == 3
