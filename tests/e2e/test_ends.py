"""The exit soak in short (issue 29): a few fault-free demo jobs (2 workers + 1 spare) on a local cluster of
their own, through bench/ends.py's code. Every job must end Succeeded, and every pod's agent and rank processes
must be gone, none left behind, within the bound of its last rank's return.

The bound here is the autouse exit check's (10 s + 5 s slack, see stalwart/local/exitcheck.py), not the bare
10 s that ``bench/ends.py`` counts against: this runs beside other tests on a loaded 2-core machine, and the soak
prints the figures against the bare bound.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import ends  # noqa: E402

from stalwart.local.exitcheck import EXIT_BOUND, SLACK  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOBS = 3


@pytest.mark.timeout(900)
def test_finished_jobs_end_and_every_process_of_theirs_is_gone(tmp_path_factory: pytest.TempPathFactory) -> None:
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    with ends.soak(tmp_path_factory.mktemp("ends"), steps=40, step_delay=0.05,
                   out=Out()) as s:  # type: ignore[arg-type]
        results = s.run(JOBS, concurrency=1)
    report = "".join(lines)
    assert len(results) == JOBS, report
    assert [r.name for r in results if not r.succeeded] == [], report
    assert [why for r in results for why in r.late(EXIT_BOUND + SLACK)] == [], report
    pods = [p for r in results for p in r.pods]
    # Every pod's agent was seen to end (the kubelet's book), after it said it was leaving, with nothing of its
    # pod alive afterwards; each worker's ranks were seen and seen to end.
    unclean = [(p.pod, p.leaving, p.ended, p.exit_code) for p in pods
               if p.ended is None or p.leaving is None or p.exit_code != 0]
    assert unclean == [], f"(pod, leaving, ended, exit code): {unclean}\n{report}"
    assert all(not p.leftovers and not p.alive_after for p in pods), report
    workers = [p for p in pods if "-worker-" in p.pod]
    assert len(workers) == 2 * JOBS, report
    assert all(p.ranks_last_seen is not None and p.ended is not None and p.ranks_last_seen <= p.ended
               for p in workers), report
    rows = {row["metric"]: row for row in ends.figures(results, concurrency=1, steps=40)}
    assert rows["jobs_succeeded"]["value"] == JOBS and rows["processes_left"]["value"] == 0
