"""The one check of a duration in seconds that every settings object uses (stalwart.api.base)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from stalwart.api.base import positive_seconds
from stalwart.drill.session import DrillOptions
from stalwart.etcd.outage import Backoff
from stalwart.operator.model import ReconcileSettings
from stalwart.restart.config import RestartConfig


@pytest.mark.parametrize(("value", "expected"), [(0.5, 0.5), (1, 1.0), (86400, 86400.0), (1e-3, 1e-3)])
def test_a_positive_finite_number_is_seconds(value: float, expected: float) -> None:
    result = positive_seconds("timeout", value)
    assert result == expected and isinstance(result, float)


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, True, False, "5", None, [1]])
def test_anything_else_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"^poll_interval: expected a finite number of seconds > 0, got "):
        positive_seconds("poll_interval", value)


@pytest.mark.parametrize(("make", "field"), [
    (lambda: Backoff(initial=0), "initial"),
    (lambda: ReconcileSettings(resync_interval=math.nan), "resync_interval"),
    (lambda: DrillOptions(ready_timeout=-1), "--ready-timeout"),
    (lambda: RestartConfig(barrier_timeout=math.inf), "barrier_timeout"),
])
def test_settings_objects_use_it(make: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: expected a finite number of seconds > 0"):
        make()
