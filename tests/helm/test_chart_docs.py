"""The chart's values are documented: a helm-docs `# --` comment above every value in values.yaml, a description
on every property of values.schema.json, and helm/stalwart/README.md as tools/chart_readme.py writes it from them."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helm_render import CHART_DIR

REPO = CHART_DIR.parents[1]
TOOL = REPO / "tools" / "chart_readme.py"


def load_tool() -> ModuleType:
    """tools/chart_readme.py, imported from its path (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("chart_readme", TOOL)
    assert spec is not None and spec.loader is not None, f"cannot import {TOOL}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


tool = load_tool()


def schema_properties(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node of a JSON schema that is a property (a value under some ``properties``), with its dotted path;
    a property of array items is named with ``[]``."""
    if isinstance(node, dict):
        for key, sub in node.items():
            if key == "properties" and isinstance(sub, dict):
                for name, prop in sub.items():
                    yield ".".join((*path, name)), prop
                    yield from schema_properties(prop, (*path, name))
            elif key == "items":
                yield from schema_properties(sub, (*path, "[]"))
            else:
                yield from schema_properties(sub, path)
    elif isinstance(node, list):
        for item in node:
            yield from schema_properties(item, path)


def test_every_value_has_a_description() -> None:
    values = tool.parse_values((CHART_DIR / "values.yaml").read_text())
    leaves = [v for v in values if v.leaf]
    assert len(leaves) > 50, "values.yaml parsed to too few values"
    undocumented = [v.key for v in leaves if not v.description]
    assert not undocumented, f"values.yaml: no `# --` comment above {undocumented}"


def test_descriptions_are_read_as_helm_docs_reads_them() -> None:
    text = ("# A section heading, not a description.\n"
            "top:\n"
            "  # -- First line\n"
            "  # continued.\n"
            "  leaf: 1\n"
            "  # plain comment\n"
            "  bare: {}\n")
    values = {v.key: v for v in tool.parse_values(text)}
    assert values["top"].description is None and not values["top"].leaf
    assert values["top.leaf"].description == "First line continued."
    assert values["top.bare"].description is None and values["top.bare"].leaf


def test_every_schema_property_has_a_description() -> None:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    properties = list(schema_properties(schema))
    assert len(properties) > 50, "values.schema.json parsed to too few properties"
    undescribed = [path for path, prop in properties
                   if not isinstance(prop.get("description"), str) or not prop["description"].strip()]
    assert not undescribed, f"values.schema.json: no description on {undescribed}"


def test_readme_is_generated_from_values() -> None:
    readme = CHART_DIR / "README.md"
    wanted = tool.generate((CHART_DIR / "values.yaml").read_text())
    assert readme.is_file() and readme.read_text() == wanted, \
        f"{readme.relative_to(REPO)} is not what values.yaml's comments make: run `python tools/chart_readme.py`"


def test_readme_has_a_row_per_documented_value() -> None:
    values = tool.parse_values((CHART_DIR / "values.yaml").read_text())
    readme = tool.generate((CHART_DIR / "values.yaml").read_text())
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "`" in line]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [v.key for v in values if v.description]
    assert "| image.pullPolicy | string | `\"IfNotPresent\"` |" in readme
    assert "| etcd.persistence.accessModes | list | `[\"ReadWriteOnce\"]` |" in readme
    assert "| etcd.quotaBackendBytes | int | `2147483648` |" in readme
    assert "| rbac.create | bool | `true` |" in readme


def test_check_names_a_stale_readme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "README.md"
    out.write_text("old\n")
    assert tool.main(["--check", "--output", str(out)]) == 1
    assert str(out) in capsys.readouterr().err
    assert out.read_text() == "old\n", "--check must write nothing"
    assert tool.main(["--output", str(out)]) == 0
    assert tool.main(["--check", "--output", str(out)]) == 0
