"""Where a test run's time goes: every pytest run writes each test's durations to a JSON file.

The file (``build/test-durations.json`` under the root directory unless ``--durations-file`` names another; an
empty name writes none) holds, per test node id, the seconds of its setup, call and teardown, its outcome and the
xdist worker that ran it, plus the run's wall time, its arguments and the worker count. A session fixture's start
is in the setup of the first test that used it, on each worker. Under xdist only the controller writes (the
workers' reports reach it with their durations). ``tools/slowest.py`` prints the slowest tests and the time per
directory from it.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

DEFAULT = "build/test-durations.json"
GROUP_SUFFIX = re.compile(r"@[\w.-]+$")


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
        node = getattr(report, "node", None)  # xdist: the WorkerController the report came from
        worker = getattr(node, "gateway", None)
        if worker is not None:
            entry["worker"] = str(worker.id)
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
