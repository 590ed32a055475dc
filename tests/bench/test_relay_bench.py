"""``bench/relay.py`` at a small size: both sides run, and the pod's barrier costs etcd two requests through
the relay against two per rank without it (exact counts; the times are the benchmark's to report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_the_relay_bench_counts_two_requests_a_barrier_against_two_per_rank() -> None:
    root = Path(__file__).resolve().parents[2]
    # A long linger: on a loaded machine the ranks' threads may ask further apart than the agent's 20 ms, and
    # the count would then show the split batch, not the relay's rule.
    out = subprocess.run([sys.executable, str(root / "bench" / "relay.py"), "--ranks", "4", "--barriers", "5",
                          "--linger", "30"], capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {(r["impl"], r["metric"]): r for r in map(json.loads, out.splitlines())}
    assert rows[("stalwart-direct", "etcd_requests_per_barrier")]["value"] == 8.0
    assert rows[("stalwart-relay", "etcd_requests_per_barrier")]["value"] == 2.0
    assert set(rows) == {(impl, metric) for impl in ("stalwart-direct", "stalwart-relay")
                         for metric in ("etcd_requests_per_barrier", "barrier_ms", "round_trip_ms")}
