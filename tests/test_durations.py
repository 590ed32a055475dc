"""Where the suite's time goes: every run writes each test's seconds and CPU seconds (tests/durations_plugin.py),
and tools/slowest.py ranks them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tools.slowest import report

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import subprocess, sys, time

def test_sleeps():
    time.sleep(0.4)

def test_starts_a_busy_child():
    # A process it starts and waits for: its CPU is the test's.
    burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", burn], check=True, timeout=60)
'''


def test_each_test_gets_its_wall_and_cpu_seconds_through_xdist(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(SAMPLE))
    out = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "durations_plugin",
                           "-n", "2", f"--durations-file={out}", "--rootdir", str(tmp_path), str(tmp_path)],
                          capture_output=True, text=True, timeout=180, check=False,
                          env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data["workers"] == 2
    tests = {k.split("::")[1]: v for k, v in data["tests"].items()}
    sleeps, busy = tests["test_sleeps"], tests["test_starts_a_busy_child"]
    assert sleeps["call"] >= 0.4 and sleeps["cpu"] < 0.2, sleeps  # waiting is not CPU
    assert busy["cpu"] >= 0.5, busy  # the child's half second, counted on the test that waited for it
    assert {sleeps["worker"], busy["worker"]} <= {"gw0", "gw1"}
    assert sleeps["ended"] >= 0.4 and busy["ended"] > 0.0  # seconds into the run


def test_the_report_ranks_by_cpu_and_sums_each_directory() -> None:
    data = {"wall_seconds": 10.0, "workers": 2, "started": "t", "exitstatus": 0, "tests": {
        "tests/a/test_x.py::test_waits": {"setup": 0.0, "call": 9.0, "teardown": 0.0, "cpu": 0.5},
        "tests/a/test_x.py::test_burns": {"setup": 0.0, "call": 3.0, "teardown": 0.0, "cpu": 6.0},
        "tests/b/test_y.py::test_old_file": {"setup": 0.0, "call": 1.0, "teardown": 0.0},  # no cpu: a file from before
    }}
    by_cpu = report(data, 2, "cpu").splitlines()
    assert "13.0s of test time, 6.5 CPU-s counted" in by_cpu[0]
    listed = [line.split()[-1] for line in by_cpu[4:6]]
    assert listed == ["tests/a/test_x.py::test_burns", "tests/a/test_x.py::test_waits"]
    per_dir = by_cpu[by_cpu.index("per directory:") + 2:]
    assert per_dir[0].split() == ["12.0", "92.3%", "6.5", "2", "tests/a"]
    assert per_dir[1].split() == ["1.0", "7.7%", "0.0", "1", "tests/b"]
    by_wall = report(data, 1, "total").splitlines()
    assert by_wall[4].split()[-1] == "tests/a/test_x.py::test_waits"


def test_the_report_shows_each_workers_busy_time_and_its_last_end() -> None:
    data = {"tests": {
        "tests/a/test_x.py::test_early": {"call": 2.0, "worker": "gw0", "ended": 2.5},
        "tests/a/test_x.py::test_late_and_long": {"call": 9.0, "worker": "gw1", "ended": 30.0},
        "tests/a/test_x.py::test_short": {"call": 1.0, "worker": "gw1", "ended": 12.0},
    }}
    lines = report(data, 1, "total").splitlines()
    rows = lines[lines.index("per worker:") + 2:]
    assert [r.split() for r in rows] == [["2.0", "2.5", "1", "gw0"], ["10.0", "30.0", "2", "gw1"]]
