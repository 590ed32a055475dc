"""free_port: a port no outgoing connection can take before its caller binds it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from stalwart import net


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
        monkeypatch.setattr(net.random, "randrange", lambda *_: next(draws))
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
