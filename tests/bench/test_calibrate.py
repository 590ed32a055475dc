"""The calibration's etcds: one that cannot be reached, or that refuses the TLS settings, is named with its cause,
and bench/scale.py then prints no row."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import scale
from bench.scalesim import calibrate as cal
from stalwart.etcd.client import EtcdCredentials
from stalwart.local.etcd import EtcdServer
from stalwart.local.etcd_pki import LocalCA
from stalwart.net import free_port

pytestmark = pytest.mark.integration


def test_an_etcd_that_cannot_be_reached_is_named_with_the_cause() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(cal.CalibrationError, match=rf"calibration: etcd at {endpoint}: .*unavailable"):
        cal.calibrate(cal.Target(endpoint))


def test_an_etcd_that_refuses_the_tls_settings_is_named_with_the_cause(tmp_path: Path) -> None:
    wrong = LocalCA(name="not-the-servers").write(tmp_path / "wrong", hosts=("127.0.0.1",))
    with EtcdServer(tls=True) as server:
        right = server.credentials()
        creds = EtcdCredentials(tls=True, ca_cert=(wrong / "ca.crt").read_bytes(), client_cert=right.client_cert,
                                client_key=right.client_key)
        with pytest.raises(cal.CalibrationError, match=rf"calibration: etcd at {server.endpoint}: .*(TLS|certificate)"):
            cal.calibrate(cal.Target(server.endpoint, creds))


def test_a_run_whose_calibration_fails_prints_no_row(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"

    @contextlib.contextmanager
    def unreachable(_: cal.Calibration) -> Iterator[cal.Target]:
        yield cal.Target(endpoint)

    monkeypatch.setattr(scale, "started", unreachable)
    monkeypatch.setattr(sys, "argv", ["scale.py", "--calibrations", "plain-1", "--nodes", "50", "--plot", ""])
    assert scale.main() == 2
    out, err = capsys.readouterr()
    assert out == ""  # not one row
    assert f"etcd at {endpoint}" in err


def test_a_published_calibration_must_be_one_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["scale.py", "--calibrations", "plain-1", "--publish", "tls-3"])
    with pytest.raises(SystemExit, match="--publish tls-3: not among --calibrations plain-1"):
        scale.main()
