"""free_port: a port no outgoing connection can take before its caller binds it."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from stalwart import net


@pytest.fixture(autouse=True)
def claims(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """This test's own record of handed-out ports (the machine's is shared with whatever else runs)."""
    monkeypatch.setattr(net, "CLAIMS", tmp_path / "claims")
    return tmp_path / "claims"


def test_the_port_is_drawn_below_the_ephemeral_range_and_is_free() -> None:
    ports = {net.free_port() for _ in range(20)}
    assert all(net.LOW_PORT <= p < min(net.HIGH_PORT, net.ephemeral_low()) for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed


def test_a_port_taken_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            free = other.getsockname()[1]
        draws = iter([busy, free])
        monkeypatch.setattr(net._DRAW, "randrange", lambda *_: next(draws))
        assert net.free_port() == free


def test_without_room_below_the_range_the_os_picks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "range"
    fake.write_text("1024\t65535\n")
    monkeypatch.setattr(net, "_RANGE_FILE", fake)
    assert net.ephemeral_low() == 1024
    port = net.free_port()
    assert port >= net.HIGH_PORT and net.bindable("127.0.0.1", port)  # not one of the draws: the OS's own
    fake.write_text("garbage")
    assert net.ephemeral_low() == 32768


def test_a_port_handed_out_lately_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch, claims: Path) -> None:
    # Two callers (two test workers, two suites at once) draw the same free port before either binds it: the
    # second is given another. An old claim is no claim: its caller bound the port long ago, or never will.
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        first, second = a.getsockname()[1], b.getsockname()[1]
    draws = iter([first, first, second, first])
    monkeypatch.setattr(net._DRAW, "randrange", lambda *_: next(draws))
    assert net.free_port() == first
    assert net.free_port() == second  # the first draw was claimed a moment ago
    old = time.time() - net.CLAIM_SECONDS - 1
    os.utime(claims / str(first), (old, old))
    assert net.free_port() == first
    assert (claims / str(first)).stat().st_mtime > old  # claimed anew


def test_without_a_place_for_claims_the_port_is_still_handed_out(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(net, "CLAIMS", blocker / "claims")  # under a file: cannot be made
    port = net.free_port()
    assert net.LOW_PORT <= port < min(net.HIGH_PORT, net.ephemeral_low()) and net.bindable("127.0.0.1", port)
