"""The status oracle: random faults of every kind against the demo's job on its own local cluster, the status
checked after each (counters, culprit, phases, Events) and the parameters at the end against a clean run's.

CI runs one fault of each kind (eight); ``bench/soak.py`` runs the full twenty and prints the recovery times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import soak  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(1500)
def test_status_oracle_soak(tmp_path_factory: pytest.TempPathFactory) -> None:
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    with soak.soak(tmp_path_factory.mktemp("soak"), faults=len(soak.KINDS), kinds=soak.KINDS, seed=7,
                   out=Out()) as s:  # type: ignore[arg-type]
        outcomes = s.run()
        report = "".join(lines)
        assert len(outcomes) == len(soak.KINDS) and {o.kind for o in outcomes} == set(soak.KINDS), report
        assert [o.line() for o in outcomes if o.problems] == [], report
        step, same = s.parameters_match()
        assert same, f"the parameters at step {step} differ from a clean run's\n{report}"
