"""The real-etcd validation at small sizes: thousands of ranks' Coordinators in a few processes, here a few dozen
in two, on the session's TLS etcd with authentication; its rows beside the simulator's, and an etcd it cannot
reach or that refuses its TLS settings named with the cause, with no row printed."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import scale
from bench.scalesim import real_etcd
from bench.scalesim.calibrate import CALIBRATIONS, Calibration, Target
from bench.scalesim.real_barrier import run_barrier
from bench.scalesim.restart import pod_layout
from bench.scalesim.sim import Costs
from bench.scalesim.validate import barrier_rows
from stalwart.etcd.client import EtcdCredentials
from stalwart.local.etcd import EtcdServer
from stalwart.local.etcd_pki import LocalCA
from stalwart.net import free_port

pytestmark = pytest.mark.integration

COSTS = Costs(rtt=0.0005, write=0.0003, read=0.002, read_byte=1e-8, event=3e-5, event_byte=5e-9)


@pytest.fixture
def started_workers(monkeypatch: pytest.MonkeyPatch) -> list[real_etcd.Worker]:
    """Every worker process the validation starts, to show that each has ended."""
    seen: list[real_etcd.Worker] = []

    class Recorded(real_etcd.Worker):
        def __init__(self, name: str, argv: Sequence[str]) -> None:
            super().__init__(name, argv)
            seen.append(self)

    monkeypatch.setattr(real_etcd, "Worker", Recorded)
    return seen


def test_pods_are_laid_out_whole_and_contiguous_over_the_processes() -> None:
    assert pod_layout(64, 8, 2) == [range(0, 32), range(32, 64)]
    assert pod_layout(20, 8, 2) == [range(0, 8), range(8, 20)]  # 3 pods: the last is short
    with pytest.raises(ValueError, match="processes: expected 1 to 3"):
        pod_layout(20, 8, 4)


def test_the_real_barrier_runs_beside_the_simulator_and_its_rows_say_so(
        secure_etcd: EtcdServer, started_workers: list[real_etcd.Worker]) -> None:
    target = Target(secure_etcd.endpoint, secure_etcd.credentials(), metrics=(secure_etcd.metrics_endpoint,))
    kind: Calibration = CALIBRATIONS["tls-1"]  # one member, TLS with client certificates, authentication
    rows = barrier_rows(target, kind, COSTS, calibration="given", ranks=32, processes=2)
    got = {(r["impl"], r["metric"]): r for r in rows}
    assert set(got) == {(impl, metric) for impl in ("validate-real-etcd", "validate-sim")
                        for metric in ("restart_barrier_seconds", "writes_per_rank_per_restart")}
    real, sim = got[("validate-real-etcd", "restart_barrier_seconds")], got[("validate-sim", "restart_barrier_seconds")]
    for row in rows:
        assert row["nodes"] == 32 and row["ranks"] == 32 and row["processes"] == 2 and row["calibration"] == "given"
        assert row["etcd"].startswith("tls-1: 1 member, fsync, TLS, authentication")
    assert real["released"] == sim["released"] == 32
    assert real["value"] > 0 and sim["value"] > 0 and real["seal_seconds"] <= real["value"]
    assert real["real_over_sim"] == pytest.approx(real["value"] / sim["value"], rel=1e-2)
    assert len(real["client_cpu_seconds"]) == 2 and 0 <= real["machine_busy"] <= 1
    # One step (the arrival reads the cause), 4 pods at least.
    assert real["relay_transactions"] >= 4 and sim["relay_transactions"] >= 4
    # The fault report, one transaction per pod for the arrivals (at least), the seal: real and modelled alike.
    writes = got[("validate-real-etcd", "writes_per_rank_per_restart")]["value"]
    assert writes * 32 >= 1 + 4 + 1 and got[("validate-sim", "writes_per_rank_per_restart")]["value"] * 32 >= 6
    assert writes <= 2
    assert len(started_workers) == 2 and all(w.proc.poll() is not None for w in started_workers)
    json.dumps(rows)  # printable as they are


def test_a_validation_whose_etcd_refuses_its_tls_settings_names_it_and_the_cause(
        secure_etcd: EtcdServer, tmp_path: Path, started_workers: list[real_etcd.Worker]) -> None:
    wrong = LocalCA(name="not-the-servers").write(tmp_path / "wrong", hosts=("127.0.0.1",))
    right = secure_etcd.credentials()
    creds = EtcdCredentials(tls=True, ca_cert=(wrong / "ca.crt").read_bytes(), client_cert=right.client_cert,
                            client_key=right.client_key, user=right.user, password=right.password)
    with pytest.raises(real_etcd.ValidationError,
                       match=rf"validation: etcd at {secure_etcd.endpoint}: .*(TLS|certificate)"):
        run_barrier(secure_etcd.endpoint, creds, (secure_etcd.metrics_endpoint,), 16, 1)
    assert started_workers == []  # nothing started, nothing written


def test_a_run_whose_validation_cannot_reach_its_etcd_prints_no_row(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there

    @contextlib.contextmanager
    def unreachable(_: Calibration) -> Iterator[Target]:
        yield Target(endpoint)

    monkeypatch.setattr(scale, "started", unreachable)
    monkeypatch.setattr(sys, "argv", ["scale.py", "--costs", json.dumps(COSTS.as_dict()), "--nodes", "50",
                                      "--validate-ranks", "16", "--validate-nodes", "0", "--plot", ""])
    assert scale.main() == 2
    out, err = capsys.readouterr()
    assert out == ""  # not one row, not even the calibration's
    assert f"validation: etcd at {endpoint}" in err and "unavailable" in err.lower()
