"""Helpers for the chart tests: render with the real Helm library and pick documents out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "stalwart"
RELEASE = "demo"
NAMESPACE = "stalwart-system"

#: The ``render`` fixture: values (and capabilities' API versions) -> the rendered YAML documents.
Render = Callable[..., list[dict[str, Any]]]


def render_files(chart: helm_python.Chart, values: dict[str, Any] | None = None,
                 api_versions: list[str] | None = None, release: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce it.

    ``Chart.render`` does not expose the capabilities option, while the library's render call accepts
    ``api_versions`` (the `helm template --api-versions` flag), so the call is made directly here.
    """
    opts: dict[str, Any] = {"name": release, "namespace": NAMESPACE, "is_install": True}
    if api_versions:
        opts["api_versions"] = api_versions
    rendered = _native.call_string("helm_render", chart._raw(),
                                   None if values is None else json.dumps(values), json.dumps(opts))
    files: dict[str, str] = json.loads(rendered)
    return files


def documents(files: dict[str, str]) -> list[dict[str, Any]]:
    """Every non-empty YAML document of the rendered templates (NOTES.txt excluded)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert isinstance(doc, dict), f"{path}: a document that is not a mapping"
                docs.append(doc)
    return docs


def find(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def one(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = find(docs, kind, name_suffix)
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]
