"""The goodput model's lost node: a warm spare's measured pod-loss recovery, read from a saved bench/podloss.py
run, stands in place of the in-process restart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import scale
from bench.scalesim.goodput import Assumptions, designs


@pytest.mark.parametrize(("pod_loss", "node_loss"), [
    (None, 10.0 + 1.0 + 0.1 + 0.5),  # lease TTL + re-rendezvous + the in-process restart + the barrier
    (3.3, 10.0 + 1.0 + 3.3 + 0.5),  # the measured pod loss in the in-process restart's place
])
def test_a_lost_node_costs_the_lease_ttl_the_rounds_and_the_measured_recovery(
        pod_loss: float | None, node_loss: float) -> None:
    a = Assumptions()
    stalwart = designs(a, inprocess_seconds=0.1, barrier_seconds=lambda n: 0.5, rerendezvous_seconds=lambda n: 1.0,
                       process_restart_seconds=4.0, pod_loss_seconds=pod_loss)[0]
    assert stalwart.node_loss(1000) == (pytest.approx(node_loss), a.step_seconds)
    assert stalwart.rank_fault(1000) == (pytest.approx(0.6), a.step_seconds)  # a rank fault: no pod lost


def test_the_pod_loss_time_is_the_median_of_the_saved_warm_spare_rows(tmp_path: Path) -> None:
    def row(impl: str, fault: str, value: float | None) -> str:
        return json.dumps({"bench": "podloss", "impl": impl, "fault": fault, "params": 1000000, "metric": "seconds",
                           "value": value})
    saved = tmp_path / "podloss.jsonl"
    saved.write_text("\n".join([row("stalwart", "force-delete", 3.0), row("stalwart", "force-delete", 5.0),
                                row("stalwart", "force-delete", 4.0), row("stalwart", "sigkill", 1.0),
                                row("stalwart-process-restart", "force-delete", 9.0),
                                row("torchrun", "force-delete", None)]) + "\n")
    seconds, source = scale.pod_loss_time(str(saved))
    assert seconds == 4.0
    assert source == "podloss.jsonl (bench/podloss.py, 1,000,000 parameters)"  # no directory of this machine


def test_a_saved_run_without_a_warm_spare_row_is_refused_naming_the_file(tmp_path: Path) -> None:
    saved = tmp_path / "other.jsonl"
    saved.write_text(json.dumps({"bench": "podloss", "impl": "torchrun", "fault": "force-delete",
                                 "metric": "seconds", "value": None}) + "\n")
    with pytest.raises(SystemExit, match=r"--podloss-results .*other\.jsonl: no row of bench/podloss\.py"):
        scale.pod_loss_time(str(saved))
