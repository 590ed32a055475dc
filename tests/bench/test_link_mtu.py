"""bench/link_mtu.py: a copy between two nodes of a local cluster's network at a chosen MTU, beside loopback;
the networks it made are gone afterwards, and an MTU no link takes is refused before anything is made."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.local import netns
from stalwart.local.netns import left_behind, missing_rights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import link_mtu

NEEDS_ROOT = pytest.mark.skipif(missing_rights() is not None,
                                reason=f"needs root to make network namespaces: {missing_rights()}")


@NEEDS_ROOT
@pytest.mark.integration
def test_the_copy_runs_at_each_mtu_and_leaves_no_network(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    made: list[Any] = []
    create = netns.NodeNetwork.create.__func__  # type: ignore[attr-defined]

    def recording(cls: type, directory: Path, nodes: list[str], *, mtu: int) -> Any:
        made.append(create(cls, directory, nodes, mtu=mtu))
        return made[-1]

    monkeypatch.setattr(netns.NodeNetwork, "create", classmethod(recording))
    link_mtu.main(["--mb", "8", "--rounds", "1", "--mtus", "1500"])

    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    speeds = {(r["impl"], r["mtu"]): r for r in rows if r["metric"] == "gbps"}
    assert set(speeds) == {("loopback", 65536), ("netns", 1500)}
    assert all(r["bytes"] == 8 << 20 and r["value"] > 0 and len(r["rounds"]) == 1 for r in speeds.values())
    ratio = [r for r in rows if r["metric"] == "ratio"]
    assert len(ratio) == 1 and ratio[0]["mtu"] == 1500 and ratio[0]["value"] > 0
    assert [n.plan.mtu for n in made] == [1500]
    assert left_behind(made[0].plan) == []


def test_an_mtu_no_link_takes_is_refused_before_anything_is_made(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(netns, "missing_rights", lambda: None)
    monkeypatch.setattr(netns, "_ip", lambda *a, **k: pytest.fail("nothing may be made for a refused MTU"))
    with pytest.raises(SystemExit) as exit_info:
        link_mtu.main(["--mtus", "1000"])
    assert exit_info.value.code == 2
    assert "--mtus: mtu: expected 1280 to 65535 (a veth's largest), got 1000" in capsys.readouterr().err
