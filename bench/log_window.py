"""The lines of a cluster's pod logs written around a moment: what a benchmark's oracle shows beside a fault it
judged wrong, so that a failure seen once (under load, in CI) can be understood from its report alone."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from pathlib import Path

__all__ = ["lines_between", "pod_logs_between"]

#: Python's logging time, as every stalwart process writes it: "2026-12-06 23:45:22,448" (local time).
_STAMP = "%Y-%m-%d %H:%M:%S,%f"
_STAMP_LEN = 23


def _when(line: str) -> float | None:
    try:
        return datetime.datetime.strptime(line[:_STAMP_LEN], _STAMP).timestamp()
    except ValueError:
        return None


def lines_between(named: Iterable[tuple[str, Iterable[str]]], start: float, end: float,
                  limit: int = 200) -> list[str]:
    """Of each (name, lines), the time-stamped lines from ``start`` to ``end`` (Unix seconds), each prefixed with
    its name, in time order; a line without a stamp (a traceback's) follows the stamped line it belongs to. At
    most ``limit`` lines, the earliest kept (what happened first explains the rest)."""
    if limit < 1:
        raise ValueError(f"limit: expected >= 1, got {limit}")
    found: list[tuple[float, int, str]] = []
    order = 0
    for name, lines in named:
        inside = False
        last = 0.0
        for line in lines:
            t = _when(line)
            if t is not None:
                inside, last = start <= t <= end, t
            if inside:
                found.append((last, order, f"{name}: {line.rstrip()}"))
                order += 1
    found.sort()
    return [text for _, _, text in found[:limit]]


def pod_logs_between(pods_dir: Path, start: float, end: float, limit: int = 200) -> list[str]:
    """:func:`lines_between` over every container log of a local cluster's pods (``<cluster>/pods``), each named
    by its pod's directory (namespace, name and uid) and file."""
    named = []
    for path in sorted(pods_dir.glob("*/*.log")):
        pod = path.parent.name.rsplit("_", 1)[0]
        with open(path, errors="replace") as f:
            named.append((f"{pod}/{path.stem}", f.readlines()))
    return lines_between(named, start, end, limit)
