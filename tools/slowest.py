"""The slowest tests of the last pytest run, and the time per test directory.

Reads the file every pytest run writes (``build/test-durations.json``, see ``tests/durations_plugin.py``)::

    python tools/slowest.py                 # the 30 slowest tests, then the seconds per directory
    python tools/slowest.py -n 50 --phase setup
    python tools/slowest.py --phase cpu       # the tests that cost the most CPU (the suite's limit on two cores)
    python tools/slowest.py other-run.json

A test's time is its setup, call and teardown together (a session fixture's start is in the setup of the first
test that used it on each worker). Under xdist the per-directory sums add up the workers' time, so their total
is larger than the run's wall time. ``cpu`` is a test's CPU seconds, its own process's and those of the
processes it started and waited for (not a local cluster's pods: see ``tests/durations_plugin.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "build" / "test-durations.json"
PHASES = ("setup", "call", "teardown")


def directory(nodeid: str) -> str:
    """``tests/operator/test_x.py::test_y[a]`` -> ``tests/operator``."""
    path = nodeid.split("::", 1)[0]
    return path.rsplit("/", 1)[0] if "/" in path else "."


def seconds(entry: dict[str, Any], phase: str) -> float:
    if phase == "cpu":
        return float(entry.get("cpu", 0.0))
    if phase == "total":
        return sum(float(entry.get(p, 0.0)) for p in PHASES)
    return float(entry.get(phase, 0.0))


def report(data: dict[str, Any], top: int, phase: str) -> str:
    tests: dict[str, dict[str, Any]] = data.get("tests", {})
    lines = []
    total = sum(seconds(e, "total") for e in tests.values())
    cpu = sum(seconds(e, "cpu") for e in tests.values())
    workers = data.get("workers") or 0
    lines.append(f"{len(tests)} tests, {total:.1f}s of test time, {cpu:.1f} CPU-s counted, "
                 f"{data.get('wall_seconds', 0.0):.1f}s wall"
                 f" ({workers or 'no'} xdist workers), started {data.get('started', '?')}, exit status "
                 f"{data.get('exitstatus', '?')}")
    lines.append("")
    lines.append(f"{top} slowest by {phase}:")
    lines.append(f"{'total':>8} {'setup':>8} {'call':>8} {'teardown':>8} {'cpu':>8}  {'worker':<6} {'outcome':<8} "
                 "test")
    ranked = sorted(tests.items(), key=lambda kv: seconds(kv[1], phase), reverse=True)
    for nodeid, e in ranked[:top]:
        lines.append(f"{seconds(e, 'total'):8.1f} {seconds(e, 'setup'):8.1f} {seconds(e, 'call'):8.1f} "
                     f"{seconds(e, 'teardown'):8.1f} {seconds(e, 'cpu'):8.1f}  {e.get('worker', '-'):<6} "
                     f"{e.get('outcome', '?'):<8} "
                     f"{nodeid}")
    lines.append("")
    lines.append("per directory:")
    lines.append(f"{'seconds':>8} {'share':>6} {'cpu':>8} {'tests':>6}  directory")
    per: dict[str, list[tuple[float, float]]] = {}
    for nodeid, e in tests.items():
        per.setdefault(directory(nodeid), []).append((seconds(e, "total"), seconds(e, "cpu")))
    for name, times in sorted(per.items(), key=lambda kv: sum(t for t, _ in kv[1]), reverse=True):
        wall = sum(t for t, _ in times)
        share = 100.0 * wall / total if total else 0.0
        lines.append(f"{wall:8.1f} {share:5.1f}% {sum(c for _, c in times):8.1f} {len(times):6d}  {name}")
    lines.extend(per_worker(tests))
    return "\n".join(lines)


def per_worker(tests: dict[str, dict[str, Any]]) -> list[str]:
    """Each xdist worker's busy seconds and when its last test ended: the run's wall time is the latest end, so
    a worker that ends long after the others shows a long test started too late."""
    workers: dict[str, list[dict[str, Any]]] = {}
    for e in tests.values():
        if "worker" in e:
            workers.setdefault(str(e["worker"]), []).append(e)
    if not workers:
        return []
    lines = ["", "per worker:", f"{'busy':>8} {'last end':>8} {'tests':>6}  worker"]
    for name, entries in sorted(workers.items()):
        busy = sum(seconds(e, "total") for e in entries)
        last = max((float(e.get("ended", 0.0)) for e in entries), default=0.0)
        lines.append(f"{busy:8.1f} {last:8.1f} {len(entries):6d}  {name}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT,
                        help=f"the durations file (default: {DEFAULT.relative_to(ROOT)})")
    parser.add_argument("-n", "--top", type=int, default=30, help="how many tests to list (default: 30)")
    parser.add_argument("--phase", choices=("total", *PHASES, "cpu"), default="total",
                        help="rank by this phase's seconds (default: all three together; cpu: CPU seconds)")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.path.read_text())
    except FileNotFoundError:
        print(f"{args.path}: no such file; run pytest first", file=sys.stderr)
        return 1
    print(report(data, args.top, args.phase))
    return 0


if __name__ == "__main__":
    sys.exit(main())
