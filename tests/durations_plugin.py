"""Where a test run's time goes: every pytest run writes each test's durations to a JSON file.

The file (``build/test-durations.json`` under the root directory unless ``--durations-file`` names another; an empty
name writes none) holds, per test node id, the seconds of its setup, call and teardown, its outcome and the xdist
worker that ran it and when it ended (seconds into the run), plus the run's wall time, its arguments and the worker
count; and its ``cpu``: the CPU seconds of its three phases spent by the process that ran it and by every process it
started and waited for (with their own children that were waited for): rank processes, agents, CLI calls. Not
counted: the pods of a local cluster (the control plane's children, waited for when the cluster stops). A server a
module or session fixture started (an etcd, a local cluster) is charged whole, its lifetime's CPU, to the teardown
of the test that ended it (measured: 318 CPU-s on a test of 8 s): read a large ``cpu`` with a small call as that.
The suite is bound by CPU on two cores, so this is the figure to cut. A session fixture's start is in the setup of
the first test that used it, on each worker. Under xdist only the controller writes (the workers' reports reach it
with their durations). ``tools/slowest.py`` prints the slowest tests and the time per directory from it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DEFAULT = "build/test-durations.json"
GROUP_SUFFIX = re.compile(r"@[\w.-]+$")
CPU = pytest.StashKey[dict[str, float]]()


def cpu_seconds() -> float:
    """This process's CPU seconds and those of its children it waited for (theirs included, recursively)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _phase_cpu(item: pytest.Item, when: str) -> Iterator[None]:
    start = cpu_seconds()
    try:
        yield
    finally:
        item.stash.setdefault(CPU, {})[when] = cpu_seconds() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase_cpu(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase_cpu(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase_cpu(item, "teardown"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    # A plain attribute travels with the report from an xdist worker to the controller (its JSON form keeps it).
    report.cpu_seconds = round(item.stash.get(CPU, {}).get(call.when, 0.0), 4)  # type: ignore[attr-defined]
    return report


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help=f"where to write each test's setup/call/teardown seconds (default: {DEFAULT} under the "
                          "root directory; an empty value writes nothing)")


class Durations:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.time()
        self.monotonic = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = GROUP_SUFFIX.sub("", report.nodeid)  # xdist's loadgroup appends "@group" to the node id
        entry = self.tests.setdefault(nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0})
        entry[report.when] = round(entry[report.when] + float(report.duration), 4)
        entry["cpu"] = round(entry.get("cpu", 0.0) + float(getattr(report, "cpu_seconds", 0.0)), 4)
        node = getattr(report, "node", None)  # xdist: the WorkerController the report came from
        worker = getattr(node, "gateway", None)
        if worker is not None:
            entry["worker"] = str(worker.id)
        if report.when == "teardown":  # when the test ended, in seconds of the run: each worker's tail shows
            entry["ended"] = round(time.time() - self.started, 1)
        if report.failed:  # a failed setup or teardown is an error, as pytest counts it
            entry["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and entry.get("outcome") not in ("failed", "error"):
            entry["outcome"] = "skipped"
        else:
            entry.setdefault("outcome", "passed")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.tests:
            return
        option = self.config.getoption("durations_file")
        if option == "":
            return
        path = Path(option) if option is not None else self.config.rootpath / DEFAULT
        numprocesses = getattr(self.config.option, "numprocesses", None)
        data = {
            "started": datetime.datetime.fromtimestamp(self.started, datetime.UTC).isoformat(timespec="seconds"),
            "wall_seconds": round(time.monotonic() - self.monotonic, 2),
            "args": list(self.config.invocation_params.args),
            "workers": int(numprocesses or 0),
            "exitstatus": int(exitstatus),
            "tests": self.tests,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller writes the file
    config.pluginmanager.register(Durations(config), "stalwart-durations")
