"""The nodes' network a test session or a benchmark's cluster takes from $STALWART_LOCAL_NETWORK."""

from __future__ import annotations

import pytest

from stalwart.local.settings import network_from_env


@pytest.mark.parametrize(("environ", "mode"), [
    ({}, "auto"),
    ({"STALWART_LOCAL_NETWORK": "loopback"}, "loopback"),
    ({"STALWART_LOCAL_NETWORK": "netns"}, "netns"),
])
def test_the_variable_picks_the_mode(environ: dict[str, str], mode: str) -> None:
    assert network_from_env(environ) == mode


def test_a_mode_that_names_none_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=r"STALWART_LOCAL_NETWORK: expected one of auto, netns, loopback, got 'lo'"):
        network_from_env({"STALWART_LOCAL_NETWORK": "lo"})
