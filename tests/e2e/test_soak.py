"""The status oracle: random faults of every kind against the demo's job on its own local cluster, the status
checked after each (counters, culprit, phases, Events) and the parameters at the end against a clean run's.

The default run has one fault of each kind (eight, in a seeded order): every kind still goes through the oracle
once. ``STALWART_FULL_SOAK=1`` (the benchmarks' CI) runs the full twenty as ``bench/soak.py`` does, kinds drawn
again at random after the first eight; ``bench/soak.py`` also prints the recovery times.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import soak  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: ``STALWART_FULL_SOAK=1``: twenty faults (bench/soak.py's default) instead of one of each kind.
FULL = os.environ.get("STALWART_FULL_SOAK", "") not in ("", "0")
FAULTS = 20 if FULL else len(soak.KINDS)


@pytest.mark.timeout(3000 if FULL else 1500)  # ceilings for a loaded 2-core machine
def test_status_oracle_soak(tmp_path_factory: pytest.TempPathFactory) -> None:
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    with soak.soak(tmp_path_factory.mktemp("soak"), faults=FAULTS, kinds=soak.KINDS, seed=7,
                   out=Out()) as s:  # type: ignore[arg-type]
        outcomes = s.run()
        report = "".join(lines)
        assert len(outcomes) == FAULTS and {o.kind for o in outcomes} == set(soak.KINDS), report
        assert [o.line() for o in outcomes if o.problems] == [], report
        step, same = s.parameters_match()
        assert same, f"the parameters at step {step} differ from a clean run's\n{report}"
