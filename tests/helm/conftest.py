"""Fixtures of the chart tests: the chart loaded once with the real Helm library."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
from helm_render import CHART_DIR, Render, documents, render_files


@pytest.fixture(scope="session")
def chart() -> Iterator[helm_python.Chart]:
    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture
def render(chart: helm_python.Chart) -> Render:
    """Render with the given values (and capabilities) and return the YAML documents."""
    def _render(values: dict[str, Any] | None = None, api_versions: list[str] | None = None) -> list[dict[str, Any]]:
        return documents(render_files(chart, values, api_versions))
    return _render
